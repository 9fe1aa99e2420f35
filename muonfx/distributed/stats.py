"""The counters of the matrix exchange: :class:`CommStats` (a plain record, no
distributed import: every optimizer holds one)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Counters of this rank's matrix traffic and work (reset with :meth:`reset`).

    ``bytes_sent`` / ``bytes_received`` count what crossed to or from other ranks in
    the matrix exchange (in the exchange dtype); ``collectives`` its all-to-alls (two
    per bucket); ``buckets`` the buckets; ``wait_seconds`` the time this rank spent
    blocked waiting for them (what the overlap did not hide); ``reductions`` the
    all-reduces of :meth:`DTensorBackend.sum_over`; ``plans`` the exchange plans made
    (once per set of stacks); ``matrices_orthogonalized`` the matrices this rank
    transformed."""

    elements_sent: int = 0
    elements_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    buckets: int = 0
    wait_seconds: float = 0.0
    reductions: int = 0
    plans: int = 0
    matrices_orthogonalized: int = 0
    shapes: list = field(default_factory=list)

    def reset(self) -> None:
        self.elements_sent = self.elements_received = self.bytes_sent = self.bytes_received = 0
        self.collectives = self.buckets = self.reductions = self.plans = self.matrices_orthogonalized = 0
        self.wait_seconds = 0.0
        self.shapes = []

    def snapshot(self) -> tuple:
        """The counters now (to count a call's share with :meth:`add_since`)."""
        return tuple(getattr(self, f.name) for f in _COUNTERS) + (len(self.shapes),)

    def add_since(self, before: tuple, source: "CommStats") -> None:
        """Add what ``source`` counted since its :meth:`snapshot` ``before``."""
        for f, b in zip(_COUNTERS, before):
            setattr(self, f.name, getattr(self, f.name) + getattr(source, f.name) - b)
        self.shapes.extend(source.shapes[before[-1]:])


_COUNTERS = tuple(f for f in fields(CommStats) if f.name != "shapes")
