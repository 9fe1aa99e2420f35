"""Fused kernels the plan runs where a group's chain computes an arithmetic torch has a
kernel for: a rule of the plan, decided when the plan is built, never by timing.

The one lowering today: a group whose transform is :func:`muonfx.adamw` (its factory,
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

from ..._compat.dtensor import local
from ...presets import adamw
from ...transforms.adam import AMSGRAD_WITHOUT_STATE
from ...counts import Counts, advance, by_count
from ...wrappers import hyperparam_values

__all__ = ["FusedAdamW", "lowering", "register", "KERNELS"]

#: the devices whose fused AdamW kernel the plan runs
_DEVICES = ("cpu", "cuda")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
        for p in params:
            lp = local(p)
            if lp.device.type not in _DEVICES:
                return f"parameters on {lp.device.type}"
            if lp.dtype not in _DTYPES:
                return f"parameters of {lp.dtype}"
        return None

    @staticmethod
    def ready(state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], keys: tuple) -> str | None:
        """None where this step's gradients and state buffers are what the kernel takes
        (each of its parameter's dtype and device, dense), else the reason: the step then
        runs the chain (a rule on this step's tensors)."""
        hyper = getattr(state, "hyperparams", None)
        inner = getattr(state, "inner_state", None)
        adam = inner.get("adam") if isinstance(inner, dict) else None
        if hyper is None or adam is None or not isinstance(getattr(adam, "count", None), Counts):
            return "the state is not AdamW's"
        if any([callable(v) and not isinstance(v, torch.Tensor) for v in hyper.values()]):
            return "a schedule in the state"
        mu, nu = getattr(adam, "mu", None), getattr(adam, "nu", None)
        try:
            ms, vs = [mu[k] for k in keys], [nu[k] for k in keys]
        except (KeyError, TypeError):
            return "the moments do not match the parameters"
        for p, g, m, v in zip(params, grads, ms, vs):
            lp, lg, lm, lv = local(p), local(g), local(m), local(v)
            if not (lg.dtype == lm.dtype == lv.dtype == lp.dtype and lg.device == lm.device == lv.device == lp.device
                    and lg.layout == torch.strided and lg.shape == lp.shape == lm.shape == lv.shape):
                return "gradients or moments differ from their parameters in dtype, device or shape"
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
        count = state.count
        counts = [t for t, _ in by_count(count, list(count.keys))] if isinstance(count, Counts) else [0]
        vals = {**hp, **hyperparam_values(state.hyperparams, counts[0] if counts else 0)}
        kept = getattr(state.inner_state["adam"], "nu_max", None)
        if vals.get("amsgrad") and (kept is None or not kept.keys()):
            raise ValueError(AMSGRAD_WITHOUT_STATE)  # the chain's error, before anything is written
        return vals

    @staticmethod
    def step(state: Any, vals: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
             keys: tuple) -> Any:
        """Run the kernel (in place) and return the new state."""
        inner = state.inner_state
        adam = inner["adam"]
        ms, vs = [adam.mu[k] for k in keys], [adam.nu[k] for k in keys]
        amsgrad, maximize = bool(vals.get("amsgrad", False)), bool(vals.get("maximize", False))
        maxs = [adam.nu_max[k] for k in keys] if amsgrad else []
        b1, b2 = vals["betas"]
        lr = vals["lr"]
        # torch passes a Python lr as a float and a CPU tensor lr as it is
        lr = lr if isinstance(lr, torch.Tensor) else float(lr)
        steps_of = {}
        steps = []
        for t, pos in by_count(adam.count, list(keys), "adam state (count)"):
            for j in pos:
                dev = local(params[j]).device
                s = steps_of.get((t, dev))
                if s is None:
                    s = steps_of[(t, dev)] = torch.full((), float(t + 1), dtype=torch.float32, device=dev)
                steps.append((j, s))
        steps.sort(key=lambda x: x[0])
        lp = [local(p) for p in params]
        lg, lm, lv = [local(g) for g in grads], [local(m) for m in ms], [local(v) for v in vs]
        lx = [local(x) for x in maxs]
        ls = [s for _, s in steps]
        for (device, dtype), idx in _groups(lp).items():
            pick = lambda xs: [xs[i] for i in idx] if xs else []  # noqa: E731
            torch._fused_adamw_(pick(lp), pick(lg), pick(lm), pick(lv), pick(lx), pick(ls), amsgrad=amsgrad, lr=lr,
                                beta1=float(b1), beta2=float(b2), weight_decay=float(vals["weight_decay"]),
                                eps=float(vals["eps"]), maximize=maximize, grad_scale=None, found_inf=None)
        new_adam = adam._replace(count=advance(adam.count))
        injected = {n: vals[n] for n in state.hyperparams}
        return state._replace(count=advance(state.count), hyperparams=injected,
                              inner_state={**inner, "adam": new_adam})


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
