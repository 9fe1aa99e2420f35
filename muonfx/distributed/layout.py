"""Where each rank's piece of a DTensor lies in the whole tensor (no communication).

A DTensor's placements say how its mesh cuts it: each ``Shard(d)`` (or
``_StridedShard(d)``, what ``fully_shard`` puts on top of a tensor-parallel
``Shard(d)``) cuts tensor dim ``d`` over one mesh dim, ``Replicate()`` copies it. A cut
along dim ``d`` only moves indices of dim ``d``, so a rank's piece is the product of
one index list per dim: the indices that remain of ``range(size)`` after every cut of
that dim, applied in mesh-dim order with the placement's own split rule (as DTensor
itself computes local shapes). :func:`stack_layout` computes these lists for every
position of the mesh, as runs ``(start, stop)`` in the order the local tensor holds
them (a ``_StridedShard`` leaves several runs).

Everything here is a pure function of the global shape, the placements and the mesh
shape: every rank computes the same layout, and so can a test or a planning script.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Runs", "StackLayout", "stack_layout", "placement_key", "is_cut", "runs_len", "root_mesh", "mesh_ranks",
           "is_slice_of", "largest", "lifted"]

#: contiguous index runs ``((start, stop), ...)`` in local order
Runs = tuple[tuple[int, int], ...]


def runs_len(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def placement_key(pl) -> tuple:
    """A hashable description of a placement: ``("S", dim)``, ``("SS", dim, split_factor)``
    or ``("R",)``. ``Partial`` placements are refused (``ValueError``).

    ``_StridedShard`` is told by its type (it is a ``Shard`` on some torch versions and
    not on others, where ``is_shard()`` is False for it)."""
    if type(pl).__name__ == "_StridedShard":
        return ("SS", int(pl.dim), int(pl.split_factor))
    if pl.is_replicate():
        return ("R",)
    if pl.is_shard():
        return ("S", int(pl.dim))
    raise ValueError(f"placement {pl!r} is neither a shard nor a replica; reduce Partial placements first")


def is_cut(pl) -> bool:
    """True for ``Shard`` and ``_StridedShard`` placements (on every torch version)."""
    return type(pl).__name__ == "_StridedShard" or pl.is_shard()


def _placement(key: tuple):
    """A placement of kind ``key`` on dim 0 (to cut a 1-D index list)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if key[0] == "SS":
        return _StridedShard(0, split_factor=key[2])
    return Shard(0)


@functools.lru_cache(maxsize=4096)
def _cut(size: int, cuts: tuple[tuple[tuple, int, int], ...]) -> Runs:
    """The runs of ``range(size)`` left after ``cuts`` (``(placement key, chunks, index)``),
    each applied with the placement's own split rule."""
    idx = torch.arange(size)
    for key, chunks, at in cuts:
        parts, _ = _placement(key)._split_tensor(idx, chunks, with_padding=False, contiguous=False)
        idx = parts[at] if at < len(parts) else idx[:0]
    if idx.numel() == 0:
        return ()
    breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, idx.numel()]
    vals = idx.tolist()
    return tuple((vals[a], vals[b - 1] + 1) for a, b in zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class StackLayout:
    """The pieces of a ``[k, m, n]`` stack over a mesh.

    Attributes:
        shape: the global ``(k, m, n)``.
        mesh_shape: the mesh's shape; positions are its flattened (row-major) order.
        placements: :func:`placement_key` of each mesh dim.
        pieces: per mesh position, the runs held along each of the three dims.
    """

    shape: tuple[int, int, int]
    mesh_shape: tuple[int, ...]
    placements: tuple[tuple, ...]
    pieces: tuple[tuple[Runs, Runs, Runs], ...]

    def local_shape(self, pos: int) -> tuple[int, int, int]:
        return tuple(runs_len(r) for r in self.pieces[pos])  # type: ignore[return-value]

    def coords(self, pos: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.mesh_shape):
            out.append(pos % s)
            pos //= s
        return tuple(reversed(out))

    def matrix_dims_sharded(self) -> tuple[bool, bool, bool]:
        """Whether some placement cuts each of the three dims."""
        cut = [False, False, False]
        for p in self.placements:
            if p[0] != "R":
                cut[p[1]] = True
        return tuple(cut)  # type: ignore[return-value]


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple[int, int, int], mesh_shape: tuple[int, ...], placements: tuple[tuple, ...]) -> StackLayout:
    pieces = []
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        dims = []
        for d, size in enumerate(shape):
            cuts = tuple((p, mesh_shape[md], coord[md]) for md, p in enumerate(placements)
                         if p[0] != "R" and p[1] == d)
            dims.append(_cut(size, cuts) if cuts else (((0, size),) if size else ()))
        pieces.append(tuple(dims))
    return StackLayout(shape, mesh_shape, placements, tuple(pieces))


def stack_layout(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence) -> StackLayout:
    """The layout of a ``[k, m, n]`` stack of global ``shape`` placed with ``placements``
    (DTensor placements or :func:`placement_key` tuples) on a mesh of ``mesh_shape``.

    Example (rows cut over 2 ranks, then ``fully_shard`` on top over 2 more: the
    FSDP2 + tensor-parallel ``_StridedShard``)::

        >>> from muonfx.distributed.layout import stack_layout
        >>> lay = stack_layout((1, 8, 4), (2, 2), [("SS", 1, 2), ("S", 1)])
        >>> [lay.pieces[p][1] for p in range(4)]       # rows held at mesh positions 0..3
        [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]
    """
    if len(shape) != 3:
        raise ValueError(f"stack_layout takes [k, m, n] stacks, got shape {tuple(shape)}")
    keys = tuple(p if isinstance(p, tuple) else placement_key(p) for p in placements)
    if len(keys) != len(mesh_shape):
        raise ValueError(f"{len(keys)} placements for a {len(mesh_shape)}-D mesh")
    for p in keys:
        if p[0] != "R" and not 0 <= p[1] < 3:
            raise ValueError(f"placement {p} cuts dim {p[1]} of a 3-D stack")
    return _layout(tuple(int(s) for s in shape), tuple(int(s) for s in mesh_shape), keys)


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if it was not)."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # older torch

    return _mesh_resources.get_root_mesh(mesh)


def mesh_ranks(mesh) -> tuple[int, ...]:
    """The global ranks of ``mesh``, in its flattened (row-major) order."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def is_slice_of(mesh, onto) -> bool:
    """True when ``mesh`` is a named slice of ``onto`` (or ``onto`` itself): sliced from the
    same mesh, its dim names among ``onto``'s, its ranks among ``onto``'s."""
    if mesh is onto:
        return True
    names, onto_names = getattr(mesh, "mesh_dim_names", None), getattr(onto, "mesh_dim_names", None)
    if not names or not onto_names or len(set(names)) != len(names) or not set(names) <= set(onto_names):
        return False
    return root_mesh(mesh) is root_mesh(onto) and set(mesh_ranks(mesh)) <= set(mesh_ranks(onto))


def largest(meshes: Sequence) -> object:
    """The mesh with the most ranks (then the most dims; then the first): the one the
    others are lifted onto (:func:`lifted`). The same on every rank."""
    best, size = None, None
    seen: set[int] = set()
    for m in meshes:
        if id(m) in seen:  # (``DeviceMesh.mesh`` builds a tensor each time on torch 2.13)
            continue
        seen.add(id(m))
        n = (m.mesh.numel(), m.ndim)
        if best is None or n > size:
            best, size = m, n
    return best


def lifted(mesh, placements: Sequence, onto=None) -> tuple[object, tuple[tuple, ...]]:
    """``mesh`` and the :func:`placement_key` of ``placements``, lifted onto the mesh
    ``onto`` where ``mesh`` is a named slice of it (:func:`is_slice_of`): a parameter that
    ``fully_shard`` placed on the ``"dp"`` slice of a ``("dp", "tp")`` mesh, next to
    tensor-parallel parameters on the whole mesh, is the same tensor on every ``"tp"``
    rank, i.e. one placed on the whole mesh with ``Replicate()`` on ``"tp"``. Its matrices
    then join the exchange over the whole mesh (each transformed once in the world)
    instead of being repeated by every ``"tp"`` replica. ``onto`` is the largest mesh of
    the parameters served together (never a mesh none of them is on: ranks of another
    pipeline stage hold other parameters). Other meshes stay as they are.

    Example (meshes made up of names and ranks only)::

        >>> import torch
        >>> from types import SimpleNamespace as NS
        >>> root = NS(mesh_dim_names=("dp", "tp"), mesh=torch.arange(4).view(2, 2), ndim=2)
        >>> root._get_root_mesh = lambda: root
        >>> dp = NS(mesh_dim_names=("dp",), mesh=torch.tensor([0, 2]), ndim=1, _get_root_mesh=lambda: root)
        >>> lifted(dp, [("S", 0)], onto=root)[1]
        (('S', 0), ('R',))
    """
    keys = tuple(p if isinstance(p, tuple) else placement_key(p) for p in placements)
    if onto is None or mesh is onto or not is_slice_of(mesh, onto):
        return mesh, keys
    by_name = dict(zip(mesh.mesh_dim_names, keys))
    return onto, tuple(by_name.get(n, ("R",)) for n in onto.mesh_dim_names)
