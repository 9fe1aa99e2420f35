"""Fused kernels the plan runs where a group's chain computes an arithmetic torch has a
kernel for: a rule of the plan, decided when the plan is built, never by timing.

The lowerings: Muon's (:mod:`.fused_muon`, its elementwise links in foreach passes around
the group's own Newton-Schulz), the catalogue's Adam-like presets' (:mod:`.fused_adam_family`,
their links in in-place foreach passes) and AdamW's, here: a group whose transform is :func:`muonfx.adamw` (its factory,
as ``TransformOptimizer(params, mfx.adamw)``, ``{"tx": mfx.adamw}`` in a param group,
and the AdamW groups of :class:`muonfx.MuonOptimizer` and
:func:`muonfx.create_hybrid_optimizer`) with plain numbers for its hyperparameters runs
``torch._fused_adamw_``, the kernel of ``torch.optim.AdamW(fused=True)``, on the group's
own state buffers: the result is bit for bit torch's fused AdamW (same kernel, same
inputs: each parameter's step count as a float32 tensor, ``lr`` as torch passes it). The
state keeps its layout (``adam.mu``, ``adam.nu``, the per-parameter counts), so
checkpoints, resumes and the chain run link by link read and write the same state.

What is not lowered runs the chain as before: a user's own chain, an ``lr`` (or any
hyperparameter) given as a schedule, moments stored in another dtype than their
parameter, parameters on devices torch has no fused kernel for. The transform itself
is not touched: :func:`muonfx.adamw` stays a pure chain of public transforms, and the
tests check that the lowered step equals that chain within the kernel's rounding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..._compat.dtensor import dtensor_class, is_dtensor, shards
from ..._compat.tensordict import td_items
from ...presets import adamw
from ...transforms.adam import AMSGRAD_WITHOUT_STATE
from ...counts import Counts, advance, by_count
from ...wrappers import hyperparam_values

__all__ = ["FusedAdamW", "lowering", "register", "KERNELS"]

#: the devices whose fused AdamW kernel the plan runs
_DEVICES = ("cpu", "cuda")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _leaves(td: Any, keys: tuple) -> list[torch.Tensor]:
    """``[td[k] for k in keys]``: in one walk of ``td`` where its leaves are ``keys`` in
    order (the state built from the group's parameters), else one lookup per key (a
    ``KeyError`` or ``TypeError`` where ``td`` does not hold them)."""
    ks, vs = td_items(td)
    if len(ks) == len(keys) and ks == list(keys):
        return vs
    return [td[k] for k in keys]


def _locals(ts: list[Any]) -> list[Any]:
    """Each tensor's local shard (the tensors themselves where no DTensor can exist)."""
    cls = dtensor_class()
    return list(ts) if cls is None else shards(ts, cls)


def _step_numbers(ts: list[tuple[int, list[int]]], devices: list[torch.device]) -> list[torch.Tensor]:
    """Each parameter's step number ``t + 1`` (its count ``t`` from ``ts``, ``[(t,
    positions)]``; its device from ``devices``) as the 0-D float32 tensor that torch's
    fused kernels read their bias corrections from: one tensor per count and device."""
    made: dict = {}
    out: list = [None] * len(devices)
    for t, pos in ts:
        for j in pos:
            dev = devices[j]
            s = made.get((t, dev))
            if s is None:
                s = made[(t, dev)] = torch.full((), float(t + 1), dtype=torch.float32, device=dev)
            out[j] = s
    return out


def step_values(hp: dict[str, Any], state: Any) -> dict[str, Any]:
    """The group's hyperparameters ``hp`` with the numbers injected in ``state`` (an
    :class:`muonfx.InjectHyperparamsState`) at the first count of its parameters: the
    values a lowered step computes with."""
    count = state.count
    counts = [t for t, _ in by_count(count, list(count.keys))] if isinstance(count, Counts) else [0]
    return {**hp, **hyperparam_values(state.hyperparams, counts[0] if counts else 0)}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def not_numbers(hp: dict[str, Any], flags: tuple = ()) -> str | None:
    """Why a lowering does not take the hyperparameters ``hp`` (``betas`` not two plain
    numbers, a name in ``flags`` not a bool, any other not a plain number: a schedule, a
    tensor), or None."""
    for n, v in hp.items():
        if n == "betas":
            if not (isinstance(v, (tuple, list)) and len(v) == 2 and all([_number(b) for b in v])):
                return f"betas {v!r} are not two numbers"
        elif n in flags:
            if not isinstance(v, bool):
                return f"{n} is not a bool"
        elif not _number(v):
            return f"{n} is {'a schedule' if callable(v) else type(v).__name__}"
    return None


def not_plain(params: list[torch.Tensor], dtensor: str, dtypes: tuple | None = None) -> str | None:
    """Why a lowering does not take ``params`` (a DTensor, saying ``dtensor``; a device
    without the kernel; a dtype not in ``dtypes``), or None."""
    for p in params:
        if is_dtensor(p):
            return dtensor
        if p.device.type not in _DEVICES:
            return f"parameters on {p.device.type}"
        if dtypes is not None and p.dtype not in dtypes:
            return f"parameters of {p.dtype}"
    return None


class FusedAdamW:
    """``torch._fused_adamw_`` for a group whose transform is :func:`muonfx.adamw`.

    ``name`` is what ``print(opt.plan)`` shows. :meth:`why_not` is the rule (a reason
    where it does not apply, checked when the plan is built); :meth:`step` runs the
    kernel on the group's parameters, gradients and state buffers and returns the new
    state (the same buffers, the counts advanced).
    """

    name = "torch._fused_adamw_: AdamW's arithmetic in torch's fused kernel"

    @staticmethod
    def why_not(hp: dict[str, Any], params: list[torch.Tensor]) -> str | None:
        """None where the kernel computes the group's step, else the reason it does not."""
        for n, v in hp.items():
            if n == "betas":
                if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(b) for b in v)):
                    return f"betas {v!r} are not two numbers"
            elif n == "lr":
                if not (_number(v) or isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type == "cpu"):
                    return "lr is a schedule or a tensor off the CPU" if callable(v) else f"lr {type(v).__name__}"
            elif n in ("amsgrad", "maximize"):
                if not isinstance(v, bool):
                    return f"{n} is not a bool"
            elif not _number(v):
                return f"{n} is {'a schedule' if callable(v) else type(v).__name__}"
        for lp in _locals(params):
            if lp.device.type not in _DEVICES:
                return f"parameters on {lp.device.type}"
            if lp.dtype not in _DTYPES:
                return f"parameters of {lp.dtype}"
        return None

    @staticmethod
    def ready(state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], keys: tuple,
              memo: dict | None = None) -> str | None:
        """None where this step's gradients and state buffers are what the kernel takes
        (each of its parameter's dtype and device, dense), else the reason: the step then
        runs the chain (a rule on this step's tensors). ``memo`` (the group plan's): the
        state's buffers as the kernel reads them, kept while the state and the parameters
        are the same objects (the kernel writes in place), so a step reads them once."""
        hyper = getattr(state, "hyperparams", None)
        inner = getattr(state, "inner_state", None)
        adam = inner.get("adam") if isinstance(inner, dict) else None
        if hyper is None or adam is None or not isinstance(getattr(adam, "count", None), Counts):
            return "the state is not AdamW's"
        if any([callable(v) and not isinstance(v, torch.Tensor) for v in hyper.values()]):
            return "a schedule in the state"
        try:
            bufs = _buffers(adam, params, keys, memo)
        except (KeyError, TypeError, AttributeError):
            return "the moments do not match the parameters"
        if bufs is None:
            return "moments differ from their parameters in dtype, device, shape or strides"
        if [(g.dtype, g.device, g.shape, g.stride()) for g in _locals(grads)] != bufs.sig:
            return "gradients differ from their parameters in dtype, device, shape or strides"
        return None

    @staticmethod
    def check(factory: Callable, hp: dict[str, Any], state: Any) -> dict[str, Any]:
        """The hyperparameter values of this step (the group's ``hp`` with the state's
        injected numbers), checked as the chain checks them: the same errors, raised
        before anything is written. The factory is not called: its numbers are checked
        by the rules of :mod:`muonfx.hyperparams` (the ones it checks them by: betas in
        range, lr, eps and weight decay finite and ``>= 0``) and the rest of what it
        takes (two betas, ``amsgrad`` and ``maximize`` booleans) by :meth:`why_not` when
        the plan was built."""
        vals = step_values(hp, state)
        kept = getattr(state.inner_state["adam"], "nu_max", None)
        if vals.get("amsgrad") and (kept is None or not kept.keys()):
            raise ValueError(AMSGRAD_WITHOUT_STATE)  # the chain's error, before anything is written
        return vals

    @staticmethod
    def step(state: Any, vals: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
             keys: tuple, memo: dict | None = None) -> Any:
        """Run the kernel (in place) and return the new state."""
        inner = state.inner_state
        adam = inner["adam"]
        bufs = _buffers(adam, params, keys, memo)
        amsgrad, maximize = bool(vals.get("amsgrad", False)), bool(vals.get("maximize", False))
        lx = bufs.maxs() if amsgrad else []
        b1, b2 = vals["betas"]
        lr = vals["lr"]
        # torch passes a Python lr as a float and a CPU tensor lr as it is
        lr = lr if isinstance(lr, torch.Tensor) else float(lr)
        lg = _locals(grads)
        ls = _step_numbers(by_count(adam.count, list(keys), "adam state (count)"), bufs.devices)
        for idx, (lp, lm, lv) in bufs.groups:
            one = idx is None  # every tensor in one (device, dtype): the lists as they are
            pick = (lambda xs: xs) if one else (lambda xs: [xs[i] for i in idx] if xs else [])  # noqa: E731
            torch._fused_adamw_(lp, pick(lg), lm, lv, pick(lx), pick(ls), amsgrad=amsgrad, lr=lr,
                                beta1=float(b1), beta2=float(b2), weight_decay=float(vals["weight_decay"]),
                                eps=float(vals["eps"]), maximize=maximize, grad_scale=None, found_inf=None)
        new_adam = adam._replace(count=advance(adam.count))
        injected = {n: vals[n] for n in state.hyperparams}
        return state._replace(count=advance(state.count), hyperparams=injected,
                              inner_state={**inner, "adam": new_adam})


class _Buffers:
    """The local parameters and moments of a fused AdamW group as the kernel takes them,
    by (device, dtype), and each parameter's ``(dtype, device, shape, strides)`` (what its
    gradient must have: the kernel reads its tensors as flat memory, element by element)."""

    def __init__(self, adam: Any, params: list[torch.Tensor], keys: tuple) -> None:
        self.adam, self.keys, self.ids = adam, keys, [id(p) for p in params]
        lp, lm, lv = _locals(params), _locals(_leaves(adam.mu, keys)), _locals(_leaves(adam.nu, keys))
        self.sig = [(p.dtype, p.device, p.shape, p.stride()) for p in lp]
        self.ok = all([(m.dtype, m.device, m.shape, m.stride()) == sg == (v.dtype, v.device, v.shape, v.stride())
                       for m, v, sg in zip(lm, lv, self.sig)])
        self.devices = [p.device for p in lp]
        parts = _groups(lp)
        if len(parts) == 1:
            self.groups = [(None, (lp, lm, lv))]
        else:
            self.groups = [(idx, ([lp[i] for i in idx], [lm[i] for i in idx], [lv[i] for i in idx]))
                           for idx in parts.values()]
        self._maxs: list | None = None

    def fits(self, adam: Any, params: list[torch.Tensor], keys: tuple) -> bool:
        """Whether these are still the buffers of ``adam`` for ``params``."""
        return (adam.mu is self.adam.mu and adam.nu is self.adam.nu and getattr(adam, "nu_max", None) is
                getattr(self.adam, "nu_max", None) and keys == self.keys and [id(p) for p in params] == self.ids)

    def maxs(self) -> list[torch.Tensor]:
        """The local running maxima (amsgrad), in the order of the first group."""
        if self._maxs is None:
            self._maxs = _locals(_leaves(self.adam.nu_max, self.keys))
        return self._maxs


def _buffers(adam: Any, params: list[torch.Tensor], keys: tuple, memo: dict | None) -> _Buffers | None:
    """The group's :class:`_Buffers` (the memo's where they still fit); None where a moment
    differs from its parameter in dtype, device or shape."""
    bufs = memo.get("adamw") if memo is not None else None
    if bufs is None or not bufs.fits(adam, params, keys):
        bufs = _Buffers(adam, params, keys)
        if memo is not None:
            memo["adamw"] = bufs
    return bufs if bufs.ok else None


def _groups(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Positions of ``tensors`` by (device, dtype), in order (the kernel takes one of each)."""
    out: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.device, t.dtype), []).append(i)
    return out


#: factory -> (its kernel, a condition on the hyperparameters or None): the chains the
#: plan lowers, by the factory the group was built with (:func:`register`)
KERNELS: dict[Callable, tuple[type, Callable[[dict], str | None] | None]] = {}


def register(factory: Callable, kernel: type, when: Callable[[dict], str | None] | None = None) -> None:
    """Declare that groups built with ``factory`` compute ``kernel``'s arithmetic (with
    the state layout it reads) wherever ``when(hp)`` returns None (else the reason it
    does not). For presets whose transform is, for some hyperparameters, exactly a chain
    with a kernel (FSDPMuonOptimizer's AdamW without gradient accumulation)."""
    KERNELS[factory] = (kernel, when)


def lowering(factory: Callable, hp: dict[str, Any], params: list[torch.Tensor]) -> tuple[type | None, str]:
    """``(kernel, why)``: the fused kernel that computes the group's step, or ``(None,
    why not)``."""
    kernel, when = KERNELS.get(factory, (None, None))
    if kernel is None:
        return None, ""
    reason = when(hp) if when is not None else None
    if reason is None:
        reason = kernel.why_not(hp, params)
    if reason is not None:
        return None, reason
    return kernel, kernel.name


register(adamw, FusedAdamW)
