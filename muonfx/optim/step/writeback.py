"""Write-back: a step's new state into the old state buffers, its updates into the parameters.

The pure update returns new tensors; a step keeps the old ones. Each tensor of the new
state that has the shape, dtype, device and type of the buffer at its place (the same
key of the same TensorDict, or the same place of the tree) is copied into that buffer,
which then stands in the state (references held by users, ``opt.state`` and
checkpoints stay valid); anything else (a new shape, a number, a
:class:`~muonfx.counts.Counts`) is taken from the new state. The parameters get
``p += u``. A tensor of the new state or an update that shares memory with an old
buffer or a parameter (and is not the buffer it goes to) is copied first, so the order
of the writes cannot change a value that a later write reads.

Eagerly (:func:`write_back`) that is one ``torch._foreach_copy_`` and one
``_foreach_add_``; traced (:func:`store`, inside ``torch.compile``) one ``copy_`` per
buffer, which the compiler orders after the reads.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from ... import tree
from ..._compat.dtensor import dtensor_class, shards, storages as _storages
from ...core import build, td_items
from ...ops import foreach

__all__ = ["write_back", "store", "commit"]


def _pairs(old: Any, new: Any) -> tuple[list, Any, list, list]:
    """``new``'s leaves and structure, ``old``'s leaves at the same places (None where
    the structures differ), and per leaf of ``new``: for a TensorDict ``(keys, old
    tensors or None, new tensors)`` by key, for a bare tensor ``([None], [old], [new])``,
    else None."""
    new_leaves, spec = tree.flatten(new)
    old_leaves, old_spec = tree.flatten(old)
    if len(old_leaves) != len(new_leaves) or old_spec != spec:
        old_leaves = [None] * len(new_leaves)
    pairs: list = []
    for o, n in zip(old_leaves, new_leaves):
        if isinstance(n, TensorDictBase):
            nk, nv = td_items(n)
            if isinstance(o, TensorDictBase):
                ok, ov = td_items(o)
                if ok != nk:
                    by_key = dict(zip(ok, ov))
                    ov = [by_key.get(k) for k in nk]
            else:
                ov = [None] * len(nv)
            pairs.append((nk, ov, nv))
        elif isinstance(n, torch.Tensor):
            pairs.append(([None], [o if isinstance(o, torch.Tensor) else None], [n]))
        else:
            pairs.append(None)
    return new_leaves, spec, old_leaves, pairs


def commit(old: Any, new: Any, params: list[torch.Tensor] = (), updates: list[torch.Tensor] = ()) -> Any:
    """Write the state ``new`` into ``old``'s buffers where they match, and add
    ``updates`` to ``params``; return the state holding ``old``'s buffers (``old``'s
    tensors and the parameters are written; ``new``'s tensors and the updates are not).

    A tensor of ``new`` or an update that shares memory with an old buffer or a
    parameter, and is not the buffer it goes to, is copied before anything is written.

    Example::

        >>> import torch
        >>> from muonfx.optim.step.writeback import commit
        >>> buf, p = torch.zeros(2), torch.ones(2)
        >>> kept = commit((buf,), (torch.ones(2),), [p], [torch.full((2,), 0.5)])
        >>> kept[0] is buf, buf.tolist(), p.tolist()
        (True, [1.0, 1.0], [1.5, 1.5])
    """
    leaves, spec, old_leaves, pairs = _pairs(old, new)
    olds = [o for p in pairs if p is not None for o in p[1] if o is not None]
    news = [n for p in pairs if p is not None for n in p[2]]
    param_addrs = _storages(list(params))
    unsafe = set(_storages(olds)) | set(param_addrs)
    us = list(updates)
    if us:
        addrs = _storages(us)
        if not unsafe.isdisjoint(addrs):
            us = [u.clone() if a in unsafe and u is not p else u for p, u, a in zip(params, us, addrs)]
    addrs = iter(_storages(news))
    dst, src = [], []
    out = list(leaves)
    for i, p in enumerate(pairs):
        if p is None:
            continue
        keys, ov, nv = p
        kept = []
        in_place = True
        for o, n in zip(ov, nv):
            addr = next(addrs)
            if n is o:
                kept.append(o)
                continue
            s = n.clone() if addr in unsafe else n
            if o is not None and o.shape == s.shape and o.dtype == s.dtype and o.device == s.device and \
                    type(o) is type(s):
                dst.append(o)
                src.append(s)
                kept.append(o)
            else:
                kept.append(s)
                in_place = False
        if keys == [None]:
            out[i] = kept[0]
        elif in_place and isinstance(old_leaves[i], TensorDictBase) and len(keys) == len(ov) and \
                td_items(old_leaves[i])[0] == keys:
            out[i] = old_leaves[i]  # every entry written into the old TensorDict's buffers: it stays
        else:
            out[i] = build(keys, kept)
    if dst:
        cls = dtensor_class()
        if cls is not None and any([isinstance(t, cls) for t in dst]):
            dst, src = shards(dst, cls), shards(src, cls)
        torch._foreach_copy_(dst, src)
    if us:
        foreach("add_", list(params), us)
    return tree.unflatten(out, spec)


def write_back(old: Any, new: Any) -> Any:
    """:func:`commit` of a state alone: ``new``'s tensors copied into ``old``'s matching
    buffers; returns the state holding those buffers.

    Example::

        >>> import torch
        >>> from muonfx.optim.step.writeback import write_back
        >>> buf = torch.zeros(2)
        >>> kept = write_back((buf,), (torch.ones(2),))
        >>> kept[0] is buf, buf.tolist()
        (True, [1.0, 1.0])
    """
    return commit(old, new)


def store(old: Any, new: Any) -> Any:
    """:func:`write_back` for traced code (inside ``torch.compile``): copy ``new``'s
    tensors into ``old``'s matching buffers with no aliasing analysis (the compiler's
    functionalization orders the reads before the writes); return the state holding
    ``old``'s buffers.

    One ``copy_`` per buffer, not ``torch._foreach_copy_``: inductor (2.10-2.13) fuses a
    foreach copy into one loop that writes each buffer before it computes the next
    one's new value, so a new value that reads another old buffer read it overwritten
    (``accumulate(momentum(0.9), 2)``: the momentum took the zeroed sum, a 15 % wrong
    trajectory after 8 steps; aot_eager and eager were right)."""
    leaves, spec, _, pairs = _pairs(old, new)
    out = list(leaves)
    for i, p in enumerate(pairs):
        if p is None:
            continue
        keys, ov, nv = p
        kept = []
        for o, n in zip(ov, nv):
            if n is not o and o is not None and o.shape == n.shape and o.dtype == n.dtype and \
                    o.device == n.device and type(o) is type(n):
                o.copy_(n)
                kept.append(o)
            else:
                kept.append(n)
        out[i] = kept[0] if keys == [None] else build(keys, kept)
    return tree.unflatten(out, spec)
