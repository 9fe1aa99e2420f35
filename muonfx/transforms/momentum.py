"""Momentum in the EMA (lerp) form used by torch.optim.Muon."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from ..base import GradientTransformation, aligned, build, foreach, leaves
from ..hyperparams import check, check_float_dtype


class MomentumState(NamedTuple):
    """State of :func:`momentum`.

    Attributes:
        mu: EMA buffer, one tensor per parameter (same key, shape; dtype ``mu_dtype``
            or the parameter's), zeros at ``init``.
    """

    mu: TensorDict


def momentum(beta: float = 0.95, nesterov: bool = False, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """EMA momentum.

    Formula (buffer ``m``, starting at zero; ``g`` the incoming update)::

        m <- lerp(m, g, 1 - beta) = beta * m + (1 - beta) * g
        out = m                       (nesterov=False)
        out = lerp(g, m, beta)        (nesterov=True, the torch.optim.Muon form)

    Defaults follow torch.optim.Muon (``beta=0.95``). With ``mu_dtype`` (e.g.
    ``torch.bfloat16``) the buffer is stored in that dtype and the arithmetic runs
    in the update's dtype.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.zeros(2)}, [])
        >>> tx = mfx.momentum(0.5)
        >>> u, s = tx.update(TensorDict({"w": torch.ones(2)}, []), tx.init(p))
        >>> u["w"].tolist()
        [0.5, 0.5]
    """
    beta = check("beta", beta)
    check_float_dtype("mu_dtype", mu_dtype)

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return MomentumState(build(keys, [torch.zeros_like(p, dtype=mu_dtype or p.dtype) for p in ps]))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "momentum state (mu)", like=gs)
        ms_c = [m if m.dtype == g.dtype else m.to(g.dtype) for m, g in zip(ms, gs)]
        new_m = foreach("lerp", ms_c, gs, 1.0 - beta)
        out = foreach("lerp", gs, new_m, beta) if nesterov else new_m
        stored = [n if n.dtype == m.dtype else n.to(m.dtype) for n, m in zip(new_m, ms)]
        return build(keys, out), MomentumState(build(keys, stored))

    return GradientTransformation(init_fn, update_fn)


def nesterov(beta: float = 0.95, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Nesterov momentum: ``momentum(beta, nesterov=True)``.

    Formula: ``m <- lerp(m, g, 1 - beta)``; ``out = lerp(g, m, beta)``.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.nesterov(0.95)
    """
    return momentum(beta, nesterov=True, mu_dtype=mu_dtype)
