"""Agree on a rank-local error before a step's collectives: the agreement primitive.

A rank whose ``step()`` raises before the matrix exchange (a gradient it cannot take,
a hyperparameter that is not a number, a static setting its transform refuses) would
leave every other rank waiting in the all-to-all until the process group's timeout
(gloo: 30 minutes by default). So every rank runs its rank-local checks inside
:func:`agree` (or :func:`agree_counts`): one all-reduce of one flag per rank (and of
the counts given) tells every rank who failed, and every rank raises before any other
collective of the step, changing nothing. The all-reduce waits at most the process
group's timeout (the one the user set with ``init_process_group(timeout=...)``).

What the checks are is the caller's: the adapter's (gathering and checking each param
group, and which gradients are missing where) is :mod:`muonfx.optim.agreement`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = ["agree", "agree_counts", "who_has", "step_group", "RankFailed"]

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


def _flags(err: BaseException | None, counts: Sequence[int], group, device) -> tuple[list[int], list[int]]:
    """One all-reduce: the ranks (in ``group``) that failed, and ``counts`` summed."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    flags = torch.zeros(world + len(counts), dtype=torch.int32)
    if err is not None:
        flags[me] = 1
    if counts:
        flags[world:] = torch.tensor(list(counts), dtype=torch.int32)
    flags = flags.to(device)
    dist.all_reduce(flags, group=group)
    flags = flags.cpu()
    return flags[:world].nonzero().flatten().tolist(), flags[world:].tolist()


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
    return agree_counts(check, (), what, group, device)[0]


def agree_counts(check: Callable[[], T], counts: Sequence[int], what: str = "step()",
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> tuple[T, list[int]]:
    """:func:`agree`, with this rank's ``counts`` summed over the ranks of ``group`` in the
    same all-reduce: ``(check()'s result, the summed counts)``."""
    err: BaseException | None = None
    result = None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    failed, summed = _flags(err, counts, group, device)
    _raise(err, failed, what, group)
    return result, summed  # type: ignore[return-value]


def _raise(err: BaseException | None, failed: list[int], what: str, group) -> None:
    if err is not None:
        raise err
    if failed:
        ranks = [dist.get_global_rank(group, r) for r in failed] if group is not None else failed
        raise RankFailed(what, ranks)


def step_group(ref) -> tuple[Any, torch.device] | None:
    """The process group and flag device of a step's agreement for an optimizer whose
    DTensor parameter on the largest mesh is ``ref``
    (:func:`muonfx.distributed.check_params`); None where there is nothing to agree (no
    DTensor, no process group, or one rank)."""
    if ref is None or not dist.is_initialized():
        return None
    from .backend import mesh_group

    group, ranks = mesh_group(ref.device_mesh)
    if len(set(ranks)) == 1:
        return None
    if ref.device_mesh.device_type == "cuda":
        return group, torch.device("cuda", torch.cuda.current_device())
    return group, torch.device(ref.device_mesh.device_type)


def who_has(flags: Sequence[bool], group, device) -> list[tuple[list[int], list[int]]]:
    """For each of this rank's ``flags``: the global ranks of ``group`` where it is set and
    those where it is not (one all-reduce of a ``world x len(flags)`` table)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, len(flags), dtype=torch.int32)
    table[me] = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    table = table.to(device)
    dist.all_reduce(table, group=group)
    table = table.cpu()
    glob = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    out = []
    for c in range(len(flags)):
        col = table[:, c].tolist()
        out.append(([glob[r] for r in range(world) if col[r]], [glob[r] for r in range(world) if not col[r]]))
    return out
