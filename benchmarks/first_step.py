"""Time to the first step, and the steady step, of the hybrid optimizer (Muon on the hidden
matrices, AdamW on embeddings, head, norms and biases) against torch's pair.

    python benchmarks/first_step.py                      # GPT-2 small (124 M) and the 2-layer MoE set
    python benchmarks/first_step.py --sets gpt2 --layers 2   # a quick look
    python benchmarks/first_step.py --rounds 2           # each contender twice, alternating
    python benchmarks/first_step.py --device cuda        # on a GPU
    python benchmarks/first_step.py --compiled           # also opt.compile(): a cold and a warm compile cache

Contenders, each in a process of its own (a fresh interpreter: nothing compiled or cached
in memory from another contender), on the same model and the same gradients (drawn from
one seed in every process):

* ``muonfx``: ``mfx.create_hybrid_optimizer(model)`` with its defaults (its plan: the
  Muon group eager, the AdamW group in torch's fused AdamW kernel; nothing compiled);
* ``torch``: ``torch.optim.Muon`` on the same matrices (one 2-D parameter per expert in
  the MoE set: it takes 2-D only) + ``torch.optim.AdamW(fused=True)`` on the rest, the
  same hyperparameters;
* ``heavyball`` (when the ``heavyball`` package is installed; left out with a note where
  it is not): ``heavyball.Muon`` + ``heavyball.AdamW``, its defaults (it compiles its step);
* with ``--compiled``: ``muonfx compiled, cold`` and ``muonfx compiled, warm``, the same
  optimizer after ``opt.compile()``, in a process with an empty inductor cache
  (``TORCHINDUCTOR_CACHE_DIR`` a new folder) and then in a second process that finds the
  first one's cache.

``first``: seconds from building the optimizer to the end of its first ``step()`` (what a
user waits for before training moves); ``steady``: the median of the next ``--steps``
steps. Ratios are muonfx / torch measured in the same run. Sets:

* ``gpt2``: GPT-2 small's parameters by name (``wte``, ``wpe``, 12 layers of ``c_attn``
  768x2304, ``c_proj`` 768x768, ``c_fc`` 768x3072, ``mlp.c_proj`` 3072x768, biases, norms);
* ``moe``: 2 layers of attention (4 x 512x512), a router (8x512) and 8 experts of
  512x1024 and 1024x512 (muonfx: one 3-D stack each), norms, an 8192x512 embedding and head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

import _common  # (sets ONEDNN_MAX_CPU_ISA before torch)
import torch
from adamw_step import gpt2_shapes  # GPT-2 small's parameters by name

CONTENDERS = ("muonfx", "torch", "heavyball")
COMPILED = ("muonfx compiled, cold", "muonfx compiled, warm")


def moe_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8192, 512)}
    for i in range(layers):
        for n, s in (("norm_1.weight", (512,)), ("attn.q.weight", (512, 512)), ("attn.k.weight", (512, 512)),
                     ("attn.v.weight", (512, 512)), ("attn.o.weight", (512, 512)), ("norm_2.weight", (512,)),
                     ("moe.router.weight", (8, 512)), ("moe.w1", (8, 512, 1024)), ("moe.w2", (8, 1024, 512))):
            shapes[f"layers.{i}.{n}"] = s
    shapes["norm.weight"] = (512,)
    shapes["lm_head.weight"] = (8192, 512)
    return shapes


SETS = {"gpt2": (gpt2_shapes, 12), "moe": (moe_shapes, 2)}


def build(shapes: dict[str, tuple[int, ...]], device: torch.device) -> tuple[torch.nn.Module, list]:
    """A module holding parameters of these names and shapes, and their gradients (one seed)."""
    root = torch.nn.Module()
    gen = torch.Generator(device).manual_seed(0)
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape, generator=gen, device=device) * 0.02))
    grads = [torch.randn(p.shape, generator=gen, device=device) for p in root.parameters()]
    return root, grads


def split(model: torch.nn.Module) -> tuple[list, list]:
    """The hybrid's routing (muonfx's default labels): the Muon matrices, the AdamW rest."""
    from muonfx import default_muon_labels

    muon, adamw = [], []
    for n, p in model.named_parameters():
        (muon if default_muon_labels(n, p) == "muon" else adamw).append(p)
    return muon, adamw


def make(contender: str, model: torch.nn.Module) -> tuple[list, str]:
    """The contender's optimizers over ``model`` (and the path of muonfx's plan)."""
    if contender.startswith("muonfx"):
        import muonfx as mfx

        opt = mfx.create_hybrid_optimizer(model)
        return [opt.compile() if "compiled" in contender else opt], ""
    muon, adamw = split(model)
    mats = []
    for p in muon:  # torch.optim.Muon takes 2-D parameters: one per expert of a stack, its gradient a slice
        if p.ndim == 3:
            for e, g in zip(p.detach().unbind(0), p.grad.unbind(0)):
                mats.append(torch.nn.Parameter(e.clone()))
                mats[-1].grad = g
        else:
            mats.append(p)
    if contender == "torch":
        return [torch.optim.Muon(mats, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0),
                torch.optim.AdamW(adamw, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)], ""
    import heavyball

    return [heavyball.Muon(mats, lr=0.02), heavyball.AdamW(adamw, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)], ""


def child(set_name: str, layers: int, contender: str, steps: int, device: torch.device) -> dict:
    fn, _ = SETS[set_name]
    model, grads = build(fn(layers), device)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    _common.sync(device)
    t0 = time.perf_counter()
    opts, _ = make(contender, model)
    # every parameter an optimizer holds and its gradient: given again before each steady
    # step, outside the timing (HeavyBall sets p.grad to None after a step)
    pairs = [(p, p.grad) for o in opts for g in o.param_groups for p in g["params"]]
    for o in opts:
        o.step()
    _common.sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        for p, g in pairs:
            p.grad = g
        _common.sync(device)
        t = time.perf_counter()
        for o in opts:
            o.step()
        _common.sync(device)
        times.append(time.perf_counter() - t)
    path = ""
    if contender.startswith("muonfx"):
        path = " + ".join(sorted({g.path for g in opts[0].plan.groups}))
    return {"first": first, "steady": statistics.median(times), "path": path,
            "params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="gpt2,moe")
    ap.add_argument("--layers", type=int, default=None, help="layers of every set (default: gpt2 12, moe 2)")
    ap.add_argument("--steps", type=int, default=5, help="steady steps timed after the first")
    ap.add_argument("--rounds", type=int, default=1, help="processes per contender, alternating")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compiled", action="store_true", help="also opt.compile(), with a cold and a warm cache")
    ap.add_argument("--child", nargs=2, metavar=("SET", "CONTENDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.child:
        s, c = args.child
        print(json.dumps(child(s, args.layers or SETS[s][1], c, args.steps, device)))
        return
    sets = [s for s in args.sets.split(",") if s]
    for s in sets:
        if s not in SETS:
            raise SystemExit(f"first_step.py: unknown set {s!r}; choose from {', '.join(SETS)}")
    try:
        import heavyball  # noqa: F401
        contenders = list(CONTENDERS)
        note = ""
    except ImportError:
        contenders = ["muonfx", "torch"]
        note = "heavyball is not installed: its row is left out (pip install heavyball adds it)"
    if args.compiled:
        contenders += list(COMPILED)
    rows = []
    for s in sets:
        got: dict[str, list[dict]] = {c: [] for c in contenders}
        for _ in range(args.rounds):
            cache = tempfile.mkdtemp(prefix="muonfx-first-step-")  # the compiled rows' inductor cache, cold then warm
            for c in contenders:
                cmd = [sys.executable, __file__, "--child", s, c, "--steps", str(args.steps), "--device", args.device]
                if args.layers:
                    cmd += ["--layers", str(args.layers)]
                env = {**os.environ, **({"TORCHINDUCTOR_CACHE_DIR": cache} if c in COMPILED else {})}
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    raise SystemExit(f"first_step.py: {s} / {c} failed:\n{out.stderr[-3000:]}")
                got[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
            shutil.rmtree(cache, ignore_errors=True)
        best = {c: {k: min(r[k] for r in got[c]) for k in ("first", "steady")} for c in contenders}
        for c in contenders:
            first, steady = best[c]["first"], best[c]["steady"]
            rows.append([s, f"{got[c][0]['params'] / 1e6:.1f} M", c, got[c][0]["path"] or "-", f"{first:.2f}",
                         f"{first / best['torch']['first']:.2f}", _common.fmt_ms(steady),
                         f"{steady / best['torch']['steady']:.2f}"])
    print(f"\nHybrid optimizer: time to the first step and steady step, one process per contender "
          f"({_common.machine()})")
    print(_common.table(["set", "params", "contender", "path", "first s", "first / torch", "steady ms",
                         "steady / torch"], rows))
    print(f"first: building the optimizer and its first step(); steady: median of {args.steps} steps after it; "
          f"best of {args.rounds} process(es) each; torch: torch.optim.Muon + torch.optim.AdamW(fused=True)")
    if note:
        print(note)


if __name__ == "__main__":
    main()
