"""``muonfx bench``: run the repository's ``benchmarks/*.py`` scripts and show their tables.

The scripts live in the source repository, next to the ``muonfx`` package
(``<repo>/benchmarks``); an installed wheel has none (``--dir`` points elsewhere).
Each script runs in its own process with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
set; arguments after ``--`` are passed to every script. A benchmark measures for a
while before it prints its table: while a script is silent, a line on stderr says that
it is still running and for how long, first after :data:`HEARTBEAT_S` seconds of
silence, then at doubling intervals up to six times that.

Before the first script it prints how long the chosen ones took on a 2-core CPU
(:data:`MEASURED_S`), and after each one how long the rest should take at the pace
measured so far. The profiler's own lines (``USDT: ... profiler_start``, a
``CPUAllocator.cpp`` warning), which the memory measurement of a step provokes, are
left out (:data:`NOISE`). Ctrl-C stops the running script and the rest, in one line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .progress import format_time

__all__ = ["find_benchmarks", "run_bench", "run_script", "estimate_line", "HEARTBEAT_S", "MEASURED_S", "NOISE"]

#: seconds of silence from a benchmark script before a "still running" line
HEARTBEAT_S = 10.0

#: seconds each script took with its default arguments: ``muonfx bench`` on a 2-core AMD
#: EPYC VM (AVX512-BF16, torch 2.13.0+cpu) shared with other jobs (load average 5-7),
#: 2026-11-26, 49 min 51 s in all; a quiet machine takes less (``adamw_step`` alone 177 s
#: on a quiet 2-core Intel VM; ``host_cost`` and ``fsdp_scale`` were timed on the AMD VM at
#: load 0.5-1). The estimate scales them by the pace of the scripts run so far.
#: ``first_step``: 152 s on the AMD VM at load 2-3, 2026-11-28. ``catalogue_step``: 392 s on the AMD VM
#: at load 10-12, heavyball not installed (muonfx alone), 2026-11-28.
MEASURED_S = {"adamw_step": 361.0, "catalogue_step": 392.0, "first_step": 152.0, "fsdp_scale": 12.0, "fsdp_step": 43.0, "host_cost": 6.0,
              "muon_step": 1618.0, "newton_schulz": 574.0, "step_memory": 396.0}

#: lines of the profiler itself, not of the benchmark (``torch.profiler`` start and stop,
#: and its warning about blocks allocated before it started)
NOISE = re.compile(r"^USDT:.*\bprofiler_(start|stop)\s*$|CPUAllocator\.cpp:\d+\].*before the profiling started")


def find_benchmarks() -> Path | None:
    """``<repo>/benchmarks`` when muonfx runs from a source checkout, else None."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    return here if here.is_dir() and any(here.glob("*.py")) else None


def _summary(path: Path) -> str:
    """The first line of a script's docstring (what it measures), or ''."""
    import ast

    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError, ValueError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def run_script(cmd: list[str], env: dict, cwd: Path, name: str, heartbeat: float | None = None) -> int:
    """Run one benchmark, passing its output through line by line; while it is silent,
    print ``[name] still running, N s`` to stderr after ``heartbeat`` seconds, then
    after 2x, 4x, ... up to 6x that (output from the script starts over). Returns the
    exit status."""
    heartbeat = HEARTBEAT_S if heartbeat is None else heartbeat
    # a process group of its own: a terminal's Ctrl-C reaches this process only, which stops the script
    proc = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    t0 = time.perf_counter()
    last, gap = [t0], [heartbeat]
    lock = threading.Lock()

    def pump() -> None:
        for line in proc.stdout:
            if NOISE.search(line):
                continue
            with lock:
                last[0], gap[0] = time.perf_counter(), heartbeat
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while True:
            try:
                proc.wait(timeout=min(1.0, heartbeat))
                break
            except subprocess.TimeoutExpired:
                now = time.perf_counter()
                with lock:
                    if now - last[0] >= gap[0]:
                        last[0], gap[0] = now, min(2 * gap[0], 6 * heartbeat)
                        print(f"  [{name}] still running, {now - t0:.0f} s", file=sys.stderr, flush=True)
    except BaseException:  # Ctrl-C or a kill: leave no benchmark running
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    reader.join()
    return proc.returncode


def run_bench(args) -> int:
    root = Path(args.dir) if args.dir else find_benchmarks()
    if root is None or not root.is_dir():
        where = f"--dir {args.dir}" if args.dir else "next to the muonfx package"
        print(f"muonfx bench: no benchmarks/ directory {where}: the benchmark scripts ship with the source "
              "repository, not the installed package; clone it and run from there (or pass --dir)", file=sys.stderr)
        return 1
    scripts = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    if args.only:
        wanted = {n.removesuffix(".py") for n in args.only}
        unknown = sorted(wanted - {p.stem for p in scripts})
        if unknown:
            print(f"muonfx bench: unknown benchmark {', '.join(unknown)}; choose from "
                  f"{', '.join(p.stem for p in scripts)}", file=sys.stderr)
            return 2
        scripts = [p for p in scripts if p.stem in wanted]
    if args.list:
        for p in scripts:
            print(p.stem)
        return 0
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")}
    failed = []
    names = [p.stem for p in scripts]
    print(f"muonfx bench: {len(scripts)} benchmark(s), one process each: {', '.join(names)}; "
          "each times its steps first, then prints its table", flush=True)
    first = estimate_line(names, {}, bool(args.script_args))
    if first:
        print(first, flush=True)
    took: dict[str, float] = {}
    for i, p in enumerate(scripts, 1):
        what = _summary(p)
        print(f"== [{i}/{len(scripts)}] {p.stem} ({p}) " + " ".join(args.script_args) + (f"\n   {what}" if what else ""),
              flush=True)
        t0 = time.perf_counter()
        try:
            rc = run_script([sys.executable, str(p), *args.script_args], env, root.parent, p.stem)
        except KeyboardInterrupt:
            rest = f"; not run: {', '.join(names[i:])}" if names[i:] else ""
            print(f"\nmuonfx bench: interrupted during {p.stem} after {time.perf_counter() - t0:.0f} s{rest}",
                  file=sys.stderr, flush=True)
            return 128 + signal.SIGINT
        took[p.stem] = time.perf_counter() - t0
        print(f"== {p.stem}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {took[p.stem]:.0f} s", flush=True)
        later = estimate_line(names[i:], took, bool(args.script_args))
        print((later + "\n") if later else "", flush=True)
        if rc:
            failed.append(p.stem)
    return 1 if failed else 0


def estimate_line(todo: list[str], took: dict[str, float], other_args: bool) -> str | None:
    """How long the benchmarks ``todo`` should take: :data:`MEASURED_S`, scaled by the pace
    of those already run (``took``: seconds by name). None when nothing is left or a
    script has no measured time.

    Example::

        >>> print(estimate_line(["fsdp_step", "step_memory"], {}, False))
        expected: ~7:19 for fsdp_step, step_memory (measured on a 2-core CPU shared with other jobs, default arguments; a quiet machine takes less)
        >>> print(estimate_line(["step_memory"], {"fsdp_step": 21.5}, False))
        expected: ~3:18 more for step_memory (at this machine's pace so far: 0.5x the 2-core figures)
    """
    if not todo or any(n not in MEASURED_S for n in todo):
        return None
    done = [n for n in took if n in MEASURED_S]
    pace = sum(took[n] for n in done) / sum(MEASURED_S[n] for n in done) if done else 1.0
    left = pace * sum(MEASURED_S[n] for n in todo)
    why = (f"at this machine's pace so far: {pace:.1f}x the 2-core figures" if done else
           "measured on a 2-core CPU shared with other jobs, default arguments; a quiet machine takes less")
    if other_args:
        why += "; other arguments change it"
    return f"expected: ~{format_time(left)}{' more' if done else ''} for {', '.join(todo)} ({why})"
