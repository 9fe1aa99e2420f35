"""FSDP2 optimizer-step benchmark: muonfx vs torch.optim.Muon vs gather-everything.

    python benchmarks/fsdp_step.py                      # W = 2 and 4, spawned gloo ranks on the CPU
    python benchmarks/fsdp_step.py --worlds 4 --tp 2    # FSDP2 x tensor parallel on a (2, 2) mesh
    python benchmarks/fsdp_step.py --worlds 2 --layers 8 --dim 128
    torchrun --nproc_per_node=2 benchmarks/fsdp_step.py # one world, under torchrun

NCCL on GPUs only when the machine has one GPU per rank; otherwise gloo on the CPU
(``_common.pick_backend``: ranks sharing one GPU is an NCCL error).

All three optimizers see the same ``fully_shard``-ed GPT-style model (with ``--tp``,
``q k v fc`` colwise and ``o proj`` rowwise first, then ``fully_shard`` over dp) and the
same gradients; only the optimizer step is timed (median of ``--repeats`` rounds after
``--warmup``, the three stepping in turn, a barrier around each step):

* ``muonfx``: ``TransformOptimizer(model.named_parameters(), mfx.muon)``: each whole
  matrix is assembled on one owner rank with all-to-alls in buckets, orthogonalised
  there (the default Newton-Schulz dtype: bf16 on GPUs and native-bf16 CPUs), sent back;
* ``torch.optim.Muon``: PyTorch's own Muon on the same DTensor parameters; DTensor
  redistributes implicitly and every rank orthogonalises every matrix (bf16 NS);
* ``gather-all``: every full update all-gathered on every rank and every matrix
  orthogonalised on every rank with the kernel muonfx uses.

Bytes sent per rank per step, in the exchange dtype: muonfx's as counted by its backend
(``muonfx.distributed.comm_stats``), next to the floor (each matrix's pieces to its owner
and back: ``2 (W-1)/W`` of the matrix bytes over all ranks, ``2 (W-1)/W^2`` of them per
rank) and next to gathering everything (``(W-1)/W`` of the matrix bytes per rank).
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
                    from torch.distributed.tensor import Replicate

                    mesh = p.device_mesh  # every rank holds the whole result: slicing it moves nothing
                    whole = DTensor.from_local(out[j], mesh, [Replicate()] * mesh.ndim, run_check=False)
                    local = whole.redistribute(mesh, p.placements).to_local()
                    p.to_local().add_(local, alpha=-self.lr * scale)
                else:
                    p.add_(out[j], alpha=-self.lr * scale)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _timed_rounds(opts: dict, warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each optimizer, stepping in turn (A B C A B C ...)."""
    for _ in range(warmup):
        for opt in opts.values():
            opt.step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(repeats):
        for k, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _model(args, device: torch.device, W: int) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(args.layers, args.dim).to(device)
    if args.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (W // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                "fc": ColwiseParallel(), "proj": RowwiseParallel()}
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], plan)
        dp = mesh["dp"]
    else:
        dp = init_device_mesh(device.type, (W,), mesh_dim_names=("dp",))
    for b in model.blocks:
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


class Budgeted:
    """A muonfx optimizer stepping with the matrix budget (bucket size) ``mb`` MiB."""

    def __init__(self, opt, mb: float, device_type: str) -> None:
        self.opt, self.nbytes, self.device_type = opt, int(mb * (1 << 20)), device_type

    def step(self) -> None:
        from muonfx.linalg import set_batch_bytes

        old = set_batch_bytes(self.nbytes, self.device_type)
        try:
            self.opt.step()
        finally:
            set_batch_bytes(old, self.device_type)


def bench(args, device: torch.device) -> None:
    import muonfx as mfx
    from muonfx.distributed import comm_stats
    from muonfx.linalg import ns_dtype_for

    rank, W = dist.get_rank(), dist.get_world_size()
    model = _model(args, device, W)
    tokens = torch.randint(0, 256, (2, 32), device=device)
    nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    hidden = _hidden(model)
    n_mat = len(hidden)
    E = sum(p.numel() for _, p in hidden)
    dtype = ns_dtype_for(device)
    el = torch.empty((), dtype=dtype).element_size()

    opts = {"muonfx": mfx.TransformOptimizer(hidden, mfx.muon, lr=0.02),
            "torch.optim.Muon": torch.optim.Muon([p for _, p in hidden], lr=0.02, weight_decay=0.0),
            "gather-all": GatherAll(hidden, ns_dtype=None)}
    for mb in args.budgets:  # muonfx again with smaller buckets: more all-to-alls, overlapped
        opts[f"muonfx {mb:g} MiB"] = Budgeted(mfx.TransformOptimizer(hidden, mfx.muon, lr=0.02), mb, device.type)
    for name, opt in opts.items():
        if name.startswith("muonfx"):
            opt.step()  # the first step plans the exchange (once): not timed, not counted
    counted: dict = {}

    class Counted:  # muonfx's counters per contender
        def __init__(self, name, opt):
            self.name, self.opt = name, opt

        def step(self):
            comm_stats().reset()
            self.opt.step()
            st = comm_stats()
            c = counted.setdefault(self.name, [0, 0, 0, 0.0, 0])
            c[0] += st.bytes_sent
            c[1] += st.buckets
            c[2] += st.matrices_orthogonalized
            c[3] += st.wait_seconds
            c[4] += 1

    opts = {k: Counted(k, v) if k.startswith("muonfx") else v for k, v in opts.items()}
    times = _timed_rounds(opts, args.warmup, args.repeats)
    _common.sync(device)
    mine = {k: [c[0] / c[4], c[1] / c[4], c[2] / c[4], c[3] / c[4]] for k, c in counted.items()}
    every = [None] * W
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    floor = 2 * (W - 1) / W ** 2 * E * el
    gather = (W - 1) / W * E * el
    layout = f"FSDP2 {W // args.tp} x TP {args.tp}" if args.tp > 1 else "FSDP2"
    print(f"\n{layout}, world size {W}, {device.type} ({dist.get_backend()}), {n_mat} hidden matrices "
          f"({args.layers} layers, d={args.dim}), {E / 1e6:.2f} M matrix elements, exchanged in "
          f"{str(dtype).replace('torch.', '')}; {_common.machine()}")
    print("bytes sent per rank per step (MB):")
    print(f"{'rank':>4} {'muonfx':>9} {'floor':>9} {'gather-all':>11} {'muonfx/floor':>13} "
          f"{'muonfx/gather-all':>18} {'matrices':>9}")
    for r, per in enumerate(every):
        sent, _, owned, _ = per["muonfx"]
        print(f"{r:>4} {sent / 1e6:9.3f} {floor / 1e6:9.3f} {gather / 1e6:11.3f} {sent / floor:13.3f} "
              f"{sent / gather:18.3f} {owned:9.1f}")
    worst = max(per["muonfx"][0] for per in every)
    print(f"max over ranks: {worst / floor:.3f}x the floor, {worst / gather:.3f}x gathering everything")
    print(f"step time (median of {args.repeats} rounds after {args.warmup} warm-up; buckets per step and the "
          "time blocked in their all-to-alls, worst rank):")
    print(f"{'optimizer':<18} {'step ms':>9} {'muonfx / this':>14} {'buckets':>8} {'blocked ms':>11}")
    base = times["muonfx"]
    for name, t in times.items():
        extra = ""
        if name in every[0]:
            extra = (f" {every[0][name][1]:8.0f} {max(per[name][3] for per in every) * 1e3:11.1f}")
        print(f"{name:<18} {t * 1e3:9.1f} {base / t:14.3f}{extra}")


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
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes, one run each")
    ap.add_argument("--world", type=int, default=None, help="one world size (same as --worlds N)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP2 over world/tp)")
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks (6 matrices each)")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.5],
                    help="muonfx again with these bucket budgets (MiB of whole matrices per owner)")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        _run(ranks, int(os.environ.get("LOCAL_RANK", "0")), args)
        return
    import torch.multiprocessing as mp

    for i, world in enumerate([args.world] if args.world else args.worlds):
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide world size {world}")
        mp.start_processes(_worker, args=(world, args.port + i, args), nprocs=world, start_method="spawn")
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}" if os.path.exists("/proc/loadavg") else "")


if __name__ == "__main__":
    sys.exit(main())
