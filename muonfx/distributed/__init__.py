"""muonfx on DTensors: the FSDP2 / HSDP / tensor-parallel side of the seam.

Importing this module changes nothing and imports no DTensor code (so neither does
``import muonfx``): the backend (:mod:`muonfx.distributed.backend`, which imports
``torch.distributed.tensor``) is loaded by :func:`install`, called by
:class:`muonfx.TransformOptimizer` as soon as it sees a DTensor parameter, or on first
use of ``BACKEND`` or ``DTensorBackend`` from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from .. import seam
from .overview import describe
from .plan import assign_owners, ns_flops, shard_sizes
from .stats import CommStats

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from .backend import DTensorBackend

__all__ = ["install", "uninstall", "check_params", "comm_stats", "pick_backend", "describe", "BACKEND",
           "CommStats", "DTensorBackend", "assign_owners", "ns_flops", "shard_sizes"]

_LAZY = ("BACKEND", "DTensorBackend")


def __getattr__(name: str) -> Any:
    """``BACKEND`` and ``DTensorBackend``, imported on first use."""
    if name in _LAZY:
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pick_backend(ranks: int, local_rank: int = 0) -> tuple[str, torch.device]:
    """``("nccl", cuda:local_rank)`` when this machine has a GPU for each of its ``ranks``;
    ``("gloo", cpu)`` otherwise (no GPU, or ranks that would share one: an NCCL error).

    ``ranks`` counts the ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; the world
    size on one machine). The CLI, the FSDP2 example and the benchmarks choose with it.

    Example::

        >>> import torch
        >>> from muonfx.distributed import pick_backend
        >>> pick_backend(2) if not torch.cuda.is_available() else ("gloo", torch.device("cpu"))
        ('gloo', device(type='cpu'))
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= ranks:
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def install() -> DTensorBackend:
    """Register the DTensor backend with the seam (idempotent) and return it."""
    from .backend import BACKEND

    seam.register_backend(BACKEND)
    return BACKEND


def uninstall() -> None:
    from .backend import BACKEND

    seam.unregister_backend(BACKEND)


def comm_stats() -> CommStats:
    """This rank's matrix-exchange counters (bytes, collectives, matrices orthogonalised)
    of the whole process; an optimizer's own share is its
    :attr:`~muonfx.TransformOptimizer.comm_stats`."""
    from .backend import BACKEND

    return BACKEND.stats


def check_params(names: Sequence[str], params: Sequence[torch.Tensor], reference: DTensor | None = None) -> DTensor | None:
    """Refuse DTensor parameters the adapter cannot serve, naming the parameter.

    Served: placements made of ``Shard(d)``, ``_StridedShard(d)`` (``fully_shard`` on
    top of tensor parallelism) and ``Replicate()``, on meshes of any number of dims that
    span the same ranks as the largest one, or are named slices of it (``mesh["dp"]``
    next to parameters on ``mesh``; see :func:`muonfx.distributed.layout.lifted`).
    Refused (``ValueError``): ``Partial`` placements and meshes over other sets of ranks.
    Every rank raises the same error before any communication, so none hangs. Returns
    the DTensor on the largest mesh seen (the reference for later groups, and the mesh
    of the step's agreement).
    """
    from torch.distributed.tensor import DTensor

    from .layout import is_slice_of, largest, mesh_ranks, placement_key

    dts = [(n, p) for n, p in zip(names, params) if isinstance(p, DTensor)]
    for name, p in dts:
        for pl in p.placements:
            if pl.is_partial():
                raise ValueError(f"parameter {name!r} has a Partial placement {p.placements}; "
                                 "muonfx needs Shard/Replicate parameters (reduce the Partial first)")
            try:
                placement_key(pl)
            except ValueError:
                raise ValueError(f"parameter {name!r} has unsupported placement {pl!r}") from None
    if not dts:
        return reference
    meshes = [p.device_mesh for _, p in dts] + ([reference.device_mesh] if reference is not None else [])
    big = largest(meshes)
    ref = reference if reference is not None and reference.device_mesh is big else \
        next(p for _, p in dts if p.device_mesh is big)
    want = sorted(mesh_ranks(big))
    for name, p in dts + ([("(an earlier group's parameter)", reference)] if reference is not None else []):
        m = p.device_mesh
        if sorted(mesh_ranks(m)) != want and not is_slice_of(m, big):
            raise ValueError(
                f"parameter {name!r} lives on a device mesh over ranks {sorted(mesh_ranks(m))}, but other parameters "
                f"use ranks {want}; one optimizer serves parameters over one set of ranks (or named slices of "
                "its largest mesh)")
    install()
    return ref
