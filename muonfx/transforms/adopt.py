"""ADOPT: Adam with the second moment taken before the current gradient (Taniguchi et al., 2024)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..counts import Counts, advance, per_count, zeros
from ..hyperparams import check
from ..ops import foreach


class ScaleByAdoptState(NamedTuple):
    """State of :func:`scale_by_adopt`.

    Attributes:
        count: updates made so far, per parameter (the first one only fills ``nu``).
        mu: EMA of the normalised (and clipped) gradients, zeros at ``init``.
        nu: EMA of the squared gradients, zeros at ``init``.
    """

    count: Counts
    mu: TensorDict
    nu: TensorDict


def _quarter_power(t: int) -> float:
    return t**0.25


def scale_by_adopt(b1: float = 0.9, b2: float = 0.9999, eps: float = 1e-6,
                   clip: Callable[[int], float] | None = _quarter_power) -> GradientTransformation:
    """ADOPT's direction (the authors' ``adopt.py``, its ``clip_lambda`` form).

    Formula (``t`` counts updates from 0, per parameter)::

        t = 0:   nu <- g * g;   out = 0                                   (no step)
        t >= 1:  n  = clamp(g / max(sqrt(nu), eps), -clip(t), clip(t))
                 mu <- lerp(mu, n, 1 - b1);   out = mu
                 nu <- b2 * nu + (1 - b2) * g * g

    The gradient is normalised by the second moment of the *previous* gradients (so
    ``g`` and its normaliser are independent), and the momentum is taken after the
    normalisation; no bias correction. ``clip(t)`` bounds the normalised gradient
    (default ``t ** 0.25``, the authors'; ``None``: no clipping). Defaults are the
    authors'. Elementwise: runs on DTensor shards as they are.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.tensor([2.0, -1.0])}, [])
        >>> tx = mfx.scale_by_adopt(b1=0.0)
        >>> out, s = tx.update(g, tx.init(g))        # the first update only fills nu
        >>> out["w"].tolist()
        [0.0, 0.0]
        >>> out, s = tx.update(g, s)                 # g / sqrt(g * g)
        >>> out["w"].tolist()
        [1.0, -1.0]
    """
    b1, b2, eps = check("b1", b1), check("b2", b2), check("eps", eps)
    if clip is not None and not callable(clip):
        raise TypeError(f"scale_by_adopt: clip must be a function of the step or None, got {clip!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return ScaleByAdoptState(count=zeros(keys), mu=zeros_like_leaves(keys, ps), nu=zeros_like_leaves(keys, ps))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "adopt state (mu)", like=gs)
        vs = aligned(state.nu, keys, "adopt state (nu)", like=gs)

        def step(count, g_, m_, v_):
            if count == 0:
                return list(zip([torch.zeros_like(g) for g in g_], list(m_), foreach("mul", g_, g_)))
            den = foreach("sqrt", v_)
            foreach("clamp_min_", den, eps)
            n = foreach("div", g_, den)
            if clip is not None:
                c = float(clip(count))
                foreach("clamp_min_", n, -c)
                foreach("clamp_max_", n, c)
            new_m = foreach("lerp", m_, n, 1.0 - b1)
            new_v = foreach("mul", v_, b2)
            foreach("addcmul_", new_v, g_, g_, value=1.0 - b2)
            return list(zip(new_m, new_m, new_v))

        if not keys:  # an empty share still counts the update
            return updates, state._replace(count=advance(state.count))
        out, new_m, new_v = zip(*per_count(state.count, keys, "adopt state (count)", step, gs, ms, vs))
        return build(keys, list(out)), ScaleByAdoptState(advance(state.count), build(keys, list(new_m)),
                                                         build(keys, list(new_v)))

    return LeafwiseTransformation(init_fn, update_fn)
