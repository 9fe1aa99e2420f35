"""The catalogue's Adam-like presets in the fewest passes: rules of the plan, like the
fused AdamW and Muon's lowering.

A group built with :func:`muonfx.adopt`, :func:`muonfx.laprop`,
:func:`muonfx.cautious_adamw` or :func:`muonfx.mars_adamw` (``TransformOptimizer(params,
mfx.adopt)``, ``{"tx": mfx.laprop}`` in a param group) with plain numbers for its
hyperparameters, on plain tensors (not DTensor shards) of the CPU or a GPU, runs its
links as in-place ``torch._foreach_*`` passes on the group's own state buffers, in the
chain's state layout (checkpoints move between the two). Per count ``t`` (each
parameter's own, as the chain), ``d`` the preset's direction::

    ADOPT    t = 0: v <- g * g                                   (no step)
             t > 0: n = clamp(g / max(sqrt(v), eps), +-t^(1/4));  m <- lerp(m, n, 1 - b1)
                    v <- b2 * v + (1 - b2) * g * g;  d = m      (decouple=False: g + wd * W for g)
    LaProp   v <- b2 * v + (1 - b2) * g * g;  m <- b1 * m + (1 - b1) * g / (sqrt(v / bc2) + eps)
             d = m / bc1
    C-AdamW  m <- lerp(m, g, 1 - b1);  v <- b2 * v + (1 - b2) * g * g
             u = (sqrt(bc2) / bc1) * m / (sqrt(v) + eps);  d = u * [u g > 0] * n / (sum [u g > 0] + 1)
    all      W <- W * (1 - lr * wd) - lr * d                     (skipped where wd = 0: a product by 1)
    MARS     c = g + gamma * b1 / (1 - b1) * (g - g_prev), clipped to norm max_norm (in g_prev's buffer)
             torch._fused_adamw_ on c;  g_prev <- g

The moments and MARS's ``g_prev`` are the chain's bit for bit, in every dtype, from the
same parameters (ADOPT's ``decouple=False`` decay reads them): the same ops on the same
values, written in place; so are ADOPT's ``n``, C-AdamW's ``u`` and mask and MARS's
``c``. The parameter update is written as torch.optim's (``W * (1 - lr wd)``, then one
``add_`` of ``-lr * d``; MARS: the fused AdamW kernel's update and moments), which rounds
differently from the chain's ``W + (-lr * (d + wd * W))``: a few float32
ulps of the update (``tests/test_fused_catalogue.py`` measures it). Nothing in the step
can fail once ``ready`` (the tensors) and ``check`` (the hyperparameters, by the chain's
rules) have passed, so an error stops it before anything is written. A group over the
plan's batch budget steps in runs of at most that many bytes, each with its temporaries
(the bound of the chain's pieces, without splitting the state); on the CPU a parameter
of 512 KiB or more runs alone (its tensors stay in the cache), and a group keeps its
temporaries between steps (one or two buffers the size of its largest run:
:func:`.fused_foreach._scratch`).

What is not lowered runs the chain: a schedule or tensor for a number, DTensor shards,
a state that is not the preset's, gradients or moments of another dtype, device or shape
than their parameter.
"""

from __future__ import annotations

import math

import torch

from ...presets.catalogue import adopt, cautious_adamw, laprop, mars_adamw
from ...transforms.adam import ScaleByAdamState
from ...transforms.adopt import ScaleByAdoptState
from ...transforms.cautious import _totals
from ...transforms.laprop import ScaleByLapropState
from ...transforms.mars import MarsCorrectionState
from .fused import _groups, register
from .fused_foreach import ForeachLowering, _by_count, _Ops

__all__ = ["FusedAdopt", "FusedLaProp", "FusedCautiousAdamW", "FusedMarsAdamW"]


class FusedAdopt(ForeachLowering):
    """:func:`muonfx.adopt`'s chain (both decay placements) in foreach passes."""

    name = "ADOPT's links in foreach passes"
    link, kind = "adopt", ScaleByAdoptState
    orders = (("weight_decay", "adopt", "lr"), ("adopt", "weight_decay", "lr"))  # decouple False, True

    @classmethod
    def _run(cls, k: _Ops, ts, grads, params, bufs, lr, wd, b1, b2, vals) -> None:
        decouple, eps = bool(vals.get("decouple", False)), float(vals["eps"])  # a clamp takes a number as it is
        into = wd != 0.0 and not decouple
        scratch = k.scratch(2 if into else 1)
        if into:  # the chain's decay link before ADOPT's: the gradient g + wd * W
            grads = torch._foreach_add(grads, params, alpha=wd) if scratch[1] is None else \
                [torch.add(g, p, alpha=wd, out=o) for g, p, o in zip(grads, params, scratch[1])]
        for t, (gs, ps, ms, vs, ns) in _by_count(ts, [grads, params, *bufs, scratch[0]]):
            if t == 0:  # the first update fills nu alone (the chain's direction is 0)
                torch._foreach_copy_(vs, gs)
                torch._foreach_mul_(vs, gs)
                if decouple:
                    cls._decay(k, ps, lr, wd)
                continue
            c = float(t**0.25)  # scale_by_adopt's clip at count t
            if ns is None:
                n = torch._foreach_sqrt(vs)
                torch._foreach_clamp_min_(n, eps)
                n = torch._foreach_div(gs, n)
                torch._foreach_clamp_min_(n, -c)
                torch._foreach_clamp_max_(n, c)
            else:  # each tensor's next op on it while it is in cache
                n = ns
                for v, x in zip(vs, n):
                    torch.sqrt(v, out=x).clamp_min_(eps)
                for g, x in zip(gs, n):
                    torch.div(g, x, out=x).clamp_(-c, c)
            torch._foreach_lerp_(ms, n, 1.0 - b1)
            cls._second_moment(k, vs, gs, b2)
            if decouple:
                cls._decay(k, ps, lr, wd)
            torch._foreach_add_(ps, ms, alpha=-lr)


class FusedLaProp(ForeachLowering):
    """:func:`muonfx.laprop`'s chain in foreach passes."""

    name = "LaProp's links in foreach passes"
    link, kind = "laprop", ScaleByLapropState
    orders = (("laprop", "weight_decay", "lr"),)

    @classmethod
    def _run(cls, k: _Ops, ts, grads, params, bufs, lr, wd, b1, b2, vals) -> None:
        ms, vs = bufs
        cls._second_moment(k, vs, grads, b2)
        eps = k.num(float(vals["eps"]))
        for t, (gs, ps, ms_, vs_, ds) in _by_count(ts, [grads, params, ms, vs, k.scratch(1)[0]]):
            t += 1
            if ds is None:
                den = torch._foreach_div(vs_, 1.0 - b2**t)
                torch._foreach_sqrt_(den)
                torch._foreach_add_(den, eps)
            else:  # each tensor's next op on it while it is in cache
                den, bc2 = ds, k.num(1.0 - b2**t)
                for v, x in zip(vs_, den):
                    torch.div(v, bc2, out=x).sqrt_().add_(eps)
            k.mul_(ms_, b1)
            torch._foreach_addcdiv_(ms_, gs, den, value=1.0 - b1)
            cls._decay(k, ps, lr, wd)
            torch._foreach_add_(ps, ms_, alpha=-lr / (1.0 - b1**t))


class FusedCautiousAdamW(ForeachLowering):
    """:func:`muonfx.cautious_adamw`'s chain in foreach passes."""

    name = "C-AdamW's links in foreach passes"
    link, kind = "adam", ScaleByAdamState
    orders = (("adam", "weight_decay", "lr"),)

    @classmethod
    def _run(cls, k: _Ops, ts, grads, params, bufs, lr, wd, b1, b2, vals) -> None:
        ms, vs = bufs
        torch._foreach_lerp_(ms, grads, 1.0 - b1)
        cls._second_moment(k, vs, grads, b2)
        eps = k.num(float(vals["eps"]))
        for t, (gs, ps, ms_, vs_, us, ks) in _by_count(ts, [grads, params, ms, vs, *k.scratch(2)]):
            t += 1
            if us is None:
                u = torch._foreach_sqrt(vs_)
                torch._foreach_add_(u, eps)  # epsilon before the bias correction
                u = torch._foreach_div(ms_, u)
            else:  # each tensor's next op on it while it is in cache
                u = us
                for v, m, x in zip(vs_, ms_, u):
                    torch.div(m, torch.sqrt(v, out=x).add_(eps), out=x)
            torch._foreach_mul_(u, k.num(math.sqrt(1.0 - b2**t) / (1.0 - b1**t), inplace=True))  # the chain's u
            mask = torch._foreach_mul(u, gs) if ks is None else [torch.mul(x, g, out=a) for x, g, a in zip(u, gs, ks)]
            for a in mask:
                torch.gt(a, 0, out=a)  # [u g > 0], in the parameter's dtype
            # n / (sum + 1) per parameter, as the chain: reciprocal(sum + 1) * n, no read-back to the host
            scale = torch._foreach_add(_totals(mask), 1.0)
            torch._foreach_reciprocal_(scale)
            torch._foreach_mul_(mask, torch._foreach_mul(scale, [a.numel() for a in mask]))
            cls._decay(k, ps, lr, wd)
            torch._foreach_addcmul_(ps, u, mask, value=-lr)


class FusedMarsAdamW(ForeachLowering):
    """:func:`muonfx.mars_adamw`'s chain: the MARS correction in foreach passes (in the
    previous gradient's buffer), then ``torch._fused_adamw_`` on it."""

    name = "MARS's correction in foreach passes, then torch._fused_adamw_"
    link, kind = "adam", ScaleByAdamState
    orders = (("mars", "adam", "weight_decay", "lr"),)
    others = {"mars": MarsCorrectionState}

    @classmethod
    def _tds(cls, inner: dict) -> tuple:
        return inner["adam"].mu, inner["adam"].nu, inner["mars"].prev

    @classmethod
    def _run(cls, k: _Ops, ts, grads, params, bufs, lr, wd, b1, b2, vals) -> None:
        ms, vs, prev = bufs
        gamma, max_norm = float(vals["gamma"]), vals.get("max_norm")
        cs = grads
        if gamma != 0.0 or max_norm is not None:
            # c = g + k (g - g_prev) in g_prev's buffer: (g_prev - g) * -k is (g - g_prev) * k exactly
            torch._foreach_sub_(prev, grads)
            torch._foreach_mul_(prev, k.num(-(gamma * (b1 / (1.0 - b1))), inplace=True))
            torch._foreach_add_(prev, grads)
            cs = prev
            if max_norm is not None:  # c / max(1, ||c|| / max_norm), the chain's norms
                out = k.scratch(1)[0]
                if out is None:
                    factor = torch._foreach_div(torch._foreach_sqrt_(_totals(torch._foreach_mul(cs, cs))),
                                                float(max_norm))
                    torch._foreach_clamp_min_(factor, 1.0)
                else:  # the same arithmetic per norm, on the norms stacked where they have one dtype
                    sums = [torch.mul(c, c, out=o).sum() for c, o in zip(cs, out)]
                    factor = torch.stack(sums).sqrt_().div_(float(max_norm)).clamp_min_(1.0).unbind() \
                        if k.cpu is not None else [torch.sqrt_(x).div_(float(max_norm)).clamp_min_(1.0) for x in sums]
                torch._foreach_div_(cs, factor)
        step_of: dict = {}
        steps: list = [None] * len(params)
        for t, pos in ts:
            for j in pos:
                dev = params[j].device
                s = step_of.get((t, dev))
                if s is None:
                    s = step_of[(t, dev)] = torch.full((), float(t + 1), dtype=torch.float32, device=dev)
                steps[j] = s
        parts = _groups(params)
        for idx in parts.values():
            pick = (lambda xs: xs) if len(parts) == 1 else (lambda xs: [xs[i] for i in idx])  # noqa: E731
            torch._fused_adamw_(pick(params), pick(cs), pick(ms), pick(vs), [], pick(steps), amsgrad=False, lr=lr,
                                beta1=b1, beta2=b2, weight_decay=wd, eps=float(vals["eps"]), maximize=False,
                                grad_scale=None, found_inf=None)
        torch._foreach_copy_(prev, grads)  # g_prev <- g


register(adopt, FusedAdopt)
register(laprop, FusedLaProp)
register(cautious_adamw, FusedCautiousAdamW)
register(mars_adamw, FusedMarsAdamW)
