"""Pure planning for the owner-based matrix exchange (no communication here).

Every rank computes the same plan from the same inputs, so no rank waits on a
decision another rank made differently.
"""

from __future__ import annotations

from typing import Sequence


def shard_sizes(size: int, world: int) -> list[int]:
    """Sizes of ``size`` split in ``world`` chunks the way ``torch.chunk``/DTensor ``Shard`` do.

    Chunks are ``ceil(size / world)`` long; trailing ranks get a shorter or empty one.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    chunk = -(-size // world) if size else 0
    return [max(0, min(size, (r + 1) * chunk) - r * chunk) for r in range(world)]


def assign_owners(numels: Sequence[int], world: int) -> list[int]:
    """Owner rank of each matrix: sorted by size (largest first, ties in input order),
    then dealt round-robin, so every rank gets about the same amount of work."""
    order = sorted(range(len(numels)), key=lambda i: (-numels[i], i))
    owners = [0] * len(numels)
    for pos, i in enumerate(order):
        owners[i] = pos % world
    return owners
