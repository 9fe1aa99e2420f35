"""``muonfx bench``: run the repository's ``benchmarks/*.py`` scripts and show their tables.

The scripts live in the source repository, next to the ``muonfx`` package
(``<repo>/benchmarks``); an installed wheel has none (``--dir`` points elsewhere).
Each script runs in its own process with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
set; arguments after ``--`` are passed to every script.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["find_benchmarks", "run_bench"]


def find_benchmarks() -> Path | None:
    """``<repo>/benchmarks`` when muonfx runs from a source checkout, else None."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    return here if here.is_dir() and any(here.glob("*.py")) else None


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
    for p in scripts:
        print(f"== {p.stem} ({p}) " + " ".join(args.script_args), flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(p), *args.script_args], env=env, cwd=root.parent)
        print(f"== {p.stem}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s\n",
              flush=True)
        if rc:
            failed.append(p.stem)
    return 1 if failed else 0
