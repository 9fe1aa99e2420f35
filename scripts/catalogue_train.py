"""The main job (``muonfx train``) with every optimizer of ``--optimizer``, back to back, at
one or more seeds: for each optimizer, the step where it reaches AdamW's final validation
loss (of the same seed) and its wall time per training step.

    python scripts/catalogue_train.py                          # every optimizer, seeds 0 and 1, 100 steps
    python scripts/catalogue_train.py --names lion,soap --seeds 0
    python scripts/catalogue_train.py --steps 300 --batch-size 32 --eval-every 50   # the main job's defaults
    python scripts/catalogue_train.py --table-only --out DIR   # the table of runs already in DIR
    python scripts/catalogue_train.py --sweep 0.3,1,3,10 --seeds 0   # each one's lr: its default times each factor
    python scripts/catalogue_train.py --lr lion=3e-4 --lr adopt=3e-3  # these lrs, the defaults elsewhere

Each run is ``python -m muonfx train --optimizer NAME --seed S --steps N --batch-size B
--eval-every E --threads 1 --no-progress --out OUT/NAME-sS`` (the tiny model) in a process
of its own (``--lr`` not given: each optimizer's ``muonfx train`` default, see
``muonfx/cli/optimizers.py``); for each seed, ``adamw`` runs first, then the others in the
order given (default: the catalogue, then ``muon`` and ``muon_adamw``). A run whose
``summary.json`` is already in ``--out`` is not run again (an interrupted sweep resumes).
``--lr NAME=VALUE`` (repeatable) runs NAME at that lr (``--lr VALUE``; for the Muon
optimizers Muon's lr, the AdamW part keeps ``--adamw-lr``) in ``OUT/NAME-lrVALUE-sS``.

``--sweep F1,F2,...`` runs, at the first seed only, each optimizer (not ``adamw``, the
baseline at its tuned lr) at its preset's own default lr (``muonfx.cli.optimizers.preset_lr``:
the reference's; Muon's 0.02 for the Muon optimizers) times each factor, and prints the final
validation loss of each lr, the best one marked, and the ``--lr`` options that run the
best of each.

Columns: ``final val``, the run's final validation loss (mean of the seeds); ``steps to
AdamW's final val``, the step where the validation curve reaches the ``adamw`` run's final
loss of the same seed (interpolated between evaluations; ``-`` where it does not within
the run), per seed; ``x AdamW``, that step over the run's length, per seed; ``AdamW's step
at this final val``, the other way round: the step where ``adamw``'s curve reaches this
run's final loss (``-``: never, the run ends below AdamW's curve), per seed; ``s/step``,
the training wall time per step (evaluations excluded, first step included; mean of the
seeds) and its ratio to ``adamw``'s, measured in the same sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _common  # noqa: E402  (sets ONEDNN_MAX_CPU_ISA before torch)

from muonfx.cli.optimizers import optimizer_names  # noqa: E402
from muonfx.cli.report import steps_to_reach  # noqa: E402
from muonfx.presets import catalogue  # noqa: E402


def run_dir(out: Path, name: str, seed: int, lr: float | None) -> Path:
    """Where the run of ``name`` at ``seed`` (and ``lr``, None: its default) keeps its files."""
    return out / (f"{name}-s{seed}" if lr is None else f"{name}-lr{lr:g}-s{seed}")


def run(name: str, seed: int, args, out: Path, lr: float | None = None) -> dict:
    summary = run_dir(out, name, seed, lr) / "summary.json"
    if not summary.exists():
        cmd = [sys.executable, "-m", "muonfx", "train", "--optimizer", name, "--seed", str(seed),
               *([] if lr is None else ["--lr", repr(float(lr))]),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--eval-every", str(args.eval_every),
               "--threads", "1",
               "--no-progress", "--out", str(summary.parent), *args.extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        at = "" if lr is None else f" lr {lr:g}"
        print(f"  {name}{at} seed {seed}: {time.perf_counter() - t0:.0f} s ({_common.load()})", flush=True)
    data = json.loads(summary.read_text())
    return data["runs"][name]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    order = [*catalogue.__all__, *(n for n in optimizer_names() if n not in catalogue.__all__)]
    p.add_argument("--names", default=",".join(n for n in order if n != "adamw"),
                   help="comma-separated --optimizer names (adamw, the baseline, always runs)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", default="/tmp/muonfx-catalogue-train")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (default 1: back to back); more only where that many cores are idle")
    p.add_argument("--table-only", action="store_true", help="no new runs: the table of the runs in --out")
    p.add_argument("--lr", action="append", default=[], metavar="NAME=VALUE",
                   help="run NAME at this lr (repeatable; the others at their defaults)")
    p.add_argument("--sweep", metavar="F1,F2,...",
                   help="at the first seed, each optimizer at its preset's own lr times each factor; print the best")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more options of muonfx train")
    args = p.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    names = [n for n in args.names.split(",") if n and n != "adamw"]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    lrs = parse_lrs(args.lr, ["adamw", *names])
    import torch

    torch.set_num_threads(1)  # as every run: the machine line says so
    print(f"# {_common.machine()}")
    if args.sweep:
        return sweep(names, seeds[0], [float(f) for f in args.sweep.split(",") if f], args, out)
    todo = [(name, seed, lrs.get(name)) for seed in seeds for name in ["adamw", *names]]
    if args.table_only:
        todo = [(n, s, lr) for n, s, lr in todo if (run_dir(out, n, s, lr) / "summary.json").exists()]
    done = _run_all(todo, args, out)
    runs: dict[tuple[str, int], dict] = {(n, s): rec for (n, s, _), rec in zip(todo, done)}
    rows = []
    base_s = statistics.mean(_per_step(runs["adamw", s]) for s in seeds if ("adamw", s) in runs)
    for name in ["adamw", *names]:
        done = [s for s in seeds if (name, s) in runs and ("adamw", s) in runs]
        if not done:
            continue
        hits, fracs, back = [], [], []
        for s in done:
            rec = runs[name, s]
            mirror = steps_to_reach(runs["adamw", s]["val_curve"], rec["final_val_loss"])
            back.append("-" if mirror is None else f"{mirror['interpolated']:.0f}")
            hit = steps_to_reach(rec["val_curve"], runs["adamw", s]["final_val_loss"])
            hits.append("-" if hit is None else f"{hit['interpolated']:.0f}")
            fracs.append("-" if hit is None else f"{hit['interpolated'] / rec['steps']:.2f}")
        per_step = statistics.mean(_per_step(runs[name, s]) for s in done)
        rows.append([name, f"{statistics.mean(runs[name, s]['final_val_loss'] for s in done):.3f}",
                     " / ".join(hits), " / ".join(fracs), " / ".join(back),
                     f"{per_step:.3f}", f"{per_step / base_s:.2f}x"])
    print(f"seeds {', '.join(map(str, seeds))}; {args.steps} steps, batch {args.batch_size}; "
          f"{args.jobs} run(s) at a time, one thread each")
    if lrs:
        print("lr: " + ", ".join(f"{n} {v:g}" for n, v in lrs.items()) + "; the others at their defaults")
    print(_common.table(["optimizer", "final val", "steps to AdamW's final val", "x AdamW",
                         "AdamW's step at this final val", "s/step",
                         "s/step x AdamW"], rows))


def parse_lrs(items: list[str], names: list[str]) -> dict[str, float]:
    """``{name: lr}`` from ``NAME=VALUE`` items (a clear error for a malformed one or an
    optimizer not run)."""
    lrs = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = float("nan")
        if not sep or not lr > 0:
            raise SystemExit(f"catalogue_train.py: --lr {item!r}: expected NAME=VALUE with a positive VALUE")
        if name not in names:
            raise SystemExit(f"catalogue_train.py: --lr {item!r}: {name!r} is not among the optimizers run "
                             f"({', '.join(names)})")
        lrs[name] = lr
    return lrs


def sweep(names: list[str], seed: int, factors: list[float], args, out: Path) -> None:
    """Each optimizer at its preset's own lr times each factor (``adamw`` once, at its
    own), at one seed: the final validation loss of each, the best marked, and the ``--lr``
    options of the best."""
    from muonfx.cli.optimizers import preset_lr

    grid = {n: [preset_lr(n) * f for f in factors] for n in names}
    todo = [("adamw", seed, None)] + [(n, seed, lr) for n in names for lr in grid[n]]
    done = dict(zip([(n, lr) for n, _, lr in todo], _run_all(todo, args, out)))
    rows, best_opts = [], []
    for n in names:
        finals = [done[n, lr]["final_val_loss"] for lr in grid[n]]
        best = min(range(len(finals)), key=lambda i: finals[i])
        best_opts.append(f"--lr {n}={grid[n][best]:g}")
        rows.append([n, *(f"{lr:g}: {v:.3f}{' *' if i == best else ''}"
                          for i, (lr, v) in enumerate(zip(grid[n], finals)))])
    print(f"seed {seed}; {args.steps} steps, batch {args.batch_size}; final validation loss at each lr "
          f"(the preset's lr x {', '.join(f'{f:g}' for f in factors)}; * the best); adamw at its lr: "
          f"{done['adamw', None]['final_val_loss']:.3f}")
    print(_common.table(["optimizer", *(f"x {f:g}" for f in factors)], rows))
    print("the best: " + " ".join(best_opts))


def _run_all(todo: list[tuple], args, out: Path) -> list[dict]:
    if args.jobs > 1:  # on a machine with cores to spare: runs side by side, one thread each
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            return list(pool.map(lambda nsl: run(nsl[0], nsl[1], args, out, nsl[2]), todo))
    return [run(n, s, args, out, lr) for n, s, lr in todo]


def _per_step(rec: dict) -> float:
    return (rec["seconds"] - rec["eval_seconds"]) / rec["steps"]


if __name__ == "__main__":
    main()
