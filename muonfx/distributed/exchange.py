"""Run an :class:`~muonfx.distributed.plan.ExchangePlan` on one rank.

Per bucket, one all-to-all brings every piece of the bucket's matrices to their owners
and one brings each rank its pieces of the results. The collectives are asynchronous:
the next bucket's pieces travel while this bucket's matrix function runs, and at most
two buckets' results are in flight, so the extra memory stays about two buckets' worth.
Matrices held whole by their owner alone are transformed while the first bucket
travels. Which rank sends what, in which order, is fixed by the plan; only the data
moves at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..linalg.settings import MatrixSettings
from ..seam import MatrixFn, local_map_matrices
from .layout import Runs, runs_len
from .plan import ExchangePlan

__all__ = ["RankProgram", "rank_program", "run_program"]


@dataclass
class _Bucket:
    send: list[list[tuple[int, int]]]            # per destination: (stack, local index) of my pieces
    send_splits: list[int]
    recv: list[list[tuple[int, Runs, Runs]]]     # per source: (owned matrix slot, rows, cols)
    recv_splits: list[int]
    shapes: list[tuple[int, int, int]]           # (m, n, count) of the whole matrices I assemble
    own: list[tuple[int, int, int, Runs, Runs]]  # (slot, stack, local index, rows, cols): my own pieces
    back_send: list[list[tuple[int, Runs, Runs]]]  # per destination: (slot, rows, cols)
    back_splits: list[int]
    back_recv: list[list[tuple[int, int]]]       # per owner: (stack, local index) the result piece goes to
    back_recv_splits: list[int]
    mine: int                                     # matrices I own in this bucket
    groups: list[tuple[int, int, list[int]]]      # (lead stack, index, slots of its group): plans with units


@dataclass
class RankProgram:
    """One rank's share of a plan: its matrices held whole and alone (``local``: per
    stack, the local indices), and per bucket what it sends, receives and assembles."""

    me: int
    world: int
    local: list[tuple[int, list[int]]]
    buckets: list[_Bucket]
    grouped: bool = False


def rank_program(plan: ExchangePlan, me: int) -> RankProgram:
    """``me``'s view of ``plan`` (pure; cached by the backend with the plan)."""
    W = plan.world
    local: dict[int, list[int]] = {}
    buckets = [_Bucket([[] for _ in range(W)], [0] * W, [[] for _ in range(W)], [0] * W, [], [],
                       [[] for _ in range(W)], [0] * W, [[] for _ in range(W)], [0] * W, 0, [])
               for _ in range(plan.buckets)]
    slots: list[dict[tuple[int, int], int]] = [{} for _ in range(plan.buckets)]
    order = sorted(range(len(plan.matrices)), key=lambda i: (plan.matrices[i].bucket, plan.matrices[i].m,
                                                             plan.matrices[i].n, i))
    # slots: my owned matrices of each bucket, grouped by shape (one batch per shape)
    for i in order:
        mp = plan.matrices[i]
        if mp.bucket < 0:
            if mp.owner == me:
                local.setdefault(mp.stack, []).append(mp.own.local)  # type: ignore[union-attr]
            continue
        bk = buckets[mp.bucket]
        if mp.owner == me:
            if bk.shapes and bk.shapes[-1][:2] == (mp.m, mp.n):
                m, n, c = bk.shapes[-1]
                bk.shapes[-1] = (m, n, c + 1)
            else:
                bk.shapes.append((mp.m, mp.n, 1))
            slots[mp.bucket][(mp.stack, mp.index)] = bk.mine
            bk.mine += 1
    for i in order:
        mp = plan.matrices[i]
        if mp.bucket < 0:
            continue
        bk = buckets[mp.bucket]
        for p in mp.sources:
            if p.rank == me:
                bk.send[mp.owner].append((mp.stack, p.local))
                bk.send_splits[mp.owner] += p.numel
        for p in mp.targets:
            if p.rank == me:
                bk.back_recv[mp.owner].append((mp.stack, p.local))
                bk.back_recv_splits[mp.owner] += p.numel
        if mp.owner != me:
            continue
        slot = slots[mp.bucket][(mp.stack, mp.index)]
        if mp.own is not None:
            bk.own.append((slot, mp.stack, mp.own.local, mp.own.rows, mp.own.cols))
        for p in mp.sources:
            bk.recv[p.rank].append((slot, p.rows, p.cols))
            bk.recv_splits[p.rank] += p.numel
        for p in mp.targets:
            bk.back_send[p.rank].append((slot, p.rows, p.cols))
            bk.back_splits[p.rank] += p.numel
    for unit in plan.units or ():
        lead = plan.matrices[unit[0]]
        if lead.owner == me:
            b = lead.bucket
            buckets[b].groups.append((lead.stack, lead.index, [slots[b][plan.matrices[u].stack, plan.matrices[u].index]
                                                               for u in unit]))
    return RankProgram(me, W, sorted(local.items()), buckets, plan.units is not None)


def _runs_copy(full: torch.Tensor, piece: torch.Tensor, rows: Runs, cols: Runs, into_full: bool) -> None:
    """Copy ``piece`` (``[len(rows), len(cols)]``) into ``full``'s runs, or the reverse."""
    if len(rows) == 1 and len(cols) == 1:
        (a, b), (c, d) = rows[0], cols[0]
        if into_full:
            full[a:b, c:d].copy_(piece)
        else:
            piece.copy_(full[a:b, c:d])
        return
    ro = 0
    for a, b in rows:
        co = 0
        for c, d in cols:
            dst, src = (full[a:b, c:d], piece[ro:ro + b - a, co:co + d - c])
            (dst.copy_(src) if into_full else src.copy_(dst))
            co += d - c
        ro += b - a


class _Counter:
    def __init__(self, stats, me: int, elsize: int) -> None:
        self.stats, self.me, self.elsize = stats, me, elsize

    def __call__(self, send_splits: Sequence[int], recv_splits: Sequence[int]) -> None:
        sent = sum(v for r, v in enumerate(send_splits) if r != self.me)
        got = sum(v for r, v in enumerate(recv_splits) if r != self.me)
        st = self.stats
        st.elements_sent += sent
        st.elements_received += got
        st.bytes_sent += sent * self.elsize
        st.bytes_received += got * self.elsize
        st.collectives += 1


def run_program(prog: RankProgram, fn: MatrixFn, locals_: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                dtype: torch.dtype, group, stats, wait: Callable[[object], None], device: torch.device,
                settings: MatrixSettings | None = None) -> None:
    """Transform the matrices of ``locals_`` (the stacks' local tensors) as ``prog``
    says, writing this rank's pieces of the results into ``outs`` (tensors shaped like
    ``locals_``); ``dtype`` is the exchange dtype, ``wait(work)`` waits for a collective,
    ``device`` the one the collectives and the owners' work run on (the mesh's: a GPU
    under NCCL also when FSDP2 offloads the shards to the host), ``settings`` the step's
    (the owners' batch budget; None: the process's). A program of groups
    (``prog.grouped``) calls ``fn(lead stack, index, [whole matrices of the group])``
    once per group it owns, which returns the group's results (the same shapes)."""
    count = _Counter(stats, prog.me, torch.empty((), dtype=dtype).element_size())
    W = prog.world

    def a2a(parts: list[torch.Tensor], send_splits: list[int], recv_splits: list[int]):
        if parts:
            send = torch.cat([p.to(device=device, dtype=dtype) for p in parts])
        else:
            send = torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
        count(send_splits, recv_splits)
        return work, recv, send

    def forward(bk: _Bucket):
        parts = [locals_[s][j].reshape(-1) for dst in range(W) for s, j in bk.send[dst]]
        return a2a(parts, bk.send_splits, bk.recv_splits)

    pending = forward(prog.buckets[0]) if prog.buckets else None

    # matrices held whole by me alone: transformed while the first bucket travels
    if prog.local:
        parts = []
        for s, js in prog.local:
            loc = locals_[s]
            part = loc if len(js) == loc.shape[0] else loc[torch.tensor(js, device=loc.device)]
            parts.append(part.to(device))
        results = local_map_matrices(fn, parts, settings)
        for (s, js), res in zip(prog.local, results):
            if len(js) == outs[s].shape[0]:
                outs[s].copy_(res)
            else:
                outs[s][torch.tensor(js, device=outs[s].device)] = res.to(device=outs[s].device, dtype=outs[s].dtype)
        stats.matrices_orthogonalized += sum(len(js) for _, js in prog.local)

    backs: list = []
    for b, bk in enumerate(prog.buckets):
        work, recv, _send = pending
        pending = forward(prog.buckets[b + 1]) if b + 1 < len(prog.buckets) else None
        wait(work)
        # assemble my whole matrices, one buffer per shape
        bufs = [torch.empty(c, m, n, dtype=dtype, device=device) for m, n, c in bk.shapes]
        views = [buf[i] for buf in bufs for i in range(buf.shape[0])]
        for slot, s, j, rows, cols in bk.own:
            _runs_copy(views[slot], locals_[s][j], rows, cols, True)
        off = 0
        for src in range(W):
            for slot, rows, cols in bk.recv[src]:
                nr, nc = runs_len(rows), runs_len(cols)
                _runs_copy(views[slot], recv[off:off + nr * nc].view(nr, nc), rows, cols, True)
                off += nr * nc
        del recv
        if prog.grouped:
            results = [torch.empty_like(buf) for buf in bufs]
            res_views = [r[i] for r in results for i in range(r.shape[0])]
            for s, j, group_slots in bk.groups:
                for slot, r in zip(group_slots, fn(s, j, [views[x] for x in group_slots])):  # type: ignore[call-arg]
                    res_views[slot].copy_(r)
            stats.matrices_orthogonalized += len(bk.groups)
        else:
            results = local_map_matrices(fn, bufs, settings) if bufs else []
            res_views = [r[i] for r in results for i in range(r.shape[0])]
            stats.matrices_orthogonalized += bk.mine
        del bufs, views
        for m, n, c in bk.shapes:
            stats.shapes.append((m, n, c))
        parts = []
        for dst in range(W):
            for slot, rows, cols in bk.back_send[dst]:
                piece = torch.empty(runs_len(rows), runs_len(cols), dtype=dtype, device=device)
                _runs_copy(res_views[slot], piece, rows, cols, False)
                parts.append(piece.reshape(-1))
        for slot, s, j, rows, cols in bk.own:
            _runs_copy(res_views[slot], outs[s][j], rows, cols, False)
        backs.append((bk, a2a(parts, bk.back_splits, bk.back_recv_splits)))
        del results, res_views, parts
        if len(backs) > 1:
            _land(backs.pop(0), outs, W, wait)
    while backs:
        _land(backs.pop(0), outs, W, wait)


def _land(item, outs: Sequence[torch.Tensor], W: int, wait: Callable[[object], None]) -> None:
    """Wait for a bucket's results and write my pieces of them."""
    bk, (work, recv, _send) = item
    wait(work)
    off = 0
    for src in range(W):
        for s, j in bk.back_recv[src]:
            dst = outs[s][j]
            k = dst.numel()
            dst.copy_(recv[off:off + k].view(dst.shape))
            off += k
