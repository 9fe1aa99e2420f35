"""Muon's elementwise links in the fewest passes: a rule of the plan, like the fused AdamW.

A group built with :func:`muonfx.muon` (``TransformOptimizer(params, mfx.muon)``, the
Muon groups of :class:`muonfx.MuonOptimizer` and :func:`muonfx.create_hybrid_optimizer`)
with plain numbers for ``lr``, ``momentum``, ``weight_decay`` and ``eps``, no ``mu_dtype``
and no ``dims``, on plain tensors (not DTensor shards), steps as torch.optim.Muon writes
it, per piece of the plan (:mod:`.pieces`)::

    compute (nothing written)        u = lerp(m, g, 1 - beta); u <- lerp(g, u, beta)   (Nesterov, in u's buffer)
                                     o = NS(u)                  (the group's own newton_schulz rule, left in
                                                                 its compute dtype: bfloat16 by default)
    write                            m <- lerp(m, g, 1 - beta)  (in place: the same op, the same bits as u)
                                     W <- W * (1 - lr * wd)     (skipped where wd = 0: a product by 1)
                                     W <- W - lr * s(A, B) * o  (one foreach add per shape scale, o as it is)

The Nesterov input of a Newton-Schulz batch is made when the seam runs that batch
(:func:`muonfx.seam.local_map_parts`): the step holds one batch of it at a time, never a
whole group's, and on the CPU it is made in one buffer kept between steps (the largest
batch's size: at most the budget, or one matrix above it). Fresh memory is expensive on
the CPU, whose allocator caches nothing: the operating system hands it out page by page
(before this, 56,000 page faults a step on two MoE layers, 8-10 % of the step; 18,000-
30,000 on two GPT-2-small layers).

On the CPU a large tall matrix's output (computed wide, so a transposed view; one matrix
a batch) is copied into rows while it is in the cache (torch's blocked transposing copy;
the same bits): the parameter update then reads it in order, where an addition that reads
the transposed view gathers it element by element (1.3-1.7 % of the step on two MoE or
GPT-2-small layers, one thread, measured).

The chain computes ``W + (-lr * (s * o + wd * W))`` in four passes after Newton-Schulz,
casts o back to float32 and copies the new momentum into its buffer; the lowered step
makes three passes, writes the momentum in place, keeps no second momentum buffer and no
float32 copy of o. The momentum, the Nesterov input and the Newton-Schulz output are the
chain's bit for bit; the parameter update is torch.optim.Muon's form, which rounds
differently from the chain's (a few float32 ulps of the update: ``tests/test_fused_muon.py``
measures it). Everything a step can detect is detected before a write, as for the chain:
hyperparameters when the step starts, each piece's Newton-Schulz before that piece writes.

The same lowering runs :class:`muonfx.FSDPMuonOptimizer`'s matrices on plain tensors
without ``beta2`` (row normalisation) and gradient accumulation: Muon's chain with the
constant ``ns_stepsize`` after the shape scale (``W <- W - lr * s(A, B) * ns_stepsize * o``).

What is not lowered runs the chain: a schedule or tensor for a number, ``mu_dtype`` or
``dims`` given, DTensor shards (the seam's exchange), a state that is not the preset's,
gradients of another dtype than their momentum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._compat.dtensor import is_dtensor
from ... import seam
from ...core import EmptyState
from ...core.cache import LRU
from ...counts import Counts, advance
from ...presets import muon
from ...presets.options import MuonOptions
from ...linalg.settings import EXTRA_ARG
from ...transforms._matrix import as_stacks
from ...transforms.momentum import MomentumState
from ...transforms.orthogonalize import NSRule
from ...transforms.scaling import shape_factors
from .fused import _leaves, _number, register, step_values

__all__ = ["FusedMuon"]

_LINKS = ("momentum", "orthogonalize", "scale_by_shape", "weight_decay", "lr")
#: the chain of FSDPMuonOptimizer's matrices without row normalisation and accumulation:
#: Muon's with a constant scale (``ns_stepsize``) after the shape scale
_STEPSIZE_LINKS = ("momentum", "orthogonalize", "scale_by_shape", "ns_stepsize", "weight_decay", "lr")
_OPTIONS = tuple(f.name for f in dataclasses.fields(MuonOptions))
#: Muon's options that fix its ``newton_schulz`` link when it is built (``eps`` is read
#: at each step)
_STATIC = {"ns_steps": "steps", "ns_coefficients": "coefficients", "ns_dtype": "dtype", "ns_method": "method"}

#: the Newton-Schulz rules of the lowered groups, by their options (a new lr, momentum or
#: eps builds nothing)
_NS: LRU = LRU(16)


def _ns_rule(vals: dict[str, Any]) -> NSRule:
    """The rule of the group's ``newton_schulz`` link, as :func:`muonfx.muon` builds it
    (:meth:`muonfx.MuonOptions.orthogonalize`)."""
    opts = {_STATIC[n]: vals[n] for n in _STATIC if n in vals}
    key = repr(sorted(opts.items()))
    rule = _NS.get(key)
    if rule is None:
        rule = _NS[key] = NSRule(**opts)
    return rule


def _scratch(memo: dict | None, like: list[torch.Tensor]) -> torch.Tensor | None:
    """A flat buffer of at least ``like``'s elements (one dtype) to make a batch's Nesterov
    input in, kept in the plan's ``memo`` between steps on the CPU (as large as the
    largest batch: at most the budget, or one matrix above it); None elsewhere (a GPU's
    caching allocator gives temporaries at no cost). On the CPU fresh memory costs a page
    fault per 4 KiB at every step: 9 MiB of it per GPT-2-small MLP matrix."""
    if memo is None or like[0].device.type != "cpu":
        return None
    n = sum([t.numel() for t in like])
    buf = memo.get(("muon nesterov", like[0].dtype))
    if buf is None or buf.numel() < n:
        buf = memo[("muon nesterov", like[0].dtype)] = torch.empty(n, dtype=like[0].dtype)
    return buf


class _InRows:
    """A matrix function whose transposed result for one matrix (a large tall matrix's
    polar factor, computed wide; the CPU's Newton-Schulz takes large matrices one at a
    time) comes back laid out in rows, copied while it is in the cache (the same bits).

    On the CPU an addition that reads a transposed bfloat16 operand gathers it element by
    element: 0.87 ms for a 1024 x 512 matrix against 0.22 ms for torch's blocked copy of
    the 2-D transpose into rows and 0.08 ms for the addition then (two threads, measured;
    a 3-D copy takes the element-by-element path too, 0.58 ms, and a copy at the parameter
    update, after the piece's other products, 0.43 ms). torch.optim.Muon adds its update
    as the transposed view."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.compute_dtype, self.batch_limit = fn, fn.compute_dtype, fn.batch_limit

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        o = self.fn(g)
        if o.device.type != "cpu" or o.shape[0] != 1 or o.is_contiguous() or not o.mT.is_contiguous():
            return o  # a batch of several (small matrices: its Python calls would cost more) as it is
        out = torch.empty(o.shape, dtype=o.dtype)
        out[0].copy_(o[0])  # 2-D: torch's blocked transposing copy takes 2-D tensors only
        return out


class FusedMuon:
    """Muon's step with its elementwise links in foreach passes, piece by piece.

    ``pieces = True``: the runner calls :meth:`compute` for a piece (or the whole group)
    before anything of it is written, then :meth:`write`; :meth:`why_not` (when the plan
    is built) and :meth:`ready` (each step) are the rules, :meth:`check` the
    hyperparameters' checks.
    """

    name = "Muon's elementwise links in foreach passes"
    pieces = True

    @staticmethod
    def why_not(hp: dict[str, Any], params: list[torch.Tensor]) -> str | None:
        """None where the lowered step computes the group's chain, else the reason."""
        for n in ("lr", "momentum", "weight_decay", "eps", "ns_stepsize"):
            if n in hp and not _number(hp[n]):
                return f"{n} is {'a schedule' if callable(hp[n]) else type(hp[n]).__name__}"
        if not isinstance(hp.get("nesterov", True), bool):
            return "nesterov is not a bool"
        if hp.get("mu_dtype") is not None:
            return "mu_dtype is given"
        if hp.get("dims") is not None:
            return "dims is given"
        for p in params:
            if is_dtensor(p):
                return "DTensor parameters (the seam's exchange)"
            if p.device.type not in ("cpu", "cuda"):
                return f"parameters on {p.device.type}"
        return None

    @staticmethod
    def ready(state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], keys: tuple,
              memo: dict | None = None) -> str | None:
        """None where this step's state and gradients are what the lowered step takes."""
        hyper = getattr(state, "hyperparams", None)
        inner = getattr(state, "inner_state", None)
        if hyper is None or not isinstance(inner, dict) or tuple(inner) not in (_LINKS, _STEPSIZE_LINKS) or \
                not isinstance(inner["momentum"], MomentumState) or \
                not all(type(v) is EmptyState for n, v in inner.items() if n != "momentum") or \
                not isinstance(getattr(state, "count", None), Counts):
            return "the state is not Muon's"
        if any([callable(v) and not isinstance(v, torch.Tensor) for v in hyper.values()]):
            return "a schedule in the state"
        try:
            ms = _leaves(inner["momentum"].mu, keys)
        except (KeyError, TypeError):
            return "the momentum does not match the parameters"
        for p, g, m in zip(params, grads, ms):
            if not (g.dtype == m.dtype == p.dtype and g.device == m.device == p.device and g.layout == torch.strided
                    and g.shape == p.shape == m.shape):
                return "gradients or momentum differ from their parameters in dtype, device or shape"
        return None

    @staticmethod
    def check(factory: Any, hp: dict[str, Any], state: Any) -> dict[str, Any]:
        """The hyperparameter values of this step (the group's ``hp`` with the state's
        injected numbers), checked by Muon's own rules (:class:`muonfx.MuonOptions`): the
        same errors as the chain, raised before anything is written."""
        vals = step_values(hp, state)
        MuonOptions(**{n: vals[n] for n in _OPTIONS if n in vals})
        return vals

    @staticmethod
    def compute(keys: tuple, grads: list[torch.Tensor], params: list[torch.Tensor], state: Any,
                vals: dict[str, Any], extra: dict[str, Any], memo: dict | None = None) -> tuple:
        """The Newton-Schulz outputs of these parameters (nothing written): what
        :meth:`write` takes (``memo``, the group's: on the CPU it keeps the buffer the
        Nesterov input is made in, :func:`_scratch`)."""
        beta, nesterov = vals["momentum"], vals.get("nesterov", True)
        ms = _leaves(state.inner_state["momentum"].mu, keys)
        settings = extra.get(EXTRA_ARG)
        run = _ns_rule(vals).matrix_fn(grads, float(vals["eps"]), settings, polar=True)
        factors = shape_factors(vals.get("adjust_lr") or "original", list(keys), params)
        m3, g3 = as_stacks(list(keys), ms, "muon"), as_stacks(list(keys), grads, "muon")
        for s in g3:  # a tall matrix on the CPU: its output comes back in rows (_InRows)
            if s.shape[-2] > s.shape[-1] and s.device.type == "cpu":
                run = _InRows(run)
                break

        def inputs(batch: list) -> list[torch.Tensor]:
            # the Nesterov momentum of one batch's matrices, made when the batch runs: the
            # step holds one batch of it at a time (a batch's bytes are bounded by the
            # budget: fresh memory of a whole group at every step costs page faults on the
            # CPU, whose allocator keeps nothing)
            mb = [m3[i][a:b] for i, a, b in batch]
            gb = [g3[i][a:b] for i, a, b in batch]
            buf = _scratch(memo, gb)
            if buf is None:
                u = list(torch._foreach_lerp(mb, gb, 1.0 - beta))  # the chain's new momentum (foreach "ema")
            else:  # the same op (the CPU's foreach lerp is this lerp), into the kept buffer
                u, at = [], 0
                for m, g in zip(mb, gb):
                    u.append(torch.lerp(m, g, 1.0 - beta, out=buf[at:at + g.numel()].view(g.shape)))
                    at += g.numel()
            if nesterov:
                for g, v in zip(gb, u):  # the chain's lerp(g, m', beta), in m''s own buffer
                    torch.lerp(g, v, beta, out=v)
            return u

        # the polar factors in the compute dtype: added to the float32 parameters as they
        # are (torch.optim.Muon's add of its bfloat16 update), no float32 copy of them
        parts = seam.local_map_parts(run, g3, settings, cast_back=False, inputs=inputs)
        p3 = as_stacks(list(keys), params, "muon")
        return (grads, [p3[i][a:b] for i, a, b, _ in parts], [o for *_, o in parts],
                [factors[i] for i, *_ in parts])

    @staticmethod
    def write(state: Any, pending: tuple, params: list[torch.Tensor], keys: tuple, vals: dict[str, Any]) -> Any:
        """Write the momentum and the parameters in place; return the new state (the same
        buffers, the counts advanced)."""
        grads, dests, os_, factors = pending
        inner = state.inner_state
        ms = _leaves(inner["momentum"].mu, keys)
        lr, wd, size = float(vals["lr"]), float(vals["weight_decay"]), float(vals.get("ns_stepsize", 1.0))
        with torch.no_grad():
            torch._foreach_lerp_(ms, grads, 1.0 - vals["momentum"])
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            by_factor: dict[float, list[int]] = {}
            for j, f in enumerate(factors):
                by_factor.setdefault(f, []).append(j)
            for f, js in by_factor.items():
                torch._foreach_add_([dests[j] for j in js], [os_[j] for j in js],
                                    alpha=-(lr * f) if size == 1.0 else -(lr * (f * size)))
        injected = {n: vals[n] for n in state.hyperparams}
        return state._replace(count=advance(state.count), hyperparams=injected)


register(muon, FusedMuon)
