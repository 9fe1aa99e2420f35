"""FSDP2 optimizer-step benchmark: muonfx vs torch.optim.Muon vs gather-everything.

    python benchmarks/fsdp_step.py                 # spawns 2 gloo ranks on the CPU
    python benchmarks/fsdp_step.py --world 3 --layers 8 --dim 128
    torchrun --nproc_per_node=2 benchmarks/fsdp_step.py   # same, under torchrun

NCCL on GPUs only when the machine has one GPU per rank; otherwise gloo on the CPU
(``_common.pick_backend``: ranks sharing one GPU is an NCCL error).

All three optimizers see the same FSDP2 (``fully_shard``) GPT-style model and the
same gradients; only the optimizer step is timed (median of ``--repeats`` steps,
after ``--warmup``), side by side in one run:

* ``muonfx``: ``TransformOptimizer(model.named_parameters(), mfx.muon)``: each whole
  matrix is assembled on one owner rank with all-to-all, orthogonalised there
  (float32 batched Newton-Schulz on CPU, bf16 on CUDA), sent back.
* ``torch.optim.Muon``: PyTorch's own Muon on the DTensor parameters; DTensor
  redistributes implicitly and every rank orthogonalises every matrix (bf16 NS).
* ``gather-all``: every full gradient all-gathered on every rank and every matrix
  orthogonalised on every rank with the same kernel muonfx uses.

Bytes received per rank per step: muonfx's are counted by its backend; gather-all's
are ``E (W-1)/W`` per matrix (counted as we gather); torch.optim.Muon's are counted
with ``CommDebugMode`` (collective count) and reported as at least gather-all's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import _common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.o(a)
        return x + self.proj(torch.relu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(t)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def _hidden(model: GPT) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]


class GatherAll:
    """Baseline (b): momentum on shards, all-gather every gradient, NS everywhere."""

    def __init__(self, params, lr=0.02, beta=0.95, ns_dtype=None):
        from muonfx.linalg import newton_schulz_batched, resolve

        self.params = [p for _, p in params]
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.lr, self.beta = lr, beta
        self.sched = resolve("keller", 5)
        self.ns = newton_schulz_batched
        self.ns_dtype = ns_dtype
        self.received = 0

    @torch.no_grad()
    def step(self):
        from torch.distributed.tensor import DTensor

        W = dist.get_world_size()
        fulls = []
        for p, b in zip(self.params, self.bufs):
            b.lerp_(p.grad, 1 - self.beta)
            u = p.grad.lerp(b, self.beta)
            full = u.full_tensor() if isinstance(u, DTensor) else u
            self.received += full.numel() * (W - 1) // W * full.element_size()
            fulls.append(full)
        groups: dict = {}
        for i, f in enumerate(fulls):
            groups.setdefault(tuple(f.shape), []).append(i)
        for shape, idx in groups.items():
            out = self.ns(torch.stack([fulls[i] for i in idx]), self.sched, dtype=self.ns_dtype)
            for j, i in enumerate(idx):
                p = self.params[i]
                a, bdim = shape
                scale = max(1.0, a / bdim) ** 0.5
                if isinstance(p, DTensor):
                    from torch.distributed.tensor import distribute_tensor

                    local = distribute_tensor(out[j], p.device_mesh, p.placements, src_data_rank=None).to_local()
                    p.to_local().add_(local, alpha=-self.lr * scale)
                else:
                    p.add_(out[j], alpha=-self.lr * scale)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _time_steps(opt, warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(args, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    import muonfx as mfx
    from muonfx.distributed import comm_stats

    rank, W = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (W,))
    torch.manual_seed(0)
    model = GPT(args.layers, args.dim).to(device)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokens = torch.randint(0, 256, (2, 32), device=device)
    nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    hidden = _hidden(model)
    n_mat = len(hidden)
    E = sum(p.numel() for _, p in hidden)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    results = {}
    opt = mfx.TransformOptimizer(hidden, mfx.muon, lr=0.02)
    comm_stats().reset()
    t = _time_steps(opt, args.warmup, args.repeats)
    sync()
    st = comm_stats()
    steps = args.warmup + args.repeats
    results["muonfx"] = (t, st.bytes_received / steps, st.collectives / steps)

    opt = torch.optim.Muon([p for _, p in hidden], lr=0.02, weight_decay=0.0)
    with CommDebugMode() as cm:
        opt.step()
    coll = cm.get_total_counts()
    t = _time_steps(opt, args.warmup, args.repeats)
    el = 2 if device.type == "cuda" else 2  # bf16 NS input
    results["torch.optim.Muon"] = (t, E * (W - 1) / W * el, coll)

    opt = GatherAll(hidden, ns_dtype=None)
    t = _time_steps(opt, args.warmup, args.repeats)
    results["gather-all"] = (t, opt.received / steps, None)

    if rank == 0:
        print(f"\nFSDP2 optimizer step, world size {W}, {device.type}, {n_mat} hidden matrices "
              f"({args.layers} layers, d={args.dim}), {E / 1e6:.2f} M matrix elements ({_common.machine()})")
        print(f"{'optimizer':<18} {'step ms':>9} {'MB recv/rank':>13} {'collectives':>12} {'muonfx / this':>14}")
        base = results["muonfx"][0]
        for name, (t, b, c) in results.items():
            c_s = "-" if c is None else f"{c:.0f}"
            note = " (estimate: one bf16 all-gather)" if name == "torch.optim.Muon" else ""
            print(f"{name:<18} {t * 1e3:9.1f} {b / 1e6:13.2f} {c_s:>12} {base / t:14.2f}{note}")


def _run(ranks: int, local_rank: int, args) -> None:
    backend, device = _common.pick_backend(ranks, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        bench(args, device)
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    _run(world, rank, args)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks (6 matrices each)")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        _run(ranks, int(os.environ.get("LOCAL_RANK", "0")), args)
        return
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(args.world, args.port, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
