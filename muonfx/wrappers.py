"""Wrappers that change *when* or *with what* an inner transform runs:
finite checks, gradient accumulation and injected (schedulable) hyperparameters.

Each passes the extra arguments of a call (``update(u, s, p, **extra_args)``, see
:mod:`muonfx.core.contract`) to its inner transform when that takes them."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from . import seam, tree
from .core import GradientTransformation, aligned, build, leafwise, leafwise_if, leaves, takes_extra_args, td_items
from .counts import Counts, by_count, common, from_values, zeros
from .inject import InjectHyperparamsState, _pick, hyperparam_values, inject_hyperparams, is_schedule, signature
from .ops import foreach

__all__ = ["apply_if_finite", "ApplyIfFiniteState", "accumulate", "AccumulateState",
           "inject_hyperparams", "InjectHyperparamsState", "is_schedule", "hyperparam_values"]


# ---------------------------------------------------------------------------
# apply_if_finite
# ---------------------------------------------------------------------------


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`.

    Attributes:
        notfinite_count: consecutive steps whose update was not finite.
        last_finite: whether the last update was finite.
        total_notfinite: all non-finite steps so far.
        inner_state: the inner transform's state (kept unchanged on a skipped step).
    """

    notfinite_count: int
    last_finite: bool
    total_notfinite: int
    inner_state: Any


def _count_nonfinite(t: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(t)).sum().to(torch.float32)


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int = 5) -> GradientTransformation:
    """Skip steps whose update contains NaN or Inf.

    The inner update is computed; if any element is not finite (checked with one
    global reduction, identical on every rank under FSDP2) the output is a zero
    update and the inner state is kept. After more than ``max_consecutive_errors``
    consecutive bad steps the update is let through (optax's semantics), so a run
    that is really diverging does not silently stall. Not leafwise
    (:func:`muonfx.leafwise`): one leaf's NaN zeroes every leaf's update.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.apply_if_finite(mfx.momentum(0.9), max_consecutive_errors=3)
        >>> g = TensorDict({"w": torch.tensor([float("nan")])}, [])
        >>> out, s = tx.update(g, tx.init(g))
        >>> out["w"].item(), s.notfinite_count
        (0.0, 1)
    """
    if not isinstance(max_consecutive_errors, int) or max_consecutive_errors < 0:
        raise ValueError(f"max_consecutive_errors must be an int >= 0, got {max_consecutive_errors!r}")

    takes = takes_extra_args(inner)

    def init_fn(params):
        return ApplyIfFiniteState(0, True, 0, inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        new_u, new_inner = inner.update(updates, state.inner_state, params, **(extra_args if takes else {}))
        keys, us = leaves(new_u)
        bad = int(seam.global_sum(_count_nonfinite, us).item()) if us else 0
        if bad == 0:
            return new_u, ApplyIfFiniteState(0, True, state.total_notfinite, new_inner)
        count = state.notfinite_count + 1
        total = state.total_notfinite + 1
        if count > max_consecutive_errors:
            return new_u, ApplyIfFiniteState(count, False, total, new_inner)
        zeros = build(keys, [torch.zeros_like(u) for u in us])
        return zeros, ApplyIfFiniteState(count, False, total, state.inner_state)

    return GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# accumulate
# ---------------------------------------------------------------------------


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
        mini_step: micro-steps accumulated since the last inner step (0..k-1), per
            parameter (one left out of a micro-step keeps its own).
        acc: running sum of the micro-step updates (float32 or wider).
        inner_state: the inner transform's state.
    """

    mini_step: Counts
    acc: TensorDict
    inner_state: Any


def _acc_dtype(p: torch.Tensor) -> torch.dtype:
    return p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32


def accumulate(inner: GradientTransformation, every_k: int) -> GradientTransformation:
    """Gradient accumulation: run ``inner`` on the mean of every ``every_k`` updates.

    Calls 1..k-1 of each cycle return zero updates and only add to the running sum;
    call k feeds ``sum / k`` (in the update's dtype) to ``inner`` and resets the sum.
    ``accumulate(t, 1)`` computes exactly what ``t`` does. The micro-step count is per
    parameter: one left out of a call keeps its own, and completes its cycle a call
    later. Leafwise (:func:`muonfx.leafwise`) when ``inner`` is.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.accumulate(mfx.scale(1.0), every_k=2)
        >>> s = tx.init(TensorDict({"w": torch.zeros(1)}, []))
        >>> out, s = tx.update(TensorDict({"w": torch.tensor([1.0])}, []), s); out["w"].item()
        0.0
        >>> out, s = tx.update(TensorDict({"w": torch.tensor([3.0])}, []), s); out["w"].item()
        2.0
    """
    if not isinstance(every_k, int) or isinstance(every_k, bool) or every_k < 1:
        raise ValueError(f"accumulate: every_k must be an int >= 1, got {every_k!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        acc = build(keys, [torch.zeros_like(p, dtype=_acc_dtype(p)) for p in ps])
        return AccumulateState(zeros(keys), acc, inner.init(params))

    takes = takes_extra_args(inner)

    def cycle(keys, gs, accs, mini, inner_state, params, extra_args):
        """One call on parameters that share their micro-step ``mini``."""
        total = foreach("add", accs, [g if g.dtype == a.dtype else g.to(a.dtype) for g, a in zip(gs, accs)])
        if mini + 1 < every_k:
            zeros_ = build(keys, [torch.zeros_like(g) for g in gs])
            return zeros_, build(keys, total), inner_state
        if every_k > 1:
            foreach("div_", total, float(every_k))
        mean = build(keys, [t if t.dtype == g.dtype else t.to(g.dtype) for t, g in zip(total, gs)])
        new_u, new_inner = inner.update(mean, inner_state, params, **(extra_args if takes else {}))
        return new_u, build(keys, [torch.zeros_like(a) for a in accs]), new_inner

    def update_fn(updates, state, params=None, **extra_args):
        keys, gs = leaves(updates)
        accs = aligned(state.acc, keys, "accumulate state (acc)", like=gs)
        groups = by_count(state.mini_step, keys, "accumulate state (mini_step)")
        if len(groups) <= 1:
            mini = groups[0][0] if groups else common(state.mini_step)
            new_u, acc, new_inner = cycle(keys, gs, accs, mini, state.inner_state, params, extra_args)
            nxt = mini + 1 if mini + 1 < every_k else 0
            steps = state.mini_step
            steps = steps._replace(values=(nxt,), index=None) if isinstance(steps, Counts) else nxt
            return new_u, AccumulateState(steps, acc, new_inner)
        # parameters at different points of their cycles (some were left out of a
        # micro-step): each set of them goes its own way
        outs: dict = {}
        acc_out: dict = {}
        inner_state = state.inner_state
        nxt = [0] * len(keys)
        for mini, pos in groups:
            ks = [keys[j] for j in pos]
            sub_p = None if params is None else _pick(params, ks)
            sub_inner = tree.restrict(inner_state, ks)
            new_u, acc, new_sub = cycle(ks, [gs[j] for j in pos], [accs[j] for j in pos], mini, sub_inner, sub_p,
                                        extra_args)
            inner_state = tree.merge(inner_state, new_sub)
            outs.update(zip(*td_items(new_u)))
            acc_out.update(zip(*td_items(acc)))
            for j in pos:
                nxt[j] = mini + 1 if mini + 1 < every_k else 0
        by_key = dict(zip(keys, nxt))
        mini_step = from_values(state.mini_step.keys, [by_key[k] for k in state.mini_step.keys])
        return (build(keys, [outs[k] for k in keys]),
                AccumulateState(mini_step, build(keys, [acc_out[k] for k in keys]), inner_state))

    return leafwise_if(GradientTransformation(init_fn, update_fn), inner)
