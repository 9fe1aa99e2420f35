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

__all__ = ["newton_schulz_batched", "default_compute_dtype"]


def default_compute_dtype(t: torch.Tensor) -> torch.dtype:
    """bfloat16 on CUDA; elsewhere the input dtype, at least float32."""
    if t.device.type == "cuda":
        return torch.bfloat16
    if t.dtype == torch.float64:
        return torch.float64
    return torch.float32


def newton_schulz_batched(
    g: torch.Tensor,
    schedule: Schedule,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalise each matrix of ``g`` (``[N, m, n]``); returns a new tensor like ``g``.

    ``g`` is never modified, even when it already has the compute dtype.
    """
    if g.ndim != 3:
        raise ValueError(f"newton_schulz_batched takes [N, m, n], got {tuple(g.shape)}")
    cdtype = dtype if dtype is not None else default_compute_dtype(g)
    x = g.to(cdtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    # out-of-place division: x may alias g when no cast happened
    x = x / (norm * schedule.safety).clamp_min(eps)
    for a, b, c in schedule.steps:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if tall:
        x = x.mT
    return x.to(g.dtype).contiguous()
