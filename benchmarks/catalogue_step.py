"""Step time of each catalogue optimizer (and AdamW, Muon) in muonfx next to HeavyBall's
same optimizer, where HeavyBall has one.

    python benchmarks/catalogue_step.py                       # the tiny GPT of muonfx train, every optimizer
    python benchmarks/catalogue_step.py --model small --steps 20
    python benchmarks/catalogue_step.py --names soap,adopt --heavyball-eager
    python benchmarks/catalogue_step.py --rounds 2            # each contender twice, alternating
    python benchmarks/catalogue_step.py --names lion,adopt,laprop --chain --dtensor --no-heavyball

Contenders, each in a process of its own (a fresh interpreter), on the same model (the
``--model`` GPT of ``muonfx train``, built from one seed) and the same gradients (drawn
from one seed in every process):

* ``muonfx``: ``mfx.TransformOptimizer(params, mfx.NAME)`` with the preset's defaults;
* ``heavyball`` (when the ``heavyball`` package is installed; left out with a note where
  it is not): HeavyBall's optimizer of that name, with its defaults (it compiles its step
  with ``torch.compile`` at the first step) and the preset's betas where they differ;
  ``heavyball eager`` with ``--heavyball-eager``: the same with
  ``heavyball.utils.compile_mode = None``.

HeavyBall's counterparts: ``AdamW``, ``Muon``, ``ADOPT``, ``LaProp``, ``AdamW(caution=True)``
for ``cautious_adamw``, ``AdamW(mars=True)`` for ``mars_adamw``, ``Muon(mars=True)`` for
``mars_muon``, ``SFAdamW`` for ``schedule_free_adamw`` and ``SOAP``; it has no Lion and no
Dion2 (those rows show muonfx alone). The matrix optimizers (``muon``, ``mars_muon``,
``dion2``) get the model's matrices, the others every parameter, in both libraries.

``--chain`` adds ``muonfx chain``: the same preset with ``"fused": False`` (its chain of
transforms, where the plan would run a lowering); ``--dtensor`` adds each muonfx
contender again on the parameters as DTensors of a one-rank gloo world (sharded on dim 0,
a 0-D one replicated: what FSDP2 hands an optimizer), ``muonfx DTensor`` and ``muonfx
DTensor chain``.

``first``: seconds from building the optimizer to the end of its first ``step()``;
``steady``: the median of the next ``--steps`` steps; ``mean``: their mean (SOAP's basis
refresh every 10 steps shows there). The gradients are given again before every step,
outside the timed call (HeavyBall sets ``p.grad = None`` after its step). ``/ heavyball``:
muonfx's time over HeavyBall's (default, compiled) in the same run; below 1 is muonfx
faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _common  # noqa: E402  (sets ONEDNN_MAX_CPU_ISA before torch)
import torch  # noqa: E402

NAMES = ("adamw", "muon", "lion", "adopt", "laprop", "cautious_adamw", "mars_adamw", "mars_muon",
         "schedule_free_adamw", "soap", "dion2")
MATRIX = ("muon", "mars_muon", "dion2")


def heavyball_counterpart(name: str, params: list):
    """HeavyBall's optimizer for muonfx's preset ``name``, or None where it has none."""
    import heavyball

    table = {
        "adamw": lambda: heavyball.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01),
        "muon": lambda: heavyball.Muon(params, lr=0.02),
        "adopt": lambda: heavyball.ADOPT(params, lr=1e-3, betas=(0.9, 0.9999)),
        "laprop": lambda: heavyball.LaProp(params, lr=4e-4, betas=(0.9, 0.999)),
        "cautious_adamw": lambda: heavyball.AdamW(params, lr=1e-3, betas=(0.9, 0.999), caution=True),
        "mars_adamw": lambda: heavyball.AdamW(params, lr=3e-3, betas=(0.95, 0.99), mars=True),
        "mars_muon": lambda: heavyball.Muon(params, lr=0.02, mars=True),
        "schedule_free_adamw": lambda: heavyball.SFAdamW(params, lr=2.5e-3, betas=(0.9, 0.999)),
        "soap": lambda: heavyball.SOAP(params, lr=3e-3, betas=(0.95, 0.95), precondition_frequency=10),
    }
    return table[name]() if name in table else None


def build(model_name: str) -> tuple[list, list]:
    """The GPT's parameters (one seed) and gradients for them (another seed)."""
    from muonfx.cli.model import GPT, MODELS

    torch.manual_seed(0)
    model = GPT(MODELS[model_name])
    named = [(n, p) for n, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 0.01 for _, p in named]
    return named, grads


def as_dtensors(named: list, grads: list) -> tuple[list, list, Any]:
    """The parameters and gradients as DTensors of a one-rank gloo world made in this
    process (sharded on dim 0, a 0-D one replicated: what FSDP2 hands an optimizer), and
    the function that ends the world."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1), rank=0,
                            world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    place = [[Shard(0)] if p.ndim else [Replicate()] for _, p in named]
    named = [(n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, pl))) for (n, p), pl in zip(named, place)]
    grads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, place)]
    return named, grads, dist.destroy_process_group


def child(name: str, contender: str, model_name: str, steps: int) -> dict:
    named, grads = build(model_name)
    keep = [i for i, (_, p) in enumerate(named) if name not in MATRIX or p.ndim >= 2]
    named, grads = [named[i] for i in keep], [grads[i] for i in keep]
    end = None
    if contender.startswith("muonfx") and "DTensor" in contender:
        named, grads, end = as_dtensors(named, grads)
    try:
        return _timed(name, contender, named, grads, steps)
    finally:
        if end is not None:
            end()


def _timed(name: str, contender: str, named: list, grads: list, steps: int) -> dict:
    """The first and the next ``steps`` steps of ``contender``'s optimizer ``name``; for
    muonfx also the paths of its step plan."""
    params = [p for _, p in named]

    def give_grads() -> None:  # before every step, untimed: HeavyBall sets p.grad = None after its step
        for p, g in zip(params, grads):
            p.grad = g

    give_grads()
    t0 = time.perf_counter()
    if contender.startswith("muonfx"):
        import muonfx as mfx

        opt = mfx.TransformOptimizer(named, getattr(mfx, name), **({"fused": False} if "chain" in contender else {}))
    else:
        import heavyball

        if contender == "heavyball eager":
            heavyball.utils.compile_mode = None
        opt = heavyball_counterpart(name, params)
    opt.step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        give_grads()
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    paths = sorted({g.path for g in opt.plan.groups}) if contender.startswith("muonfx") else []
    return {"first": first, "steady": statistics.median(times), "mean": statistics.mean(times),
            "params": sum(p.numel() for _, p in named), "paths": paths}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--names", default=",".join(NAMES), help="comma-separated preset names")
    ap.add_argument("--model", default="tiny", help="the muonfx train model whose parameters are stepped")
    ap.add_argument("--steps", type=int, default=20, help="steps timed after the first")
    ap.add_argument("--rounds", type=int, default=1, help="processes per contender, alternating")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every contender")
    ap.add_argument("--heavyball-eager", action="store_true", help="also HeavyBall with compile_mode=None")
    ap.add_argument("--no-heavyball", action="store_true", help="muonfx alone, even where heavyball is installed")
    ap.add_argument("--chain", action="store_true", help='also muonfx running the chain ("fused": False)')
    ap.add_argument("--dtensor", action="store_true",
                    help="also muonfx on the parameters as DTensors (one gloo rank, sharded on dim 0)")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "CONTENDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(*args.child, args.model, args.steps)))
        return
    names = [n for n in args.names.split(",") if n]
    for n in names:
        if n not in NAMES:
            raise SystemExit(f"catalogue_step.py: unknown optimizer {n!r}; choose from {', '.join(NAMES)}")
    note = ""
    try:
        if args.no_heavyball:
            raise ImportError
        import heavyball

        hb = ["heavyball"] + (["heavyball eager"] if args.heavyball_eager else [])
        version = f"heavyball {heavyball.__version__}" if hasattr(heavyball, "__version__") else "heavyball"
    except ImportError:
        hb, version = [], ""
        note = ("heavyball is not installed: its rows are left out (pip install heavyball adds them)"
                if not args.no_heavyball else "--no-heavyball: muonfx alone")
    rows = []
    for n in names:
        ours = ["muonfx"] + (["muonfx chain"] if args.chain else [])
        ours += [f"{c.replace('muonfx', 'muonfx DTensor')}" for c in ours] if args.dtensor else []
        contenders = ours + [c for c in hb if c and _has_counterpart(n)]
        got: dict[str, list[dict]] = {c: [] for c in contenders}
        for _ in range(args.rounds):
            for c in contenders:
                cmd = [sys.executable, __file__, "--child", n, c, "--model", args.model, "--steps", str(args.steps),
                       "--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"catalogue_step.py: {n} / {c} failed:\n{out.stderr[-3000:]}")
                got[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = {c: {k: min(r[k] for r in got[c]) for k in ("first", "steady", "mean")} for c in contenders}
        ref = best.get("heavyball")
        for c in contenders:
            b = best[c]
            ratio = lambda k: f"{b[k] / ref[k]:.2f}" if ref else "-"  # noqa: E731
            rows.append([n, c, f"{got[c][0]['params'] / 1e6:.2f} M", f"{b['first']:.2f}", ratio("first"),
                         f"{b['steady'] * 1e3:.2f}", ratio("steady"), f"{b['mean'] * 1e3:.2f}", ratio("mean")])
    print(f"\nCatalogue step times, one process per contender ({_common.machine()}"
          f"{', ' + version if version else ''})")
    print(_common.table(["optimizer", "contender", "params", "first s", "/ heavyball", "steady ms", "/ heavyball",
                         "mean ms", "/ heavyball"], rows))
    print(f"model: muonfx train's {args.model} GPT; first: building the optimizer and its first step(); "
          f"steady: median of {args.steps} steps after it, mean: their mean; best of {args.rounds} process(es) each")
    if note:
        print(note)


def _has_counterpart(name: str) -> bool:
    return name not in ("lion", "dion2")


if __name__ == "__main__":
    main()
