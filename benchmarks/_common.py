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



def cpu_kind() -> str:
    """The CPU's model name and its matmul-relevant flags, e.g. ``AMD EPYC (avx2, avx512f,
    avx512_bf16)`` or ``Intel(R) Xeon(R) Platinum 8480+ (avx2, avx512f, avx512_bf16, amx_bf16)``
    (read as ``muonfx info`` and the Newton-Schulz dtype rule read them)."""
    from muonfx.cli.info import _cpu_name
    from muonfx.linalg.precision import _cpu_flags

    _, flags = _cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "bf16") if f in flags]
    return f"{_cpu_name()} ({', '.join(shown) or 'no AVX2'})"


def load() -> str:
    """The load average now and the cores it competes for: ``load 5.3/6.1/6.0 on 2 cores``."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load unknown"
    return f"load {one:.1f}/{five:.1f}/{fifteen:.1f} on {os.cpu_count()} cores"


def machine() -> str:
    """Where a table was measured: the device (on the CPU: its kind, threads, oneDNN's ISA
    cap and the load average when the table is printed), torch's version."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return (f"{cpu_kind()}, {torch.get_num_threads()} threads, {load()}, torch {torch.__version__}, "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}")


class busy:
    """``with busy(n):`` ``n`` processes that spin on the CPU for the duration: a machine
    with more runnable threads than cores, on purpose (``--busy N`` of the step benchmarks).
    ``n = 0`` starts nothing."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> "busy":
        import subprocess
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)  # let the scheduler see them
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


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


def fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant digits (0.842, 12.4, 113): GPU steps of a
    millisecond or two keep their digits."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def fmt_bytes(n: float) -> str:
    """``1.23 GiB``, ``45.6 MiB``, ``7.0 KiB``, ``0 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------
# multi-rank runs
# ---------------------------------------------------------------------------


