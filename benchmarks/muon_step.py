"""Muon step: muonfx (through TransformOptimizer) vs torch.optim.Muon, same settings.

    python benchmarks/muon_step.py                  # GPT-2 small and MoE matrices, 2 layers
    python benchmarks/muon_step.py --layers 12      # the full GPT-2 small set (slow on CPU)
    python benchmarks/muon_step.py --device cuda --sets llama1b,moe32   # the GPU sets, full size
    python benchmarks/muon_step.py --sets llama1b,moe32 --layers 1 --shrink 8   # their shape, on a CPU
    python benchmarks/muon_step.py --variants default  # only the default row next to torch
    python benchmarks/muon_step.py --variants default --busy 2   # two spinning processes beside it

Matrix sets (one parameter per matrix for torch; torch.optim.Muon takes 2-D only):

* ``gpt2``: per layer 768x2304, 768x768, 768x3072, 3072x768 (default 2 layers);
* ``moe``: per layer 8 experts of 512x1024 and 1024x512 (default 2 layers);
* ``llama1b``: a Llama-1B-like set, per layer q, o 2048x2048; k, v 256x2048; gate, up
  5632x2048; down 2048x5632 (default 22 layers: 968 M parameters);
* ``moe32``: per layer 32 experts of 1024x2048 and 2048x1024 (default 8 layers: 1074 M).

In the MoE sets muonfx keeps each expert stack as one 3-D parameter, torch needs one 2-D
parameter per expert. ``--layers`` overrides every set's default; ``--shrink K`` divides
every matrix dimension by K (a quick look at a GPU set on a CPU).

Both optimizers get the same gradients; steps are timed in alternating rounds (median).
muonfx runs its defaults for the device (the standard iteration, torch's, in bf16 on CUDA
and on CPUs with native bf16 matmul, float32 elsewhere: ``muonfx.linalg.ns_dtype_for``)
and, as extra rows, float32 NS, bf16 NS (torch.optim.Muon's arithmetic), ``ns_method="auto"``
(the Gram iteration on rectangular matrices; where float32 is the device's default also the
spectral form on large ones) and bf16 Gram on every matrix (restarts every 3 steps); a row
that computes exactly what an earlier row computes on this device is left out.
torch.optim.Muon runs its bf16 standard NS. The header names the CPU kind (model, bf16
flags, oneDNN's cap), the threads and the load average; ``--busy N`` starts N processes
that spin for the whole run (more runnable threads than cores, on purpose).

Before the timed rounds every optimizer makes one untimed step (a compiled muonfx step
compiles there); the ``path`` column is the path of muonfx's step plan (by rules:
eager unless asked to compile, in pieces where a group exceeds the batch budget;
nothing is measured). Extra step memory: the peak bytes allocated during one
``opt.step()`` of that path beyond what existed before it (the optimizer state already
created), measured in one more, untimed step per optimizer: ``torch.cuda.max_memory_allocated``
on CUDA, the CPU allocator's own records (``muonfx.memory.AllocatorPeak``) on the CPU. The gradients are shared by all optimizers (none
writes them), so a full-size set needs about 10x its float32 bytes of GPU memory.
"""

from __future__ import annotations

import argparse

import _common  # (sets ONEDNN_MAX_CPU_ISA before torch)
import torch

import muonfx as mfx
from muonfx.linalg import auto_method, auto_takes_gram, cpu_ns_choice, ns_dtype_for
from muonfx.linalg.precision import pinned_ns_dtype

#: per-layer matrices and the default number of layers of each set
SETS: dict[str, tuple[tuple[tuple[str, tuple[int, ...]], ...], int]] = {
    "gpt2": ((("attn", (768, 2304)), ("proj", (768, 768)), ("fc", (768, 3072)), ("out", (3072, 768))), 2),
    "moe": ((("w1", (8, 512, 1024)), ("w2", (8, 1024, 512))), 2),
    "llama1b": ((("q", (2048, 2048)), ("k", (256, 2048)), ("v", (256, 2048)), ("o", (2048, 2048)),
                 ("gate", (5632, 2048)), ("up", (5632, 2048)), ("down", (2048, 5632))), 22),
    "moe32": ((("w1", (32, 1024, 2048)), ("w2", (32, 2048, 1024))), 8),
}

VARIANTS = {"muonfx default": {}, "muonfx float32": {"ns_dtype": torch.float32},
            "muonfx bf16": {"ns_dtype": torch.bfloat16},
            "muonfx auto": {"ns_method": "auto"},
            "muonfx bf16 gram": {"ns_dtype": torch.bfloat16, "ns_method": "gram"}}


def matrices(kind: str, layers: int | None = None, shrink: int = 1) -> dict[str, tuple[int, ...]]:
    if kind not in SETS:
        raise SystemExit(f"muon_step.py: unknown set {kind!r}; choose from {', '.join(SETS)}")
    per_layer, default_layers = SETS[kind]
    n = default_layers if layers is None else layers

    def small(s: tuple[int, ...]) -> tuple[int, ...]:
        return s[:-2] + tuple(max(1, d // shrink) for d in s[-2:])

    return {f"h{i}.{name}": small(s) for i in range(n) for name, s in per_layer}


def distinct_variants(device: torch.device) -> dict[str, dict]:
    """The variants that compute differently on ``device`` (the first name of each)."""
    default_dtype = ns_dtype_for(device)
    out, seen = {}, set()
    for name, kw in VARIANTS.items():
        dtype = kw.get("ns_dtype", default_dtype)
        method = kw.get("ns_method", "standard")
        # no dtype given (and none pinned): the device's default, with bf16's accuracy
        accuracy = "bf16" if "ns_dtype" not in kw and pinned_ns_dtype() is None else "dtype"
        if method != "auto" or not auto_takes_gram(dtype, accuracy):  # the accuracy only steers "auto"
            method, accuracy = ("standard" if method == "auto" else method), "dtype"
        if (dtype, method, accuracy) not in seen:
            seen.add((dtype, method, accuracy))
            out[name] = kw
    return out


def run(kind: str, layers: int | None, shrink: int, device: torch.device, repeats: int, warmup: int,
        only: list[str] | None = None) -> list:
    shapes = matrices(kind, layers, shrink)
    # drawn on the device (a GPU set's billion values drawn by the CPU took tens of seconds)
    gen = torch.Generator(device).manual_seed(0)
    grads = {k: torch.randn(*s, generator=gen, device=device) for k, s in shapes.items()}
    init = {k: torch.randn(*s, generator=gen, device=device) * 0.02 for k, s in shapes.items()}
    torch_params = []
    for k, p in init.items():
        # the gradients are shared (views for experts): no optimizer writes them
        for w, g in (zip(p, grads[k]) if p.ndim == 3 else [(p, grads[k])]):
            q = torch.nn.Parameter(w.clone())
            q.grad = g
            torch_params.append(q)
    variants = distinct_variants(device)
    if only:
        variants = {k: v for k, v in variants.items() if k.removeprefix("muonfx ") in only}
    opts = {}
    for name, kw in variants.items():
        copies = [(k, torch.nn.Parameter(p.clone())) for k, p in init.items()]
        for k, c in copies:
            c.grad = grads[k]
        opts[name] = mfx.TransformOptimizer(copies, mfx.muon, lr=0.02, weight_decay=0.1, **kw)
    del init
    opts["torch"] = torch.optim.Muon(torch_params, lr=0.02, weight_decay=0.1)
    paths = {k: _common.settle(o) for k, o in opts.items()}  # one untimed step each (compiles where compiled)
    t = _common.interleaved({k: o.step for k, o in opts.items()}, repeats, warmup, device)
    mem = {k: _common.step_memory(o.step, device) for k, o in opts.items()}  # untimed, after the timed steps
    n = len(torch_params)
    numel = sum(p.numel() for p in torch_params)
    # what "auto" computes on this set with the default dtype (bf16's accuracy unless pinned)
    accuracy = "bf16" if pinned_ns_dtype() is None else "dtype"
    forms = sorted({auto_method(*s[-2:], ns_dtype_for(device), accuracy, device) for s in shapes.values()})
    label = {name: f"{name} ({', '.join(forms)})" if name == "muonfx auto" else name for name in variants}
    what = f"{len({k.split('.')[0] for k in shapes})} layers, {n} matrices, {numel / 1e6:.1f} M"
    return [[kind, what, label[name], paths[name], _common.fmt_ms(t[name]), _common.fmt_ms(t['torch']),
             f"{t[name] / t['torch']:.2f}", _common.fmt_bytes(mem[name]), _common.fmt_bytes(mem["torch"])]
            for name in variants]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of every set (default: each set's own, 2 for gpt2 and moe)")
    ap.add_argument("--sets", default="gpt2,moe", help=f"comma-separated, from {', '.join(SETS)} (default gpt2,moe)")
    ap.add_argument("--shrink", type=int, default=1, help="divide every matrix dimension by this (default 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="start N processes that spin on the CPU for the whole run (default 0)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated muonfx rows to run, from: " + ", ".join(k.removeprefix("muonfx ") for k in VARIANTS)
                         + " (default: every row that computes differently on the device)")
    args = ap.parse_args(argv)
    only = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in only or () if f"muonfx {v}" not in VARIANTS]
    if bad:
        raise SystemExit(f"muon_step.py: unknown variants {bad}; choose from "
                         + ", ".join(k.removeprefix("muonfx ") for k in VARIANTS))
    if args.shrink < 1:
        raise SystemExit("muon_step.py: --shrink must be at least 1")
    device = torch.device(args.device)
    kinds = [k.strip() for k in args.sets.split(",") if k.strip()]
    for k in kinds:
        matrices(k)  # unknown names fail before anything runs
    rows = []
    before = _common.load()
    with _common.busy(args.busy):
        for k in kinds:
            rows += run(k, args.layers, args.shrink, device, args.repeats, args.warmup, only)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"\nMuon step, muonfx vs torch.optim.Muon ({_common.machine()})")
    print(f"{before} at the start; {args.busy} spinning process(es) started by --busy")
    why = cpu_ns_choice().reason if device.type == "cpu" else f"the {device.type} default"
    print(f"muonfx default Newton-Schulz dtype here: {str(ns_dtype_for(device)).replace('torch.', '')} ({why}); "
          "method standard (torch's iteration); the auto row names the forms it computes on the set "
          "(muonfx.linalg.auto_method)")
    print(_common.table(["set", "matrices", "muonfx variant", "path", "muonfx ms", "torch ms", "muonfx/torch",
                         "muonfx extra mem", "torch extra mem"], rows))
    print("path: the step plan's path (by rules: print(opt.plan)), its first step untimed; "
          "extra mem: peak bytes allocated during one step of that path beyond those allocated before it "
          f"({'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'the CPU allocator records'}; "
          "an untimed step after the timed ones)")


if __name__ == "__main__":
    main()
