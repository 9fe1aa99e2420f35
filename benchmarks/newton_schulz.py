"""Newton-Schulz: achieved GFLOP/s against this machine's matmul peak, and accuracy.

    python benchmarks/newton_schulz.py                # both tables
    python benchmarks/newton_schulz.py --only speed   # or: --only accuracy, restarts, spectral, blocks

Speed: the batched NS (muonfx.linalg.newton_schulz_batched) on same-shape groups of
matrices, standard and Gram forms: on the CPU GPT-2-small matrices in float32 and bf16;
on CUDA (bf16) GPT-2 small, the Llama-1B-like set (2048^2, 256x2048, 2048x5632) and MoE
experts (1024x2048), each with torch's products and, where Triton is installed, the
symmetric Triton products (muonfx.linalg.triton_ns). Achieved GFLOP/s counts the
*standard* iteration's flops, ``5 * (4 m^2 n + 2 m^3)`` per matrix, so forms that need
fewer flops for the same function (Gram, symmetric products) can exceed 100% of peak.
The peak is a plain ``bmm`` measured in the same run, same dtype: of the largest square
size on the CPU, of 8192^2 on CUDA.

    python benchmarks/newton_schulz.py --only speed --device cuda   # the GPU table

Accuracy: relative Frobenius error to the exact polar factor ``U V^T`` (SVD, float64)
and the singular-value band, for each coefficient schedule on a Gaussian matrix and on
one with a power-law spectrum (condition ~1e3), NS computed in float32 and bf16.

Spectral (CPU, float32): where the spectral form (the same function evaluated on LAPACK's
eigendecomposition of the Gram matrix, ``method="spectral"``) is faster than the faster
iteration (standard or Gram), by the smaller matrix side: the measurement behind
``muonfx.linalg.SPECTRAL_MIN_DIM``; and its relative error to the float64 iteration on
an ill-conditioned input (condition 1e6) next to float32 Gram's and standard bf16's.

Blocks (CPU): the iterations with their symmetric products computed by block rows up to
the diagonal (``muonfx.linalg.blocked``) against the plain batched products, by size,
dtype and number of blocks: the measurement behind ``muonfx.linalg.blocked.block_count``.

Restarts: the Gram iteration in bf16 by restart pattern (segment length 2 = 2+2+1, 3 = 3+2
(the default), 5 = no restart) against the standard bf16 iteration, as relative
Frobenius error to the float64 standard iteration (the same function, exactly computed).
"""

from __future__ import annotations

import argparse

import _common
import torch

from muonfx.linalg import PRESETS, SPECTRAL_MIN_DIM, blocked, newton_schulz_batched, resolve, triton_ns
from muonfx.linalg.newton_schulz import _gram, _normalized, _standard, gram_pays_off


def flops(m: int, n: int, steps: int = 5) -> int:
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m ** 3)


SHAPES = {  # (rows, cols): matrices per batch
    "cpu": {(768, 2304): 4, (768, 768): 4, (768, 3072): 4},
    # GPT-2 small per 12 layers; the Llama-1B-like set per 22 layers; one MoE layer
    "cuda": {(768, 2304): 12, (768, 768): 12, (768, 3072): 24, (2048, 2048): 44, (256, 2048): 44,
             (2048, 5632): 66, (1024, 2048): 64},
}


def _peak(device: torch.device, dtype: torch.dtype, repeats: int) -> tuple[float, str]:
    """GFLOP/s of a plain ``bmm``: the largest square size of the set (CPU), 8192^2 (CUDA)."""
    size, count = (768, 4) if device.type == "cpu" else (8192, 1)
    a = torch.randn(count, size, size, device=device, dtype=dtype)
    t = _common.interleaved({"mm": lambda: torch.bmm(a, a)}, repeats, 1, device)["mm"]
    return count * 2 * size ** 3 / t / 1e9, f"{count}x{size}^2 bmm"


def _routes(device: torch.device, dtype: torch.dtype) -> list[str]:
    """"torch" products everywhere; the symmetric Triton kernels too where they run."""
    probe = torch.empty(1, device=device)
    return ["torch", "triton"] if dtype == torch.bfloat16 and triton_ns.available(probe) else ["torch"]


def speed(device: torch.device, repeats: int) -> str:
    rows = []
    sched = resolve("keller", 5)
    shapes = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.float32, torch.bfloat16)
    peaks = []
    for dtype in dtypes:
        peak, what = _peak(device, dtype, repeats)
        peaks.append(f"{str(dtype).replace('torch.', '')} {peak:.0f} GFLOP/s ({what})")
        for shape, count in shapes.items():
            g = torch.randn(count, *shape, device=device)
            fns = {}
            for route in _routes(device, dtype):
                # the spectral form: float32 on the CPU, where "auto" may take it
                forms = ("standard", "gram", "spectral") if (device.type, dtype, route) == (
                    "cpu", torch.float32, "torch") else ("standard", "gram")
                for m in forms:
                    def fn(m=m, route=route, g=g):
                        with _products(route == "triton"):
                            return newton_schulz_batched(g, sched, dtype=dtype, method=m)
                    fns[(route, m)] = fn
            t = _common.interleaved(fns, repeats, 1, device)
            fns.clear()  # the closures hold the batch
            for (route, m), sec in t.items():
                gf = count * flops(*shape) / sec / 1e9
                rows.append([str(dtype).replace("torch.", ""), f"{count}x{shape[0]}x{shape[1]}", m, route,
                             f"{sec * 1e3:.1f}", f"{gf:.0f}", f"{100 * gf / peak:.0f}%"])
            del g
    return "\n".join([f"\nNewton-Schulz speed ({_common.machine()})", "measured peak: " + "; ".join(peaks),
                      _common.table(["dtype", "batch", "form", "products", "ms", "GFLOP/s", "of peak"], rows)])


class _products:
    """Within: the symmetric Triton products (``triton=True``: asked for, checked against
    torch's on each shape's first use, in the warm-up) or torch's (the default)."""

    def __init__(self, triton: bool) -> None:
        self.triton = triton

    def __enter__(self):
        self._saved = triton_ns._switch
        triton_ns.set_enabled(self.triton)

    def __exit__(self, *exc):
        triton_ns.set_enabled(self._saved)


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
                o = newton_schulz_batched(x.float()[None], sched, dtype=dtype, method="standard")[0].double()
                err = ((o - exact).norm() / exact.norm()).item()
                sv = torch.linalg.svdvals(o)
                cells += [f"{err:.3f}", f"[{sv.min():.2f}, {sv.max():.2f}]"]
            rows.append(cells)
    return "\n".join([f"\nNewton-Schulz accuracy, {m}x{n}, 5 steps (relF to U V^T; singular-value band)",
                      _common.table(["schedule", "input", "relF f32", "band f32", "relF bf16", "band bf16"], rows)])


def spectral(repeats: int, sides=(128, 256, 320, 384, 512, 768), ratios=(1, 2, 4)) -> str:
    """The spectral form against the iterations in float32 on the CPU, by matrix size."""
    sched = resolve("keller", 5)
    rows = []
    for m in sides:
        for r in ratios:
            n = m * r
            count = max(1, (4 << 20) // (m * n * 4))  # about 4 MiB of float32 matrices per batch
            g = torch.randn(count, m, n)
            fns = {f: (lambda f=f: newton_schulz_batched(g, sched, dtype=torch.float32, method=f))
                   for f in ("standard", "gram", "spectral")}
            t = _common.interleaved(fns, repeats, 1, torch.device("cpu"))
            best = min(t["standard"], t["gram"])
            gen = torch.Generator().manual_seed(0)
            u = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
            v = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))[0]
            x = ((u * torch.logspace(0, -6, m, dtype=torch.float64)) @ v.mT)[None]
            ref = newton_schulz_batched(x, sched, dtype=torch.float64, method="standard")
            err = {k: ((newton_schulz_batched(x.float(), sched, dtype=d, method=f).double() - ref).norm()
                       / ref.norm()).item()
                   for k, d, f in (("spectral", torch.float32, "spectral"), ("gram", torch.float32, "gram"),
                                   ("bf16", torch.bfloat16, "standard"))}
            rows.append([f"{count}x{m}x{n}", f"{t['standard'] * 1e3:.1f}", f"{t['gram'] * 1e3:.1f}",
                         f"{t['spectral'] * 1e3:.1f}", f"{t['spectral'] / best:.2f}",
                         "yes" if m >= SPECTRAL_MIN_DIM else "no",
                         f"{err['spectral']:.1e}", f"{err['gram']:.1e}", f"{err['bf16']:.1e}"])
    return "\n".join([f"\nSpectral form vs the iterations, float32, keller 5 steps ({_common.machine()})",
                      _common.table(["batch", "standard ms", "gram ms", "spectral ms", "spectral / faster",
                                     "auto takes it", "relF spectral", "relF gram f32", "relF bf16 std"], rows),
                      "relF: to the float64 iteration, on a matrix of condition 1e6"])


BLOCK_SHAPES = ((4, 512, 1024), (1, 640, 1280), (3, 768, 768), (1, 768, 2304), (1, 768, 3072), (2, 1024, 2048))


def blocks(repeats: int, shapes=BLOCK_SHAPES) -> str:
    """Block-row symmetric products against the plain ones (CPU), per size and dtype."""
    sched = resolve("keller", 5)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for count, m, n in shapes:
            restart = 3 if dtype == torch.bfloat16 else None
            gram = gram_pays_off(m, n, 5, restart)
            x = _normalized(torch.randn(count, m, n), sched, 1e-7, dtype, False)
            fns = {1: (lambda: _gram(x, sched.steps, restart) if gram else _standard(x, sched.steps))}
            for k in (2, 3, 4):
                fns[k] = lambda k=k: blocked.orthogonalize(x, sched.steps, restart, gram, k)
            t = _common.interleaved(fns, repeats, 1, torch.device("cpu"))
            rows.append([str(dtype).replace("torch.", ""), f"{count}x{m}x{n}", "gram" if gram else "standard",
                         f"{t[1] * 1e3:.1f}"] + [f"{t[k] / t[1]:.2f}" for k in (2, 3, 4)]
                        + [str(blocked.block_count(m, "cpu", dtype))])
    return "\n".join([f"\nBlock-row symmetric products vs plain, keller 5 steps ({_common.machine()})",
                      _common.table(["dtype", "batch", "form", "plain ms", "2 blocks", "3 blocks", "4 blocks",
                                     "rule takes"], rows),
                      "time relative to the plain products, same run (median)"])


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
            cells = [name, label, err(newton_schulz_batched(g, sched, dtype=torch.bfloat16, method="standard"))]
            cells += [err(newton_schulz_batched(g, sched, dtype=torch.bfloat16, method="gram", restart=r))
                      for r in (2, 3, 5)]
            rows.append(cells)
    return "\n".join([f"\nbf16 Gram restarts, {count}x{m}x{n}, 5 steps (relF to the float64 standard iteration)",
                      _common.table(["schedule", "input", "standard", "gram 2+2+1", "gram 3+2 (default)", "gram, none"], rows)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["speed", "accuracy", "restarts", "spectral", "blocks"], default=None)
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
    if args.only in (None, "spectral") and args.device == "cpu":
        print(spectral(args.repeats))
    if args.only in (None, "blocks") and args.device == "cpu":
        print(blocks(args.repeats))


if __name__ == "__main__":
    main()
