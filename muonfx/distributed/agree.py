"""Agree on a rank-local error before the step's collectives.

A rank whose ``step()`` raises before the matrix exchange (a gradient it cannot take,
a hyperparameter that is not a number) would leave every other rank waiting in the
all-to-all until the process group's timeout (gloo: 30 minutes by default). So the
FSDP adapter runs its cheap checks inside :func:`agree`: every rank runs them, then one
all-reduce of one flag per rank tells each rank who failed, and every rank raises.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

__all__ = ["agree", "RankFailed"]

T = TypeVar("T")


class RankFailed(RuntimeError):
    """Raised on the ranks that did not fail, when another rank's checks did.

    Attributes:
        ranks: the global ranks whose checks raised (each raises its own error).
    """

    def __init__(self, what: str, ranks: list[int]) -> None:
        self.ranks = ranks
        super().__init__(f"{what} failed on rank(s) {ranks} (see the error there); this rank stopped before "
                         "any collective and changed nothing")


def agree(check: Callable[[], T], what: str = "step()", group: dist.ProcessGroup | None = None,
          device: torch.device | str = "cpu") -> T:
    """Run ``check()`` on every rank of ``group``; if it raised anywhere, raise everywhere.

    One ``all_reduce`` of ``world`` int32 flags (on ``device``: the CPU for gloo, the
    rank's GPU for NCCL). The rank(s) whose ``check`` raised re-raise their own
    exception; the others raise :class:`RankFailed` naming them. Returns ``check()``'s
    result when every rank passed. Every rank of ``group`` must call it, in the same
    order as its other collectives.

    Example (on each rank of an initialised process group)::

        work = agree(lambda: validate(batch), "validate")   # raises on all ranks or none
    """
    err: BaseException | None = None
    result = None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    world, me = dist.get_world_size(group), dist.get_rank(group)
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    if err is not None:
        flags[me] = 1
    dist.all_reduce(flags, group=group)
    if err is not None:
        raise err
    failed = flags.nonzero().flatten().tolist()
    if failed:
        ranks = [dist.get_global_rank(group, r) for r in failed] if group is not None else failed
        raise RankFailed(what, ranks)
    return result  # type: ignore[return-value]
