"""Clipping by the global norm of all updates (a global transform: one reduction)."""

from __future__ import annotations

import torch

from .. import seam
from ..core import EmptyState, GradientTransformation, build, leaves
from ..hyperparams import check
from ..ops import foreach


_DOWN, _UP = 2.0 ** -100, 2.0 ** 100  # powers of two: scaling by them is exact


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float64:
        return torch.linalg.vector_norm(t).square()
    norm = torch.linalg.vector_norm(t, dtype=torch.float32)
    # A float32 sum of squares overflows for a norm above ~1.8e19 (entries of ~1e19 and
    # more): the norm is inf and the clip factor would be zero. Such a norm is taken
    # again on the tensor scaled by 2**-100 (exact), and everything is squared and summed
    # in float64. Branch-free (no device sync): the scaled norm is always computed, one
    # more pass over the updates; norms that did not overflow are kept bit for bit.
    wide = torch.linalg.vector_norm(t * _DOWN, dtype=torch.float32).to(torch.float64) * _UP
    return torch.where(torch.isinf(norm) & torch.isfinite(wide), wide, norm.to(torch.float64)).square()


def global_norm(updates) -> torch.Tensor:
    """``sqrt(sum over leaves of ||u||^2)``, reduced over all ranks under FSDP2.

    The squares are summed in float64 (no overflow below float64's range); the result
    is float32 unless a leaf is float64.
    """
    _, us = leaves(updates)
    norm = seam.global_sum(_sum_of_squares, us).sqrt()
    return norm if any(u.dtype == torch.float64 for u in us) else norm.to(torch.float32)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so their global norm is at most ``max_norm``.

    Formula: ``n = sqrt(sum_i ||u_i||^2)``; ``out = u * max_norm / max(n, max_norm)``
    (unchanged when ``n <= max_norm``). Under FSDP2 ``n`` is one all-reduce, identical
    on every rank. ``n`` is summed in float64, so gradients with entries of 1e19 or more
    (whose float32 sum of squares overflows) are still scaled down to ``max_norm``
    rather than zeroed; a gradient holding inf or NaN gives a NaN update (wrap the
    chain in :func:`~muonfx.apply_if_finite` to skip such steps). Not leafwise
    (:func:`muonfx.leafwise`): every leaf's update depends on every other leaf.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> u = TensorDict({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, [])
        >>> out, _ = mfx.clip_by_global_norm(1.0).update(u, None)
        >>> [round(out[k].item(), 4) for k in ("a", "b")]
        [0.6, 0.8]
    """
    max_norm = float(check("max_norm", max_norm))

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        if not us:
            return updates, state
        norm = seam.global_sum(_sum_of_squares, us).sqrt()
        # tensor / tensor: `float / tensor` is reciprocal * float, which is not exactly 1
        # when norm <= max_norm; this way the updates pass through bit for bit.
        factor = torch.as_tensor(max_norm, dtype=norm.dtype, device=norm.device) / torch.clamp(norm, min=max_norm)
        if not any(u.dtype == torch.float64 for u in us):
            factor = factor.to(torch.float32)  # exactly 1.0 when n <= max_norm
        out = foreach("mul", us, factor.to(us[0].device))
        # a 0-D leaf times the 0-D factor promotes like two tensors (f32 * f64 -> f64,
        # bf16 * f32 -> f32): cast back so every update keeps its dtype
        return build(keys, [o if o.dtype == u.dtype else o.to(u.dtype) for o, u in zip(out, us)]), state

    return GradientTransformation(init_fn, update_fn)
