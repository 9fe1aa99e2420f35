"""MARS: a variance-reduced gradient for the momentum that follows (Yuan et al., 2024)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from .. import seam
from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..hyperparams import check
from ..ops import foreach
from .cautious import _totals


class MarsCorrectionState(NamedTuple):
    """State of :func:`mars_correction`.

    Attributes:
        prev: the previous update (gradient), per parameter, zeros at ``init``.
    """

    prev: TensorDict


def mars_correction(gamma: float = 0.025, beta: float = 0.95, max_norm: float | None = None) -> GradientTransformation:
    """The MARS correction of the gradient, placed before the momentum it feeds.

    Formula (``g`` the incoming update, ``g_prev`` the previous one, zeros at first)::

        c = g + gamma * beta / (1 - beta) * (g - g_prev)
        c = c / max(1, ||c|| / max_norm)                  (with max_norm, per parameter)
        out = c;   g_prev <- g

    ``beta`` is the first-moment coefficient of the momentum that follows (MARS ties the
    correction to it); ``gamma`` the size of the correction. This is MARS-approx (the
    previous step's gradient stands for the gradient of the previous parameters on the
    current batch), as the authors train with. ``max_norm`` clips each parameter's ``c``
    to that norm (the authors' MARS clips at 1; the norm of a DTensor's whole tensor,
    through :mod:`muonfx.seam`). With ``gamma=0`` and no ``max_norm`` the output is the
    gradient itself, bit for bit: a chain starting with ``mars_correction(0.0)``
    computes what the chain without it computes. Elementwise but for the clip.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.mars_correction(gamma=0.1, beta=0.9)
        >>> s = tx.init(TensorDict({"w": torch.zeros(1)}, []))
        >>> out, s = tx.update(TensorDict({"w": torch.tensor([1.0])}, []), s)
        >>> round(out["w"].item(), 6)                 # 1 + 0.1 * 9 * (1 - 0)
        1.9
        >>> out, s = tx.update(TensorDict({"w": torch.tensor([1.0])}, []), s)
        >>> out["w"].item()                           # no change in g: no correction
        1.0
    """
    gamma, beta = check("gamma", gamma), check("beta", beta)
    if max_norm is not None:
        max_norm = check("max_norm", max_norm)
    k = gamma * (beta / (1.0 - beta))

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return MarsCorrectionState(zeros_like_leaves(keys, ps))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        prev = aligned(state.prev, keys, "mars_correction state (prev)", like=gs)
        if gamma == 0 and max_norm is None:
            return build(keys, list(gs)), MarsCorrectionState(build(keys, [g.clone() for g in gs]))
        c = foreach("sub", gs, prev)
        foreach("mul_", c, k)
        foreach("add_", c, gs)
        if max_norm is not None and keys:
            norms = foreach("sqrt_", _totals(foreach("mul", c, c)))
            # c / max(1, ||c|| / max_norm): the authors' ``c / ||c||`` where ||c|| > 1
            c = [ci / torch.clamp_min(n / max_norm, 1.0) for ci, n in zip(c, norms)]
        return build(keys, c), MarsCorrectionState(build(keys, [g.clone() for g in gs]))

    return LeafwiseTransformation(init_fn, update_fn)
