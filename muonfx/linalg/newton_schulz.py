"""Batched Newton-Schulz orthogonalisation (approximate polar factor).

For a batch ``G`` of shape ``[N, m, n]`` every matrix is processed independently:

    X <- G (transposed to the wide orientation if m > n), cast to the compute dtype
    X <- X / max(||X||_F * safety, eps)
    for (a, b, c) in schedule:
        A <- X X^T
        B <- b A + c A A
        X <- a X + B X

The result is cast back to ``G``'s dtype. Flops per iteration and matrix with
``m <= n``: ``4 m^2 n + 2 m^3``. In bf16/fp16 on CUDA with Triton installed, the
symmetric products (``X X^T``, ``b A + c A A``) compute only their upper-triangular tiles
(:mod:`muonfx.linalg.triton_ns`): about ``3 m^2 n + m^3``.
"""

from __future__ import annotations

import torch

from .coefficients import Schedule
from . import triton_ns
from .precision import ns_dtype_for

__all__ = ["newton_schulz_batched", "default_compute_dtype", "gram_pays_off", "gram_flops", "standard_flops",
           "default_restart"]


def default_compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The compute dtype used for ``t`` when none is given: see :mod:`muonfx.linalg.precision`
    (bfloat16 on CUDA and on CPUs with native bf16 matmul, float32 elsewhere, float64 for
    float64 input)."""
    return ns_dtype_for(t.device, t.dtype)


def _standard(x: torch.Tensor, steps) -> torch.Tensor:
    for a, b, c in steps:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def _gram(x: torch.Tensor, steps, restart: int | None) -> torch.Tensor:
    """Iterate on the small Gram matrix ``R = X X^T`` (``m x m``, ``m <= n``).

    Every step is ``X <- p(R) X`` with ``p(R) = a I + b R + c R^2``, so after ``k``
    steps ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0``; all those polynomials
    commute, hence ``R_{k+1} = P R_k P``. Only the ``m x m`` products are iterated;
    ``X`` is touched twice per segment (``R_0`` and ``Q X_0``). ``restart`` re-forms
    ``X`` and ``R`` every that many steps (needed in low precision).
    """
    steps = list(steps)
    seg = len(steps) if not restart else restart
    for start in range(0, len(steps), seg):
        part = steps[start:start + seg]
        r = torch.bmm(x, x.mT)
        q = None
        for i, (a, b, c) in enumerate(part):
            p = torch.baddbmm(r, r, r, beta=b, alpha=c)
            p.diagonal(dim1=-2, dim2=-1).add_(a)
            q = p if q is None else torch.bmm(p, q)
            if i < len(part) - 1:
                r = torch.bmm(p, torch.bmm(r, p))
        x = torch.bmm(q, x)
    return x


def standard_flops(m: int, n: int, steps: int) -> int:
    """Flops of the standard iteration on one ``m x n`` matrix: ``K (4 m^2 n + 2 m^3)``, ``m <= n``."""
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m ** 3)


def gram_flops(m: int, n: int, steps: int, restart: int | None = None) -> int:
    """Flops of the Gram iteration with restarts every ``restart`` steps (``None``: never).

    A segment of ``L`` steps costs ``4 m^2 n`` (``R = X X^T`` and ``X <- Q X``) plus
    ``2 m^3`` per step for ``p(R)``, ``2 m^3`` per step after the first for ``Q <- p Q``
    and ``4 m^3`` per step but the last for ``R <- p R p``: ``4 m^2 n + (8 L - 6) m^3``.
    """
    m, n = min(m, n), max(m, n)
    segments = -(-steps // (restart or steps))
    return 4 * segments * m * m * n + (8 * steps - 6 * segments) * m ** 3


def default_restart(dtype: torch.dtype) -> int | None:
    """Gram restarts: every 3 steps in 16-bit dtypes (5 steps: 3 + 2), else never.

    Without restarts bf16 Gram diverges on ill-conditioned inputs. Restarting every 3
    steps is as accurate as every 2 (the published bf16 pattern) with the default keller
    schedule (relative error to the float64 iteration, 4x768x3072: 1.8e-2 vs 2.0e-2 on
    Gaussian inputs, 4.1e-2 vs 4.4e-2 at condition 1e3; standard bf16 1.0e-2 and 4.6e-2),
    and within 2.5x of standard bf16 with polar_express; and it costs 0.84-0.86x of the
    2+2+1 pattern's time (``benchmarks/newton_schulz.py --only restarts``)."""
    return 3 if dtype in (torch.bfloat16, torch.float16) else None


def gram_pays_off(m: int, n: int, steps: int, restart: int | None = None) -> bool:
    """True when the Gram iteration (restarting every ``restart`` steps) needs fewer flops
    than the standard one: for 5 steps, ``n > 1.2 m`` without restarts and ``n > 1.5 m``
    restarting every 2 or 3 steps (``m <= n``)."""
    m, n = min(m, n), max(m, n)
    segments = -(-steps // (restart or steps))  # gram_flops < standard_flops, inline (hot path)
    return steps > 1 and 4 * segments * m * m * n + (8 * steps - 6 * segments) * m ** 3 < steps * (
        4 * m * m * n + 2 * m ** 3)


def newton_schulz_batched(
    g: torch.Tensor,
    schedule: Schedule,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "auto",
    restart: int | None = None,
) -> torch.Tensor:
    """Orthogonalise each matrix of ``g`` (``[N, m, n]``); returns a new tensor like ``g``.

    ``dtype``: the compute dtype; ``None`` means the device's default
    (:func:`muonfx.linalg.ns_dtype_for`: bfloat16 on CUDA and on CPUs with native bf16
    matmul, float32 elsewhere, float64 for float64 input).

    ``method``: ``"standard"`` (the iteration above), ``"gram"`` (iterate on the
    ``m x m`` Gram matrix, mathematically the same function), or ``"auto"`` (default:
    in 16-bit dtypes the Gram form where it needs fewer flops counting its restarts,
    see :func:`gram_pays_off`, i.e. rectangular matrices with ``n > 1.5 m``; there it is
    within 2.5x of the standard form's rounding error. In float32/float64 always the
    standard form: there Gram's error (~1e-4..1e-3 relative on tall matrices) is
    orders of magnitude above the dtype's own). ``restart`` (Gram
    only) re-forms ``X`` every that many steps; ``None`` means
    :func:`default_restart`: never in float32/float64 and every 3 steps in 16-bit
    dtypes. The whole batch is one call: how many matrices a
    batch holds is decided by :mod:`muonfx.linalg.batching` (the seam plans the
    batches). ``g`` is never modified, even when it already has the compute dtype.
    """
    if g.ndim != 3:
        raise ValueError(f"newton_schulz_batched takes [N, m, n], got {tuple(g.shape)}")
    if method not in ("standard", "gram", "auto"):
        raise ValueError(f"unknown Newton-Schulz method {method!r}; use 'standard', 'gram' or 'auto'")
    cdtype = dtype if dtype is not None else ns_dtype_for(g.device, g.dtype)
    low = cdtype in (torch.bfloat16, torch.float16)
    if restart is None and low:  # default_restart(cdtype), inline: this runs once per batch
        restart = 3
    use_gram = method == "gram" or (
        method == "auto" and low and gram_pays_off(g.shape[-2], g.shape[-1], len(schedule.steps), restart))
    return _orthogonalize(g, schedule, eps, cdtype, use_gram, restart)


def _orthogonalize(g: torch.Tensor, schedule: Schedule, eps: float, cdtype: torch.dtype, use_gram: bool,
                   restart: int | None) -> torch.Tensor:
    """One batched call; a new tensor of ``g``'s dtype (contiguous, except inside
    ``torch.compile``, where the compiler lays it out)."""
    x = g.to(cdtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    if x.dtype != torch.float64:
        # Entries of ~1e19 and more overflow a float32 (or bfloat16) sum of squares: the
        # norm is inf and the result would be zero. The polar factor does not depend on
        # the scale, so those matrices are scaled by 2**-100 (exact) first. Branch-free (no
        # device sync): one multiply and one more norm, in place of nothing; where the
        # norm did not overflow the scale is 1 and every bit is as before.
        down = torch.where(torch.isinf(norm), 2.0 ** -100, 1.0).to(x.dtype)
        x = x * down  # a new tensor: x may alias g when no cast happened
        norm = torch.where(down < 1, torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), norm)
        den = norm * schedule.safety
        x.div_(torch.where(down < 1, den, den.clamp_min(eps)))
    else:
        # out-of-place division: x may alias g when no cast happened
        x = x / (norm * schedule.safety).clamp_min(eps)
    y = None
    if cdtype in (torch.bfloat16, torch.float16) and triton_ns.available(x):
        # the same iteration with symmetric Triton products (CUDA); None: use torch's
        y = triton_ns.orthogonalize(x, schedule.steps, restart, use_gram)
    if y is None:
        y = _gram(x, schedule.steps, restart) if use_gram else _standard(x, schedule.steps)
    x = y
    if tall:
        x = x.mT
    if torch.compiler.is_compiling():
        # traced (the executor's compiled step): the cast stays a pointwise op that the
        # compiler fuses into whatever reads the result (scale, decay, the parameter
        # update), so no float32 copy of the batch is written and read back; the layout
        # is the compiler's to choose (measured on the CPU, MoE set: the step's
        # elementwise kernels 22.8 -> 14.5 ms)
        return x.to(g.dtype)
    if x.dtype == g.dtype:
        return x.contiguous()
    # one pass: cast back and lay out contiguously (a transposed result would otherwise
    # be cast, then copied again by a separate .contiguous())
    return torch.empty(x.shape, dtype=g.dtype, device=x.device).copy_(x)
