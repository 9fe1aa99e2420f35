"""Schedule-Free AdamW in torch's fused AdamW kernel and three foreach passes: a rule of the
plan, like the fused AdamW and Muon.

A group built with :func:`muonfx.schedule_free_adamw` (``TransformOptimizer(params,
mfx.schedule_free_adamw)``, ``{"tx": mfx.schedule_free_adamw}`` in a param group) with
plain numbers for its hyperparameters, on plain tensors (not DTensor shards) on the CPU or
CUDA, in training mode, steps in place on the group's own state::

    z, m, v <- torch._fused_adamw_(z, g, m, v; lr_k, beta1=0, b2, eps)   (torch's fused
                                            AdamW kernel: z - lr_k * g / (sqrt(v_hat) + eps))
    z <- z - lr_k * wd * y                  (the decay at y; skipped where wd = 0)
    x <- lerp(x, z, c)                      (c = w_k / (w_0 + ... + w_k), the chain's number)
    y <- lerp(z, x, b1)                     (into the parameters)

where the chain (``schedule_free(chain(scale_by_adam(0, b2, eps), decoupled_decay(wd),
lr_k))``, :func:`muonfx.schedule_free`) computes each link out of place (about fourteen
passes over the parameters, each a new tensor) and adds ``y_new - y`` to ``y``. The
arithmetic is the chain's, rounded otherwise: Adam's direction in torch's fused form
(``lr_k / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``), the decay and the step in two
additions instead of one, ``y`` written as the lerp itself; ``tests/test_fused_schedule_free.py``
measures the difference. The numbers (``lr_k``, ``c``, the counts, the weight sum) are
the chain's to the bit (:class:`muonfx.transforms.schedule_free.WarmupWeight`), and so is
the state's layout: checkpoints, resumes, ``opt.eval()``/``opt.train()`` (which swap
``x`` and ``y``) and the chain read and write the same state.

What is not lowered runs the chain: a schedule or a tensor for a number, DTensor shards,
a step in eval mode (the chain's error), a state that is not the preset's, gradients or
buffers that differ from their parameters in dtype, device, shape or strides.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core import EmptyState
from ...counts import Counts, advance, by_count
from ...presets.catalogue import schedule_free_adamw
from ...transforms.adam import ScaleByAdamState
from ...transforms.scaling import ScaleByScheduleState
from ...transforms.schedule_free import ScheduleFreeState, WarmupWeight, averaged, check_warmup_steps, warmup_lr
from .fused import _DTYPES, _leaves, not_numbers, not_plain, register, step_values

__all__ = ["FusedScheduleFreeAdamW"]


class FusedScheduleFreeAdamW:
    """Schedule-Free AdamW's step in torch's fused AdamW kernel and three foreach passes.

    :meth:`why_not` is the rule (checked when the plan is built), :meth:`ready` the rule
    on each step's state and tensors, :meth:`check` the hyperparameters' checks (the
    chain's errors, raised before anything is written), :meth:`step` the step in place.
    """

    name = "Schedule-Free AdamW in torch's fused AdamW kernel and three foreach passes"

    @staticmethod
    def why_not(hp: dict[str, Any], params: list[torch.Tensor]) -> str | None:
        """None where the lowered step computes the group's chain, else the reason."""
        return not_numbers(hp) or not_plain(params, "DTensor parameters", _DTYPES)

    @staticmethod
    def ready(state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], keys: tuple,
              memo: dict | None = None) -> str | None:
        """None where this step's state and gradients are what the lowered step takes,
        else the reason (the step then runs the chain)."""
        sf = getattr(state, "inner_state", None)
        hyper = getattr(state, "hyperparams", None)
        if hyper is None or not isinstance(sf, ScheduleFreeState) or not isinstance(sf.inner_state, tuple) or \
                len(sf.inner_state) != 3:
            return "the state is not Schedule-Free AdamW's"
        adam, decay, lrs = sf.inner_state
        if not (isinstance(adam, ScaleByAdamState) and isinstance(adam.count, Counts) and type(decay) is EmptyState
                and isinstance(lrs, ScaleByScheduleState) and isinstance(lrs.count, Counts)
                and isinstance(state.count, Counts)) or (adam.nu_max is not None and adam.nu_max.keys()):
            return "the state is not Schedule-Free AdamW's"
        if not sf.train_mode:
            return "eval mode (the chain refuses the step)"
        if any([callable(v) and not isinstance(v, torch.Tensor) for v in hyper.values()]):
            return "a schedule in the state"
        try:
            bufs = _buffers(sf, params, keys, memo)
        except (KeyError, TypeError, AttributeError):
            return "the state does not match the parameters"
        if bufs is None:
            return "buffers differ from their parameters in dtype, device, shape or strides"
        if [(g.dtype, g.device, g.shape, g.stride(), g.layout) for g in grads] != bufs.sig:
            return "gradients differ from their parameters in dtype, device, shape or strides"
        return None

    @staticmethod
    def check(factory: Any, hp: dict[str, Any], state: Any) -> dict[str, Any]:
        """The hyperparameter values of this step, checked as the chain checks them, and
        the step's averaging numbers (the chain's: ``"_total"``, ``"_c"``), computed here
        so that anything they raise is raised before a write."""
        vals = step_values(hp, state)
        check_warmup_steps(vals["warmup_steps"])
        sf = state.inner_state
        w = float(WarmupWeight(vals["lr"], vals["warmup_steps"], vals["r"], vals["weight_lr_power"]).at(sf.k, {}))
        vals["_total"], vals["_c"] = averaged(sf.weight_sum, w)
        return vals

    @staticmethod
    def step(state: Any, vals: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
             keys: tuple, memo: dict | None = None) -> Any:
        """Run the step in place; return the new state (the same buffers, the counts,
        ``k`` and the weight sum advanced)."""
        sf = state.inner_state
        adam, decay, lrs = sf.inner_state
        bufs = _buffers(sf, params, keys, memo)
        b1, b2 = (float(b) for b in vals["betas"])
        lr, warmup, eps, wd = vals["lr"], vals["warmup_steps"], float(vals["eps"]), float(vals["weight_decay"])
        ks = list(keys)
        lr_groups = by_count(lrs.count, ks, "lr state (count)")
        adam_groups = by_count(adam.count, ks, "adam state (count)")
        if len(lr_groups) == 1 and len(adam_groups) == 1:  # every parameter at one count
            lr_k = float(warmup_lr(lr, warmup, lr_groups[0][0]))
            parts = [(adam_groups[0][0], lr_k, where, js) for where, js in bufs.parts]
        else:  # parameters with counts of their own: each set at its counts
            lr_at = [0.0] * len(ks)
            for t, pos in lr_groups:
                v = float(warmup_lr(lr, warmup, t))
                for j in pos:
                    lr_at[j] = v
            split: dict[tuple, list[int]] = {}
            for t, pos in adam_groups:
                for j in pos:
                    split.setdefault((t, lr_at[j], bufs.where[j]), []).append(j)
            parts = [(t, lr_k, where, js) for (t, lr_k, where), js in split.items()]
        steps: dict = {}
        with torch.no_grad():
            for t, lr_k, (dev, _), js in parts:
                pick = (lambda xs: xs) if js is None else (lambda xs: [xs[j] for j in js])  # noqa: E731
                s = steps.get((t, dev))
                if s is None:
                    s = steps[(t, dev)] = torch.full((), float(t + 1), dtype=torch.float32, device=dev)
                zs = pick(bufs.z)
                torch._fused_adamw_(zs, pick(grads), pick(bufs.m), pick(bufs.v), [], [s] * len(zs), lr=lr_k,
                                    beta1=0.0, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
                                    grad_scale=None, found_inf=None)
                if wd != 0.0:
                    torch._foreach_add_(zs, pick(params), alpha=-(lr_k * wd))
            torch._foreach_lerp_(bufs.x, bufs.z, vals["_c"])
            torch._foreach_copy_(params, bufs.z)
            torch._foreach_lerp_(params, bufs.x, b1)
        inner = (adam._replace(count=advance(adam.count)), decay, ScaleByScheduleState(advance(lrs.count)))
        injected = {n: vals[n] for n in state.hyperparams}
        return state._replace(count=advance(state.count), hyperparams=injected,
                              inner_state=sf._replace(k=sf.k + 1, weight_sum=vals["_total"], inner_state=inner))


class _Buffers:
    """The group's ``z``, ``x`` and moments as lists in the order of its parameters, each
    parameter's ``(dtype, device, shape, strides, layout)`` (what its gradient and its
    buffers must have: torch's fused kernel reads them as flat memory) and its (device,
    dtype)."""

    def __init__(self, sf: ScheduleFreeState, params: list[torch.Tensor], keys: tuple) -> None:
        adam = sf.inner_state[0]
        self.held, self.keys, self.ids = (sf.z, sf.x, adam.mu, adam.nu), keys, [id(p) for p in params]
        self.z, self.x = _leaves(sf.z, keys), _leaves(sf.x, keys)
        self.m, self.v = _leaves(adam.mu, keys), _leaves(adam.nu, keys)
        self.sig = [(p.dtype, p.device, p.shape, p.stride(), p.layout) for p in params]
        self.ok = all([(t.dtype, t.device, t.shape, t.stride(), t.layout) == sg
                       for ts in (self.z, self.x, self.m, self.v) for t, sg in zip(ts, self.sig)])
        self.ok = self.ok and all([_dense(p) for p in params])
        self.where = [(p.device, p.dtype) for p in params]
        by_kind: dict[tuple, list[int]] = {}
        for j, w in enumerate(self.where):
            by_kind.setdefault(w, []).append(j)
        #: ((device, dtype), positions or None for all): torch's kernel takes one of each
        self.parts = [(w, None if len(js) == len(params) else js) for w, js in by_kind.items()]

    def fits(self, sf: ScheduleFreeState, params: list[torch.Tensor], keys: tuple) -> bool:
        """Whether these are still the buffers of ``sf`` for ``params``."""
        adam = sf.inner_state[0]
        return all([a is b for a, b in zip((sf.z, sf.x, adam.mu, adam.nu), self.held)]) and keys == self.keys \
            and [id(p) for p in params] == self.ids


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps (contiguous, or channels-last)."""
    return t.is_contiguous() or (t.ndim == 4 and t.is_contiguous(memory_format=torch.channels_last)) or \
        (t.ndim == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _buffers(sf: ScheduleFreeState, params: list[torch.Tensor], keys: tuple, memo: dict | None) -> _Buffers | None:
    """The group's :class:`_Buffers` (the memo's where they still fit); None where a buffer
    differs from its parameter."""
    bufs = memo.get("schedule_free") if memo is not None else None
    if bufs is None or not bufs.fits(sf, params, keys):
        bufs = _Buffers(sf, params, keys)
        if memo is not None:
            memo["schedule_free"] = bufs
    return bufs if bufs.ok else None


register(schedule_free_adamw, FusedScheduleFreeAdamW)
