"""A transform's state per parameter: the torch.optim checkpoint format, on :mod:`muonfx.tree`.

* :func:`flatten_per_param` gives, for each parameter key, a flat
  ``{"momentum.mu": tensor, "count": 3, ...}`` dict (the torch.optim state format);
* :func:`unflatten_per_param` rebuilds a state of the same structure from such dicts,
  checking everything before it returns.

Names join the fields, dict keys and positions leading to an entry; wrapper fields named
``inner_state``/``inner_states`` are left out of them (unless that makes two names
equal), and ``InjectHyperparamsState.hyperparams`` is not per-parameter state (it lives
in the optimizer's ``param_groups``). A TensorDict entry belongs to the parameter of its
key (or of the longest prefix of it, :func:`muonfx.tree.owner`); a
:class:`~muonfx.counts.Counts` gives each parameter its own count (one entry, also for a
parameter whose blocks are counted apart, :func:`muonfx.blockwise`); any other scalar
(a flag, a count of the whole transform) belongs to every parameter of the subtree it
lives in. :func:`restrict`, :func:`merge` and :func:`split` are :mod:`muonfx.tree`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torch.utils import _pytree as pytree

from ..core import Key, build, key_str
from ..counts import Counts, from_values
from ..tree import flatten, keyed_items, merge, owner, restrict, split, unflatten
from ..wrappers import InjectHyperparamsState

__all__ = ["flatten_per_param", "unflatten_per_param", "restrict", "split", "merge"]

_ELIDED = ("inner_state", "inner_states")


def _leaf(x: Any) -> bool:
    return isinstance(x, (TensorDictBase, Counts, torch.Tensor))


def _entries(state: Any, elide: bool) -> list[tuple[str, Any, tuple, int]]:
    """``[(flat name, leaf, path, position)]`` of every leaf but the injected
    hyperparameters, in :func:`muonfx.tree.flatten`'s order (``path``: the names leading
    to it, in full; ``position``: its place among those leaves)."""
    out = []
    for i, (path, leaf) in enumerate(pytree.tree_flatten_with_path(state, is_leaf=_leaf)[0]):
        node, names, full, skip = state, [], [], False
        for e in path:
            if isinstance(e, pytree.GetAttrKey):
                name = e.name
                if isinstance(node, InjectHyperparamsState) and name == "hyperparams":
                    skip = True
                    break
                if not (elide and name in _ELIDED):
                    names.append(name)
                node = getattr(node, name)
            elif isinstance(e, pytree.MappingKey):
                name = str(e.key)
                names.append(name)
                node = node[e.key]
            else:
                name = str(e.idx)
                names.append(name)
                node = node[e.idx]
            full.append(name)
        if not skip:
            out.append((".".join(names), leaf, tuple(full), i))
    return out


def _named(state: Any) -> list[tuple[str, Any, tuple, int]]:
    """:func:`_entries`, with the wrapper fields elided unless two names would be equal
    (an ``inject_hyperparams`` transform inside the adapter's own): then spelled out."""
    for elide in (True, False):
        entries = _entries(state, elide)
        names = [n for n, leaf, _, _ in entries if not isinstance(leaf, TensorDictBase)] + \
                [n for n, leaf, _, _ in entries if isinstance(leaf, TensorDictBase)]
        if len(set(names)) == len(names):
            return entries
    dup = sorted({n for n in names if names.count(n) > 1})
    raise ValueError(f"state entries {dup} have the same flat name; give the parts distinct names with mfx.named_chain")


def _scopes(entries: list[tuple[str, Any, tuple, int]], params: set) -> list[set | None]:
    """For each scalar entry (not keyed), the parameters it belongs to: those with keyed
    entries in the nearest enclosing subtree that has any (None: every parameter)."""
    keyed = [(path, {o for o in (owner(k, params) for k in keyed_items(leaf)[0]) if o is not None})
             for _, leaf, path, _ in entries if isinstance(leaf, (TensorDictBase, Counts))]
    out: list[set | None] = []
    for _, leaf, path, _ in entries:
        if isinstance(leaf, (TensorDictBase, Counts)):
            out.append(None)
            continue
        scope = None
        for depth in range(len(path) - 1, -1, -1):
            under = set()
            for p, owners in keyed:
                if p[:depth] == path[:depth]:
                    under |= owners
            if under:
                scope = under
                break
        out.append(scope)
    return out


def _entry_name(name: str, key: Key, own: Key) -> str:
    """The flat name of a TensorDict entry named ``name`` keyed ``key`` in its owner's
    dict: ``name`` for the owner's own entry, ``name.block0`` for an entry keyed under it."""
    rest = ".".join(str(p) for p in key[len(own):])
    return name if not rest else (rest if not name else f"{name}.{rest}")


def flatten_per_param(state: Any, keys: list[Key]) -> dict[Key, dict[str, Any]]:
    """``{param key: {flat name: tensor or number}}`` for every key in ``keys``."""
    entries = _named(state)
    params = set(keys)
    out: dict[Key, dict[str, Any]] = {k: {} for k in keys}
    for (name, leaf, _, _), scope in zip(entries, _scopes(entries, params)):
        if isinstance(leaf, Counts):  # one count per parameter (its blocks', blockwise's, are the same)
            for k, v in zip(*keyed_items(leaf)):
                o = owner(k, params)
                if o is not None:
                    if out[o].get(name, v) != v:
                        raise ValueError(f"state {name!r} of parameter {key_str(o)!r} holds different counts for "
                                         "entries under its key")
                    out[o][name] = v
            continue
        if isinstance(leaf, TensorDictBase):
            for k, v in zip(*keyed_items(leaf)):
                o = owner(k, params)
                if o is None:
                    continue
                entry = _entry_name(name, k, o)
                if entry in out[o]:
                    raise ValueError(f"state entries of parameter {key_str(o)!r} have the same flat name {entry!r}; "
                                     "give the parts distinct names with mfx.named_chain")
                out[o][entry] = v
            continue
        for k in (keys if scope is None else [k for k in keys if k in scope]):
            out[k][name] = leaf
    return out


def _cast_like(template: Any, value: Any, where: str) -> Any:
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(template.shape):
            raise ValueError(f"{where}: shape {tuple(value.shape)} does not match the expected {tuple(template.shape)}")
        return value.detach().to(dtype=template.dtype, device=template.device, copy=True)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}: a tensor of shape {tuple(value.shape)} where a number is expected")
        value = value.item()
    if isinstance(template, bool):
        return bool(value)
    if isinstance(template, int):
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{where}: {value!r} where a whole number is expected")
        return int(value)
    if isinstance(template, float):
        return float(value)
    return value


#: the largest step count a checkpoint may hold (a count is a Python int; beyond 2^53 a
#: schedule's float arithmetic on it is no longer exact)
MAX_COUNT = 1 << 53


def _count(value: Any, where: str) -> int:
    """A saved step count: a whole number in ``[0, MAX_COUNT]`` (an int, a whole float, or
    a one-element tensor holding one), else ``ValueError`` naming ``where`` (a hand-edited ``-3``, ``True``,
    ``'5'`` or ``1e30`` is refused at load, not met later by a schedule)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()  # (torch.optim keeps its steps as float tensors)
    if type(value) is float and value.is_integer() and 0 <= value <= MAX_COUNT:
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{where}: {value!r} where a step count (a whole number from 0 to 2^53) is expected")
    return value


def unflatten_per_param(template: Any, keys: list[Key], flat: dict[Key, dict[str, Any]],
                        names: dict[Key, str]) -> Any:
    """A state shaped like ``template`` with values from ``flat`` (see :func:`flatten_per_param`).

    Raises ``ValueError`` naming the parameter and entry for anything missing, extra
    or of the wrong shape; nothing is returned (or changed) unless all of it fits.
    Counts stored as numbers (or one-element tensors) come back as :class:`Counts`.
    """
    expected = flatten_per_param(template, keys)
    for k in keys:
        got = flat.get(k, {})
        miss = sorted(set(expected[k]) - set(got))
        extra = sorted(set(got) - set(expected[k]))
        if miss or extra:
            raise ValueError(
                f"optimizer state for parameter {names[k]!r} does not match this optimizer's "
                f"transform: missing entries {miss}, unexpected entries {extra}"
            )
    entries = _named(template)
    params = set(keys)
    leaves, spec = flatten(template)
    out = list(leaves)
    for (name, leaf, _, pos), scope in zip(entries, _scopes(entries, params)):
        if isinstance(leaf, TensorDictBase):
            tks, tvs = keyed_items(leaf)
            vals = []
            for k, v in zip(tks, tvs):
                o = owner(k, params)
                if o is None:
                    raise ValueError(
                        f"state entry {name!r} keyed {key_str(k)!r} belongs to no parameter: the per-parameter "
                        "checkpoint format (torch.optim's) cannot hold it; key such state by parameter or keep it "
                        "as a scalar")
                entry = _entry_name(name, k, o)
                vals.append(_cast_like(v, flat[o][entry], f"state {entry!r} of {names[o]!r}"))
            out[pos] = build(tks, vals)
        elif isinstance(leaf, Counts):
            counts = []
            for k in leaf.keys:
                o = owner(k, params)
                counts.append(_count(flat[o][name], f"state {name!r} of {names[o]!r}"))
            out[pos] = from_values(leaf.keys, counts)
        else:
            holders = [k for k in keys if scope is None or k in scope]
            if holders:
                out[pos] = _cast_like(leaf, flat[holders[0]][name], f"state {name!r}")
    return unflatten(out, spec)
