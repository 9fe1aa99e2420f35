"""The DTensor side of :mod:`muonfx.seam`.

* :meth:`DTensorBackend.map_matrices`: every matrix of every stack, whatever its
  placements (``Shard`` of any dim, ``_StridedShard`` from ``fully_shard`` on top of
  tensor parallelism, ``Replicate``, on meshes of any number of dims), is transformed
  exactly once in the world, whole, on one owner rank, and its result goes back to
  every rank that holds a piece of it. Pieces travel in buckets of matrices under the
  byte budget (:func:`muonfx.linalg.batch_bytes`), one all-to-all each way per bucket
  over the ranks of the mesh, the next bucket's transfer overlapping the current
  bucket's work (:mod:`muonfx.distributed.exchange`); owners are balanced by
  Newton-Schulz flops, and a matrix held whole by one rank alone (an expert on its
  expert-parallel rank) is transformed there with no communication
  (:mod:`muonfx.distributed.plan`). The plan is made once per set of stacks (shapes,
  placements, meshes, exchange dtype, budget) and reused.
* :meth:`DTensorBackend.global_sum`: per-shard partial sums and one all-reduce over
  the sharded mesh dimensions.
* :meth:`DTensorBackend.sum_over`: local sums over the given dims; the sums of dims that
  are sharded are all-reduced, all tensors of a process group and dtype in one
  all-reduce (counted in :attr:`CommStats.reductions`).

Per-rank traffic and work are counted in :attr:`DTensorBackend.stats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from .._compat.dtensor import meshes_and_placements, rewrap_all, shards
from ..core.cache import LRU
from ..linalg.batching import batch_bytes
from ..linalg.settings import MatrixSettings
from ..seam import GroupFn, MatrixFn, ScalarFn, compute_dtype
from .exchange import RankProgram, rank_program, run_program
from .stats import CommStats
from .layout import is_cut, largest, lifted, mesh_ranks, stack_layout
from .plan import ExchangePlan, plan_exchange

__all__ = ["DTensorBackend", "CommStats", "BACKEND", "mesh_group"]


#: the process group and ranks of each mesh seen (by ``id``, the mesh held so that its
#: ``id`` stays its own), at most :data:`MESHES` (the least recently used goes first)
MESHES = 64
_GROUPS: LRU = LRU(MESHES)


def mesh_group(mesh) -> tuple[Any, tuple[int, ...]]:
    """The process group over all ranks of ``mesh`` and the global rank at each mesh
    position (row-major). The default group when the mesh spans the world; the mesh's
    own group for a 1-D mesh; else the mesh flattened (``DeviceMesh._flatten``)."""
    hit = _GROUPS.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2]
    ranks = mesh_ranks(mesh)
    if sorted(ranks) == list(range(dist.get_world_size())):
        group = dist.group.WORLD
    elif mesh.ndim == 1:
        group = mesh.get_group(0)
    else:
        group = mesh._flatten().get_group(0)
    _GROUPS[id(mesh)] = (mesh, group, ranks)
    return group, ranks


def comm_device(mesh) -> torch.device:
    """Where the collectives over ``mesh`` run: this rank's GPU for a CUDA mesh (also
    when FSDP2 keeps the shards on the host, ``CPUOffloadPolicy``), else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@dataclass
class _Planned:
    plan: ExchangePlan
    program: RankProgram


class DTensorBackend:
    """Seam backend for DTensors (FSDP2, HSDP, tensor, expert parallel; see the module doc)."""

    #: exchange plans kept (per set of stacks; the least recently used goes first)
    PLANS = 256

    def __init__(self) -> None:
        #: the counters of every exchange of the process (an optimizer's step also counts
        #: its own share in its :attr:`muonfx.TransformOptimizer.comm_stats`)
        self.stats = CommStats()
        self._plans: LRU = LRU(self.PLANS)

    def claims(self, t: torch.Tensor) -> bool:
        return isinstance(t, DTensor)

    # -- matrices -----------------------------------------------------------

    def map_matrices(self, fn: MatrixFn, stacks: Sequence[torch.Tensor],
                     settings: MatrixSettings | None = None) -> list[torch.Tensor]:
        # one exchange per (process group of the mesh the stacks are lifted to, exchange dtype), in the order
        # of first appearance (the same on every rank: the stacks are)
        jobs: dict[tuple, list[int]] = {}
        views = []
        meshes, placements = meshes_and_placements(stacks)
        onto = largest(meshes)
        # per distinct layout (mesh, placements) and per (dtype, device, matrix shape), not per stack
        layouts: dict[tuple, tuple] = {}
        dtypes: dict[tuple, torch.dtype] = {}
        for i, s in enumerate(stacks):
            on, pl = meshes[i], placements[i]
            lay = layouts.get((id(on), pl))
            if lay is None:
                if any(p.is_partial() for p in pl):
                    raise ValueError(f"map_matrices: Partial placements {pl} cannot be orthogonalised; "
                                     "reduce them first")
                mesh, keys = lifted(on, pl, onto)
                lay = layouts[id(on), pl] = (mesh, keys, id(mesh_group(mesh)[0]))
            views.append(lay[:2])
            # sent both ways in the dtype fn computes in where it is narrower (seam.compute_dtype:
            # bf16 Newton-Schulz on float32 shards sends half the bytes, same results)
            dt = dtypes.get((s.dtype, s.device, s.shape[1:]))
            if dt is None:
                dt = dtypes[s.dtype, s.device, s.shape[1:]] = compute_dtype(fn, s)
            jobs.setdefault((lay[2], dt), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(stacks)
        for (_, dtype), idx in jobs.items():
            sub = [stacks[i] for i in idx]
            for i, r in zip(idx, self._map(fn, sub, [views[i] for i in idx], dtype, settings)):
                out[i] = r
        return out  # type: ignore[return-value]

    def planned(self, stacks: Sequence[DTensor], views: Sequence[tuple], dtype: torch.dtype,
                settings: MatrixSettings | None = None,
                lead: tuple[int, ...] | None = None) -> tuple[ExchangePlan, RankProgram, Any]:
        """The plan for ``stacks`` (on the meshes and placements ``views``, see
        :func:`~muonfx.distributed.layout.lifted`) exchanged in ``dtype`` under the batch
        budget of ``settings`` (None: the process's), with the stacks tied in groups by
        ``lead`` (:func:`~muonfx.distributed.plan.plan_exchange`): made once, then reused;
        this rank's program; the process group."""
        mesh = views[0][0]
        group, _ = mesh_group(mesh)
        budget = batch_bytes(mesh.device_type) if settings is None else settings.budget(mesh.device_type)
        key = (dtype, budget, id(group), lead) + tuple((tuple(s.shape), v[1], id(v[0])) for s, v in zip(stacks, views))
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = self._make_plan(stacks, views, dtype, budget, group, lead)
        return hit.plan, hit.program, group

    def _make_plan(self, stacks: Sequence[DTensor], views: Sequence[tuple], dtype: torch.dtype, budget: int,
                   group, lead: tuple[int, ...] | None = None) -> _Planned:
        world = dist.get_world_size(group)
        layouts, ranks = [], []
        for s, (mesh, keys) in zip(stacks, views):
            layouts.append(stack_layout(tuple(s.shape), tuple(mesh.mesh.shape), keys))
            ranks.append([dist.get_group_rank(group, r) for r in mesh_group(mesh)[1]])
        # every rank checks the layouts against every rank's local shapes (once per plan)
        device = comm_device(views[0][0])
        mine = torch.tensor([d for s in stacks for d in s.to_local().shape], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        for r in range(world):
            got = gathered[r].cpu().view(-1, 3).tolist()
            for si, (lay, shape) in enumerate(zip(layouts, got)):
                pos = ranks[si].index(r)
                if list(lay.local_shape(pos)) != shape:
                    raise ValueError(
                        f"map_matrices: rank {r} holds a {shape} piece of a {list(stacks[si].shape)} stack with "
                        f"placements {stacks[si].placements}, where muonfx computed {list(lay.local_shape(pos))}; "
                        "this layout is not supported on this torch version")
        elsize = torch.empty((), dtype=dtype).element_size()
        plan = plan_exchange(layouts, ranks, world, elsize, budget, lead)
        self.stats.plans += 1
        return _Planned(plan, rank_program(plan, dist.get_rank(group)))

    def _map(self, fn: MatrixFn, stacks: Sequence[DTensor], views: Sequence[tuple], dtype: torch.dtype,
             settings: MatrixSettings | None = None, lead: tuple[int, ...] | None = None) -> list[DTensor]:
        own = getattr(settings, "stats", None)  # the stepping optimizer's counters
        before = self.stats.snapshot() if own is not None else None
        plan, prog, group = self.planned(stacks, views, dtype, settings, lead)
        locals_ = shards(stacks, DTensor)
        outs = [torch.empty_like(loc) for loc in locals_]
        stats = self.stats

        def wait(work) -> None:  # bounded by the process group's timeout (the one the user set)
            t0 = time.perf_counter()
            work.wait()
            stats.wait_seconds += time.perf_counter() - t0

        run_program(prog, fn, locals_, outs, dtype, group, stats, wait, comm_device(views[0][0]), settings)
        self.stats.buckets += plan.buckets
        if own is not None:
            own.add_since(before, self.stats)
        return rewrap_all(outs, stacks)

    def map_matrix_groups(self, fn: GroupFn, groups: Sequence[Sequence[torch.Tensor]],
                          settings: MatrixSettings | None = None) -> list[list[torch.Tensor]]:
        """:func:`muonfx.seam.map_matrix_groups` on DTensors: matrix ``j`` of every stack of
        a group is gathered whole on one owner rank (the owner of the group's first stack's
        matrix ``j``), ``fn`` runs there once per group and matrix, and the results' pieces
        go back to their holders; one exchange per (process group, dtype) for all groups."""
        flat: list[torch.Tensor] = []
        where: list[int] = []  # flat stack -> its group
        for gi, g in enumerate(groups):
            flat.extend(g)
            where.extend([gi] * len(g))
        meshes, placements = meshes_and_placements(flat)
        onto = largest(meshes)
        views, jobs, job_of = [], {}, {}  # (process group, dtype) -> flat stacks; group -> its job
        for i, s in enumerate(flat):
            if any(p.is_partial() for p in placements[i]):
                raise ValueError(f"map_matrix_groups: Partial placements {placements[i]} are not supported")
            mesh, keys = lifted(meshes[i], placements[i], onto)
            views.append((mesh, keys))
            job = job_of.setdefault(where[i], (id(mesh_group(mesh)[0]), s.dtype))
            if job != (id(mesh_group(mesh)[0]), s.dtype):
                raise ValueError(f"map_matrix_groups: the stacks of group {where[i]} are on several process groups "
                                 "or of several dtypes; a group's stacks share the parameter's mesh and dtype")
            jobs.setdefault(job, []).append(i)
        out: list = [None] * len(flat)
        for (_, dtype), idx in jobs.items():
            first: dict[int, int] = {}
            lead = tuple(first.setdefault(where[i], p) for p, i in enumerate(idx))

            def call(s: int, j: int, mats: list[torch.Tensor], idx=idx) -> list[torch.Tensor]:
                return fn(where[idx[s]], j, mats)

            res = self._map(call, [flat[i] for i in idx], [views[i] for i in idx], dtype, settings, lead)
            for i, r in zip(idx, res):
                out[i] = r
        got, at = [], 0
        for g in groups:
            got.append(out[at:at + len(g)])
            at += len(g)
        return got

    # -- global reductions ----------------------------------------------------

    def global_sum(self, fn: ScalarFn, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        groups: dict = {}
        for t in tensors:
            mesh = t.device_mesh
            dims = tuple(md for md, p in enumerate(t.placements) if is_cut(p))
            if any(p.is_partial() for p in t.placements):
                raise ValueError(f"global_sum: Partial placements {t.placements} are not supported")
            groups.setdefault((id(mesh), dims), (mesh, dims, []))[2].append(t)
        total = None
        for mesh, dims, ts in groups.values():
            parts = [fn(t.to_local()) for t in ts]
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
            s = torch.stack([p.to(dtype) for p in parts]).sum()
            if dims:
                s = s.to(comm_device(mesh))
            for md in dims:
                dist.all_reduce(s, group=mesh.get_group(md))
            s = s.to(parts[0].device)
            total = s if total is None else total + s.to(total.device)
        return total if total is not None else torch.zeros(())


    def sum_over(self, tensors: Sequence[torch.Tensor], dims: tuple[int, ...]) -> list[torch.Tensor]:
        """``t.sum(dims, keepdim=True)`` of each logical DTensor: local sums, then one
        all-reduce per (process group, dtype, device) for every tensor whose summed dims
        are sharded; the summed dims come back replicated, the other placements kept."""
        parts = []  # (local sum, mesh, placements, logical shape)
        pending: dict = {}
        devices: dict = {}
        for i, t in enumerate(tensors):
            nd = t.ndim
            ds = tuple(sorted({d % nd for d in dims}))
            local = t.to_local().sum(ds, keepdim=True)
            placements = list(t.placements)
            over = []
            for md, pl in enumerate(placements):
                if pl.is_partial():
                    raise ValueError(f"sum_over: Partial placements {t.placements} are not supported")
                if is_cut(pl) and pl.dim % nd in ds:
                    over.append(md)
                    placements[md] = Replicate()
            shape = tuple(1 if d in ds else n for d, n in enumerate(t.shape))
            parts.append((local, t.device_mesh, placements, shape))
            for md in over:
                pg = t.device_mesh.get_group(md)
                key = (id(pg), local.dtype, local.device)
                pending.setdefault(key, (pg, []))[1].append(i)
                devices[key] = comm_device(t.device_mesh)
        for (pg, idx), dev in zip(pending.values(), devices.values()):
            home = parts[idx[0]][0].device
            flat = torch.cat([parts[i][0].reshape(-1) for i in idx]).to(dev)
            dist.all_reduce(flat, group=pg)
            flat = flat.to(home)
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
