"""muonfx on DTensors: the FSDP2 / HSDP / tensor-parallel side of the seam.

Importing this module changes nothing; :func:`install` (called by
:class:`muonfx.TransformOptimizer` as soon as it sees a DTensor parameter) registers
the DTensor backend with :mod:`muonfx.seam`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

from .. import seam
from .backend import BACKEND, CommStats, DTensorBackend
from .plan import assign_owners, shard_sizes

__all__ = ["install", "uninstall", "check_params", "comm_stats", "BACKEND", "CommStats", "DTensorBackend",
           "assign_owners", "shard_sizes"]


def install() -> DTensorBackend:
    """Register the DTensor backend with the seam (idempotent) and return it."""
    seam.register_backend(BACKEND)
    return BACKEND


def uninstall() -> None:
    seam.unregister_backend(BACKEND)


def comm_stats() -> CommStats:
    """This rank's matrix-exchange counters (bytes, collectives, matrices orthogonalised)."""
    return BACKEND.stats


def _ranks(t: DTensor) -> tuple[int, ...]:
    return tuple(sorted(t.device_mesh.mesh.flatten().tolist()))


def check_params(names: Sequence[str], params: Sequence[torch.Tensor], reference: DTensor | None = None) -> DTensor | None:
    """Refuse DTensor parameters the adapter cannot serve, naming the parameter.

    Served: placements made of ``Shard(d)`` and ``Replicate()`` on meshes that span
    the same ranks. Refused (``ValueError``): ``Partial`` placements, strided shards
    from nested parallelism, and meshes over different rank sets. Every rank raises
    the same error before any communication, so none hangs. Returns the first
    DTensor seen (the reference for later groups).
    """
    for name, p in zip(names, params):
        if not isinstance(p, DTensor):
            continue
        for pl in p.placements:
            if pl.is_partial():
                raise ValueError(f"parameter {name!r} has a Partial placement {p.placements}; "
                                 "muonfx needs Shard/Replicate parameters (reduce the Partial first)")
            if pl.is_shard() and type(pl).__name__ != "Shard":
                raise ValueError(f"parameter {name!r} has placement {pl!r} ({type(pl).__name__}), which "
                                 "muonfx cannot map to whole matrices; use plain Shard/Replicate placements")
            if not (pl.is_shard() or pl.is_replicate()):
                raise ValueError(f"parameter {name!r} has unsupported placement {pl!r}")
        if reference is None:
            reference = p
        elif _ranks(p) != _ranks(reference):
            raise ValueError(
                f"parameter {name!r} lives on a device mesh over ranks {list(_ranks(p))}, but other parameters "
                f"use ranks {list(_ranks(reference))}; one optimizer must serve parameters over one set of ranks"
            )
    if reference is not None:
        install()
    return reference
