"""tensordict's private layout, in one place: TensorDicts walked and made without a
Python call per leaf or node.

:func:`td_items` reads a plain TensorDict's ``_tensordict`` dicts directly; :func:`build`
makes nodes by ``object.__new__(TensorDict)`` and ``__dict__.update(_tensordict=...)``,
the attributes ``TensorDict._new_unsafe`` sets. Whether the installed tensordict has that
layout is checked once, at import (:data:`PRIVATE_LAYOUT`); where it has not, both go
through tensordict's public API (``keys``/``values``, the ``TensorDict`` constructor)
with the same results. No other muonfx module touches tensordict's private fields.

Checked against tensordict :data:`CHECKED_AGAINST` (``tests/test_compat.py`` compares the
private path with the public one on the installed version).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["Key", "td_items", "build", "PRIVATE_LAYOUT", "CHECKED_AGAINST"]

#: a (possibly nested) TensorDict key: a tuple of strings
Key = tuple[str, ...]

#: the tensordict versions whose private layout this module was checked against
CHECKED_AGAINST = ("0.15.3",)

_EMPTY = torch.Size([])


def _fast_nodes() -> bool:
    """Whether a TensorDict node can be made as this module makes it: the attributes
    ``TensorDict._new_unsafe`` gives a fresh, unlocked TensorDict, set directly (no
    per-node Python call). Checked once, against the tensordict installed."""
    try:
        made = TensorDict._new_unsafe({"x": torch.zeros(())}, batch_size=_EMPTY, nested=False)
    except Exception:  # noqa: BLE001 - another tensordict: its own constructor then
        return False
    return set(made.__dict__) == {"_tensordict", "_device", "_batch_size", "_td_dim_names"} and \
        type(made._tensordict) is dict


#: whether the installed tensordict has the layout above (decided once, at import); where it
#: has not, :func:`td_items` and :func:`build` go through tensordict's public API
PRIVATE_LAYOUT = _fast_nodes()
_new = object.__new__
_SELF = object()  # where build() keeps a nested dict's node while it makes the parents


def _node(d: dict) -> TensorDict:
    """A TensorDict (batch size ``[]``, no device) holding the dict ``d`` of leaves and
    child nodes as it is (no per-key validation; :data:`PRIVATE_LAYOUT` only)."""
    td = _new(TensorDict)
    td.__dict__.update(_tensordict=d, _device=None, _batch_size=_EMPTY, _td_dim_names=None)
    return td


def td_items(td: TensorDictBase) -> tuple[list[Key], list[Any]]:
    """Keys (tuples) and values of every leaf of ``td``, in its order, unchecked.

    A plain TensorDict's nested dicts are walked directly, depth first in insertion
    order (what ``td.items(include_nested=True, leaves_only=True)`` yields), with no
    Python call per leaf; other TensorDict types (and traced code, and a tensordict without
    :data:`PRIVATE_LAYOUT`) go through ``items``.
    """
    if type(td) is not TensorDict or not PRIVATE_LAYOUT or torch.compiler.is_compiling():
        return [((k,) if type(k) is str else tuple(k)) for k in td.keys(include_nested=True, leaves_only=True)], \
            list(td.values(include_nested=True, leaves_only=True))
    keys: list[Key] = []
    vals: list[Any] = []
    stack = [((), iter(td._tensordict.items()))]
    tensor = torch.Tensor
    while stack:
        prefix, it = stack[-1]
        for k, v in it:
            if type(v) is TensorDict:
                stack.append((prefix + (k,), iter(v._tensordict.items())))
                break
            if not isinstance(v, tensor) and isinstance(v, TensorDictBase):
                # a lazy stack, a tensorclass: tensordict's own walk
                ks, vs = td_items(v)
                keys.extend([prefix + (k,) + kk for kk in ks])
                vals.extend(vs)
                continue
            keys.append(prefix + (k,))
            vals.append(v)
        else:
            stack.pop()
    return keys, vals


def build(keys: Sequence[Key], tensors: Sequence[torch.Tensor]) -> TensorDict:
    """A new TensorDict (batch size ``[]``) with ``tensors`` at the (nested) ``keys``.

    Tensors at distinct keys go in as they are, nested nodes made at the first key under
    them (the order of ``TensorDict(dict(zip(keys, tensors)), batch_size=[])``), with no
    Python call per key; anything else (numbers, repeated keys, traced code) goes
    through TensorDict's own constructor and its checks (as everything does where the
    installed tensordict lacks :data:`PRIVATE_LAYOUT`).
    """
    if not PRIVATE_LAYOUT or torch.compiler.is_compiling():
        return TensorDict(dict(zip(keys, tensors)), batch_size=[])
    root: dict = {}
    nodes = [root]
    flat = True
    for k, t in zip(keys, tensors):
        if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
            return TensorDict(dict(zip(keys, tensors)), batch_size=[])
        if len(k) == 1:
            if k[0] in root:
                return TensorDict(dict(zip(keys, tensors)), batch_size=[])
            root[k[0]] = t
            continue
        flat = False
        d = root
        for part in k[:-1]:
            child = d.get(part)
            if child is None:
                child = d[part] = {}
                nodes.append(child)
            elif type(child) is not dict:
                return TensorDict(dict(zip(keys, tensors)), batch_size=[])
            d = child
        if k[-1] in d:
            return TensorDict(dict(zip(keys, tensors)), batch_size=[])
        d[k[-1]] = t
    if flat:
        return _node(root)
    td = None
    for d in reversed(nodes):  # (_node, inline: no Python call per node)
        for name, v in d.items():
            if type(v) is dict:
                d[name] = v[_SELF]
        td = _new(TensorDict)
        td.__dict__.update(_tensordict=d, _device=None, _batch_size=_EMPTY, _td_dim_names=None)
        if d is not root:
            d[_SELF] = td
    for d in nodes[1:]:
        del d[_SELF]
    return td

