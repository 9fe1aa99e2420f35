"""The adapter's checkpoints: torch's ``state_dict`` format over a functional state.

``state_dict()["state"][index]`` holds each parameter's slice of its group's
transform state, flattened to names like ``"momentum.mu"``, ``"adam.nu"``, ``"count"``
(see :mod:`muonfx.optim.checkpoint_names`); it loads with ``torch.load(..., weights_only=True)``.
A dtype among the group entries (``ns_dtype``, ``mu_dtype``) is saved by its name
(``"torch.bfloat16"``), since torch's state-dict utilities (``get_state_dict`` with
``full_state_dict=True`` or ``cpu_offload=True``) take only tensors, numbers, strings and
None, and read back as the dtype (a checkpoint holding the dtype itself loads too).
Loading checks everything first and changes nothing unless all of it fits.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ..core import build, key_str
from ..counts import Counts, values_of
from ..wrappers import hyperparam_values, signature
from .checkpoint_names import flatten_per_param, unflatten_per_param
from .groups import GroupRecord, serialisable, static_key

__all__ = ["torch_state", "param_groups_for_saving", "saved_dtype", "load"]


def torch_state(records: list[GroupRecord], param_groups: list[dict]) -> dict[torch.Tensor, dict[str, Any]]:
    """``{parameter: {flat name: tensor | number}}`` of every group (torch's ``opt.state``)."""
    out: dict[torch.Tensor, dict[str, Any]] = {}
    for rec, group in zip(records, param_groups):
        flat = flatten_per_param(rec.state, rec.keys)
        for p, k in zip(group["params"], rec.keys):
            out[p] = flat[k]
    return out


def param_groups_for_saving(groups: list[dict]) -> list[dict]:
    """Group entries that ``weights_only=True`` can load (a schedule function is left out),
    a dtype by its name (see the module's doc).

    Example::

        >>> param_groups_for_saving([{"lr": 0.02, "ns_dtype": torch.bfloat16, "schedule": abs}])
        [{'lr': 0.02, 'ns_dtype': 'torch.bfloat16'}]
    """
    return [{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in g.items() if serialisable(v)}
            for g in groups]


def saved_dtype(value: Any) -> Any:
    """A saved group entry as the optimizer holds it: a dtype's name (``"torch.float32"``,
    as :func:`param_groups_for_saving` writes it) as the dtype, anything else as it is.

    Example::

        >>> saved_dtype("torch.float32"), saved_dtype("original"), saved_dtype("torch.nn")
        (torch.float32, 'original', 'torch.nn')
    """
    if isinstance(value, str) and value.startswith("torch."):
        dtype = getattr(torch, value[len("torch."):], None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return value


def _check_value(gi: int, name: str, saved: Any, current: Any) -> None:
    """``ValueError`` naming the group and key when a saved hyperparameter cannot
    stand where the current one does (a string for a number, NaN, another length; an
    adapter setting, ``"compile"`` or ``"fused"``, other than None, True or False)."""
    if name in ("compile", "fused"):
        if not (saved is None or saved is True or saved is False):
            raise ValueError(f"param group {gi}: saved {name!r} is {saved!r}; it must be None, True or False")
        return
    if isinstance(current, bool) or not isinstance(current, (numbers.Real, tuple, list, torch.Tensor)):
        return
    if isinstance(current, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(current):
            raise ValueError(f"param group {gi}: saved {name!r} is {saved!r}; expected {len(current)} numbers")
        for i, (s, c) in enumerate(zip(saved, current)):
            _check_value(gi, f"{name}[{i}]", s, c)
        return
    if isinstance(saved, torch.Tensor) and saved.numel() == 1:
        saved = saved.item()
    if isinstance(saved, bool) or not isinstance(saved, numbers.Real) or not math.isfinite(float(saved)):
        raise ValueError(f"param group {gi}: saved {name!r} is {saved!r}, not a finite number")


def _check_hyperparams(gi: int, rec: GroupRecord, group: dict[str, Any]) -> None:
    """``ValueError`` naming the group (and the hyperparameter) unless the group's
    hyperparameters as they would be after loading are valid (the rules of
    :mod:`muonfx.hyperparams`) and build the group's transform."""
    count = rec.state.count
    try:
        values = hyperparam_values(rec.hyperparams(group), max(values_of(count), default=0)
                                   if isinstance(count, Counts) else count)
    except (TypeError, ValueError) as e:
        raise ValueError(f"param group {gi}: saved {e}") from None
    try:
        rec.factory(**values)
    except Exception as e:  # a factory may refuse its arguments any way it likes
        raise ValueError(f"param group {gi}: the saved hyperparameters do not build this group's transform: "
                         f"{type(e).__name__}: {e}") from e


def renamed_eps(saved: dict[str, Any], takes: Any) -> dict[str, Any]:
    """A saved param group with the epsilons renamed in 0.1 (``eps`` is the
    Newton-Schulz floor everywhere): ``ns_eps`` becomes ``eps`` and the old ``eps`` the
    factory's ``adamw_eps`` (moonlight) or ``row_eps`` (normuon); a group whose factory
    takes ``row_eps`` and that saved only ``eps`` (fsdp_muon) had the row epsilon there.

    Example::

        >>> renamed_eps({"eps": 1e-8, "ns_eps": 1e-7}, {"eps", "adamw_eps"})
        {'eps': 1e-07, 'adamw_eps': 1e-08}
    """
    if "ns_eps" in saved and "ns_eps" not in takes:
        out = {k: v for k, v in saved.items() if k not in ("eps", "ns_eps")}
        out["eps"] = saved["ns_eps"]
        if "eps" in saved:
            old = "adamw_eps" if "adamw_eps" in takes else "row_eps" if "row_eps" in takes else None
            if old is not None:
                out[old] = saved["eps"]
        return out
    if "row_eps" in takes and "row_eps" not in saved and "eps" in saved:
        out = {k: v for k, v in saved.items() if k != "eps"}
        out["row_eps"] = saved["eps"]
        return out
    return saved


def _template(rec: GroupRecord, group: dict[str, Any], saved: dict[str, Any]) -> Any:
    """The state whose layout the saved state must have: the group's own, or, where the
    saved hyperparameters select another transform (``amsgrad``, a state dtype), the
    state that transform makes (its layout is what was saved). Saved values that do not
    build a transform are left to :func:`_check_hyperparams`, which names them."""
    now = rec.hyperparams(group)
    then = rec.hyperparams({**group, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}})
    if static_key(then) == static_key(now):
        return rec.state
    try:
        with torch.no_grad():
            return rec.transform(then).init(build(rec.keys, list(group["params"])))
    except Exception:  # noqa: BLE001 (refused by name in _check_hyperparams)
        return rec.state


def load(records: list[GroupRecord], param_groups: list[dict], state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``records`` and ``param_groups``, or raise ``ValueError``
    saying what differs (group, parameter, entry) and change nothing.

    As torch's, a state dict loads between optimizers built with and without parameter
    names (``named_parameters()`` or ``parameters()``), both ways: a group without names
    takes the saved ones, a group with names keeps its own; where both have names they
    must be the same (muonfx's check that the checkpoint is this model's)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("optimizer state_dict must have 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(param_groups)}")
    saved_groups = [renamed_eps({k: saved_dtype(v) for k, v in g.items()}, signature(rec.factory).parameters)
                    for g, rec in zip(saved_groups, records)]
    new_states = []
    for gi, (rec, group, saved) in enumerate(zip(records, param_groups, saved_groups)):
        ids = list(saved["params"])
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"param group {gi}: state_dict has {len(ids)} parameters, this optimizer has {len(group['params'])}"
            )
        names = saved.get("param_names")
        mine = group.get("param_names")
        if names is not None and mine is not None and list(names) != list(mine):
            diff = [(a, b) for a, b in zip(names, mine) if a != b][:5]
            raise ValueError(f"param group {gi}: parameter names differ (saved, current): {diff}")
        if names is not None and len(names) != len(ids):
            raise ValueError(f"param group {gi}: state_dict has {len(names)} parameter names for {len(ids)} parameters")
        for k, v in saved.items():
            if (k in group or k in ("compile", "fused")) and k not in ("params", "param_names"):
                _check_value(gi, k, v, group.get(k))
        flat = {k: dict(state_dict["state"].get(pid, {})) for k, pid in zip(rec.keys, ids)}
        names_map = {k: key_str(k) for k in rec.keys}
        new_states.append(unflatten_per_param(_template(rec, group, saved), rec.keys, flat, names_map))
    for gi, (rec, group, saved) in enumerate(zip(records, param_groups, saved_groups)):
        _check_hyperparams(gi, rec, {**group, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}})
    # everything checked: now change things
    for rec, group, saved, state in zip(records, param_groups, saved_groups, new_states):
        for k, v in saved.items():
            if k not in ("params", "param_names"):
                group[k] = v
        if "param_names" in saved and "param_names" not in group:  # torch's rule: an unnamed group takes them
            group["param_names"] = list(saved["param_names"])
        hp = rec.hyperparams(group)
        rec.state = state._replace(hyperparams={n: hp[n] for n in state.hyperparams if n in hp})
