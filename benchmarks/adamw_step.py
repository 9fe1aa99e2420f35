"""AdamW step: the muonfx chain through TransformOptimizer vs torch.optim.AdamW(foreach=True).

    python benchmarks/adamw_step.py                 # GPT-2 small parameter set (124M)
    python benchmarks/adamw_step.py --scale 0.25    # fewer layers, for a quick look

Both optimizers hold the same parameters (GPT-2 small: token/position embeddings,
12 layers of 768x2304, 768x768, 768x3072, 3072x768 plus biases and norms) and the same
gradients; steps are timed in alternating rounds (median).
"""

from __future__ import annotations

import argparse
import os

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
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    named, donated, compiled, copies = [], [], [], []
    for k, s in gpt2_shapes(args.layers).items():
        p = torch.nn.Parameter(torch.randn(*s, generator=gen).to(device) * 0.02)
        p.grad = torch.randn(*s, generator=gen).to(device)
        named.append((k, p))
        for dst in (donated, compiled, copies) if args.compile else (donated, copies):
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.clone()
            dst.append(q if dst is copies else (k, q))
    n = sum(p.numel() for _, p in named)
    ours = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-3, weight_decay=0.01)
    # donate_grads: the update is computed in the gradient buffers (grads hold garbage
    # after step(); timing only, the gradients are not refilled)
    ours_dg = mfx.TransformOptimizer(donated, mfx.adamw, lr=1e-3, weight_decay=0.01)
    ours_dg.donate_grads = True
    theirs = torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.01, foreach=True)
    fns = {"muonfx": ours.step, "donated": ours_dg.step, "torch": theirs.step}
    variants = [("default", "muonfx"), ("donate_grads=True", "donated")]
    if args.compile:
        fns["compiled"] = mfx.TransformOptimizer(compiled, mfx.adamw, lr=1e-3, weight_decay=0.01).compile(**({"backend": os.environ["MFX_BACKEND"]} if "MFX_BACKEND" in os.environ else {})).step
        variants.append(("opt.compile()", "compiled"))
    t = _common.interleaved(fns, args.repeats, args.warmup, device)
    print(f"\nAdamW step, muonfx chain vs torch.optim.AdamW(foreach=True) ({_common.machine()})")
    rows = [[variant, f"{n / 1e6:.1f} M", len(named), f"{t[k] * 1e3:.0f}", f"{t['torch'] * 1e3:.0f}",
             f"{t[k] / t['torch']:.2f}"]
            for variant, k in variants]
    print(_common.table(["muonfx variant", "params", "tensors", "muonfx ms", "torch ms", "muonfx/torch"], rows))


if __name__ == "__main__":
    main()
