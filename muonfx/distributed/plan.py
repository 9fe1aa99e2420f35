"""Pure planning for the owner-based matrix exchange (no communication here).

Every rank computes the same plan from the same inputs (global shapes, placements,
mesh shapes, the byte budget), so no rank waits on a decision another rank made
differently. The rules, for each matrix of each ``[k, m, n]`` stack:

* **holders**: the ranks whose piece of the stack holds part of the matrix
  (:mod:`muonfx.distributed.layout`);
* **owner**: the one rank that runs the matrix function on the whole matrix. Matrices
  are taken largest first by Newton-Schulz flops (:func:`ns_flops`) and each goes to
  the least-loaded candidate (longest-processing-time balancing): the ranks that hold
  it whole where there are such (an expert on its expert-parallel rank: nothing to
  send), else the ranks that hold a piece of it (so an expert stack with ``fully_shard``
  on another mesh dim is exchanged only among the ranks of that dim). Ties go to the
  rank holding more of the matrix, then to the lower rank;
* **sources**: each distinct piece not already on the owner is sent by one of the
  ranks holding it, the one sharing most mesh coordinates with the owner (its own
  replica group under HSDP);
* **targets**: every holder other than the owner receives its piece of the result
  (under HSDP, every replica: the work is split over replicate x shard, the results
  shared);
* **buckets**: each owner's exchanged matrices, largest first, are cut into buckets of
  at most ``budget`` bytes of whole matrices (in the exchange dtype); bucket ``b`` of
  every owner travels in the ``b``-th pair of all-to-alls. Matrices held whole by their
  owner alone need no bucket (``bucket == -1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .layout import Runs, StackLayout, runs_len

__all__ = ["shard_sizes", "assign_owners", "ns_flops", "Piece", "MatrixPlan", "ExchangePlan", "plan_exchange"]


def shard_sizes(size: int, world: int) -> list[int]:
    """Sizes of ``size`` split in ``world`` chunks the way ``torch.chunk``/DTensor ``Shard`` do.

    Chunks are ``ceil(size / world)`` long; trailing ranks get a shorter or empty one.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    chunk = -(-size // world) if size else 0
    return [max(0, min(size, (r + 1) * chunk) - r * chunk) for r in range(world)]


def ns_flops(m: int, n: int) -> int:
    """Flops of one Newton-Schulz iteration on an ``m x n`` matrix (``a = min, b = max``):
    ``4 a^2 b + 2 a^3``; the owners' loads are balanced in these units."""
    a, b = min(m, n), max(m, n)
    return 4 * a * a * b + 2 * a ** 3


def _lpt(weights: Sequence[int], candidates: Sequence[Sequence[int]], world: int,
         prefer: Sequence[dict[int, int]] | None = None) -> list[int]:
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    load = [0] * world
    owners = [0] * len(weights)
    for i in order:
        held = prefer[i] if prefer is not None else {}
        o = min(candidates[i], key=lambda r: (load[r], -held.get(r, 0), r))
        owners[i] = o
        load[o] += weights[i]
    return owners


def assign_owners(weights: Sequence[int], world: int) -> list[int]:
    """Owner rank of each matrix by longest-processing-time balancing: largest weight
    first (ties in input order), each to the least-loaded rank (ties: the lower rank).
    Equal weights are dealt round-robin.

    Example::

        >>> from muonfx.distributed.plan import assign_owners
        >>> assign_owners([4, 4, 4, 1, 9], 2)      # 9 | 4 + 4 + 4, then 1 to the lighter rank
        [1, 1, 1, 0, 0]
    """
    return _lpt(weights, [range(world)] * len(weights), world)


@dataclass(frozen=True)
class Piece:
    """One rank's piece of one matrix: the rank (in the exchange's group), the matrix's
    index in that rank's local stack, and the row and column runs it holds."""

    rank: int
    local: int
    rows: Runs
    cols: Runs

    @property
    def numel(self) -> int:
        return runs_len(self.rows) * runs_len(self.cols)


@dataclass(frozen=True)
class MatrixPlan:
    """Where one matrix goes: ``owner`` transforms it whole; ``own`` is the owner's own
    piece (None if it holds none), ``sources`` the pieces sent to it, ``targets`` the
    pieces of the result sent back, in bucket ``bucket`` (-1: no communication)."""

    stack: int
    index: int
    m: int
    n: int
    owner: int
    own: Piece | None
    sources: tuple[Piece, ...]
    targets: tuple[Piece, ...]
    bucket: int


@dataclass(frozen=True)
class ExchangePlan:
    """The plan of one exchange over ``world`` ranks; ``elsize`` bytes per element."""

    world: int
    elsize: int
    matrices: tuple[MatrixPlan, ...]
    buckets: int
    #: the matrices of each group, lead first (indices into ``matrices``), for a plan of
    #: several operands per matrix (``plan_exchange``'s ``lead``); None otherwise
    units: tuple[tuple[int, ...], ...] | None = None
    _per_rank: dict = field(default_factory=dict, compare=False, repr=False)

    def bytes_sent(self) -> list[int]:
        """Bytes each rank sends per exchange (forward and back)."""
        out = [0] * self.world
        for mp in self.matrices:
            for p in mp.sources:
                out[p.rank] += p.numel
            out[mp.owner] += sum(p.numel for p in mp.targets)
        return [b * self.elsize for b in out]

    def bytes_received(self) -> list[int]:
        """Bytes each rank receives per exchange (forward and back)."""
        out = [0] * self.world
        for mp in self.matrices:
            out[mp.owner] += sum(p.numel for p in mp.sources)
            for p in mp.targets:
                out[p.rank] += p.numel
        return [b * self.elsize for b in out]

    def loads(self) -> list[int]:
        """Newton-Schulz flops per iteration owned by each rank."""
        out = [0] * self.world
        for mp in self.matrices:
            out[mp.owner] += ns_flops(mp.m, mp.n)
        return out

    def owned(self) -> list[int]:
        """Matrices owned by each rank."""
        out = [0] * self.world
        for mp in self.matrices:
            out[mp.owner] += 1
        return out


def _positions(lay: StackLayout, j: int) -> list[tuple[int, int]]:
    """(mesh position, local index) of every position whose dim-0 runs hold index ``j``."""
    out = []
    for pos, (r0, _, _) in enumerate(lay.pieces):
        off = 0
        for a, b in r0:
            if a <= j < b:
                out.append((pos, off + j - a))
                break
            off += b - a
    return out


def plan_exchange(layouts: Sequence[StackLayout], ranks: Sequence[Sequence[int]], world: int,
                  elsize: int, budget: int, lead: Sequence[int] | None = None) -> ExchangePlan:
    """The exchange plan of ``layouts`` (one per stack), ``ranks[i][pos]`` the rank (in
    the exchange's group of ``world`` ranks) at mesh position ``pos`` of stack ``i``'s
    mesh; ``elsize`` bytes per element in the exchange dtype; ``budget`` bytes of whole
    matrices per owner and bucket. See the module doc for the rules.

    ``lead`` ties stacks together (a matrix function of several operands): ``lead[i]``
    is the first stack of stack ``i``'s group (``lead[i] == i`` for that one). Matrix
    ``j`` of every stack of a group then goes to the owner of the lead's matrix ``j``
    (chosen by the group's flops, among the lead's holders), in the same bucket (sized by
    the group's bytes), and every group travels (no matrix is left out of the buckets);
    :attr:`ExchangePlan.units` lists each group's matrices, lead first."""
    mats = []  # (stack, index, m, n, pieces)
    for si, lay in enumerate(layouts):
        k, m, n = lay.shape
        if m == 0 or n == 0:
            continue
        for j in range(k):
            pieces = []
            for pos, lj in _positions(lay, j):
                _, rows, cols = lay.pieces[pos]
                if rows and cols:
                    pieces.append(Piece(ranks[si][pos], lj, rows, cols))
            mats.append((si, j, m, n, pieces, lay))
    if lead is None:
        units = [[i] for i in range(len(mats))]
    else:
        at = {(si, j): i for i, (si, j, *_) in enumerate(mats)}
        members: dict[int, list[int]] = {}
        for s, ld in enumerate(lead):
            members.setdefault(ld, []).append(s)
        units = [[at[s, j] for s in members[si] if (s, j) in at] for (si, j, *_) in mats if lead[si] == si]
    weights = [sum(ns_flops(mats[i][2], mats[i][3]) for i in u) for u in units]
    candidates, held = [], []
    for u in units:
        (_, _, m, n, pieces, _) = mats[u[0]]
        whole = sorted({p.rank for p in pieces if p.numel == m * n})
        any_ = sorted({p.rank for p in pieces})
        candidates.append(whole or any_)
        h: dict[int, int] = {}
        for p in pieces:
            h[p.rank] = max(h.get(p.rank, 0), p.numel)
        held.append(h)
    owners = [0] * len(mats)
    for u, o in zip(units, _lpt(weights, candidates, world, held)):
        for i in u:
            owners[i] = o

    plans = []
    for (si, j, m, n, pieces, lay), owner in zip(mats, owners):
        own = next((p for p in pieces if p.rank == owner), None)
        coords_of = {ranks[si][pos]: lay.coords(pos) for pos in range(len(lay.pieces))}
        distinct: dict[tuple, list[Piece]] = {}
        for p in pieces:
            distinct.setdefault((p.rows, p.cols), []).append(p)
        sources = []
        for key, reps in distinct.items():
            if own is not None and (own.rows, own.cols) == key:
                continue
            oc = coords_of[owner]
            best = max(reps, key=lambda p: (sum(a == b for a, b in zip(coords_of[p.rank], oc)), -p.rank))
            sources.append(best)
        targets = tuple(p for p in pieces if p.rank != owner)
        plans.append([si, j, m, n, owner, own, tuple(sorted(sources, key=lambda p: p.rank)), targets, -1])

    # buckets: per owner, exchanged matrices (groups) largest first, cut at the budget
    order = sorted(range(len(units)), key=lambda i: (-weights[i], i))
    fill: dict[int, tuple[int, int]] = {}  # owner -> (bucket, bytes in it)
    buckets = 0
    for ui in order:
        u = units[ui]
        if lead is None and not plans[u[0]][6] and not plans[u[0]][7]:
            continue  # held whole by its owner alone: no bucket
        size = sum(plans[i][2] * plans[i][3] for i in u) * elsize
        owner = plans[u[0]][4]
        b, used = fill.get(owner, (0, 0))
        if used and used + size > budget:
            b, used = b + 1, 0
        fill[owner] = (b, used + size)
        for i in u:
            plans[i][8] = b
        buckets = max(buckets, b + 1)
    return ExchangePlan(world, elsize, tuple(MatrixPlan(*p) for p in plans), buckets,
                        None if lead is None else tuple(tuple(u) for u in units))
