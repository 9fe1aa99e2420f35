"""Extra step memory of the Muon step, per path, next to the budget that bounds it.

    python benchmarks/step_memory.py                                # the GPU sets, 1 layer, CUDA's budget
    python benchmarks/step_memory.py --sets llama1b --layers 3
    python benchmarks/step_memory.py --paths eager,compiled         # compiling the big graphs takes minutes
    python benchmarks/step_memory.py --device cuda                  # on a GPU: CUDA's own statistics

On a CPU this is the stand-in for the GPU memory target (extra step memory <= 1 GiB on
the Llama-1B and 32-expert MoE sets): the sets at full matrix size, with the CUDA budget
(``--budget-mib``, default ``mfx.linalg.batch_bytes("cuda")``, 256 MiB) set for the CPU,
and the CPU allocator's records (``muonfx.memory.step_memory``). The extra memory of a
step is the peak bytes allocated during one ``opt.step()`` beyond those allocated before
it (the optimizer state already exists); one untimed step is measured after two others
(the first compiles, for ``compiled``). Whether a step runs in pieces is in its plan
(``print(opt.plan)``).

Paths: ``whole`` (eager, one piece: the memory a step held before pieces), ``eager``
(eager in pieces of at most the budget), ``compiled`` (``opt.compile()``). The ``/B``
column is the extra memory in budgets; ``/P`` in the set's parameter bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets ONEDNN_MAX_CPU_ISA before torch)
import torch  # noqa: E402

import muonfx as mfx  # noqa: E402
from muon_step import matrices  # noqa: E402
from muonfx.memory import step_memory  # noqa: E402

PATHS = ("whole", "eager", "compiled")


def measure(kind: str, layers: int | None, path: str, device: torch.device, budget: int) -> tuple[int, int]:
    """(extra bytes of one step, parameter bytes) of the default Muon on ``kind``."""
    gen = torch.Generator().manual_seed(0)
    shapes = matrices(kind, layers)
    named = [(k, torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.02).to(device))) for k, s in shapes.items()]
    grads = {k: torch.randn(*s, generator=gen).to(device) for k, s in shapes.items()}
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02)
    if path == "compiled":
        opt.compile()
    else:
        opt.param_groups[0]["compile"] = False
        if path == "whole":  # pieces off, the reference: a plan built under a budget that holds it all
            held = mfx.linalg.set_batch_bytes(1 << 50, device.type)
            try:
                opt.plan
            finally:
                mfx.linalg.set_batch_bytes(held, device.type)
    for k, p in named:
        p.grad = grads[k]
    for _ in range(2):
        opt.step()
    extra = step_memory(opt.step, device)
    params = sum(p.numel() * p.element_size() for _, p in named)
    del opt, named, grads
    return extra, params


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="llama1b,moe32", help="comma-separated, from gpt2, moe, llama1b, moe32")
    ap.add_argument("--layers", type=int, default=1, help="layers of every set (default 1)")
    ap.add_argument("--paths", default="whole,eager", help=f"comma-separated, from {', '.join(PATHS)}")
    ap.add_argument("--budget-mib", type=int, default=None,
                    help="the budget set for the device (default: the CUDA budget, on any device)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"step_memory.py: unknown paths {bad}; choose from {', '.join(PATHS)}")
    budget = (args.budget_mib << 20) if args.budget_mib else mfx.linalg.batch_bytes(torch.device("cuda"))
    mfx.linalg.set_batch_bytes(budget, device.type)
    rows = []
    try:
        for kind in [s.strip() for s in args.sets.split(",") if s.strip()]:
            for path in paths:
                extra, params = measure(kind, args.layers, path, device, budget)
                rows.append([kind, f"{args.layers} layer(s), {params / 2**20:.0f} MiB", path,
                             f"{extra / 2**20:.0f} MiB", f"{extra / budget:.2f}", f"{extra / params:.2f}"])
                print(" | ".join(rows[-1]), flush=True)
    finally:
        mfx.linalg.set_batch_bytes(None, device.type)
    print(f"\nMuon step memory ({_common.machine()}); budget B = {budget / 2**20:.0f} MiB "
          f"(default dtype: {mfx.linalg.ns_dtype_for(device)})")
    print(_common.table(["set", "P", "path", "extra", "/B", "/P"], rows))


if __name__ == "__main__":
    main()
