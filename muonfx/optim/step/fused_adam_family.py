"""The catalogue's elementwise presets in the fewest passes: rules of the plan, like the
fused AdamW and Muon's lowering.

A group built with :func:`muonfx.lion`, :func:`muonfx.adopt`, :func:`muonfx.laprop`,
:func:`muonfx.cautious_adamw` or :func:`muonfx.mars_adamw` (``TransformOptimizer(params,
mfx.adopt)``, ``{"tx": mfx.laprop}`` in a param group) with plain numbers for its
hyperparameters, on tensors of the CPU or a GPU (Lion's, ADOPT's and LaProp's also on DTensor
shards: FSDP2, HSDP, tensor parallel; their ops are elementwise, so each rank steps its
local shards, gradients and state laid out as their parameters), runs its
links in place on the group's own state buffers, in ``torch._foreach_*`` passes and
torch's fused kernels, in the chain's state layout (checkpoints move between the two).
Per count ``t`` (each parameter's own, as the chain), ``d`` the preset's direction::

    Lion     d = sign(b1 * m + (1 - b1) * g);  m <- b2 * m + (1 - b2) * g
    ADOPT    t = 0: v <- g * g                                   (no step)
             t > 0: n = clamp(g / max(sqrt(v), eps), +-t^(1/4))
                    m <- b1 * m + (1 - b1) * n;  W <- W - lr * m (torch._fused_sgd_ with dampening b1,
                                                                  after the decay; 16-bit: lerp_, add_)
                    v <- b2 * v + (1 - b2) * g * g              (decouple=False: g + wd * W for g)
    LaProp   m, v <- torch._fused_adamw_(m, g, 0, v; lr=-(1 - b1), beta1=0, b2, wd=-1, eps):
                    v <- b2 * v + (1 - b2) * g * g;  m <- b1 * m + (1 - b1) * g / (sqrt(v) / sqrt(bc2) + eps)
             d = m / bc1
    C-AdamW  m <- lerp(m, g, 1 - b1);  v <- b2 * v + (1 - b2) * g * g
             u = (sqrt(bc2) / bc1) * m / (sqrt(v) + eps);  d = u * [u g > 0] * n / (sum [u g > 0] + 1)
    all      W <- W * (1 - lr * wd) - lr * d                     (skipped where wd = 0: a product by 1)
    MARS     c = g + gamma * b1 / (1 - b1) * (g - g_prev), clipped to norm max_norm (in g_prev's buffer)
             torch._fused_adamw_ on c;  g_prev <- g

LaProp's moments come from torch's fused AdamW kernel with its momentum as the kernel's
parameter: a first moment of ``beta1 = 0`` is the gradient itself (its buffer, a zeroed
temporary), the kernel's decay factor ``1 - lr * wd`` with ``lr = -(1 - b1)`` and ``wd =
-1`` is ``b1``, and its update ``- lr * g / denom`` adds ``(1 - b1) * g / denom``: LaProp's
momentum in one pass where the chain makes five (its ``sqrt(v / bc2)`` is the kernel's
``sqrt(v) / sqrt(bc2)``). ADOPT's momentum and parameter update of float32 and float64
take torch's fused SGD kernel (``m <- b1 m + (1 - b1) n``, then ``W <- W - lr m``: one
pass for the chain's ``lerp_`` and ``add_``); on the CPU its momentum of 16-bit dtypes
comes out wrong (torch 2.13, measured), so those keep the two passes. The values these
kernels write are the chain's within their rounding (float32: under 3.1e-7 of the
largest moment over 20 steps, measured); the other moments, MARS's ``g_prev``, ADOPT's
``n``, Lion's direction, C-AdamW's ``u`` and mask and MARS's ``c`` are the chain's bit for bit, in every
dtype, from the same parameters: the same ops on the same values, written in place. The
parameter update is written as torch.optim's (``W * (1 - lr wd)``, then one ``add_`` of
``-lr * d``; MARS: the fused AdamW kernel's update and moments), which rounds
differently from the chain's ``W + (-lr * (d + wd * W))``: a few float32 ulps of the
update (``tests/test_fused_catalogue.py`` measures it). Nothing in the step can fail
once ``ready`` (the tensors) and ``check`` (the hyperparameters, by the chain's rules)
have passed, so an error stops it before anything is written. A group over the plan's
batch budget steps in runs of at most that many bytes, each with its temporaries (the
bound of the chain's pieces, without splitting the state); on the CPU a parameter of 512
KiB or more runs alone (its tensors stay in the cache), and a group keeps its
temporaries between steps (one or two buffers the size of its largest run:
:func:`.fused_foreach._scratch`).

What is not lowered runs the chain: a schedule or tensor for a number, DTensor shards
under C-AdamW and MARS-AdamW (their mask count and norm clip sum over whole parameters),
a state that is not the preset's, gradients or moments of another dtype, device, shape,
mesh or placements than their parameter.
"""

from __future__ import annotations

import math

import torch

from ...presets.catalogue import adopt, cautious_adamw, laprop, lion, mars_adamw
from ...transforms.adam import ScaleByAdamState
from ...transforms.adopt import ScaleByAdoptState
from ...transforms.cautious import _totals
from ...transforms.laprop import ScaleByLapropState
from ...transforms.lion import ScaleByLionState
from ...transforms.mars import MarsCorrectionState
from .fused import _step_numbers, register
from .fused_foreach import ForeachLowering, _by_count, _by_kind, _Ops

#: the dtypes whose momentum torch's fused SGD kernel computes right on every device (on
#: the CPU, torch 2.13, its momentum buffer of float16 and bfloat16 comes out wrong: off
#: by the buffer's own size, measured)
_SGD_DTYPES = (torch.float32, torch.float64)

__all__ = ["FusedLion", "FusedAdopt", "FusedLaProp", "FusedCautiousAdamW", "FusedMarsAdamW"]


class FusedLion(ForeachLowering):
    """:func:`muonfx.lion`'s chain in foreach passes."""

    name = "Lion's links in foreach passes"
    link, kind = "lion", ScaleByLionState
    orders = (("lion", "weight_decay", "lr"),)
    on_shards = True
    counted = False  # Lion's state is its momentum alone

    @classmethod
    def _tds(cls, inner: dict) -> tuple:
        return (inner[cls.link].mu,)

    @classmethod
    def _run(cls, k: _Ops, ts, grads, params, bufs, lr, wd, b1, b2, vals) -> None:
        (ms,) = bufs
        cs = k.scratch(1)[0]
        if cs is None:
            cs = torch._foreach_mul(ms, k.num(b1))
            torch._foreach_add_(cs, grads, alpha=1.0 - b1)
            torch._foreach_sign_(cs)
        else:  # each tensor's next op on it while it is in cache
            s = k.num(b1)
            for m, g, x in zip(ms, grads, cs):
                torch.mul(m, s, out=x).add_(g, alpha=1.0 - b1).sign_()
        k.mul_(ms, b2)  # m <- b2 m + (1 - b2) g, the chain's two ops in place
        torch._foreach_add_(ms, grads, alpha=1.0 - b2)
        cls._decay(k, params, lr, wd)
        torch._foreach_add_(params, cs, alpha=-lr)


class FusedAdopt(ForeachLowering):
    """:func:`muonfx.adopt`'s chain (both decay placements) in foreach passes, its momentum and
    parameter update (float32, float64) in torch's fused SGD kernel."""

    name = "ADOPT's links in foreach passes and torch._fused_sgd_"
    link, kind = "adopt", ScaleByAdoptState
    orders = (("weight_decay", "adopt", "lr"), ("adopt", "weight_decay", "lr"))  # decouple False, True

    on_shards = True

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
            if decouple:
                cls._decay(k, ps, lr, wd)
            for ps_, n_, ms_ in _by_kind([ps, n, ms]):  # m <- b1 m + (1 - b1) n;  W <- W - lr m
                if ps_[0].dtype in _SGD_DTYPES:
                    torch._fused_sgd_(ps_, n_, ms_, weight_decay=0.0, momentum=b1, lr=lr, dampening=b1,
                                      nesterov=False, maximize=False, is_first_step=False, grad_scale=None,
                                      found_inf=None)
                else:
                    torch._foreach_lerp_(ms_, n_, 1.0 - b1)
                    torch._foreach_add_(ps_, ms_, alpha=-lr)
            cls._second_moment(k, vs, gs, b2)


class FusedLaProp(ForeachLowering):
    """:func:`muonfx.laprop`'s chain: its moments in ``torch._fused_adamw_`` (the momentum
    as the kernel's parameter), then the parameters in foreach passes."""

    name = "LaProp's moments in torch._fused_adamw_, then foreach passes"
    link, kind = "laprop", ScaleByLapropState
    orders = (("laprop", "weight_decay", "lr"),)

    on_shards = True

    @classmethod
    def _run(cls, k: _Ops, ts, grads, params, bufs, lr, wd, b1, b2, vals) -> None:
        ms, vs = bufs
        # the kernel's first moment with beta1 = 0 is g itself (a lerp of weight 1 from
        # zeros: what it held must be finite); its decay (1 - lr wd) with lr = -(1 - b1)
        # and wd = -1 is b1: m <- b1 m + (1 - b1) g / (sqrt(v) / sqrt(bc2) + eps)
        es = k.scratch(1)[0]
        if es is None:
            es = torch._foreach_mul(grads, 0.0)
        else:
            torch._foreach_zero_(es)
        for ms_, gs, es_, vs_, steps in _by_kind([ms, grads, es, vs, _step_numbers(ts, [p.device for p in params])]):
            torch._fused_adamw_(ms_, gs, es_, vs_, [], steps, amsgrad=False, lr=-(1.0 - b1), beta1=0.0, beta2=b2,
                                weight_decay=-1.0, eps=float(vals["eps"]), maximize=False, grad_scale=None,
                                found_inf=None)
        cls._decay(k, params, lr, wd)
        for t, (ps, ms_) in _by_count(ts, [params, ms]):
            torch._foreach_add_(ps, ms_, alpha=-lr / (1.0 - b1 ** (t + 1)))


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
        for ps, cs_, ms_, vs_, steps in _by_kind([params, cs, ms, vs, _step_numbers(ts, [p.device for p in params])]):
            torch._fused_adamw_(ps, cs_, ms_, vs_, [], steps, amsgrad=False, lr=lr, beta1=b1, beta2=b2,
                                weight_decay=wd, eps=float(vals["eps"]), maximize=False, grad_scale=None,
                                found_inf=None)
        torch._foreach_copy_(prev, grads)  # g_prev <- g


register(lion, FusedLion)
register(adopt, FusedAdopt)
register(laprop, FusedLaProp)
register(cautious_adamw, FusedCautiousAdamW)
register(mars_adamw, FusedMarsAdamW)
