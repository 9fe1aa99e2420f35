"""The DTensor side of :mod:`muonfx.seam`.

* :meth:`DTensorBackend.map_matrices`: each whole matrix is assembled on exactly one
  owner rank with one all-to-all (for all matrices of a step that share a process
  group and dtype), transformed there in same-shape batches, and sent back to the
  shards with a second all-to-all. Matrices sharded on their batch dim
  (expert stacks ``Shard(0)``) or replicated are transformed where they are; any
  other layout is gathered in full, transformed, and re-sharded (correct, not fast).
* :meth:`DTensorBackend.global_sum`: per-shard partial sums and one all-reduce over
  the sharded mesh dimensions.
* :meth:`DTensorBackend.sum_over`: local sums over the given dims; the sums of dims that
  are sharded are all-reduced, all tensors of a process group and dtype in one
  all-reduce (counted in :attr:`CommStats.reductions`).

Per-rank traffic and work are counted in :attr:`DTensorBackend.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..seam import MatrixFn, ScalarFn, compute_dtype
from .plan import assign_owners, shard_sizes

__all__ = ["DTensorBackend", "CommStats", "BACKEND"]


@dataclass
class CommStats:
    """Counters of this rank's matrix traffic and work (reset with :meth:`reset`)."""

    elements_sent: int = 0
    elements_received: int = 0
    bytes_received: int = 0
    collectives: int = 0
    reductions: int = 0
    matrices_orthogonalized: int = 0
    fallback_gathers: int = 0
    shapes: list = field(default_factory=list)

    def reset(self) -> None:
        self.elements_sent = self.elements_received = self.bytes_received = 0
        self.collectives = self.reductions = self.matrices_orthogonalized = self.fallback_gathers = 0
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
        cdtype = compute_dtype(fn, s)  # gathered and scattered back in it (see _exchange)
        full = (s if cdtype == s.dtype else s.to(cdtype)).full_tensor()
        res = fn(full)
        self.stats.matrices_orthogonalized += s.shape[0]
        rep = DTensor.from_local(res, s.device_mesh, [Replicate()] * s.device_mesh.ndim, run_check=False)
        back = rep.redistribute(s.device_mesh, s.placements)
        return back if back.dtype == s.dtype else back.to(s.dtype)

    def _exchange(self, fn: MatrixFn, stacks, exchange, out) -> None:
        """Owner-based exchange: one all-to-all each way per process group and dtype.

        Every matrix (each of the ``k`` in a ``[k, m, n]`` stack) gets one owner
        (largest first, round-robin). Each rank sends its shard of every matrix to the
        matrix's owner, the owner assembles whole matrices, transforms each same-shape
        group as one batch, and sends every rank its shard of the results.
        """
        by_pg: dict = {}
        for i, md, sd in exchange:
            s = stacks[i]
            pg = s.device_mesh.get_group(md)
            # sent both ways in the dtype fn computes in where it is narrower (seam.compute_dtype:
            # bf16 Newton-Schulz on float32 shards sends half the bytes, same results)
            cdtype = compute_dtype(fn, s)
            by_pg.setdefault((id(pg), cdtype), (pg, cdtype, []))[2].append((i, sd))
        pieces: dict[int, list] = {i: [None] * stacks[i].shape[0] for i, _, _ in exchange}
        for pg, cdtype, items in by_pg.values():
            for (i, j), local in self._exchange_pg(fn, stacks, items, pg, cdtype):
                pieces[i][j] = local
        for i, ps in pieces.items():
            out[i] = _from_local(torch.stack(ps, dim=0).to(stacks[i].dtype), stacks[i])

    def _exchange_pg(self, fn: MatrixFn, stacks, items, pg, dtype: torch.dtype):
        world = dist.get_world_size(pg)
        me = dist.get_rank(pg)
        device = stacks[items[0][0]].to_local().device
        # one record per matrix: (stack, index in stack, stack dim of the shard, m, n, shard sizes)
        mats = []
        for i, sd in items:
            _, m, n = stacks[i].shape
            sizes = shard_sizes(m if sd == 1 else n, world)
            local = stacks[i].to_local()
            if local.shape[sd] != sizes[me]:
                raise ValueError(
                    f"unexpected local shard shape {tuple(local.shape)} for {m}x{n} matrices sharded on "
                    f"stack dim {sd} over {world} ranks (expected {sizes[me]} along it)"
                )
            for j in range(stacks[i].shape[0]):
                mats.append((i, j, sd, m, n, sizes))
        owners = assign_owners([m * n for (_, _, _, m, n, _) in mats], world)
        owned = [[k for k, o in enumerate(owners) if o == r] for r in range(world)]

        def shard_numel(k: int, r: int) -> int:
            _, _, sd, m, n, sizes = mats[k]
            return sizes[r] * (n if sd == 1 else m)

        # forward: my shard of each matrix, to its owner
        send_parts = [stacks[mats[k][0]].to_local()[mats[k][1]].reshape(-1).to(dtype)
                      for r in range(world) for k in owned[r]]
        in_splits = [sum(shard_numel(k, me) for k in owned[r]) for r in range(world)]
        out_splits = [sum(shard_numel(k, r) for k in owned[me]) for r in range(world)]
        recv = self._all_to_all(send_parts, in_splits, out_splits, dtype, device, pg, me)
        # assemble my whole matrices; transform each same-shape group as one batch
        by_rank = [list(p.split([shard_numel(k, r) for k in owned[me]])) for r, p in enumerate(recv.split(out_splits))]
        groups: dict = {}
        for pos, k in enumerate(owned[me]):
            _, _, sd, m, n, sizes = mats[k]
            blocks = [
                by_rank[r][pos].reshape(sizes[r], n) if sd == 1 else by_rank[r][pos].reshape(m, sizes[r])
                for r in range(world)
            ]
            groups.setdefault((m, n, sd), []).append((k, torch.cat(blocks, dim=sd - 1)))
        chunks: dict[int, tuple] = {}
        for (m, n, sd), members in groups.items():
            res = fn(torch.stack([full for _, full in members]))
            self.stats.matrices_orthogonalized += len(members)
            self.stats.shapes.append((m, n, len(members)))
            sizes = mats[members[0][0]][5]
            for (k, _), r_mat in zip(members, res):
                chunks[k] = r_mat.split(sizes, dim=sd - 1)
        # backward: each rank's shard of my results, back to it
        back_parts = [chunks[k][r].reshape(-1) for r in range(world) for k in owned[me]]
        back_in = [sum(shard_numel(k, r) for k in owned[me]) for r in range(world)]
        back_out = [sum(shard_numel(k, me) for k in owned[o]) for o in range(world)]
        got = self._all_to_all(back_parts, back_in, back_out, dtype, device, pg, me)
        for o, piece in enumerate(got.split(back_out)):
            for k, flat in zip(owned[o], piece.split([shard_numel(k, me) for k in owned[o]])):
                i, j, sd, m, n, sizes = mats[k]
                yield (i, j), flat.reshape((sizes[me], n) if sd == 1 else (m, sizes[me]))

    def _all_to_all(self, parts, in_splits, out_splits, dtype, device, pg, me) -> torch.Tensor:
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=pg)
        self._count(in_splits, out_splits, me, recv.element_size())
        return recv

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


    def sum_over(self, tensors: Sequence[torch.Tensor], dims: tuple[int, ...]) -> list[torch.Tensor]:
        """``t.sum(dims, keepdim=True)`` of each logical DTensor: local sums, then one
        all-reduce per (process group, dtype, device) for every tensor whose summed dims
        are sharded; the summed dims come back replicated, the other placements kept."""
        parts = []  # (local sum, mesh, placements, logical shape)
        pending: dict = {}
        for i, t in enumerate(tensors):
            nd = t.ndim
            ds = tuple(sorted({d % nd for d in dims}))
            local = t.to_local().sum(ds, keepdim=True)
            placements = list(t.placements)
            over = []
            for md, pl in enumerate(placements):
                if pl.is_partial():
                    raise ValueError(f"sum_over: Partial placements {t.placements} are not supported")
                if pl.is_shard() and pl.dim % nd in ds:
                    over.append(md)
                    placements[md] = Replicate()
            shape = tuple(1 if d in ds else n for d, n in enumerate(t.shape))
            parts.append((local, t.device_mesh, placements, shape))
            for md in over:
                pg = t.device_mesh.get_group(md)
                pending.setdefault((id(pg), local.dtype, local.device), (pg, []))[1].append(i)
        for pg, idx in pending.values():
            flat = torch.cat([parts[i][0].reshape(-1) for i in idx])
            dist.all_reduce(flat, group=pg)
            self.stats.reductions += 1
            for i, piece in zip(idx, flat.split([parts[i][0].numel() for i in idx])):
                parts[i] = (piece.view(parts[i][0].shape),) + parts[i][1:]
        out = []
        for local, mesh, placements, shape in parts:
            stride = torch.empty(shape, device="meta").stride()
            out.append(DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                          stride=stride))
        return out


#: The process-wide backend instance (installed by :func:`muonfx.distributed.install`).
BACKEND = DTensorBackend()
