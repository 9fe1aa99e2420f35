"""Newton-Schulz: achieved GFLOP/s against this machine's matmul peak, and accuracy.

    python benchmarks/newton_schulz.py                # both tables
    python benchmarks/newton_schulz.py --only speed   # or: --only accuracy, restarts, spectral, gram

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

Gram (CPU): the bf16 Gram iteration (``ns_method="gram"``) against the standard bf16
iteration (torch.optim.Muon's arithmetic), by shape and schedule: relative error of each
to the float64 iteration, their ratio, and the time of each.

Restarts: the Gram iteration in bf16 by restart pattern (segment length 2 = 2+2+1, 3 = 3+2
(the default), 5 = no restart) against the standard bf16 iteration, as relative
Frobenius error to the float64 standard iteration (the same function, exactly computed).
"""

from __future__ import annotations

import argparse

import _common
import torch

from muonfx.linalg import PRESETS, SPECTRAL_MIN_DIM, newton_schulz_batched, resolve, triton_ns


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


GRAM_SHAPES = ((8, 16, 48), (4, 64, 256), (4, 128, 512), (2, 256, 1024), (2, 512, 2048), (2, 768, 2304),
               (2, 768, 3072))


def gram(repeats: int, shapes=GRAM_SHAPES, schedules=("keller", "polar_express", "you")) -> str:
    """bf16 Gram (``ns_method="gram"``, restarts every 3 steps) against the standard bf16
    iteration (torch.optim.Muon's arithmetic): relative Frobenius error of each to the
    float64 standard iteration (the same function, exactly computed), worst over the
    batch's matrices, on Gaussian inputs and on a power-law spectrum (condition 1e3); and
    the time of one batch, standard and Gram, same run (median)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for count, m, n in shapes:
        gauss = torch.randn(count, m, n, generator=gen, dtype=torch.float64)
        q1 = torch.linalg.qr(torch.randn(count, m, m, generator=gen, dtype=torch.float64))[0]
        q2 = torch.linalg.qr(torch.randn(count, n, m, generator=gen, dtype=torch.float64))[0]
        power = (q1 * torch.logspace(0, -3, m, dtype=torch.float64)) @ q2.mT
        x = gauss.float()
        t = _common.interleaved({meth: (lambda meth=meth: newton_schulz_batched(x, resolve("keller", 5),
                                                                               dtype=torch.bfloat16, method=meth))
                                 for meth in ("standard", "gram")}, repeats, 1, torch.device("cpu"))
        for name in schedules:
            sched = resolve(name, 5)
            for label, inp in (("gaussian", gauss), ("power-law 1e3", power)):
                ref = newton_schulz_batched(inp, sched, dtype=torch.float64, method="standard")

                def err(meth):
                    o = newton_schulz_batched(inp.float(), sched, dtype=torch.bfloat16, method=meth).double()
                    return max(((o[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(count))

                std, grm = err("standard"), err("gram")
                rows.append([f"{count}x{m}x{n}", name, label, f"{std:.1e}", f"{grm:.1e}", f"{grm / std:.1f}",
                             f"{t['standard'] * 1e3:.1f}", f"{t['gram'] / t['standard']:.2f}"])
    return "\n".join([f"\nbf16 Gram vs standard Newton-Schulz, 5 steps ({_common.machine()})",
                      _common.table(["batch", "schedule", "input", "standard relF", "gram relF", "gram/standard",
                                     "standard ms", "gram time / standard"], rows),
                      "relF: to the float64 standard iteration, worst matrix of the batch; times: keller, Gaussian"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["speed", "accuracy", "restarts", "spectral", "gram"], default=None)
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
    if args.only in (None, "gram") and args.device == "cpu":
        print(gram(args.repeats))
    if args.only in (None, "spectral") and args.device == "cpu":
        print(spectral(args.repeats))


if __name__ == "__main__":
    main()
