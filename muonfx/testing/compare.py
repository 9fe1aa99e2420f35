"""Comparing trees of updates and states, on :mod:`muonfx.tree` (the conformance laws' tools).

:func:`tree_diff` says where two trees first differ (structure, keys, shapes, dtypes,
values, with a tolerance or bit for bit); :func:`snapshot` copies a tree's tensors;
:func:`tensor_paths` lists every tensor with its path.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from tensordict import TensorDictBase
from torch.utils import _pytree as pytree

from .. import tree
from ..core import key_str, td_items
from ..counts import Counts, values_of
from ..wrappers import InjectHyperparamsState

__all__ = ["snapshot", "tree_diff", "values_differ", "tensor_paths", "drop_hyperparams", "kind", "tensor_str",
           "td_leaves"]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def td_leaves(td: TensorDictBase) -> dict[str, Any]:
    """``{dotted key: leaf}`` of a TensorDict."""
    ks, vs = td_items(td)
    return {key_str(k): v for k, v in zip(ks, vs)}


def snapshot(obj: Any) -> Any:
    """A copy of a state/updates tree with every tensor cloned (other leaves shared)."""
    leaves, spec = tree.flatten(obj)
    out = []
    for leaf in leaves:
        if isinstance(leaf, TensorDictBase):
            out.append(leaf.clone())
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf.clone())
        else:
            out.append(leaf)
    return tree.unflatten(out, spec)


def kind(x: Any) -> str:
    if isinstance(x, TensorDictBase):
        return "a TensorDict"
    if isinstance(x, torch.Tensor):
        return f"a {tensor_str(x)} tensor"
    return f"a {type(x).__name__}"


def tensor_str(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def values_differ(a: torch.Tensor, b: torch.Tensor, mode: str, rtol: float, atol: float) -> str | None:
    """``None`` if equal under ``mode``, else a short description of the difference."""
    if a.numel() == 0:
        return None
    if mode == "bitwise" and a.is_floating_point():
        view = _INT_VIEW.get(a.element_size())
        if view is not None and torch.equal(a.contiguous().view(view), b.contiguous().view(view)):
            return None
    elif not a.is_floating_point() and not a.is_complex():
        if torch.equal(a, b):
            return None
    elif mode == "close" and (rtol or atol):
        if bool(torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True).all()):
            return None
    else:  # exact: equal values, NaNs in the same places (-0.0 == 0.0)
        nan_a, nan_b = a.isnan(), b.isnan()
        if torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)):
            return None
    if a.is_floating_point():
        da, db = a.double(), b.double()
        both_nan = da.isnan() & db.isnan()
        bad = ~((da == db) | both_nan)
        if mode == "bitwise":
            bad = bad | ((da == db) & (torch.signbit(da) != torch.signbit(db)))
        diff = (da - db).abs().masked_fill(both_nan, 0).nan_to_num(nan=float("inf"))
        return (f"{int(bad.sum())} of {a.numel()} values differ (largest difference "
                f"{diff.max().item():.3g})")
    return f"{int((a != b).sum())} of {a.numel()} values differ"


def _spec_diff(a: pytree.TreeSpec, b: pytree.TreeSpec, path: str, xa: Any, xb: Any) -> str | None:
    """Where two tree structures first differ (walking both specs and the trees)."""
    if a.type is not b.type:
        return f"{path}: {kind(xa)} vs {kind(xb)}"
    if a.type is dict:
        if list(a.context) != list(b.context):
            return f"{path}: dict keys {list(a.context)} vs {list(b.context)}"
        subs = [(f"{path}[{k!r}]", xa[k], xb[k]) for k in a.context]
    elif a.type is pytree.namedtuple:
        if type(xa) is not type(xb):
            return f"{path}: {kind(xa)} vs {kind(xb)}"
        subs = [(f"{path}.{f}", x, y) for f, x, y in zip(xa._fields, xa, xb)]
    elif a.type in (tuple, list):
        if len(xa) != len(xb):
            return f"{path}: a {type(xa).__name__} of length {len(xa)} vs {len(xb)}"
        subs = [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(xa, xb))]
    else:
        subs = []
    if a.num_children != b.num_children:
        return f"{path}: {kind(xa)} vs {kind(xb)}"
    for (p, x, y), ca, cb in zip(subs, a.children_specs, b.children_specs):
        d = _spec_diff(ca, cb, p, x, y)
        if d:
            return d
    return None


def _leaf_diff(a: Any, b: Any, path: str, mode: str, rtol: float, atol: float) -> str | None:
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        if not (isinstance(a, TensorDictBase) and isinstance(b, TensorDictBase)):
            return f"{path}: {kind(a)} vs {kind(b)}"
        la, lb = td_leaves(a), td_leaves(b)
        if set(la) != set(lb):
            return (f"{path}: TensorDict keys differ (only in the first: {sorted(set(la) - set(lb))}, "
                    f"only in the second: {sorted(set(lb) - set(la))})")
        if tuple(a.batch_size) != tuple(b.batch_size):
            return f"{path}: batch size {list(a.batch_size)} vs {list(b.batch_size)}"
        for k in la:
            d = _leaf_diff(la[k], lb[k], f"{path}[{k}]", mode, rtol, atol)
            if d:
                return d
        return None
    if isinstance(a, Counts) or isinstance(b, Counts):
        if not (isinstance(a, Counts) and isinstance(b, Counts)):
            return f"{path}: {kind(a)} vs {kind(b)}"
        ca, cb = dict(zip(a.keys, values_of(a))), dict(zip(b.keys, values_of(b)))
        if set(ca) != set(cb):
            return (f"{path}: counted keys differ (only in the first: {sorted(key_str(k) for k in set(ca) - set(cb))}"
                    f", only in the second: {sorted(key_str(k) for k in set(cb) - set(ca))})")
        if mode != "structure":
            for k in ca:
                if ca[k] != cb[k]:
                    return f"{path}[{key_str(k)}]: count {ca[k]} vs {cb[k]}"
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {kind(a)} vs {kind(b)}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {tensor_str(a)} vs {tensor_str(b)}"
        if mode == "structure":
            return None
        d = values_differ(a, b, mode, rtol, atol)
        return f"{path}: {d}" if d else None
    if type(a) is not type(b):
        return f"{path}: {kind(a)} vs {kind(b)}"
    if mode == "structure" or not isinstance(a, _PLAIN):
        return None  # scalars: only their type is structure; other objects are not compared
    if isinstance(a, float) and mode == "close" and (rtol or atol):
        same = math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or (math.isnan(a) and math.isnan(b))
    elif isinstance(a, float):
        same = a == b or (math.isnan(a) and math.isnan(b))
    else:
        same = a == b
    return None if same else f"{path}: {a!r} vs {b!r}"


def tree_diff(a: Any, b: Any, path: str, mode: str = "exact", rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """The first difference between two trees, or ``None``.

    ``mode``: ``"structure"`` (containers, keys, tensor shapes/dtypes, scalar types),
    ``"exact"`` (also values; NaN equals NaN), ``"close"`` (values within rtol/atol)
    or ``"bitwise"`` (bit patterns).
    """
    la, sa = pytree.tree_flatten(a, is_leaf=tree._leaf)  # pytree's specs: where they differ is named
    lb, sb = pytree.tree_flatten(b, is_leaf=tree._leaf)
    d = _spec_diff(sa, sb, path, a, b) if sa != sb else None
    if d:
        return d
    if sa != sb:
        return f"{path}: {kind(a)} vs {kind(b)}"
    for (p, x), y in zip(tree.paths(a), lb):
        where = path + "".join(f"[{n}]" if n.isdigit() else f".{n}" for n in p)
        d = _leaf_diff(x, y, where, mode, rtol, atol)
        if d:
            return d
    return None


def tensor_paths(node: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``node`` with its path (TensorDict leaves as ``[key]``)."""
    for p, leaf in tree.paths(node):
        where = path + "".join(f"[{n}]" if n.isdigit() else f".{n}" for n in p)
        if isinstance(leaf, TensorDictBase):
            for k, v in td_leaves(leaf).items():
                yield f"{where}[{k}]", v
        elif isinstance(leaf, torch.Tensor):
            yield where, leaf


def drop_hyperparams(node: Any) -> Any:
    """``node`` with every ``InjectHyperparamsState.hyperparams`` replaced by ``None``."""
    def drop(x: Any) -> Any:
        return x._replace(hyperparams=None, inner_state=drop_hyperparams(x.inner_state))

    return pytree.tree_map(lambda x: drop(x) if isinstance(x, InjectHyperparamsState) else x, node,
                           is_leaf=lambda x: isinstance(x, (InjectHyperparamsState, TensorDictBase, Counts,
                                                            torch.Tensor)))

