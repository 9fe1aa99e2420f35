"""Combinators: chain transforms, name them, route leaves to different transforms, and run
a transform on blocks of each matrix (:func:`blockwise`).

Predicates and label functions are called as ``fn(key, tensor)`` with ``key`` the
dotted name of the leaf (``"layers.0.weight"``, as in ``model.named_parameters()``)
and ``tensor`` the parameter (or, when ``update`` gets no params, the update).
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence, Union

import torch
from tensordict import TensorDictBase, is_leaf_nontensor

from ._compat.dtensor import is_dtensor
from .core import (GradientTransformation, Key, aligned, build, check_keys, key_str, leaves, leafwise_if,
                   takes_extra_args)

Predicate = Callable[[str, torch.Tensor], bool]
MaskSpec = Union[Predicate, TensorDictBase, Mapping[str, bool]]
LabelSpec = Union[Callable[[str, torch.Tensor], Hashable], TensorDictBase, Mapping[str, Hashable]]
SplitSizes = Union[int, Sequence[int]]

__all__ = ["chain", "named_chain", "masked", "mask_by_ndim", "partition", "MaskedState",
           "PartitionState", "resolve_labels", "blockwise", "SplitSizes"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after another; the state is the tuple of their states.

    ``chain()`` is the identity; ``chain(identity(), t)`` computes what ``t`` does.
    Leafwise (:func:`muonfx.leafwise`) when every transform is. Extra arguments of a
    call (``tx.update(u, s, p, **extra_args)``, see :mod:`muonfx.core.contract`) reach
    every transform that takes them; the others are called without.

    Example::

        >>> import muonfx as mfx
        >>> sgd_momentum = mfx.chain(mfx.momentum(0.9), mfx.scale_by_learning_rate(0.1))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, not a GradientTransformation")

    takes = [takes_extra_args(t) for t in transforms]

    def init_fn(params):
        return tuple(t.init(params) for t in transforms)

    def update_fn(updates, state, params=None, **extra_args):
        if len(state) != len(transforms):
            raise ValueError(f"chain: state has {len(state)} entries for {len(transforms)} transforms")
        new_state = []
        for t, s, x in zip(transforms, state, takes):
            updates, s = t.update(updates, s, params, **extra_args) if x else t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return leafwise_if(GradientTransformation(init_fn, update_fn), *transforms)


def named_chain(*named: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict ``{name: state}`` (addressable by name).

    Leafwise (:func:`muonfx.leafwise`) when every transform is; extra arguments as in
    :func:`chain`.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.named_chain(("momentum", mfx.momentum(0.9)), ("lr", mfx.scale_by_learning_rate(0.1)))
        >>> state = tx.init(TensorDict({"w": torch.zeros(3)}, []))
        >>> sorted(state)
        ['lr', 'momentum']
        >>> state["momentum"].mu["w"].shape
        torch.Size([3])
    """
    names = [n for n, _ in named]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"named_chain: duplicate names {dup}")
    for n, t in named:
        if not isinstance(n, str) or not isinstance(t, GradientTransformation):
            raise TypeError(f"named_chain takes (str, GradientTransformation) pairs, got ({n!r}, {type(t).__name__})")

    takes = [takes_extra_args(t) for _, t in named]

    def init_fn(params):
        return {n: t.init(params) for n, t in named}

    def update_fn(updates, state, params=None, **extra_args):
        if set(state) != set(names):
            raise ValueError(f"named_chain: state names {sorted(state)} differ from the chain's {names}")
        new_state = {}
        for (n, t), x in zip(named, takes):
            updates, new_state[n] = (t.update(updates, state[n], params, **extra_args) if x
                                     else t.update(updates, state[n], params))
        return updates, new_state

    return leafwise_if(GradientTransformation(init_fn, update_fn), *(t for _, t in named))


# ---------------------------------------------------------------------------
# routing leaves
# ---------------------------------------------------------------------------


def _lookup(spec: TensorDictBase | Mapping, key: Key) -> Any:
    if isinstance(spec, TensorDictBase):
        v = spec[key]
        return v.item() if isinstance(v, torch.Tensor) else v
    if key_str(key) in spec:
        return spec[key_str(key)]
    return spec[key]


def resolve_labels(spec: LabelSpec, keys: list[Key], tensors: list[torch.Tensor], what: str) -> list[Any]:
    """One label per leaf from a function ``(key, tensor) -> label`` or a TensorDict/mapping.

    A TensorDict or mapping must have an entry for every leaf (``ValueError`` naming
    the missing keys); extra entries are ignored, so a model-wide spec also serves a
    subset of the leaves (e.g. the parameters that received gradients).
    """
    if callable(spec) and not isinstance(spec, (TensorDictBase, Mapping)):
        return [spec(key_str(k), t) for k, t in zip(keys, tensors)]
    if isinstance(spec, TensorDictBase):
        # is_leaf_nontensor: string labels are NonTensorData, which plain leaves_only skips
        spec_keys = {key_str(k) for k in spec.keys(include_nested=True, leaves_only=True,
                                                   is_leaf=is_leaf_nontensor)}
    elif isinstance(spec, Mapping):
        spec_keys = {key_str(k) if isinstance(k, tuple) else k for k in spec}
    else:
        raise TypeError(f"{what} must be a function (key, tensor) -> value, a TensorDict or a mapping")
    missing = sorted(key_str(k) for k in keys if key_str(k) not in spec_keys)
    if missing:
        # Extra entries are allowed (a model-wide spec applied to a subset of leaves).
        raise ValueError(f"{what} has no entry for keys {missing}")
    return [_lookup(spec, k) for k in keys]


def _split(updates, params, spec, what):
    """Leaves of ``updates`` (and aligned params) with their labels."""
    keys, us = leaves(updates)
    ps = None
    if params is not None:
        check_keys(keys, params, "params")
        ps = [params.get(k) for k in keys]
    labels = resolve_labels(spec, keys, ps if ps is not None else us, what)
    return keys, us, ps, labels


def _sub(keys, tensors, pick):
    return build([k for k, p in zip(keys, pick) if p], [t for t, p in zip(tensors, pick) if p])


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state over the selected leaves."""

    inner_state: Any


def _picks(keys: list[Key], values: list[Any]) -> list[bool]:
    """The mask's values as bools; ``TypeError`` naming the key for a value that is not
    a bool (a multi-element tensor from ``lambda k, t: t > 0``, ``None`` from a predicate
    that forgot to return)."""
    out = []
    for k, m in zip(keys, values):
        if type(m) is bool:
            out.append(m)
        elif (isinstance(m, torch.Tensor) and m.numel() == 1
              or isinstance(m, numbers.Number) and not isinstance(m, complex)):
            out.append(bool(m))
        else:
            what = (f"a tensor of shape {tuple(m.shape)}" if isinstance(m, torch.Tensor)
                    else f"{m!r} (a {type(m).__name__})")
            raise TypeError(f"mask: the value for leaf {key_str(k)!r} is {what}, not a bool; a mask predicate "
                            "(key, tensor) -> bool must return one bool per leaf (e.g. t.ndim == 2)")
    return out


def masked(inner: GradientTransformation, mask: MaskSpec) -> GradientTransformation:
    """Apply ``inner`` only to the leaves selected by ``mask``; others pass through unchanged.

    ``mask`` is a predicate ``(key, tensor) -> bool``, a TensorDict of bools keyed
    like the params, or a mapping ``{dotted key: bool}``. Masked-out leaves get no
    state. With an all-false mask ``masked`` is the identity. Leafwise
    (:func:`muonfx.leafwise`) when ``inner`` is: the mask is decided leaf by leaf.
    Extra arguments of a call reach ``inner`` as in :func:`chain`.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.ones(2, 2), "b": torch.ones(2)}, [])
        >>> tx = mfx.masked(mfx.scale(0.0), lambda key, t: t.ndim == 2)
        >>> out, _ = tx.update(p, tx.init(p), p)
        >>> out["w"].sum().item(), out["b"].sum().item()
        (0.0, 2.0)
    """

    def init_fn(params):
        keys, ps = leaves(params, "params")
        pick = _picks(keys, resolve_labels(mask, keys, ps, "mask"))
        return MaskedState(inner.init(_sub(keys, ps, pick)))

    takes = takes_extra_args(inner)

    def update_fn(updates, state, params=None, **extra_args):
        keys, us, ps, labels = _split(updates, params, mask, "mask")
        pick = _picks(keys, labels)
        sub_p = _sub(keys, ps, pick) if ps is not None else None
        new_u, new_inner = inner.update(_sub(keys, us, pick), state.inner_state, sub_p, **(extra_args if takes else {}))
        out = [new_u.get(k) if p else u for k, u, p in zip(keys, us, pick)]
        return build(keys, out), MaskedState(new_inner)

    return leafwise_if(GradientTransformation(init_fn, update_fn), inner)


def mask_by_ndim(inner: GradientTransformation, ndim: int | set[int] | frozenset[int]) -> GradientTransformation:
    """:func:`masked` selecting leaves whose number of dims is ``ndim`` (an int or a set).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.mask_by_ndim(mfx.newton_schulz(), {2, 3, 4})   # matrices only
    """
    dims = {ndim} if isinstance(ndim, int) else set(ndim)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ValueError(f"mask_by_ndim: ndim must be non-negative ints, got {ndim!r}")
    return masked(inner, lambda key, t: t.ndim in dims)


class PartitionState(NamedTuple):
    """State of :func:`partition`: ``{label: inner state over that label's leaves}``."""

    inner_states: dict


def partition(transforms: Mapping[Hashable, GradientTransformation], labels: LabelSpec) -> GradientTransformation:
    """Route each leaf to the transform of its label.

    ``labels`` is a function ``(key, tensor) -> label``, a TensorDict of labels or a
    mapping ``{dotted key: label}``. A label with no transform raises ``ValueError``
    naming the leaves. Every transform is initialised (on its possibly empty share).
    Leafwise (:func:`muonfx.leafwise`) when every transform is: labels are decided
    leaf by leaf, and a transform whose share of a piece is empty still runs (its
    counters advance alike). Extra arguments of a call reach every transform as in
    :func:`chain`.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.partition(
        ...     {"muon": mfx.muon(), "adamw": mfx.adamw()},
        ...     lambda key, t: "muon" if t.ndim >= 2 else "adamw")
    """
    transforms = dict(transforms)
    for lbl, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"partition: transform for label {lbl!r} is a {type(t).__name__}")

    def _check(keys, lbls):
        unknown: dict[Any, list[str]] = {}
        for k, lbl in zip(keys, lbls):
            if lbl not in transforms:
                unknown.setdefault(lbl, []).append(key_str(k))
        if unknown:
            detail = "; ".join(f"label {lbl!r} for {ks}" for lbl, ks in unknown.items())
            raise ValueError(f"partition: no transform for {detail}; known labels {list(transforms)}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        lbls = resolve_labels(labels, keys, ps, "labels")
        _check(keys, lbls)
        return PartitionState({
            lbl: t.init(_sub(keys, ps, [x == lbl for x in lbls])) for lbl, t in transforms.items()
        })

    takes = {lbl: takes_extra_args(t) for lbl, t in transforms.items()}

    def update_fn(updates, state, params=None, **extra_args):
        keys, us, ps, lbls = _split(updates, params, labels, "labels")
        _check(keys, lbls)
        out: dict[Key, torch.Tensor] = {}
        new_states = {}
        for lbl, t in transforms.items():
            pick = [x == lbl for x in lbls]
            sub_p = _sub(keys, ps, pick) if ps is not None else None
            new_u, new_states[lbl] = t.update(_sub(keys, us, pick), state.inner_states[lbl], sub_p,
                                              **(extra_args if takes[lbl] else {}))
            for k, p in zip(keys, pick):
                if p:
                    out[k] = new_u.get(k)
        return build(keys, [out[k] for k in keys]), PartitionState(new_states)

    return leafwise_if(GradientTransformation(init_fn, update_fn), *transforms.values())


# ---------------------------------------------------------------------------
# blocks of a matrix (fused QKV, per head)
# ---------------------------------------------------------------------------


def _check_split(split_sizes: SplitSizes, who: str) -> None:
    if isinstance(split_sizes, bool) or not (
        (isinstance(split_sizes, int) and split_sizes > 0)
        or (isinstance(split_sizes, Sequence) and len(split_sizes) > 0
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in split_sizes))
    ):
        raise ValueError(f"{who}: split_sizes must be a positive int (block size) or a non-empty "
                         f"sequence of positive ints, got {split_sizes!r}")


def _block_sizes(key: Key, length: int, split_sizes: SplitSizes, what: str, who: str) -> list[int]:
    if isinstance(split_sizes, int):
        if length % split_sizes:
            raise ValueError(f"{who}: leaf {key_str(key)!r} has {length} {what}, not a multiple of "
                             f"the block size {split_sizes}")
        return [split_sizes] * (length // split_sizes)
    if sum(split_sizes) != length:
        raise ValueError(f"{who}: leaf {key_str(key)!r} has {length} {what}, but split_sizes "
                         f"{list(split_sizes)} sum to {sum(split_sizes)}")
    return list(split_sizes)


def _placed_like(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Give ``out`` the DTensor placements of ``ref`` (:func:`muonfx._compat.dtensor.is_dtensor`: no
    distributed import)."""
    if is_dtensor(ref) and tuple(out.placements) != tuple(ref.placements):
        out = out.redistribute(ref.device_mesh, ref.placements)
    return out


def blockwise(inner: GradientTransformation, split_sizes: SplitSizes, dim: int = 0) -> GradientTransformation:
    """Run ``inner`` on blocks of each matrix, as if every block were its own parameter.

    Each leaf's matrix view (2-D as is, 3-D ``[E, A, B]`` per matrix, 4-D+ as
    ``[out, rest]``) is split along its rows (``dim=0``) or columns (``dim=1``) into
    blocks of ``split_sizes`` (``torch.split``'s meaning: one block size that must divide
    the dim, or a list of sizes that must sum to it). ``inner`` sees a TensorDict of
    the blocks, keyed ``(*key, "block<i>")``, and its outputs are concatenated back::

        out = cat([inner(U_1), ..., inner(U_k)], dim)

    The state is ``inner``'s state over the blocks. Same-shape blocks are batched by the
    matrix transforms inside (one batched Newton-Schulz for all heads of all layers).
    On DTensors, blocks along a sharded dim are gathered first (correct, not fast);
    the output gets the input's placements back. Leafwise (:func:`muonfx.leafwise`) when
    ``inner`` is: a leaf's blocks are keyed under the leaf's own key. Extra arguments of
    a call reach ``inner`` as in :func:`chain`.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"qkv": torch.randn(12, 4)}, [])
        >>> tx = mfx.blockwise(mfx.scale_by_shape("match_rms_adamw"), 4)   # three 4 x 4 blocks
        >>> out, _ = tx.update(g, tx.init(g))
        >>> torch.allclose(out["qkv"], 0.4 * g["qkv"])
        True
    """
    from .core.view import batched_matrix
    from .transforms._matrix import matrix_dims  # (muonfx.transforms imports this module)

    _check_split(split_sizes, "blockwise")
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"blockwise: dim must be 0 (rows) or 1 (columns) of the matrix view, got {dim!r}")
    row_or_col = dim % 2

    def split(keys: list[Key], tensors: list[torch.Tensor]):
        block_keys, blocks, counts = [], [], []
        for k, t in zip(keys, tensors):
            matrix_dims(k, t, "blockwise")  # validates ndim >= 2
            view = batched_matrix(t)  # the default matrix view (muonfx.core.view)
            axis = view.ndim - 2 + row_or_col
            sizes = _block_sizes(k, view.shape[axis], split_sizes, ("rows", "columns")[row_or_col],
                                 "blockwise")
            parts = view.split(sizes, dim=axis)
            block_keys.extend(k + (f"block{i}",) for i in range(len(parts)))
            blocks.extend(parts)
            counts.append(len(parts))
        return block_keys, blocks, counts

    def init_fn(params):
        keys, ps = leaves(params, "params")
        bkeys, bps, _ = split(keys, ps)
        return inner.init(build(bkeys, bps))

    takes = takes_extra_args(inner)

    def update_fn(updates, state, params=None, **extra_args):
        keys, us = leaves(updates)
        bkeys, bus, counts = split(keys, us)
        bparams = None
        if params is not None:
            bparams = build(bkeys, split(keys, aligned(params, keys, "params"))[1])
        new, state = inner.update(build(bkeys, bus), state, bparams, **(extra_args if takes else {}))
        outs, i = [], 0
        for u, n in zip(us, counts):
            view_ndim = u.ndim if u.ndim <= 3 else 2  # the split view: 4-D+ leaves are [out, in*kh*kw]
            pieces = [new.get(bkeys[j]) for j in range(i, i + n)]
            i += n
            out = torch.cat(pieces, dim=view_ndim - 2 + row_or_col).reshape(u.shape)
            outs.append(_placed_like(out, u))
        return build(keys, outs), state

    return leafwise_if(GradientTransformation(init_fn, update_fn), inner)
