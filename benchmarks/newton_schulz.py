"""Newton-Schulz: achieved GFLOP/s against this machine's matmul peak, and accuracy.

    python benchmarks/newton_schulz.py                # both tables
    python benchmarks/newton_schulz.py --only speed   # or: --only accuracy, --only restarts

Speed: the batched NS (muonfx.linalg.newton_schulz_batched) on same-shape groups of
GPT-2-small matrices, in float32 and bf16, standard and Gram forms. Achieved GFLOP/s
counts the *standard* iteration's flops, ``5 * (4 m^2 n + 2 m^3)`` per matrix, so the
Gram form (fewer flops for the same function) can exceed 100% of peak. The peak is a
plain ``bmm`` of the largest square size, measured in the same run, same dtype.

Accuracy: relative Frobenius error to the exact polar factor ``U V^T`` (SVD, float64)
and the singular-value band, for each coefficient schedule on a Gaussian matrix and on
one with a power-law spectrum (condition ~1e3), NS computed in float32 and bf16.

Restarts: the Gram iteration in bf16 by restart pattern (segment length 2 = the default
2+2+1, 3 = 3+2, 5 = no restart) against the standard bf16 iteration, as relative
Frobenius error to the float64 standard iteration (the same function, exactly computed).
"""

from __future__ import annotations

import argparse

import _common
import torch

from muonfx.linalg import PRESETS, newton_schulz_batched, resolve


def flops(m: int, n: int, steps: int = 5) -> int:
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m ** 3)


def speed(device: torch.device, repeats: int) -> str:
    rows = []
    sched = resolve("keller", 5)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(4, 768, 768, device=device, dtype=dtype)
        peak_t = _common.interleaved({"mm": lambda: torch.bmm(a, a)}, repeats, 1, device)["mm"]
        peak = 4 * 2 * 768 ** 3 / peak_t / 1e9
        for shape, count in (((768, 2304), 4), ((768, 768), 4), ((768, 3072), 4)):
            g = torch.randn(count, *shape, device=device)
            fns = {m: (lambda m=m: newton_schulz_batched(g, sched, dtype=dtype, method=m)) for m in ("standard", "gram")}
            t = _common.interleaved(fns, repeats, 1, device)
            for m, sec in t.items():
                gf = count * flops(*shape) / sec / 1e9
                rows.append([str(dtype).replace("torch.", ""), f"{count}x{shape[0]}x{shape[1]}", m,
                             f"{sec * 1e3:.0f}", f"{gf:.0f}", f"{peak:.0f}", f"{100 * gf / peak:.0f}%"])
    return "\n".join([f"\nNewton-Schulz speed ({_common.machine()})",
                      _common.table(["dtype", "batch", "form", "ms", "GFLOP/s", "matmul peak", "of peak"], rows)])


def _polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


def accuracy(m: int, n: int) -> str:
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(m, n, generator=gen, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(torch.randn(m, n, generator=gen, dtype=torch.float64), full_matrices=False)
    s = torch.logspace(0, -3, min(m, n), dtype=torch.float64)
    power = (u * s) @ vh
    rows = []
    for name in PRESETS:
        sched = resolve(name, 5)
        for label, x in (("gaussian", gauss), ("power-law 1e3", power)):
            exact = _polar(x)
            cells = [name, label]
            for dtype in (torch.float32, torch.bfloat16):
                o = newton_schulz_batched(x.float()[None], sched, dtype=dtype)[0].double()
                err = ((o - exact).norm() / exact.norm()).item()
                sv = torch.linalg.svdvals(o)
                cells += [f"{err:.3f}", f"[{sv.min():.2f}, {sv.max():.2f}]"]
            rows.append(cells)
    return "\n".join([f"\nNewton-Schulz accuracy, {m}x{n}, 5 steps (relF to U V^T; singular-value band)",
                      _common.table(["schedule", "input", "relF f32", "band f32", "relF bf16", "band bf16"], rows)])


def restarts(m: int, n: int, count: int = 4) -> str:
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(count, m, n, generator=gen, dtype=torch.float64)
    q1 = torch.linalg.qr(torch.randn(count, m, m, generator=gen, dtype=torch.float64))[0]
    q2 = torch.linalg.qr(torch.randn(count, n, m, generator=gen, dtype=torch.float64))[0]
    power = (q1 * torch.logspace(0, -3, m, dtype=torch.float64)) @ q2.mT
    rows = []
    for name in ("keller", "polar_express"):
        sched = resolve(name, 5)
        for label, x in (("gaussian", gauss), ("power-law 1e3", power)):
            ref = newton_schulz_batched(x, sched, dtype=torch.float64)
            err = lambda o: f"{((o.double() - ref).norm() / ref.norm()).item():.1e}"  # noqa: E731
            g = x.float()
            cells = [name, label, err(newton_schulz_batched(g, sched, dtype=torch.bfloat16))]
            cells += [err(newton_schulz_batched(g, sched, dtype=torch.bfloat16, method="gram", restart=r))
                      for r in (2, 3, 5)]
            rows.append(cells)
    return "\n".join([f"\nbf16 Gram restarts, {count}x{m}x{n}, 5 steps (relF to the float64 standard iteration)",
                      _common.table(["schedule", "input", "standard", "gram 2+2+1", "gram 3+2", "gram, none"], rows)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["speed", "accuracy", "restarts"], default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="512x2048", help="accuracy matrix size MxN")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.only in (None, "speed"):
        print(speed(torch.device(args.device), args.repeats))
    if args.only in (None, "accuracy"):
        m, n = (int(v) for v in args.size.split("x"))
        print(accuracy(m, n))
    if args.only in (None, "restarts"):
        print(restarts(768, 3072))


if __name__ == "__main__":
    main()
