"""SOAP with one product fewer per preconditioned dimension: a rule of the plan, like the
fused AdamW and Muon.

Between two basis refreshes SOAP's first moment goes back to the original space and into
the same basis at every step (the authors' ``soap.py`` does so): ``mu <- Q_i^T (Q_i mu)``
along each dimension, two matrix products per dimension, which are not the identity
because the bases are orthogonal to float32 rounding only. A group built with
:func:`muonfx.soap` with plain numbers for its hyperparameters, on plain tensors (not
DTensor shards) on the CPU or CUDA, keeps each basis's Gram matrix ``G_i = Q_i^T Q_i``
between steps (computed again when the basis changes) and computes that round trip as
``mu <- G_i mu``: one product per dimension, the same in exact arithmetic. A Gram
matrix costs ``d^3`` once per refresh and saves ``d * numel`` at each other step: a
parameter takes them where that pays for every basis it has (``d^2 <= (frequency - 1)
* numel``; not with a refresh at every step, nor for the long side of a thin matrix). Everything
else is :class:`muonfx.transforms.soap.SoapStep`'s, the chain's: the factors, the bases
and the second moment bit for bit, the first moment and the update within the float
rounding of that product (``tests/test_fused_soap.py`` measures it). The new state is
written into the state's buffers and the update ``-lr * (u + wd * W)`` added to the
parameters in place, as the chain's write-back does. Whole or in pieces (:mod:`.pieces`);
every piece's step is computed before it is written.

Memory: the Gram matrices, ``d^2`` elements per preconditioned dimension of size ``d``
(half the factors and bases SOAP's state holds), kept by the group's plans while the
bases are the state's. ``"fused": False`` runs the chain without them.

What is not lowered runs the chain: a schedule or a tensor for a number, DTensor shards
(the seam's exchange), a state that is not the preset's, gradients or moments that differ
from their parameters in dtype, device or shape.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core import EmptyState
from ...counts import Counts, advance, of
from ...presets.catalogue import soap
from ...transforms.soap import ScaleBySoapState, SoapStep
from .fused import _leaves, not_numbers, not_plain, register, step_values

__all__ = ["FusedSoap"]

_LINKS = ("soap", "weight_decay", "lr")
_FLAGS = ("merge_dims", "precondition_1d", "normalize_grads")


class FusedSoap:
    """SOAP's step with the bases' Gram matrices kept between steps.

    Computed and written per piece of the plan (``pieces = True``: :meth:`compute`, which
    writes nothing, then :meth:`write`), by the rules :meth:`why_not` (the plan's) and
    :meth:`ready` (each step's), its numbers checked by :meth:`check` first.
    """

    name = "SOAP with its bases' Gram matrices kept between steps"
    pieces = True

    @staticmethod
    def why_not(hp: dict[str, Any], params: list[torch.Tensor]) -> str | None:
        """None where the lowered step computes the group's chain, else the reason."""
        return not_numbers(hp, _FLAGS) or not_plain(params, "DTensor parameters (the seam's exchange)")

    @staticmethod
    def ready(state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], keys: tuple,
              memo: dict | None = None) -> str | None:
        """None where this step's state and gradients are what the lowered step takes."""
        hyper = getattr(state, "hyperparams", None)
        inner = getattr(state, "inner_state", None)
        if hyper is None or not isinstance(inner, dict) or tuple(inner) != _LINKS or \
                not isinstance(inner["soap"], ScaleBySoapState) or not isinstance(inner["soap"].count, Counts) or \
                type(inner["weight_decay"]) is not EmptyState or type(inner["lr"]) is not EmptyState or \
                not isinstance(getattr(state, "count", None), Counts):
            return "the state is not SOAP's"
        if any([callable(v) and not isinstance(v, torch.Tensor) for v in hyper.values()]):
            return "a schedule in the state"
        try:
            ms, vs = _leaves(inner["soap"].mu, keys), _leaves(inner["soap"].nu, keys)
        except (KeyError, TypeError):
            return "the moments do not match the parameters"
        for p, g, m, v in zip(params, grads, ms, vs):
            if not (g.dtype == m.dtype == v.dtype == p.dtype and g.device == m.device == v.device == p.device
                    and g.layout == torch.strided and g.shape == p.shape == m.shape == v.shape):
                return "gradients or moments differ from their parameters in dtype, device or shape"
        return None

    @staticmethod
    def check(factory: Any, hp: dict[str, Any], state: Any) -> dict[str, Any]:
        """The hyperparameter values of this step (the group's ``hp`` with the state's
        injected numbers), checked as the chain checks them (the same errors, raised before
        anything is written), and the step's :class:`~muonfx.transforms.soap.SoapStep`
        (``"_step"``)."""
        vals = step_values(hp, state)
        b1, b2 = vals["betas"]
        vals["_step"] = SoapStep(b1, b2, vals["shampoo_beta"], vals["eps"], vals["precondition_frequency"],
                                 vals["max_precond_dim"], vals["merge_dims"], vals["precondition_1d"],
                                 vals["normalize_grads"])
        return vals

    @staticmethod
    def compute(keys: tuple, grads: list[torch.Tensor], params: list[torch.Tensor], state: Any,
                vals: dict[str, Any], extra: dict[str, Any], memo: dict | None = None) -> list:
        """Each parameter's ``(out, mu, nu, factors, bases, factor keys)`` (nothing
        written): what :meth:`write` takes."""
        step: SoapStep = vals["_step"]
        soap_state = state.inner_state["soap"]
        ms, vs = _leaves(soap_state.mu, keys), _leaves(soap_state.nu, keys)
        counts = of(soap_state.count, keys, "soap state (count)")
        grams = memo.setdefault("soap_grams", {}) if memo is not None else {}
        pending = []
        with torch.no_grad():
            for k, g, m, v, t in zip(keys, grads, ms, vs, counts):
                f_keys = [k + (f"dim{i}",) if on else None for i, on in enumerate(step.sides(g))]
                Fs = [None if f is None else soap_state.factors.get(f) for f in f_keys]
                Qs = [None if f is None else soap_state.bases.get(f) for f in f_keys]
                gs = None if step.refreshes(t) or not _pays(step, g, Qs) else \
                    [_gram(grams, f, Q) for f, Q in zip(f_keys, Qs)]
                pending.append((*step.leaf(g, m, v, Fs, Qs, t, gs), Fs, Qs, gs is not None))
        return pending

    @staticmethod
    def write(state: Any, pending: list, params: list[torch.Tensor], keys: tuple, vals: dict[str, Any]) -> Any:
        """Write the new state into its buffers and the update into the parameters; return
        the new state (the same buffers, the counts advanced)."""
        inner = state.inner_state
        soap_state = inner["soap"]
        ms, vs = _leaves(soap_state.mu, keys), _leaves(soap_state.nu, keys)
        lr, wd = float(vals["lr"]), float(vals["weight_decay"])
        dst, src, outs = list(ms) + list(vs), [p[1] for p in pending] + [p[2] for p in pending], []
        factors, outers = [], []  # where the bases stay: the factors lerped in place
        for out, _, _, new_F, new_Q, Fs, Qs, stays in pending:
            outs.append(out)
            for F, nF, Q, nQ in zip(Fs, new_F, Qs, new_Q):
                if F is None:
                    continue
                (factors if stays else dst).append(F)
                (outers if stays else src).append(nF)
                if nQ is not Q:  # a new basis (the first step, a refresh)
                    dst.append(Q)
                    src.append(nQ)
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
            if factors:
                torch._foreach_lerp_(factors, outers, 1.0 - vals["_step"].sb)
            if wd != 0.0:  # the chain's decoupled_decay, scale_by_learning_rate and p += u, in place
                torch._foreach_add_(outs, params, alpha=wd)
            torch._foreach_mul_(outs, -lr)
            torch._foreach_add_(params, outs)
        injected = {n: vals[n] for n in state.hyperparams}
        return state._replace(count=advance(state.count), hyperparams=injected,
                              inner_state={**inner, "soap": soap_state._replace(count=advance(soap_state.count))})


def _pays(step: SoapStep, g: torch.Tensor, qs: list) -> bool:
    """Whether the Gram matrices save products for ``g`` over a refresh period: each costs
    ``d^3`` once per ``precondition_frequency`` steps and saves ``d * numel`` in each of the
    ``precondition_frequency - 1`` others (a rule of the shapes: a long side of a thin
    matrix keeps the round trip)."""
    n = g.numel()
    return all([d * d <= (step.frequency - 1) * n
                for d, q in zip(step.view_shape(g), qs) if q is not None])


def _gram(grams: dict, key: Any, q: torch.Tensor | None) -> torch.Tensor | None:
    """``q^T q``, kept in ``grams`` under ``key`` while ``q`` is the same tensor, unchanged
    (its version counter: a write into the basis computes it again)."""
    if q is None:
        return None
    try:
        version = q._version
    except RuntimeError:  # an inference tensor keeps no version: nothing kept
        return q.T @ q
    kept = grams.get(key)
    if kept is not None and kept[0] is q and kept[1] == version:
        return kept[2]
    p = q.T @ q
    grams[key] = (q, version, p)
    return p


register(soap, FusedSoap)
