"""AdamW step: the muonfx chain through TransformOptimizer vs torch.optim.AdamW(foreach=True).

    python benchmarks/adamw_step.py                 # GPT-2 small parameter set (124M)
    python benchmarks/adamw_step.py --layers 2      # fewer layers, for a quick look
    python benchmarks/adamw_step.py --fused         # also torch.optim.AdamW(fused=True) (the GPU target)
    python benchmarks/adamw_step.py --fused --host  # and where each step's host time goes

Both optimizers hold the same parameters (GPT-2 small: token/position embeddings,
12 layers of 768x2304, 768x768, 768x3072, 3072x768 plus biases and norms) and the same
gradients (shared: neither writes them); steps are timed in alternating rounds (median).

Before the timed rounds every optimizer makes one untimed step (a compiled muonfx step
compiles there); the ``path`` column is the path of muonfx's step plan (by rules:
``fused``: torch's fused AdamW kernel on muonfx's state, for a group built with
``mfx.adamw``; nothing is measured). ``--compile`` adds a row for ``opt.compile()``. Extra step
memory: the peak bytes allocated during one ``opt.step()`` of that path beyond what existed
before it, measured in one more, untimed step per optimizer: ``torch.cuda.max_memory_allocated``
on CUDA, the CPU allocator's own records (``muonfx.memory.AllocatorPeak``) on the CPU, which
see a compiled step's buffers too.

``--host`` (with ``--fused``): the host time of a step, from the call of ``step()`` to its
return with the device idle before it (on a GPU the kernels run on after it returns),
median of 30 steps, for muonfx and the fused torch; then muonfx's Python functions by
their own time over those steps (``cProfile``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import _common
import torch

import muonfx as mfx


def gpt2_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"wte": (50257, 768), "wpe": (1024, 768)}
    for i in range(layers):
        for n, s in (("ln_1.weight", (768,)), ("ln_1.bias", (768,)), ("attn.c_attn.weight", (768, 2304)),
                     ("attn.c_attn.bias", (2304,)), ("attn.c_proj.weight", (768, 768)), ("attn.c_proj.bias", (768,)),
                     ("ln_2.weight", (768,)), ("ln_2.bias", (768,)), ("mlp.c_fc.weight", (768, 3072)),
                     ("mlp.c_fc.bias", (3072,)), ("mlp.c_proj.weight", (3072, 768)), ("mlp.c_proj.bias", (768,))):
            shapes[f"h.{i}.{n}"] = s
    shapes["ln_f.weight"] = (768,)
    shapes["ln_f.bias"] = (768,)
    return shapes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="add a row for opt.compile() (inductor; compiles first)")
    ap.add_argument("--fused", action="store_true", help="also time torch.optim.AdamW(fused=True): a muonfx/fused column")
    ap.add_argument("--host", action="store_true", help="with --fused: the host time of a step and muonfx's by function")
    args = ap.parse_args(argv)
    if args.host and not args.fused:
        ap.error("--host compares with torch.optim.AdamW(fused=True): give --fused too")
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)  # drawn on the device
    named, compiled, copies, fused = [], [], [], []
    for k, s in gpt2_shapes(args.layers).items():
        p = torch.nn.Parameter(torch.randn(*s, generator=gen, device=device) * 0.02)
        p.grad = torch.randn(*s, generator=gen, device=device)
        named.append((k, p))
        for dst in (copies,) + ((compiled,) if args.compile else ()) + ((fused,) if args.fused else ()):
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad  # shared: no optimizer writes the gradients
            dst.append((k, q) if dst is compiled else q)
    n = sum(p.numel() for _, p in named)
    opts = {"muonfx": mfx.TransformOptimizer(named, mfx.adamw, lr=1e-3, weight_decay=0.01),
            "torch": torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.01, foreach=True)}
    if args.fused:
        opts["torch fused"] = torch.optim.AdamW(fused, lr=1e-3, weight_decay=0.01, fused=True)
    variants = [("default", "muonfx")]
    if args.compile and opts["muonfx"].plan.groups[0].path != "compiled":
        backend = {"backend": os.environ["MFX_BACKEND"]} if "MFX_BACKEND" in os.environ else {}
        opts["compiled"] = mfx.TransformOptimizer(compiled, mfx.adamw, lr=1e-3, weight_decay=0.01).compile(**backend)
        variants.append(("opt.compile()", "compiled"))
    elif args.compile:
        print("the default row is compiled already (its plan's rule): no opt.compile() row")
    paths = {k: _common.settle(o) for k, o in opts.items()}  # one untimed step each (compiles where compiled)
    t = _common.interleaved({k: o.step for k, o in opts.items()}, args.repeats, args.warmup, device)
    mem = {k: _common.step_memory(o.step, device) for k, o in opts.items()}  # untimed, after the timed steps
    print(f"\nAdamW step, muonfx chain vs torch.optim.AdamW(foreach=True) ({_common.machine()})")
    rows = [[variant, paths[k], f"{n / 1e6:.1f} M", len(named), _common.fmt_ms(t[k]), _common.fmt_ms(t['torch']),
             f"{t[k] / t['torch']:.2f}", _common.fmt_bytes(mem[k]), _common.fmt_bytes(mem["torch"])]
            + ([_common.fmt_ms(t['torch fused']), f"{t[k] / t['torch fused']:.2f}"] if args.fused else [])
            for variant, k in variants]
    print(_common.table(["muonfx variant", "path", "params", "tensors", "muonfx ms", "torch ms", "muonfx/torch",
                         "muonfx extra mem", "torch extra mem"]
                        + (["torch fused ms", "muonfx/fused"] if args.fused else []), rows))
    print(f"path: the step plan's path (by rules: print(opt.plan)), its first step untimed; extra mem: peak bytes "
          f"allocated during one step of that path beyond those allocated before it "
          f"({'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'the CPU allocator records'}; "
          f"an untimed step after the timed ones); model {_common.fmt_bytes(sum(p.numel() * p.element_size() for _, p in named))}")
    if args.host:
        host(opts["muonfx"], opts["torch fused"], device)


def host(mine, theirs, device: torch.device, steps: int = 30) -> None:
    """The host time of a step (``step()`` called with the device idle, until it returns),
    median of ``steps``, muonfx's against torch's fused; then muonfx's functions by their
    own time over ``steps`` more steps."""
    def timed(opt) -> float:
        ts = []
        for _ in range(steps):
            _common.sync(device)
            t0 = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t0)
        _common.sync(device)
        return statistics.median(ts)

    a, b = timed(mine), timed(theirs)
    print(f"host time of a step (until step() returns, the device idle before it; median of {steps}): "
          f"muonfx {a * 1e3:.3f} ms, torch fused {b * 1e3:.3f} ms ({a / b:.2f}x)")
    prof = cProfile.Profile()
    for _ in range(steps):
        _common.sync(device)
        prof.enable()
        mine.step()
        prof.disable()
    _common.sync(device)
    print(f"muonfx's step by function, own time over {steps} steps (cProfile; its overhead included):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)

if __name__ == "__main__":
    main()
