"""DTensor's private layout, in one place: shards read and DTensors made without DTensor's
per-tensor Python.

A DTensor keeps its local shard and its spec (mesh, placements, global shape) in the slots
``_local_tensor`` and ``_spec``; ``DTensor.__new__(cls, local, spec, requires_grad=...)``
makes one from them in one call, where ``DTensor.from_local`` and DTensor's view rules make
dozens per tensor, at every step. Whether the loaded DTensor has those slots is decided
once (:data:`PRIVATE_LAYOUT`): at import where ``torch.distributed.tensor`` is already
loaded, else when the first DTensor class is found (muonfx never imports DTensor code to
find out). Where it has not, every function here takes DTensor's public API (``to_local``,
``device_mesh``, ``placements``, ``from_local``, ``reshape``) with the same results; a
``DTensor.__new__`` that takes other arguments falls back to ``from_local`` too. No other
muonfx module touches DTensor's private fields.

Checked against torch :data:`CHECKED_AGAINST` (``tests/test_compat.py`` compares the
private path with the public one on the installed version).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch

__all__ = ["dtensor_class", "is_dtensor", "local", "shards", "storages", "meshes_and_placements", "rewrap_all",
           "dtensor_stack_views", "unstack_like", "local_range", "local_indices", "row_sharded_like",
           "PRIVATE_LAYOUT", "CHECKED_AGAINST"]

#: the torch versions whose DTensor layout this module was checked against
CHECKED_AGAINST = ("2.13.0",)

#: whether DTensor keeps its shard and spec in the slots ``_local_tensor`` and ``_spec``:
#: None until decided (once, see the module's docstring)
PRIVATE_LAYOUT: bool | None = None


def _decide(cls: type) -> bool:
    """Decide :data:`PRIVATE_LAYOUT` from the DTensor class ``cls`` (once per process)."""
    global PRIVATE_LAYOUT
    PRIVATE_LAYOUT = all(type(getattr(cls, name, None)).__name__ == "member_descriptor"
                         for name in ("_local_tensor", "_spec"))
    return PRIVATE_LAYOUT


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` once that module is loaded, else None (no
    tensor can be a DTensor then): muonfx never imports it to find out."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    if PRIVATE_LAYOUT is None and cls is not None:
        _decide(cls)
    return cls


def _private() -> bool:
    """:data:`PRIVATE_LAYOUT`, decided if it is not yet (a DTensor exists: its class is
    loaded). Spelled inline where it runs at every step (no Python call once decided)."""
    return PRIVATE_LAYOUT if PRIVATE_LAYOUT is not None else bool(_decide(dtensor_class()))


if "torch.distributed.tensor" in sys.modules:  # decided at import where DTensor is already loaded
    dtensor_class()


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 / tensor-parallel shard): the one test, by
    ``isinstance``, of every module below :mod:`muonfx.distributed`.

    Example::

        >>> import torch
        >>> from muonfx._compat.dtensor import is_dtensor
        >>> is_dtensor(torch.zeros(2))
        False
    """
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """A DTensor's local shard (the tensor itself for anything else)."""
    cls = dtensor_class()
    if cls is None or not isinstance(t, cls):
        return t
    return t._local_tensor if PRIVATE_LAYOUT and not torch.is_grad_enabled() else t.to_local()


def shards(ts: Sequence[Any], cls: type, idx: Sequence[int] | None = None) -> list[Any]:
    """:func:`local` of each of ``ts`` (of ``ts[i]`` for ``i`` in ``idx`` when given), in
    one call for the list; ``cls`` is the DTensor class (:func:`dtensor_class`)."""
    out = []
    # the slot itself (no call per tensor) with gradients off
    inline = (PRIVATE_LAYOUT if PRIVATE_LAYOUT is not None else _private()) and not torch.is_grad_enabled()
    for i in (range(len(ts)) if idx is None else idx):
        t = ts[i]
        out.append((t._local_tensor if inline else t.to_local()) if isinstance(t, cls) else t)
    return out


def storages(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The storage address of each tensor (of its local shard for a DTensor)."""
    cls = dtensor_class()
    if cls is None:
        return [t.untyped_storage().data_ptr() for t in tensors]
    if PRIVATE_LAYOUT:
        return [(t._local_tensor if isinstance(t, cls) else t).untyped_storage().data_ptr() for t in tensors]
    return [(t.to_local() if isinstance(t, cls) else t).untyped_storage().data_ptr() for t in tensors]


def meshes_and_placements(ts: Sequence[Any]) -> tuple[list[Any], list[tuple]]:
    """The device mesh and the placements of each DTensor of ``ts``: read from its spec
    (no Python call per tensor), or through the public properties."""
    meshes, placements = [], []
    if PRIVATE_LAYOUT if PRIVATE_LAYOUT is not None else _private():
        for t in ts:
            spec = t._spec
            meshes.append(spec.mesh)
            placements.append(spec.placements)
    else:
        for t in ts:
            meshes.append(t.device_mesh)
            placements.append(tuple(t.placements))
    return meshes, placements


_FAST_REWRAP = [True]


def _dtensor_new(cls: type) -> Any:
    """How to make a DTensor of class ``cls`` from ``(local, spec, requires_grad=...)``:
    eagerly its ``__new__`` alone (``DTensor.__init__`` only marks the constructor for
    export, behind wrappers that cost seven Python calls per tensor), traced the class."""
    if torch.compiler.is_compiling():
        return lambda c, local_t, spec, requires_grad: c(local_t, spec, requires_grad=requires_grad)
    return cls.__new__


def rewrap_all(locals_: Sequence[torch.Tensor], likes: Sequence[Any]) -> list[Any]:
    """Each ``locals_[i]`` as a DTensor placed like ``likes[i]``: with that one's own spec
    where the shard has its shape, strides and dtype (the constructor: one call, where
    ``from_local`` makes dozens), else through ``from_local``."""
    if not likes:
        return []
    cls = type(likes[0])
    new = _dtensor_new(cls) if _FAST_REWRAP[0] and (
        PRIVATE_LAYOUT if PRIVATE_LAYOUT is not None else _private()) else None
    out = []
    for loc, like in zip(locals_, likes):
        if new is not None and type(like) is cls:
            mine = like._local_tensor
            if loc.shape == mine.shape and loc.dtype == mine.dtype and loc.stride() == mine.stride():
                try:
                    out.append(new(cls, loc, like._spec, requires_grad=False))
                    continue
                except TypeError:  # a torch whose DTensor constructor takes other arguments
                    _FAST_REWRAP[0] = False
                    new = None
        out.append(type(like).from_local(loc, like.device_mesh, like.placements, run_check=False,
                                         shape=like.shape, stride=like.stride()))
    return out


#: the spec of ``t.reshape(1, a, b)`` for a 2-D DTensor ``t`` (:func:`dtensor_stack_views`), by
#: ``t``'s mesh (held, so its ``id`` stays its own), placements, shape, strides and dtype: DTensor's own view rule
#: runs once per distinct layout, not once per parameter and step. At most :data:`STACK_SPECS`
#: layouts: storing one more drops the one stored first (a hit costs no Python call: it runs per
#: parameter and step)
STACK_SPECS = 4096
_STACK_SPECS: dict[tuple, tuple[Any, Any]] = {}


def dtensor_stack_views(ts: Sequence[torch.Tensor], dims: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Each 2-D DTensor ``ts[i]`` (``dims[i]`` = ``(a, b)``) viewed as a ``[1, a, b]``
    stack: its shard's view wrapped with a spec that DTensor's own view rule computes once
    per layout (that rule is many Python calls per tensor, at every step), where the view
    is the shard's own. Call with gradients off (an optimizer step)."""
    if ts and not (PRIVATE_LAYOUT if PRIVATE_LAYOUT is not None else _private()):
        return [t.reshape(1, a, b) for t, (a, b) in zip(ts, dims)]
    out = []
    new = _dtensor_new(type(ts[0])) if ts and _FAST_REWRAP[0] else None
    for t, (a, b) in zip(ts, dims):
        spec = t._spec
        key = (id(spec.mesh), spec.placements, t.shape, t.stride(), t.dtype)
        hit = _STACK_SPECS.get(key)
        if hit is None or hit[0] is not spec.mesh:
            view = t.reshape(1, a, b)
            if view._local_tensor.shape == (1, *t._local_tensor.shape):
                if len(_STACK_SPECS) >= STACK_SPECS and key not in _STACK_SPECS:
                    del _STACK_SPECS[next(iter(_STACK_SPECS))]
                _STACK_SPECS[key] = (spec.mesh, view._spec)
            # else: a layout whose view is not the shard's own: DTensor's rule each time
            out.append(view)
            continue
        if new is not None:
            try:
                out.append(new(type(t), t._local_tensor.unsqueeze(0), hit[1], requires_grad=False))
                continue
            except TypeError:  # a torch whose DTensor constructor takes other arguments
                _FAST_REWRAP[0] = False
                new = None
        out.append(t.reshape(1, a, b))
    return out


def unstack_like(outs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each ``[k, a, b]`` result of a matrix stack back in the shape of its ``g``; a
    2-D DTensor's is its shard's view wrapped with ``g``'s own spec (see :func:`rewrap_all`)."""
    cls = dtensor_class()
    if cls is None or torch.is_grad_enabled() or not PRIVATE_LAYOUT:
        return [o if o.shape == g.shape else o.reshape(g.shape) for o, g in zip(outs, gs)]
    res: list = []
    fast = []  # (position, shard view, g): rewrapped together
    for o, g in zip(outs, gs):
        if o.shape == g.shape:
            res.append(o)
        elif isinstance(o, cls) and isinstance(g, cls) and g.ndim == 2 and \
                o._local_tensor.shape == (1, *g._local_tensor.shape):
            fast.append((len(res), o._local_tensor.view(g._local_tensor.shape), g))
            res.append(None)
        else:
            res.append(o.reshape(g.shape))
    if fast:
        for (i, _, _), r in zip(fast, rewrap_all([f[1] for f in fast], [f[2] for f in fast])):
            res[i] = r
    return res


def local_range(t: Any, dim: int) -> tuple[int, int] | None:
    """``(start, length)``: the indices along ``dim`` of the whole tensor that a DTensor's
    local shard holds, one contiguous range (``Shard``, ``Replicate``, uneven and empty
    shards); ``None`` where they are not one range (a ``_StridedShard`` of ``dim``). A
    plain tensor holds all of them.

    Read with DTensor's own rule (``compute_local_shape_and_global_offset``, private);
    where that is missing, from the placements by ``torch.chunk``'s split, as ``Shard``
    splits.

    Example::

        >>> import torch
        >>> from muonfx._compat.dtensor import local_range
        >>> local_range(torch.zeros(6, 4), 0)
        (0, 6)
    """
    if not is_dtensor(t):
        return 0, t.shape[dim]
    dim = dim % t.ndim
    for pl in t.placements:
        if type(pl).__name__ == "_StridedShard" and getattr(pl, "dim", None) == dim:
            return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return int(offset[dim]), int(shape[dim])
    except ImportError:  # the placements, by Shard's split (ceil-sized chunks, the last ones short or empty)
        start, length = 0, t.shape[dim]
        coord = t.device_mesh.get_coordinate()
        for mesh_dim, pl in enumerate(t.placements):
            if getattr(pl, "dim", None) == dim and pl.is_shard():
                n = t.device_mesh.size(mesh_dim)
                chunk = -(-length // n)
                lo = min(coord[mesh_dim] * chunk, length)
                start, length = start + lo, min(chunk, length - lo)
        return start, length


def local_indices(t: Any, dim: int) -> torch.Tensor:
    """The indices along ``dim`` of the whole tensor that a DTensor's local shard holds, in
    the order it holds them (an ``int64`` tensor on the CPU): one range for ``Shard``,
    ``Replicate``, uneven and empty shards, several for a ``_StridedShard`` of ``dim``
    (what ``fully_shard`` puts on top of a tensor-parallel ``Shard``). A plain tensor holds
    ``arange(size)``.

    Read with each placement's own split rule (``_split_tensor``, private) applied to the
    indices in mesh-dim order, as DTensor cuts the tensor itself; where that is missing,
    ``Shard``'s split from :func:`local_range` (a ``_StridedShard`` then raises).

    Example::

        >>> import torch
        >>> from muonfx._compat.dtensor import local_indices
        >>> local_indices(torch.zeros(3, 4), 0).tolist()
        [0, 1, 2]
    """
    size = t.shape[dim]
    if not is_dtensor(t):
        return torch.arange(size)
    dim = dim % t.ndim
    cuts = [(md, pl) for md, pl in enumerate(t.placements)
            if getattr(pl, "dim", None) == dim and (type(pl).__name__ == "_StridedShard" or pl.is_shard())]
    if not cuts:
        return torch.arange(size)
    try:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        coord = t.device_mesh.get_coordinate()
        idx = torch.arange(size)
        for md, pl in cuts:  # the same cut on a 1-D index list, dim 0
            cut = (_StridedShard(0, split_factor=pl.split_factor) if type(pl).__name__ == "_StridedShard"
                   else Shard(0))
            parts, _ = cut._split_tensor(idx, t.device_mesh.size(md), with_padding=False, contiguous=False)
            idx = parts[coord[md]] if coord[md] < len(parts) else idx[:0]
        return idx
    except (ImportError, AttributeError, TypeError):
        rng = local_range(t, dim)
        if rng is None:
            raise ValueError(f"local_indices: this torch cannot place a _StridedShard of dim {dim} "
                             f"{tuple(t.placements)}") from None
        return torch.arange(rng[0], rng[0] + rng[1])


def row_sharded_like(like: Any, full: torch.Tensor) -> Any:
    """``full`` (the same whole tensor on every rank, computed locally) as a DTensor on
    ``like``'s mesh, cut along its dim 0 over every mesh dim that cuts ``like`` (any dim of
    it) and replicated over the others: a matrix of per-parameter state (a factor, a
    basis) spread over the ranks that share the parameter. No communication: each rank
    keeps its own rows (``Shard(0)``'s split, applied in mesh-dim order)."""
    cls = dtensor_class()
    mod = sys.modules["torch.distributed.tensor"]
    mesh = like.device_mesh
    placements = tuple(mod.Shard(0) if (type(pl).__name__ == "_StridedShard" or pl.is_shard()) else mod.Replicate()
                       for pl in like.placements)
    piece = full
    coord = mesh.get_coordinate()
    for md, pl in enumerate(placements):
        if pl.is_shard():  # torch.chunk's split: ceil-sized chunks, the last ones short or empty
            n, size = mesh.size(md), piece.shape[0]
            chunk = -(-size // n) if size else 0
            lo = min(coord[md] * chunk, size)
            piece = piece[lo:min(lo + chunk, size)]
    return cls.from_local(piece.contiguous(), mesh, placements, run_check=False, shape=full.shape,
                          stride=full.stride())
