"""Muon on an FSDP2 model, on the CPU with gloo (or GPUs with NCCL).

    torchrun --nproc_per_node=2 examples/fsdp_muon.py            # CPU, gloo
    torchrun --nproc_per_node=8 examples/fsdp_muon.py --steps 200 # GPUs, NCCL
    python examples/fsdp_muon.py --world 2                        # spawns the ranks itself

The process group is NCCL, each rank on its own GPU, only when this machine has a GPU for
every rank on it; otherwise (no GPU, or more ranks than GPUs) gloo on the CPU: ranks
sharing one GPU is an NCCL error. See :func:`muonfx.distributed.pick_backend`.

A small GPT-style model is ``fully_shard``-ed block by block; ``mfx.muon_adamw``
runs through ``mfx.TransformOptimizer`` unchanged: elementwise work (momentum,
Adam moments, weight decay) runs on the local shards, and every hidden matrix is
orthogonalised whole on exactly one owner rank. At the end the optimizer state is
saved with ``torch.distributed.checkpoint`` (reshardable to any world size) when
``--save DIR`` is given.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from muonfx.distributed import pick_backend  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, ctx: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(t) + self.pos[: t.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def train(args: argparse.Namespace, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import muonfx as mfx

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    # the mesh names the device: fully_shard's default mesh is CUDA whenever a GPU exists,
    # even when this run is on the CPU with gloo
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, lr=0.02, adamw_lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data shard
    for step in range(args.steps):
        # toy task: predict the next token of a repeating pattern
        start = torch.randint(0, 8, (8, 1), generator=gen)
        seq = ((start + torch.arange(33)) % 8 * 3 % 64).to(device)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.save)
        if rank == 0:
            print(f"saved a reshardable checkpoint to {args.save}")
    if rank == 0:
        from muonfx.distributed import comm_stats

        st = comm_stats()
        print(f"world {world}: rank 0 orthogonalised {st.matrices_orthogonalized} matrices, "
              f"received {st.bytes_received / 1e6:.2f} MB of matrix shards in {st.collectives} all-to-alls")


def _run(ranks: int, local_rank: int, args: argparse.Namespace) -> None:
    backend, device = pick_backend(ranks, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _run(world, rank, args)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn when not run under torchrun")
    ap.add_argument("--save", default=None, help="directory for a torch.distributed.checkpoint")
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        _run(ranks, int(os.environ.get("LOCAL_RANK", "0")), args)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_spawned, args=(args.world, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
