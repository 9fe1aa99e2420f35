"""Adam's bias-corrected moment estimates."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..counts import Counts, advance, per_count, zeros
from ..hyperparams import VALUES_ARG, Slot, check, check_float_dtype
from ..ops import foreach
from ._dtypes import narrow, widen


#: the error of an AMSGrad step on a state made without AMSGrad
AMSGRAD_WITHOUT_STATE = ("scale_by_adam: amsgrad=True but the state has no running maximum (nu_max): it was made "
                         "with amsgrad=False. Build the optimizer (or init the transform) with amsgrad=True; the "
                         "maximum cannot start part-way through training")


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
        count: updates made so far, per parameter (for bias correction): a parameter
            left out of an update keeps its count (torch's ``state[p]["step"]``).
        mu: first-moment EMA, per parameter, zeros at init.
        nu: second-moment EMA, per parameter, zeros at init.
        nu_max: with ``amsgrad=True``, the largest second moment so far, per parameter
            (torch's ``max_exp_avg_sq``); an empty TensorDict otherwise, so a state
            without AMSGrad has no entry of it, in checkpoints neither (a maximum made
            before amsgrad was turned off is kept as it is, as torch keeps it).
    """

    count: Counts
    mu: TensorDict
    nu: TensorDict
    nu_max: TensorDict | None = None


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  mu_dtype: torch.dtype | None = None, *, nesterov: bool = False,
                  eps_before_bias_correction: bool = False, amsgrad: bool = False,
                  maximize: bool = False) -> GradientTransformation:
    """Adam's direction with bias correction (torch.optim.Adam's arithmetic).

    Formula (``t`` counts from 1)::

        m <- lerp(m, g, 1 - b1);   v <- b2 * v + (1 - b2) * g * g
        out = m_hat / (sqrt(v) / sqrt(1 - b2^t) + eps),    m_hat = m / (1 - b1^t)

    ``t`` is each parameter's own count (a parameter left out of an update keeps it, as
    torch's ``state[p]["step"]``). Defaults are torch's; ``b1``, ``b2`` and ``eps`` may be
    :class:`muonfx.hyperparams.Slot` s, read at each update. ``mu_dtype`` stores both moments
    in that dtype; each moment's arithmetic runs in the wider of it and the update's dtype
    (float32 moments of bf16 parameters accumulate in float32), the output has the
    update's dtype. Two
    variants other libraries compute, by name:

    * ``nesterov=True``: NAdam as optax computes it (``optax.nadamw``, and the 1-D
      parameters of ``optax.contrib.muon`` with Nesterov on):
      ``m_hat = b1 * m / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t)``;
    * ``eps_before_bias_correction=True``: epsilon added to the uncorrected
      ``sqrt(v)``, as Moonlight's AdamW does:
      ``out = (sqrt(1 - b2^t) / (1 - b1^t)) * m / (sqrt(v) + eps)``, i.e. an epsilon
      ``eps / sqrt(1 - b2^t)`` in the standard form (larger in the first steps).

    And torch's options, with torch.optim.Adam's arithmetic:

    * ``amsgrad=True``: the denominator takes the largest second moment so far,
      ``v_max <- max(v_max, v)``, ``out = m_hat / (sqrt(v_max) / sqrt(1 - b2^t) + eps)``;
      ``v_max`` is state (:attr:`ScaleByAdamState.nu_max`), created by ``init`` with
      ``amsgrad=True`` only;
    * ``maximize=True``: the direction for ascent, computed from ``-g``.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.full((2,), 4.0)}, [])
        >>> tx = mfx.scale_by_adam()
        >>> out, _ = tx.update(g, tx.init(g))
        >>> round(out["w"][0].item(), 6)
        1.0
    """
    b1, b2, eps = check("b1", b1), check("b2", b2), check("eps", eps)
    late = Slot in (type(b1), type(b2), type(eps))  # values read at each update
    check_float_dtype("mu_dtype", mu_dtype)
    for name, flag in (("amsgrad", amsgrad), ("maximize", maximize)):
        if not isinstance(flag, bool):
            raise TypeError(f"scale_by_adam: {name} must be True or False, got {flag!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        moments = lambda: zeros_like_leaves(keys, ps, mu_dtype)  # noqa: E731
        return ScaleByAdamState(count=zeros(keys), mu=moments(), nu=moments(),
                                nu_max=moments() if amsgrad else TensorDict({}, []))

    def update_fn(updates, state, params=None, **extra_args):
        if late:
            vals = extra_args[VALUES_ARG]
            b1_ = vals[b1.key] if type(b1) is Slot else b1
            b2_ = vals[b2.key] if type(b2) is Slot else b2
            eps_ = vals[eps.key] if type(eps) is Slot else eps
        else:
            b1_, b2_, eps_ = b1, b2, eps
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "adam state (mu)", like=gs)
        vs = aligned(state.nu, keys, "adam state (nu)")
        kept = state.nu_max if state.nu_max is not None else TensorDict({}, [])
        if amsgrad:
            if keys and not kept.keys():
                raise ValueError(AMSGRAD_WITHOUT_STATE)
            xs = aligned(kept, keys, "adam state (nu_max)")
        if maximize:
            gs = foreach("neg", gs)
        # each moment's arithmetic in the wider of its dtype and the update's (float32
        # moments of bf16 gradients accumulate in float32); the output in the update's
        ms_c, gs_c, back = widen(ms, gs)
        vs_c = vs if back is None else narrow(vs, [m.dtype for m in ms_c])
        new_m = foreach("lerp", ms_c, gs_c, 1.0 - b1_)
        new_v = foreach("mul", vs_c, b2_)
        foreach("addcmul_", new_v, gs_c, gs_c, value=1.0 - b2_)  # new_v is this update's own tensor
        if amsgrad:
            new_x = foreach("maximum", xs if back is None else narrow(xs, [v.dtype for v in new_v]), new_v)
        den = foreach("sqrt", new_x if amsgrad else new_v)
        # the bias corrections of each count (one, while every parameter steps every time):
        # out = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) = (sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2))
        def corrected(count, m_, d_, g_):
            t = count + 1
            bc1, bc2 = 1.0 - b1_**t, 1.0 - b2_**t
            foreach("add_", d_, eps_ if eps_before_bias_correction else eps_ * math.sqrt(bc2))
            if nesterov:  # bc1 * m_hat = b1 * m * bc1 / (1 - b1^(t+1)) + (1 - b1) * g
                num = foreach("mul", m_, b1_ * bc1 / (1.0 - b1_ ** (t + 1)))
                foreach("add_", num, g_, alpha=1.0 - b1_)
            else:
                num = m_
            o = foreach("div", num, d_)
            foreach("mul_", o, math.sqrt(bc2) / bc1)
            return o

        out = per_count(state.count, keys, "adam state (count)", corrected, new_m, den, gs_c)
        if back is not None:
            out, new_m, new_v = narrow(out, back[1]), narrow(new_m, back[0]), narrow(new_v, back[0])
            if amsgrad:
                new_x = narrow(new_x, back[0])
        # without amsgrad a maximum kept from before (amsgrad turned off) is kept as it is, as torch keeps
        # its max_exp_avg_sq
        return build(keys, out), ScaleByAdamState(advance(state.count), build(keys, new_m), build(keys, new_v),
                                                  build(keys, new_x) if amsgrad else kept)

    return LeafwiseTransformation(init_fn, update_fn)
