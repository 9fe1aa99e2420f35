"""Batched Newton-Schulz orthogonalisation (approximate polar factor).

For a batch ``G`` of shape ``[N, m, n]`` every matrix is processed independently:

    X <- G (transposed to the wide orientation if m > n), cast to the compute dtype
    X <- X / max(||X||_F * safety, eps)
    for (a, b, c) in schedule:
        A <- X X^T
        B <- b A + c A A
        X <- a X + B X

The result is cast back to ``G``'s dtype. Flops per iteration and matrix with
``m <= n``: ``4 m^2 n + 2 m^3``.
"""

from __future__ import annotations

import torch

from .coefficients import Schedule

__all__ = ["newton_schulz_batched", "default_compute_dtype", "gram_pays_off"]


def default_compute_dtype(t: torch.Tensor) -> torch.dtype:
    """bfloat16 on CUDA; elsewhere the input dtype, at least float32."""
    if t.device.type == "cuda":
        return torch.bfloat16
    if t.dtype == torch.float64:
        return torch.float64
    return torch.float32


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


def gram_pays_off(m: int, n: int, steps: int) -> bool:
    """True when the Gram iteration needs fewer flops than the standard one (``m <= n``):
    standard ``K (4 m^2 n + 2 m^3)`` vs Gram ``4 m^2 n + (8K - 6) m^3``."""
    m, n = min(m, n), max(m, n)
    return steps > 1 and 4 * m * m * n + (8 * steps - 6) * m ** 3 < steps * (4 * m * m * n + 2 * m ** 3)


def newton_schulz_batched(
    g: torch.Tensor,
    schedule: Schedule,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "standard",
    restart: int | None = None,
) -> torch.Tensor:
    """Orthogonalise each matrix of ``g`` (``[N, m, n]``); returns a new tensor like ``g``.

    ``method``: ``"standard"`` (the iteration above), ``"gram"`` (iterate on the
    ``m x m`` Gram matrix, mathematically the same function; fewer flops for
    rectangular matrices), or ``"auto"`` (Gram in float32/float64 where it needs fewer
    flops, see :func:`gram_pays_off`; standard in 16-bit dtypes, where Gram loses about
    2x accuracy). ``restart`` (Gram only) re-forms ``X`` every that many steps;
    ``None`` means never in float32/float64 and every 2 steps in 16-bit dtypes, as
    published for bf16. The whole batch is one call: how many matrices a batch holds
    is decided by :mod:`muonfx.linalg.batching` (the seam plans the batches).
    ``g`` is never modified, even when it already has the compute dtype.
    """
    if g.ndim != 3:
        raise ValueError(f"newton_schulz_batched takes [N, m, n], got {tuple(g.shape)}")
    if method not in ("standard", "gram", "auto"):
        raise ValueError(f"unknown Newton-Schulz method {method!r}; use 'standard', 'gram' or 'auto'")
    cdtype = dtype
    if cdtype is None:  # default_compute_dtype(g), inline: this runs once per batch
        cdtype = torch.bfloat16 if g.device.type == "cuda" else (
            torch.float64 if g.dtype == torch.float64 else torch.float32)
    m, n = min(g.shape[-2], g.shape[-1]), max(g.shape[-2], g.shape[-1])
    use_gram = method == "gram" or (
        method == "auto" and cdtype in (torch.float32, torch.float64) and gram_pays_off(m, n, len(schedule.steps))
    )
    if use_gram and restart is None and cdtype in (torch.bfloat16, torch.float16):
        restart = 2
    return _orthogonalize(g, schedule, eps, cdtype, use_gram, restart)


def _orthogonalize(g: torch.Tensor, schedule: Schedule, eps: float, cdtype: torch.dtype, use_gram: bool,
                   restart: int | None) -> torch.Tensor:
    """One batched call; a new contiguous tensor of ``g``'s dtype."""
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
    x = _gram(x, schedule.steps, restart) if use_gram else _standard(x, schedule.steps)
    if tall:
        x = x.mT
    if x.dtype == g.dtype:
        return x.contiguous()
    # one pass: cast back and lay out contiguously (a transposed result would otherwise
    # be cast, then copied again by a separate .contiguous())
    return torch.empty(x.shape, dtype=g.dtype, device=x.device).copy_(x)
