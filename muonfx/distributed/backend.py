"""The DTensor side of :mod:`muonfx.seam`.

* :meth:`DTensorBackend.map_matrices`: each whole matrix is assembled on exactly one
  owner rank with one all-to-all per same-shape group, transformed there, and sent
  back to the shards with a second all-to-all. Matrices sharded on their batch dim
  (expert stacks ``Shard(0)``) or replicated are transformed where they are; any
  other layout is gathered in full, transformed, and re-sharded (correct, not fast).
* :meth:`DTensorBackend.global_sum`: per-shard partial sums and one all-reduce over
  the sharded mesh dimensions.

Per-rank traffic and work are counted in :attr:`DTensorBackend.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..seam import MatrixFn, ScalarFn
from .plan import assign_owners, shard_sizes

__all__ = ["DTensorBackend", "CommStats", "BACKEND"]


@dataclass
class CommStats:
    """Counters of this rank's matrix traffic and work (reset with :meth:`reset`)."""

    elements_sent: int = 0
    elements_received: int = 0
    bytes_received: int = 0
    collectives: int = 0
    matrices_orthogonalized: int = 0
    fallback_gathers: int = 0
    shapes: list = field(default_factory=list)

    def reset(self) -> None:
        self.elements_sent = self.elements_received = self.bytes_received = 0
        self.collectives = self.matrices_orthogonalized = self.fallback_gathers = 0
        self.shapes = []


def _from_local(local: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


class DTensorBackend:
    """Seam backend for DTensors (FSDP2 / HSDP / tensor-parallel shards)."""

    def __init__(self) -> None:
        self.stats = CommStats()

    def claims(self, t: torch.Tensor) -> bool:
        return isinstance(t, DTensor)

    # -- matrices -----------------------------------------------------------

    def map_matrices(self, fn: MatrixFn, stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(stacks)
        exchange: list[tuple[int, int, int]] = []  # (stack index, mesh dim, stack dim)
        for i, s in enumerate(stacks):
            pl = s.placements
            if any(p.is_partial() for p in pl):
                raise ValueError(f"map_matrices: Partial placements {pl} cannot be orthogonalised; reduce them first")
            sharded = [(md, p.dim) for md, p in enumerate(pl) if p.is_shard()]
            if not sharded or (len(sharded) == 1 and sharded[0][1] == 0):
                local = s.to_local()
                res = fn(local) if local.shape[0] > 0 else local.clone()
                self.stats.matrices_orthogonalized += local.shape[0] if self._is_first_replica(s) else 0
                out[i] = _from_local(res, s)
            elif len(sharded) == 1 and s.device_mesh.size(sharded[0][0]) > 1:
                exchange.append((i, sharded[0][0], sharded[0][1]))
            elif len(sharded) == 1:
                out[i] = _from_local(fn(s.to_local()), s)
                self.stats.matrices_orthogonalized += s.shape[0]
            else:
                out[i] = self._gather_everywhere(fn, s)
        if exchange:
            self._exchange(fn, stacks, exchange, out)
        return out  # type: ignore[return-value]

    def _is_first_replica(self, s: DTensor) -> bool:
        """Count batch-sharded/replicated work once: on ranks at coordinate 0 of every
        mesh dim that does not shard the batch."""
        coord = s.device_mesh.get_coordinate() or []
        return all(c == 0 for md, c in enumerate(coord) if not s.placements[md].is_shard())

    def _gather_everywhere(self, fn: MatrixFn, s: DTensor) -> DTensor:
        self.stats.fallback_gathers += 1
        full = s.full_tensor()
        res = fn(full)
        self.stats.matrices_orthogonalized += s.shape[0]
        rep = DTensor.from_local(res, s.device_mesh, [Replicate()] * s.device_mesh.ndim, run_check=False)
        return rep.redistribute(s.device_mesh, s.placements)

    def _exchange(self, fn: MatrixFn, stacks, exchange, out) -> None:
        # matrices: (stack index, position in stack); group by process group and shape
        by_pg: dict = {}
        for i, md, sd in exchange:
            s = stacks[i]
            pg = s.device_mesh.get_group(md)
            by_pg.setdefault(id(pg), (pg, []))[1].append((i, md, sd))
        for pg, items in by_pg.values():
            world = dist.get_world_size(pg)
            me = dist.get_rank(pg)
            mats = [(i, j) for i, _, _ in items for j in range(stacks[i].shape[0])]
            owners = assign_owners([stacks[i].shape[1] * stacks[i].shape[2] for i, _ in mats], world)
            owner_of = dict(zip(mats, owners))
            groups: dict = {}
            for i, md, sd in items:
                s = stacks[i]
                key = (tuple(s.shape[1:]), sd, s.dtype, s.to_local().device)
                groups.setdefault(key, []).append(i)
            locals_: dict[int, list[torch.Tensor]] = {}
            for (shape, sd, dtype, device), idx in groups.items():
                members = [(i, j) for i in idx for j in range(stacks[i].shape[0])]
                results = self._exchange_group(fn, stacks, members, owner_of, shape, sd, dtype, device, pg, world, me)
                for (i, j), r in zip(members, results):
                    locals_.setdefault(i, [None] * stacks[i].shape[0])[j] = r  # type: ignore[list-item]
            for i, pieces in locals_.items():
                out[i] = _from_local(torch.stack(pieces, dim=0), stacks[i])

    def _exchange_group(self, fn, stacks, members, owner_of, shape, sd, dtype, device, pg, world, me):
        m, n = shape
        split_dim_size = m if sd == 1 else n
        other = n if sd == 1 else m
        sizes = shard_sizes(split_dim_size, world)
        by_owner: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for mat in members:
            by_owner[owner_of[mat]].append(mat)
        mine = by_owner[me]
        # forward: my shard of every matrix, to its owner
        send_parts = []
        for o in range(world):
            for i, j in by_owner[o]:
                loc = stacks[i].to_local()[j]
                if loc.shape[sd - 1] != sizes[me]:
                    raise ValueError(
                        f"unexpected local shard shape {tuple(loc.shape)} for a {m}x{n} matrix sharded on dim "
                        f"{sd - 1} over {world} ranks (expected {sizes[me]} along it)"
                    )
                send_parts.append(loc.reshape(-1))
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=dtype, device=device)
        in_splits = [len(by_owner[o]) * sizes[me] * other for o in range(world)]
        out_splits = [len(mine) * sizes[r] * other for r in range(world)]
        recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=pg)
        self._count(in_splits, out_splits, me, recv.element_size())
        # assemble whole matrices on the owner, transform them as one batch
        result_chunks: list[torch.Tensor] = []
        if mine:
            pieces = recv.split(out_splits)
            blocks = [
                p.reshape(len(mine), sizes[r], n) if sd == 1 else p.reshape(len(mine), m, sizes[r])
                for r, p in enumerate(pieces)
            ]
            full = torch.cat(blocks, dim=sd)
            res = fn(full)
            self.stats.matrices_orthogonalized += len(mine)
            self.stats.shapes.append((m, n, len(mine)))
            result_chunks = list(res.split(sizes, dim=sd))
        # backward: every rank's shard of my results, back to it
        back_parts = [
            result_chunks[r].reshape(-1) if mine else torch.empty(0, dtype=dtype, device=device)
            for r in range(world)
        ]
        back = torch.cat(back_parts) if back_parts else torch.empty(0, dtype=dtype, device=device)
        back_in = [len(mine) * sizes[r] * other for r in range(world)]
        back_out = [len(by_owner[o]) * sizes[me] * other for o in range(world)]
        got = torch.empty(sum(back_out), dtype=dtype, device=device)
        dist.all_to_all_single(got, back.contiguous(), back_out, back_in, group=pg)
        self._count(back_in, back_out, me, got.element_size())
        # my local shard of every member, in member order
        shard_shape = (sizes[me], n) if sd == 1 else (m, sizes[me])
        result: dict = {}
        for o, piece in enumerate(got.split(back_out)):
            for k, mat in enumerate(by_owner[o]):
                numel = sizes[me] * other
                result[mat] = piece[k * numel:(k + 1) * numel].reshape(shard_shape)
        return [result[mat] for mat in members]

    def _count(self, sent_splits, recv_splits, me, elsize) -> None:
        sent = sum(v for r, v in enumerate(sent_splits) if r != me)
        got = sum(v for r, v in enumerate(recv_splits) if r != me)
        self.stats.elements_sent += sent
        self.stats.elements_received += got
        self.stats.bytes_received += got * elsize
        self.stats.collectives += 1

    # -- global reductions ----------------------------------------------------

    def global_sum(self, fn: ScalarFn, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        groups: dict = {}
        for t in tensors:
            mesh = t.device_mesh
            dims = tuple(md for md, p in enumerate(t.placements) if p.is_shard())
            if any(p.is_partial() for p in t.placements):
                raise ValueError(f"global_sum: Partial placements {t.placements} are not supported")
            groups.setdefault((id(mesh), dims), (mesh, dims, []))[2].append(t)
        total = None
        for mesh, dims, ts in groups.values():
            parts = [fn(t.to_local()) for t in ts]
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
            s = torch.stack([p.to(dtype) for p in parts]).sum()
            for md in dims:
                dist.all_reduce(s, group=mesh.get_group(md))
            total = s if total is None else total + s.to(total.device)
        return total if total is not None else torch.zeros(())


#: The process-wide backend instance (installed by :func:`muonfx.distributed.install`).
BACKEND = DTensorBackend()
