"""Clipping by the global norm of all updates (a global transform: one reduction)."""

from __future__ import annotations

import torch

from .. import seam
from ..base import EmptyState, GradientTransformation, build, foreach, leaves
from ..hyperparams import check


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).square()


def global_norm(updates) -> torch.Tensor:
    """``sqrt(sum over leaves of ||u||^2)``, reduced over all ranks under FSDP2."""
    _, us = leaves(updates)
    return seam.global_sum(_sum_of_squares, us).sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so their global norm is at most ``max_norm``.

    Formula: ``n = sqrt(sum_i ||u_i||^2)``; ``out = u * max_norm / max(n, max_norm)``
    (unchanged when ``n <= max_norm``). Under FSDP2 ``n`` is one all-reduce, identical
    on every rank.

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
        out = foreach("mul", us, factor.to(us[0].device))
        # a 0-D leaf times the 0-D factor promotes like two tensors (f32 * f64 -> f64,
        # bf16 * f32 -> f32): cast back so every update keeps its dtype
        return build(keys, [o if o.dtype == u.dtype else o.to(u.dtype) for o, u in zip(out, us)]), state

    return GradientTransformation(init_fn, update_fn)
