"""Shared helpers for the benchmark scripts (not a benchmark itself).

* :func:`interleaved`: median step times, measured in alternating rounds;
* :func:`settle`: one untimed step of an optimizer (a compiled step compiles there); the path of a muonfx one;
* :func:`step_memory` (from :mod:`muonfx.memory`): the extra memory of one step (peak bytes allocated during the
  call beyond what existed before it), of the path the executor runs: CUDA's allocator statistics on GPUs,
  the CPU allocator's records (:class:`AllocatorPeak`) on the CPU;
* :func:`pick_backend`: NCCL or gloo for a multi-rank run.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402



def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call of each function, measured in alternating rounds
    (A B C A B C ...) so that machine noise hits every contender alike."""
    for _ in range(warmup):
        for f in fns.values():
            f()
        sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            sync(device)
            t0 = time.perf_counter()
            f()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def settle(opt) -> str:
    """One untimed step of ``opt`` (a muonfx optimizer whose plan compiles a group
    compiles it there), so that timed rounds measure steady steps; returns the path of a
    muonfx optimizer's step ("eager", "compiled", "compiled, pieces", ... from its plan,
    decided by rules: nothing is measured), "" for any other optimizer."""
    opt.step()
    plan = getattr(opt, "plan", None)
    if plan is None:
        return ""
    paths = sorted({g.path + (", pieces" if g.pieces else "") for g in plan.groups})
    return " + ".join(paths)


def table(header: list[str], rows: list[list[object]]) -> str:
    cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(header)]
    widths = [max(len(c) for c in col) for col in cols]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


# ---------------------------------------------------------------------------
# extra step memory
# ---------------------------------------------------------------------------


from muonfx.distributed import pick_backend  # noqa: E402,F401  (re-exported for the scripts)
from muonfx.memory import AllocatorPeak, FreshMemory, step_memory  # noqa: E402,F401  (re-exported for the scripts)


def fmt_bytes(n: float) -> str:
    """``1.23 GiB``, ``45.6 MiB``, ``7.0 KiB``, ``0 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------
# multi-rank runs
# ---------------------------------------------------------------------------


