"""Muon on a model that is tensor parallel inside a node and FSDP2 across: a (dp, tp) mesh.

    python examples/fsdp_tp_muon.py --world 4 --tp 2              # spawns 4 gloo ranks (CPU)
    torchrun --nproc_per_node=4 examples/fsdp_tp_muon.py --tp 2   # the same under torchrun
    torchrun --nproc_per_node=8 examples/fsdp_tp_muon.py --tp 8 --steps 200   # one node of 8 GPUs
    # several nodes: the same command on each node (here 2 x 8 GPUs: dp 2 x tp 8)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        examples/fsdp_tp_muon.py --tp 8

Each block's attention and MLP matrices are split by tensor parallelism (``q k v`` and
``fc`` colwise, ``o`` and ``proj`` rowwise: ``parallelize_module`` over ``tp``), then
``fully_shard`` cuts every parameter again over ``dp``: the colwise weights end up
``_StridedShard(0) x Shard(0)``, the rowwise ones ``Shard(0) x Shard(1)``, the rest
``Shard(0)`` on the ``dp`` slice. ``mfx.muon_adamw`` runs through
``mfx.TransformOptimizer`` unchanged: Newton-Schulz runs once per matrix in the whole
world, on one owner rank, and its result goes back to every rank's piece.
``muonfx.distributed.describe`` prints where each matrix goes before the first step.

The process group is NCCL, each rank on its own GPU, only when this machine has a GPU for
every rank on it; otherwise gloo on the CPU (see :func:`muonfx.distributed.pick_backend`).
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
        self.ln1, self.ln2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.ln1(x)
        # local heads: under tensor parallelism q, k, v hold heads / tp heads each
        q, k, v = (t.view(B, T, -1, x.shape[-1] // self.heads).transpose(1, 2) for t in (self.q(h), self.k(h),
                                                                                       self.v(h)))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.proj(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(t)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def build(world: int, tp: int, device: torch.device) -> tuple[TinyGPT, object]:
    """The model on a (dp, tp) mesh: tensor parallel inside, FSDP2 across."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = TinyGPT().to(device)
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "fc": ColwiseParallel(), "proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def train(args: argparse.Namespace, device: torch.device) -> None:
    import muonfx as mfx
    from muonfx.distributed import comm_stats, describe

    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    model, mesh = build(world, args.tp, device)
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, lr=0.02, adamw_lr=3e-3)
    if rank == 0:
        print(describe(opt), flush=True)
    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(1234 + dp_rank)  # each dp rank its own data; tp ranks share it
    for step in range(args.steps):
        # toy task: predict the next token of a repeating pattern
        start = torch.randint(0, 8, (8, 1), generator=gen)
        seq = ((start + torch.arange(33)) % 8 * 3 % 64).to(device)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    st = comm_stats()
    counts = torch.tensor([st.matrices_orthogonalized, st.bytes_sent], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"dp {world // args.tp} x tp {args.tp}: {int(counts[0])} matrices orthogonalised in {args.steps} "
              f"steps over all ranks; rank 0 sent {st.bytes_sent / 1e6:.3f} MB in {st.collectives} all-to-alls")


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
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per group (dp = world / tp)")
    ap.add_argument("--world", type=int, default=4, help="ranks to spawn when not run under torchrun")
    ap.add_argument("--port", type=int, default=29563)
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        _run(ranks, int(os.environ.get("LOCAL_RANK", "0")), args)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_spawned, args=(args.world, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
