"""Lion: the sign of an interpolation of momentum and gradient (Chen et al., 2023)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..hyperparams import check, check_float_dtype
from ..ops import foreach
from ._dtypes import narrow, widen


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`.

    Attributes:
        mu: the momentum EMA (``b2``), one tensor per parameter, zeros at ``init``.
    """

    mu: TensorDict


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Lion's direction: the sign of ``b1 * m + (1 - b1) * g`` (lion-pytorch's arithmetic).

    Formula (buffer ``m`` starting at zero, ``g`` the incoming update)::

        out = sign(b1 * m + (1 - b1) * g)
        m  <- b2 * m + (1 - b2) * g

    Every output element is -1, 0 or +1 (a zero gradient on a zero buffer gives 0).
    Defaults are the paper's and lion-pytorch's. ``mu_dtype`` stores the buffer in that
    dtype (its arithmetic runs in the wider of it and the update's dtype). Elementwise:
    runs on DTensor shards as they are.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.tensor([0.3, -2.0, 0.0])}, [])
        >>> tx = mfx.scale_by_lion()
        >>> out, state = tx.update(g, tx.init(g))
        >>> out["w"].tolist(), [round(x, 6) for x in state.mu["w"].tolist()]
        ([1.0, -1.0, 0.0], [0.003, -0.02, 0.0])
    """
    b1, b2 = check("b1", b1), check("b2", b2)
    check_float_dtype("mu_dtype", mu_dtype)

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return ScaleByLionState(zeros_like_leaves(keys, ps, mu_dtype))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "lion state (mu)", like=gs)
        ms_c, gs_c, back = widen(ms, gs)
        c = foreach("mul", ms_c, b1)
        foreach("add_", c, gs_c, alpha=1.0 - b1)
        out = foreach("sign_", c)
        new_m = foreach("mul", ms_c, b2)
        foreach("add_", new_m, gs_c, alpha=1.0 - b2)
        if back is not None:
            out, new_m = narrow(out, back[1]), narrow(new_m, back[0])
        return build(keys, out), ScaleByLionState(build(keys, new_m))

    return LeafwiseTransformation(init_fn, update_fn)
