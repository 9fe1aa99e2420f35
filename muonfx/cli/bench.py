"""``muonfx bench``: run the repository's ``benchmarks/*.py`` scripts and show their tables.

The scripts live in the source repository, next to the ``muonfx`` package
(``<repo>/benchmarks``); an installed wheel has none (``--dir`` points elsewhere).
Each script runs in its own process with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
set; arguments after ``--`` are passed to every script. A benchmark measures for a
while before it prints its table: while a script is silent, a line on stderr says that
it is still running and for how long, first after :data:`HEARTBEAT_S` seconds of
silence, then at doubling intervals up to six times that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["find_benchmarks", "run_bench", "run_script", "HEARTBEAT_S"]

#: seconds of silence from a benchmark script before a "still running" line
HEARTBEAT_S = 10.0


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
    proc = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    t0 = time.perf_counter()
    last, gap = [t0], [heartbeat]
    lock = threading.Lock()

    def pump() -> None:
        for line in proc.stdout:
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
    print(f"muonfx bench: {len(scripts)} benchmark(s), one process each: {', '.join(p.stem for p in scripts)}; "
          "each times its steps first, then prints its table", flush=True)
    for i, p in enumerate(scripts, 1):
        what = _summary(p)
        print(f"== [{i}/{len(scripts)}] {p.stem} ({p}) " + " ".join(args.script_args) + (f"\n   {what}" if what else ""),
              flush=True)
        t0 = time.perf_counter()
        rc = run_script([sys.executable, str(p), *args.script_args], env, root.parent, p.stem)
        print(f"== {p.stem}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s\n",
              flush=True)
        if rc:
            failed.append(p.stem)
    return 1 if failed else 0
