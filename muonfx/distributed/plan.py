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
                  elsize: int, budget: int) -> ExchangePlan:
    """The exchange plan of ``layouts`` (one per stack), ``ranks[i][pos]`` the rank (in
    the exchange's group of ``world`` ranks) at mesh position ``pos`` of stack ``i``'s
    mesh; ``elsize`` bytes per element in the exchange dtype; ``budget`` bytes of whole
    matrices per owner and bucket. See the module doc for the rules."""
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
    weights = [ns_flops(m, n) for (_, _, m, n, _, _) in mats]
    candidates, held = [], []
    for (_, _, m, n, pieces, _) in mats:
        whole = sorted({p.rank for p in pieces if p.numel == m * n})
        any_ = sorted({p.rank for p in pieces})
        candidates.append(whole or any_)
        h: dict[int, int] = {}
        for p in pieces:
            h[p.rank] = max(h.get(p.rank, 0), p.numel)
        held.append(h)
    owners = _lpt(weights, candidates, world, held)

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
        plans.append([si, j, m, n, owner, own, tuple(sorted(sources, key=lambda p: p.rank)), targets])

    # buckets: per owner, exchanged matrices largest first, cut at the budget
    order = sorted(range(len(plans)), key=lambda i: (-weights[i], i))
    fill: dict[int, tuple[int, int]] = {}  # owner -> (bucket, bytes in it)
    buckets = 0
    for i in order:
        p = plans[i]
        if not p[6] and not p[7]:
            p.append(-1)
            continue
        size = p[2] * p[3] * elsize
        b, used = fill.get(p[4], (0, 0))
        if used and used + size > budget:
            b, used = b + 1, 0
        fill[p[4]] = (b, used + size)
        p.append(b)
        buckets = max(buckets, b + 1)
    return ExchangePlan(world, elsize, tuple(MatrixPlan(*p) for p in plans), buckets)
