"""The one walker of state trees, on ``torch.utils._pytree``.

A transform's state is a tree of NamedTuples, tuples, lists and dicts whose leaves are
*keyed* nodes (TensorDicts of per-parameter tensors, :class:`~muonfx.counts.Counts` of
per-parameter counts) and *scalars* (numbers, flags, bare tensors: shared by every
parameter of the subtree they live in). Every muonfx function that walks a state goes
through here:

* :func:`flatten` / :func:`unflatten`: the leaves in order and the structure
  (``torch.utils._pytree`` with keyed nodes as leaves, so its cost does not grow with
  the number of parameters);
* :func:`paths`: each leaf with its path of field names, dict keys and positions;
* :func:`tensors`: every tensor of a state (TensorDict leaves included);
* :func:`restrict`, :func:`split`, :func:`merge`: the state of some parameters, and an
  updated part put back (a step where some parameters have no gradient, the pieces of a
  large group), key by key; :func:`owner` attributes an entry to its parameter.

Example::

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from muonfx import tree
    >>> from muonfx.counts import zeros
    >>> state = (zeros([("a",), ("b",)]), TensorDict({"a": torch.zeros(1), "b": torch.ones(1)}, []))
    >>> part = tree.restrict(state, {("b",)})
    >>> part[0].keys, list(part[1].keys())
    ((('b',),), ['b'])
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from tensordict import TensorDictBase
from torch.utils import _pytree as pytree

from .core import Key, build, td_items
from .counts import Counts, from_values, values_of

__all__ = ["is_keyed", "flatten", "unflatten", "paths", "tensors", "owner", "restrict", "split", "merge",
           "keyed_items"]


def is_keyed(x: Any) -> bool:
    """Whether ``x`` is a keyed node: a TensorDict or :class:`~muonfx.counts.Counts`."""
    return isinstance(x, (TensorDictBase, Counts))


def _leaf(x: Any) -> bool:
    return isinstance(x, (TensorDictBase, Counts, torch.Tensor))


def flatten(state: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of ``state`` (keyed nodes, tensors, scalars), in order, and its structure."""
    return pytree.tree_flatten(state, is_leaf=_leaf)


def unflatten(leaves: Sequence[Any], spec: pytree.TreeSpec) -> Any:
    """The state of structure ``spec`` holding ``leaves``."""
    return pytree.tree_unflatten(list(leaves), spec)


def _name(entry: Any) -> str:
    if isinstance(entry, pytree.GetAttrKey):
        return entry.name
    if isinstance(entry, pytree.MappingKey):
        return str(entry.key)
    if isinstance(entry, pytree.SequenceKey):
        return str(entry.idx)
    return str(entry)


def paths(state: Any) -> list[tuple[tuple[str, ...], Any]]:
    """``[(path, leaf)]``: every leaf with the names leading to it (NamedTuple fields, dict
    keys, positions in tuples and lists), in :func:`flatten`'s order."""
    flat, _ = pytree.tree_flatten_with_path(state, is_leaf=_leaf)
    return [(tuple([_name(e) for e in path]), leaf) for path, leaf in flat]


def keyed_items(node: Any) -> tuple[list[Key], list[Any]]:
    """The keys and values of a keyed node (a TensorDict's leaves, a Counts' counts)."""
    if isinstance(node, Counts):
        return list(node.keys), values_of(node)
    return td_items(node)


def tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of ``state``: TensorDict leaves, and tensors held as scalars."""
    out: list[torch.Tensor] = []
    for leaf in flatten(state)[0]:
        if isinstance(leaf, TensorDictBase):
            out.extend(td_items(leaf)[1])
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out


def owner(key: Key, params: "set | dict") -> Key | None:
    """The parameter a state entry keyed ``key`` belongs to: ``key`` itself or its longest
    prefix among ``params`` (:func:`muonfx.blockwise` keys its blocks' state
    ``(*key, "block<i>")``); None for an entry of no parameter in ``params``."""
    if key in params:
        return key
    for i in range(len(key) - 1, 0, -1):
        if key[:i] in params:
            return key[:i]
    return None


def _parts(node: Any, where: dict, n: int) -> list[Any]:
    """A keyed node cut by the owners of its keys: ``n`` nodes, the ``i``-th with the
    entries whose parameter ``where`` maps to ``i``."""
    keys, vals = keyed_items(node)
    ks: list[list] = [[] for _ in range(n)]
    vs: list[list] = [[] for _ in range(n)]
    for k, v in zip(keys, vals):
        g = where.get(k)
        if g is None:
            o = owner(k, where)
            g = None if o is None else where[o]
        if g is not None:
            ks[g].append(k)
            vs[g].append(v)
    if isinstance(node, Counts):
        if node.index is None:
            return [Counts(tuple(k), node.values) for k in ks]
        return [from_values(k, v) for k, v in zip(ks, vs)]
    return [build(k, v) for k, v in zip(ks, vs)]


def split(state: Any, groups: Sequence[Iterable[Key]]) -> list[Any]:
    """The states of several disjoint sets of parameters, in one pass over the keyed
    nodes: ``split(state, gs)[i]`` is :func:`restrict` ``(state, gs[i])``. The parts
    share ``state``'s tensors and scalars."""
    where = {k: i for i, g in enumerate(groups) for k in g}
    n = len(groups)
    leaves, spec = flatten(state)
    cols = [_parts(leaf, where, n) if is_keyed(leaf) else [leaf] * n for leaf in leaves]
    return [unflatten([c[i] for c in cols], spec) for i in range(n)]


def restrict(state: Any, keep: Iterable[Key]) -> Any:
    """The state of the parameters in ``keep``: keyed nodes cut to their entries (an
    entry is kept when its key, or a prefix of it, is in ``keep``); scalars as they are."""
    return split(state, [keep])[0]


def _merged(full: Any, sub: Any) -> Any:
    fk, fv = keyed_items(full)
    sk, sv = keyed_items(sub)
    if fk == sk:
        return sub
    new = dict(zip(sk, sv))
    vals = [new.get(k, v) for k, v in zip(fk, fv)]
    if isinstance(full, Counts):
        return from_values(fk, vals)
    return build(fk, vals)


def merge(full: Any, sub: Any, scalars: bool = True) -> Any:
    """``full`` with the entries present in ``sub`` (a part of it, same structure)
    replaced; its scalars too, unless ``scalars=False`` (then only the keyed entries)."""
    fl, spec = flatten(full)
    sl, _ = flatten(sub)
    out = []
    for f, s in zip(fl, sl):
        if is_keyed(f):
            out.append(_merged(f, s))
        else:
            out.append(s if scalars else f)
    return unflatten(out, spec)
