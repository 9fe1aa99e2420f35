"""LaProp: momentum over the RMSProp-normalised gradient (Ziyin et al., 2020)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..counts import Counts, advance, per_count, zeros
from ..hyperparams import check
from ..ops import foreach


class ScaleByLapropState(NamedTuple):
    """State of :func:`scale_by_laprop`.

    Attributes:
        count: updates made so far, per parameter (for the bias corrections).
        mu: EMA of the normalised gradients, zeros at ``init``.
        nu: EMA of the squared gradients, zeros at ``init``.
    """

    count: Counts
    mu: TensorDict
    nu: TensorDict


def scale_by_laprop(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-15) -> GradientTransformation:
    """LaProp's direction: the momentum of ``g / sqrt(v)``, bias-corrected.

    Formula (``t`` counts from 1, per parameter)::

        nu <- b2 * nu + (1 - b2) * g * g
        mu <- b1 * mu + (1 - b1) * g / (sqrt(nu / (1 - b2^t)) + eps)
        out = mu / (1 - b1^t)

    Adam normalises the momentum; LaProp takes the momentum of the normalised
    gradient, which decouples ``b1`` from ``b2`` (any ``b1 < 1`` is stable). Defaults are
    the authors' (``laprop.py`` of Z-T-WANG/LaProp-Optimizer). With a constant learning
    rate this is the authors' arithmetic; they fold the learning rate into ``mu`` (its
    bias correction an EMA of the lr), which differs while the lr changes.
    Elementwise: runs on DTensor shards as they are.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.tensor([4.0, -0.5])}, [])
        >>> tx = mfx.scale_by_laprop()
        >>> out, _ = tx.update(g, tx.init(g))         # the first step: sign(g)
        >>> [round(x, 6) for x in out["w"].tolist()]
        [1.0, -1.0]
    """
    b1, b2, eps = check("b1", b1), check("b2", b2), check("eps", eps)

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return ScaleByLapropState(count=zeros(keys), mu=zeros_like_leaves(keys, ps), nu=zeros_like_leaves(keys, ps))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "laprop state (mu)", like=gs)
        vs = aligned(state.nu, keys, "laprop state (nu)", like=gs)
        new_v = foreach("mul", vs, b2)
        foreach("addcmul_", new_v, gs, gs, value=1.0 - b2)

        def step(count, g_, m_, v_):
            t = count + 1
            den = foreach("div", v_, 1.0 - b2**t)
            foreach("sqrt_", den)
            foreach("add_", den, eps)
            m = foreach("mul", m_, b1)
            foreach("addcdiv_", m, g_, den, value=1.0 - b1)
            out = foreach("div", m, 1.0 - b1**t)
            return list(zip(out, m))

        if not keys:  # an empty share still counts the update
            return updates, state._replace(count=advance(state.count))
        out, new_m = zip(*per_count(state.count, keys, "laprop state (count)", step, gs, ms, new_v))
        return build(keys, list(out)), ScaleByLapropState(advance(state.count), build(keys, list(new_m)),
                                                          build(keys, new_v))

    return LeafwiseTransformation(init_fn, update_fn)
