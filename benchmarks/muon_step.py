"""Muon step: muonfx (through TransformOptimizer) vs torch.optim.Muon, same settings.

    python benchmarks/muon_step.py                  # GPT-2 small matrices, 2 layers
    python benchmarks/muon_step.py --layers 12      # the full GPT-2 small set (slow on CPU)
    python benchmarks/muon_step.py --device cuda

Matrix sets (one parameter per matrix for torch; torch.optim.Muon takes 2-D only):

* ``gpt2``: per layer 768x2304, 768x768, 768x3072, 3072x768;
* ``moe``: per layer 8 experts of 512x1024 and 1024x512; muonfx keeps each expert stack
  as one 3-D parameter, torch needs one 2-D parameter per expert.

Both optimizers get the same gradients; steps are timed in alternating rounds (median).
muonfx runs its defaults for the device (float32 Newton-Schulz on CPU, bf16 on CUDA) and,
as extra rows, the Gram iteration (float32, rectangular only), bf16 NS, and bf16 with the
Gram iteration on every matrix (restarts every 2 steps); torch.optim.Muon runs its bf16 NS.
"""

from __future__ import annotations

import argparse

import _common  # noqa: F401  (sets ONEDNN_MAX_CPU_ISA before torch)
import torch

import muonfx as mfx


def matrices(kind: str, layers: int) -> dict[str, list[tuple[int, ...]]]:
    if kind == "gpt2":
        return {f"h{i}.{n}": s for i in range(layers)
                for n, s in (("attn", (768, 2304)), ("proj", (768, 768)), ("fc", (768, 3072)), ("out", (3072, 768)))}
    return {f"h{i}.{n}": s for i in range(layers) for n, s in (("w1", (8, 512, 1024)), ("w2", (8, 1024, 512)))}


def run(kind: str, layers: int, device: torch.device, repeats: int, warmup: int) -> list:
    shapes = matrices(kind, layers)
    gen = torch.Generator().manual_seed(0)
    mfx_params = {k: torch.nn.Parameter(torch.randn(*s, generator=gen).to(device) * 0.02) for k, s in shapes.items()}
    torch_params = []
    for k, p in mfx_params.items():
        p.grad = torch.randn(p.shape, generator=gen).to(device)
        if p.ndim == 3:
            for e in range(p.shape[0]):
                q = torch.nn.Parameter(p.detach()[e].clone())
                q.grad = p.grad[e].clone()
                torch_params.append(q)
        else:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = p.grad.clone()
            torch_params.append(q)
    variants = {"muonfx default": {}, "muonfx gram": {"ns_method": "auto"},
                "muonfx bf16": {"ns_dtype": torch.bfloat16},
                "muonfx bf16 gram": {"ns_dtype": torch.bfloat16, "ns_method": "gram"}}
    fns = {}
    for name, kw in variants.items():
        copies = [(k, torch.nn.Parameter(p.detach().clone())) for k, p in mfx_params.items()]
        for (_, c), p in zip(copies, mfx_params.values()):
            c.grad = p.grad.clone()
        fns[name] = mfx.TransformOptimizer(copies, mfx.muon, lr=0.02, weight_decay=0.1, **kw).step
    fns["torch"] = torch.optim.Muon(torch_params, lr=0.02, weight_decay=0.1).step
    t = _common.interleaved(fns, repeats, warmup, device)
    n = len(torch_params)
    return [[kind, f"{layers} layers, {n} matrices", name, f"{t[name] * 1e3:.0f}", f"{t['torch'] * 1e3:.0f}",
             f"{t[name] / t['torch']:.2f}"] for name in variants]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sets", default="gpt2,moe")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = [r for k in args.sets.split(",") for r in run(k, args.layers, device, args.repeats, args.warmup)]
    print(f"\nMuon step, muonfx vs torch.optim.Muon ({_common.machine()})")
    print(_common.table(["set", "matrices", "muonfx variant", "muonfx ms", "torch ms", "muonfx/torch"], rows))


if __name__ == "__main__":
    main()
