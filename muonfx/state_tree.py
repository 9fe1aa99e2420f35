"""Walk a transform's state: per-parameter views, subsets and merges.

A state is a tree of NamedTuples, dicts, tuples, TensorDicts and scalars. Its
TensorDicts are keyed by parameter keys (per-parameter tensors); everything else
(counters, flags) is a *scalar* shared by the parameters of the subtree it lives in.

* :func:`flatten_per_param` gives, for each parameter key, a flat
  ``{"momentum.mu": tensor, "count": 3, ...}`` dict (the torch.optim state format);
* :func:`unflatten_per_param` rebuilds a state of the same structure from such dicts,
  checking everything before it returns;
* :func:`restrict` / :func:`merge` take the sub-state of some parameters and put an
  updated sub-state back (the adapter uses them for parameters without gradients).

Wrapper fields named ``inner_state``/``inner_states`` are left out of the flat names,
and ``InjectHyperparamsState.hyperparams`` is not per-parameter state (it lives in the
optimizer's ``param_groups``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDictBase

from .base import Key, build, key_str
from .wrappers import InjectHyperparamsState

__all__ = ["flatten_per_param", "unflatten_per_param", "restrict", "split", "merge", "frozen_scalars", "state_tensors", "scalars_per_param",
           "with_scalars", "same_scalars", "own_scalars"]

_ELIDED = ("inner_state", "inner_states")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _children(node: Any, elide: bool = True) -> Iterator[tuple[str, Any]]:
    if _is_namedtuple(node):
        for f in node._fields:
            if isinstance(node, InjectHyperparamsState) and f == "hyperparams":
                continue
            yield ("" if elide and f in _ELIDED else f), getattr(node, f)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield str(k), v
    elif isinstance(node, (tuple, list)):
        for i, v in enumerate(node):
            yield str(i), v


def _join(path: str, name: str) -> str:
    return name if not path else (path if not name else f"{path}.{name}")


def _is_container(node: Any) -> bool:
    return isinstance(node, (tuple, list, dict)) and not isinstance(node, TensorDictBase)


def _td_keys(td: TensorDictBase) -> list[Key]:
    return [k if isinstance(k, tuple) else (k,) for k in td.keys(include_nested=True, leaves_only=True)]


def _owner(key: Key, params: "set[Key] | dict[Key, Any]") -> Key | None:
    """The parameter a state entry keyed ``key`` belongs to: ``key`` itself or its longest
    prefix among ``params`` (:func:`muonfx.blockwise` keys its blocks' state
    ``(*key, "block<i>")``); None for an entry of no parameter in ``params``."""
    for i in range(len(key), 0, -1):
        if key[:i] in params:
            return key[:i]
    return None


def _entry_name(path: str, key: Key, owner: Key) -> str:
    """The flat name of a TensorDict entry at ``path`` keyed ``key`` in its owner's dict:
    ``path`` for the owner's own entry, ``path.block0`` for an entry keyed under it."""
    return _join(path, ".".join(str(p) for p in key[len(owner):]))


def _owners(scope: set, params: "set[Key] | dict[Key, Any]") -> set:
    """The parameters of a scalar's scope (the entry keys of its subtree)."""
    return {o for o in (_owner(k, params) for k in scope) if o is not None}


def _scan(node: Any, path: str, out_td: list, out_scalar: list, elide: bool = True) -> set:
    """Collect (path, td) and (path, value, scope) entries; return the subtree's keys."""
    if isinstance(node, TensorDictBase):
        out_td.append((path, node))
        return set(_td_keys(node))
    if _is_container(node):
        keys: set = set()
        pending_start = len(out_scalar)
        for name, child in _children(node, elide):
            keys |= _scan(child, _join(path, name), out_td, out_scalar, elide)
        if keys:
            for i in range(pending_start, len(out_scalar)):
                if out_scalar[i][2] is None:
                    out_scalar[i] = (out_scalar[i][0], out_scalar[i][1], keys)
        return keys
    out_scalar.append((path, node, None))
    return set()


def _collect(state: Any) -> tuple[list, list, bool]:
    """TensorDict and scalar entries with their flat names.

    Wrapper fields (``inner_state``) are left out of the names unless that makes two
    names equal (e.g. an ``inject_hyperparams`` transform inside the adapter's own):
    then every name is spelled out in full.
    """
    for elide in (True, False):
        tds: list = []
        scalars: list = []
        _scan(state, "", tds, scalars, elide)
        paths = [p for p, _ in tds] + [p for p, _, _ in scalars]
        if len(set(paths)) == len(paths):
            return tds, scalars, elide
    dup = sorted({p for p in paths if paths.count(p) > 1})
    raise ValueError(f"state entries {dup} have the same flat name; give the parts distinct names with mfx.named_chain")


def flatten_per_param(state: Any, keys: list[Key]) -> dict[Key, dict[str, Any]]:
    """``{param key: {flat name: tensor or scalar}}`` for every key in ``keys``."""
    tds, scalars, _ = _collect(state)
    out: dict[Key, dict[str, Any]] = {k: {} for k in keys}
    for path, td in tds:
        for k in _td_keys(td):
            o = _owner(k, out)
            if o is not None:
                name = _entry_name(path, k, o)
                if name in out[o]:
                    raise ValueError(f"state entries of parameter {key_str(o)!r} have the same flat name {name!r}; "
                                     "give the parts distinct names with mfx.named_chain")
                out[o][name] = td.get(k)
    for path, value, scope in scalars:
        for k in (_owners(scope, out) if scope is not None else keys):
            out[k][path] = value
    return out


def scalars_per_param(state: Any, keys: list[Key]) -> dict[Key, dict[str, Any]]:
    """``{param key: {flat name: scalar}}``: the scalar entries (step counters, flags) of
    the subtrees each parameter is in; :func:`flatten_per_param` without the tensors.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.state_tree import scalars_per_param
        >>> p = TensorDict({"w": torch.zeros(2)}, [])
        >>> scalars_per_param(mfx.adamw().init(p), [("w",)])
        {('w',): {'adam.count': 0}}
    """
    _, scalars, _ = _collect(state)
    out: dict[Key, dict[str, Any]] = {k: {} for k in keys}
    for path, value, scope in scalars:
        for k in (_owners(scope, out) if scope is not None else keys):
            out[k][path] = value
    return out


def same_scalars(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``{flat name: scalar}`` dicts hold the same entries and values."""
    if a.keys() != b.keys():
        return False
    for n, v in a.items():
        o = b[n]
        if isinstance(v, torch.Tensor) or isinstance(o, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(o, torch.Tensor) and torch.equal(v, o)):
                return False
        elif v != o:
            return False
    return True


def own_scalars(state: Any, keys: list[Key], flat: dict[Key, dict[str, Any]],
                names: dict[Key, str]) -> dict[Key, dict[str, Any]]:
    """The parameters whose scalars in ``flat`` (a checkpoint's per-parameter entries)
    differ from ``state``'s, with those scalars cast like ``state``'s: ``{key: {flat
    name: value}}`` (the adapter's per-parameter step counters)."""
    mine = scalars_per_param(state, keys)
    out = {}
    for k in keys:
        got = {n: _cast_like(v, flat[k][n], f"state {n!r} of {names[k]!r}") for n, v in mine[k].items()}
        if not same_scalars(got, mine[k]):
            out[k] = got
    return out


def with_scalars(state: Any, values: dict[str, Any]) -> Any:
    """``state`` with the scalar entries named in ``values`` (flat names, as
    :func:`scalars_per_param` gives them) replaced; TensorDicts are kept as they are."""
    _, _, elide = _collect(state)

    def fn(path: str, node: Any) -> Any:
        return node if isinstance(node, TensorDictBase) else values.get(path, node)

    return _rebuild(state, "", fn, elide)


def _cast_like(template: Any, value: Any, where: str) -> Any:
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(template.shape):
            raise ValueError(f"{where}: shape {tuple(value.shape)} does not match the expected {tuple(template.shape)}")
        return value.detach().to(dtype=template.dtype, device=template.device, copy=True)
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(template, bool):
        return bool(value)
    if isinstance(template, int):
        return int(value)
    if isinstance(template, float):
        return float(value)
    return value


def _rebuild(node: Any, path: str, fn: Callable[[str, Any], Any], elide: bool = True) -> Any:
    if isinstance(node, TensorDictBase):
        return fn(path, node)
    if _is_namedtuple(node):
        vals = []
        for f in node._fields:
            child = getattr(node, f)
            if isinstance(node, InjectHyperparamsState) and f == "hyperparams":
                vals.append(dict(child))
            else:
                vals.append(_rebuild(child, _join(path, "" if elide and f in _ELIDED else f), fn, elide))
        return type(node)(*vals)
    if isinstance(node, dict):
        return {k: _rebuild(v, _join(path, str(k)), fn, elide) for k, v in node.items()}
    if isinstance(node, (tuple, list)):
        return type(node)(_rebuild(v, _join(path, str(i)), fn, elide) for i, v in enumerate(node))
    return fn(path, node)


def unflatten_per_param(template: Any, keys: list[Key], flat: dict[Key, dict[str, Any]], names: dict[Key, str]) -> Any:
    """A state shaped like ``template`` with values from ``flat`` (see :func:`flatten_per_param`).

    Raises ``ValueError`` naming the parameter and entry for anything missing, extra
    or of the wrong shape; nothing is returned (or changed) unless all of it fits.
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
    _, scalars, elide = _collect(template)
    scopes = {path: scope for path, _, scope in scalars}
    params = set(keys)

    def entry(path: str, node: TensorDictBase, k: Key) -> Any:
        o = _owner(k, params)
        if o is None:
            raise ValueError(
                f"state entry {path!r} keyed {key_str(k)!r} belongs to no parameter: the per-parameter "
                "checkpoint format (torch.optim's) cannot hold it; key such state by parameter or keep it "
                "as a scalar")
        name = _entry_name(path, k, o)
        return _cast_like(node.get(k), flat[o][name], f"state {name!r} of {names[o]!r}")

    def fn(path: str, node: Any) -> Any:
        if isinstance(node, TensorDictBase):
            tks = _td_keys(node)
            return build(tks, [entry(path, node, k) for k in tks])
        scope = scopes.get(path)
        owners = _owners(scope, params) if scope is not None else params
        holders = [k for k in keys if k in owners]
        if not holders:
            return node
        return _cast_like(node, flat[holders[0]][path], f"state {path!r}")

    return _rebuild(template, "", fn, elide)


def restrict(state: Any, keep: set) -> Any:
    """The sub-state of the parameters in ``keep`` (TensorDicts filtered; scalars kept).

    A TensorDict entry is kept when its key, or a prefix of it, is in ``keep``
    (:func:`muonfx.blockwise` keeps its blocks' state at ``(*key, "block<i>")``).
    """
    return split(state, [keep])[0]


def split(state: Any, groups: list[set]) -> list[Any]:
    """The sub-states of several disjoint sets of parameters, in one pass over the
    state's TensorDicts: ``split(state, gs)[i]`` is :func:`restrict` ``(state, gs[i])``
    (an entry goes to the set holding its key, or a prefix of it). The sub-states share
    ``state``'s tensors and scalars."""
    where = {k: i for i, g in enumerate(groups) for k in g}
    n = len(groups)

    def owner(key: Key) -> int | None:
        for i in range(len(key), 0, -1):
            g = where.get(key[:i])
            if g is not None:
                return g
        return None

    def walk(node: Any) -> list[Any]:
        if isinstance(node, TensorDictBase):
            keys: list[list] = [[] for _ in range(n)]
            vals: list[list] = [[] for _ in range(n)]
            for k in _td_keys(node):
                g = owner(k)
                if g is not None:
                    keys[g].append(k)
                    vals[g].append(node.get(k))
            return [build(ks, vs) for ks, vs in zip(keys, vals)]
        if _is_namedtuple(node):
            cols = [[dict(v)] * n if isinstance(node, InjectHyperparamsState) and f == "hyperparams" else walk(v)
                    for f, v in zip(node._fields, node)]
            return [type(node)(*(c[i] for c in cols)) for i in range(n)]
        if isinstance(node, dict):
            cols = {k: walk(v) for k, v in node.items()}
            return [{k: c[i] for k, c in cols.items()} for i in range(n)]
        if isinstance(node, (tuple, list)):
            cols = [walk(v) for v in node]
            return [type(node)(c[i] for c in cols) for i in range(n)]
        return [node] * n

    return walk(state)


def frozen_scalars(state: Any) -> Any:
    """``state``'s scalars (step counters, flags) in its structure, without per-parameter
    tensors, tensor scalars copied: ``merge(later, frozen_scalars(state))`` puts the
    scalars of ``state`` back into a later state, even one whose tensor scalars have
    been written in place since."""
    return _rebuild(restrict(state, set()), "",
                    lambda path, node: node.clone() if isinstance(node, torch.Tensor) else node)


def merge(full: Any, sub: Any, scalars: bool = True) -> Any:
    """``full`` with the entries present in ``sub`` (same structure) replaced; its
    scalars too, unless ``scalars=False`` (then only the per-parameter tensors)."""
    if isinstance(full, TensorDictBase):
        sub_keys = set(_td_keys(sub))
        ks = _td_keys(full)
        return build(ks, [sub.get(k) if k in sub_keys else full.get(k) for k in ks])
    if _is_namedtuple(full):
        return type(full)(*(merge(a, b, scalars) for a, b in zip(full, sub)))
    if isinstance(full, dict):
        return {k: merge(full[k], sub[k], scalars) for k in full}
    if isinstance(full, (tuple, list)):
        return type(full)(merge(a, b, scalars) for a, b in zip(full, sub))
    return sub if scalars else full


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor in ``state`` (TensorDict leaves and tensor scalars)."""
    tds: list = []
    scalars: list = []
    _scan(state, "", tds, scalars)
    out = [t for _, td in tds for t in td.values(include_nested=True, leaves_only=True)]
    out += [v for _, v, _ in scalars if isinstance(v, torch.Tensor)]
    return out


def describe(keys: list[Key]) -> list[str]:
    return [key_str(k) for k in keys]
