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
* :func:`restrict`, :func:`split`, :func:`merge`, :func:`merge_parts`: the state of some
  parameters, and updated parts put back (a step where some parameters have no
  gradient, the pieces of a large group), key by key; :func:`owner` attributes an entry
  to its parameter.

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
           "merge_parts", "keyed_items"]


def is_keyed(x: Any) -> bool:
    """Whether ``x`` is a keyed node: a TensorDict or :class:`~muonfx.counts.Counts`."""
    return isinstance(x, (TensorDictBase, Counts))


def _leaf(x: Any) -> bool:
    return isinstance(x, (TensorDictBase, Counts, torch.Tensor))


class _Other(Exception):
    """A container :func:`_walk` does not know (registered with ``torch.utils._pytree``)."""


def _walk(x: Any, out: list) -> Any:
    """``x``'s leaves appended to ``out`` in ``torch.utils._pytree``'s order; returns the
    structure: None for a leaf, else ``(kind, type or keys, children)``."""
    t = type(x)
    if t is dict:
        keys = tuple(x)
        return ("d", keys, tuple([_walk(x[k], out) for k in keys]))
    if t is tuple or t is list:
        return ("t" if t is tuple else "l", len(x), tuple([_walk(v, out) for v in x]))
    if isinstance(x, (TensorDictBase, Counts, torch.Tensor)):
        out.append(x)
        return None
    if isinstance(x, tuple) and hasattr(t, "_fields"):  # a NamedTuple
        return ("n", t, tuple([_walk(v, out) for v in x]))
    if t in pytree.SUPPORTED_NODES:
        raise _Other
    out.append(x)
    return None


def _build(spec: Any, it: Any) -> Any:
    if spec is None:
        return next(it)
    kind, what, children = spec
    vals = [_build(c, it) for c in children]
    if kind == "d":
        return dict(zip(what, vals))
    if kind == "t":
        return tuple(vals)
    if kind == "l":
        return vals
    return what(*vals)


def flatten(state: Any) -> tuple[list[Any], Any]:
    """The leaves of ``state`` (keyed nodes, tensors, scalars), in order, and its
    structure (an opaque value that compares equal for equal structures). The leaves are
    ``torch.utils._pytree``'s (with keyed nodes and tensors as leaves); dicts, tuples,
    lists and NamedTuples are walked here (several times faster: a group in pieces walks
    its state a few times per piece), any other container by ``torch.utils._pytree``."""
    out: list = []
    try:
        return out, _walk(state, out)
    except _Other:
        return pytree.tree_flatten(state, is_leaf=_leaf)


def unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    """The state of structure ``spec`` (from :func:`flatten`) holding ``leaves``."""
    if isinstance(spec, pytree.TreeSpec):
        return pytree.tree_unflatten(list(leaves), spec)
    return _build(spec, iter(leaves))


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


def merge_parts(full: Any, parts: Sequence[Any]) -> Any:
    """``full`` with the entries of every part in ``parts`` (disjoint parts of it, same
    structure) replaced, in one pass over its keyed nodes: ``merge`` of each part in
    turn (the last part's scalars), at the cost of one merge however many parts there
    are (a group stepped in pieces puts its pieces back at once)."""
    if not parts:
        return full
    if len(parts) == 1:
        return merge(full, parts[0])
    fl, spec = flatten(full)
    cols = [flatten(p)[0] for p in parts]
    out = []
    for j, f in enumerate(fl):
        if not is_keyed(f):
            out.append(cols[-1][j])
            continue
        fk, fv = keyed_items(f)
        new: dict = {}
        for c in cols:
            new.update(zip(*keyed_items(c[j])))
        vals = [new.get(k, v) for k, v in zip(fk, fv)]
        out.append(from_values(fk, vals) if isinstance(f, Counts) else build(fk, vals))
    return unflatten(out, spec)


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
