"""Momentum in the EMA (lerp) form used by torch.optim.Muon."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..counts import Counts, advance, per_count, zeros
from ..hyperparams import VALUES_ARG, Slot, check, check_float_dtype
from ..ops import foreach
from ._dtypes import narrow, widen


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

    Defaults follow torch.optim.Muon (``beta=0.95``). With ``mu_dtype`` the buffer is
    stored in that dtype and its arithmetic runs in the wider of it and the update's
    dtype: ``torch.float32`` with bf16 parameters accumulates in float32 (a bf16 EMA
    stops moving once ``(1 - beta) (g - m)`` is below half a bf16 step);
    ``torch.bfloat16`` with float32 parameters halves the buffer, computed in float32
    and rounded once when stored. The output has the update's dtype. ``beta`` may be a
    :class:`muonfx.hyperparams.Slot`, read at each update.

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
    late = type(beta) is Slot

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return MomentumState(zeros_like_leaves(keys, ps, mu_dtype))

    def update_fn(updates, state, params=None, **extra_args):
        b = extra_args[VALUES_ARG][beta.key] if late else beta
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "momentum state (mu)", like=gs)
        # the buffer's arithmetic in the wider dtype (float32 mu of bf16 grads: float32)
        ms_c, gs_c, back = widen(ms, gs)
        new_m = foreach("ema", ms_c, gs_c, b)  # lerp(m, g, 1 - beta)
        out = foreach("lerp", gs_c, new_m, b) if nesterov else new_m
        if back is not None:  # the buffer in its dtype, the output in the update's
            out, new_m = narrow(out, back[1]), narrow(new_m, back[0])
        return build(keys, out), MomentumState(build(keys, new_m))

    return LeafwiseTransformation(init_fn, update_fn)


def nesterov(beta: float = 0.95, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Nesterov momentum: ``momentum(beta, nesterov=True)``.

    Formula: ``m <- lerp(m, g, 1 - beta)``; ``out = lerp(g, m, beta)``.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.nesterov(0.95)
    """
    return momentum(beta, nesterov=True, mu_dtype=mu_dtype)


class BiasCorrectedMomentumState(NamedTuple):
    """State of :func:`bias_corrected_momentum`.

    Attributes:
        count: updates made so far, per parameter (for the bias correction).
        mu: EMA buffer, one tensor per parameter, zeros at ``init``.
    """

    count: Counts
    mu: TensorDict


def bias_corrected_momentum(beta: float = 0.95, nesterov: bool = True,
                            mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """EMA momentum with Adam-style bias correction (optax ``contrib.muon``'s momentum).

    Formula (``t`` counts from 1; buffer ``m`` starting at zero)::

        m <- lerp(m, g, 1 - beta)
        out = m / (1 - beta^t)                                            (nesterov=False)
        out = beta * m / (1 - beta^(t+1)) + (1 - beta) * g / (1 - beta^t)  (nesterov=True)

    Without Nesterov the output is :func:`momentum`'s times ``1 / (1 - beta^t)``, a
    positive factor that Newton-Schulz normalises away. With Nesterov the two terms are
    corrected separately, which changes the direction, not just the size, in the first
    steps (at ``t = 1`` both forms give ``g``; from ``t = 2`` on the mix of ``m`` and
    ``g`` differs from torch's ``lerp(g, m, beta)``, and Muon steps differ by 8-60 %);
    the difference fades as ``beta^t -> 0``. State: ``count`` (per parameter: one left out
    of an update keeps its own) and ``mu`` (``mu_dtype`` or the parameter's dtype).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.ones(2)}, [])
        >>> tx = mfx.bias_corrected_momentum(0.9, nesterov=False)
        >>> tx.update(g, tx.init(g))[0]["w"].tolist()      # m = 0.1, / (1 - 0.9)
        [1.0, 1.0]
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"bias_corrected_momentum: beta must be in [0, 1), got {beta!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return BiasCorrectedMomentumState(zeros(keys), zeros_like_leaves(keys, ps, mu_dtype))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "bias_corrected_momentum state (mu)")
        ms_c, gs_c, back = widen(ms, gs)  # as in momentum: the buffer's arithmetic in the wider dtype
        new_m = foreach("lerp", ms_c, gs_c, 1.0 - beta)
        def corrected(count, m_, g_):
            t = count + 1
            if nesterov:
                o = foreach("mul", m_, beta / (1.0 - beta ** (t + 1)))
                foreach("add_", o, g_, alpha=(1.0 - beta) / (1.0 - beta**t))
                return o
            return foreach("mul", m_, 1.0 / (1.0 - beta**t))

        out = per_count(state.count, keys, "bias_corrected_momentum state (count)", corrected, new_m, gs_c)
        if back is not None:
            out, new_m = narrow(out, back[1]), narrow(new_m, back[0])
        return build(keys, out), BiasCorrectedMomentumState(advance(state.count), build(keys, new_m))

    return LeafwiseTransformation(init_fn, update_fn)
