"""Agree on a rank-local error before the step's collectives.

A rank whose ``step()`` raises before the matrix exchange (a gradient it cannot take,
a hyperparameter that is not a number, a static setting its transform refuses) would
leave every other rank waiting in the all-to-all until the process group's timeout
(gloo: 30 minutes by default). So the adapter (:class:`muonfx.TransformOptimizer` on
DTensor parameters) runs its rank-local checks inside :func:`agreed_work`: every rank
runs them, then one all-reduce of one flag per rank and one count per parameter (on how
many ranks it has a gradient) tells every rank who failed and which gradients are
missing where, and every rank raises before any other collective of the step, changing
nothing. The all-reduce waits at most the process group's timeout (the one the user set
with ``init_process_group(timeout=...)``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = ["agree", "agreed_work", "RankFailed", "GradientsDiffer"]

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


class GradientsDiffer(ValueError):
    """Raised on every rank, with the same message, when parameters have a gradient on
    some ranks and ``grad=None`` on others; no rank changed anything.

    Attributes:
        params: ``{name: (ranks with a gradient, ranks with grad=None)}``.
    """

    def __init__(self, params: dict[str, tuple[list[int], list[int]]]) -> None:
        self.params = params
        shown = "; ".join(f"{n!r} has a gradient on rank(s) {has} and grad=None on rank(s) {lacks}"
                          for n, (has, lacks) in list(params.items())[:5])
        more = f" (and {len(params) - 5} more)" if len(params) > 5 else ""
        super().__init__(
            f"step(): parameter {shown}{more}. Every rank must have a gradient for a parameter, or none: set "
            "the missing ones to zeros (p.grad = torch.zeros_like(p)) to step them, or grad=None on every rank "
            "to skip them. No rank changed anything.")


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
    err: BaseException | None = None
    result = None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    failed, _ = _flags(err, (), group, device)
    _raise(err, failed, what, group)
    return result  # type: ignore[return-value]


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


def agreed_work(records: Sequence[Any], param_groups: Sequence[dict], group, device, what: str = "step()") -> list:
    """The step's work (:func:`muonfx.optim.groups.gather` of every group), gathered and
    checked on every rank, agreed in one all-reduce.

    The rank-local checks: every gradient (sparse, complex, shape, device and local
    shard against its parameter), every group's hyperparameters
    (:func:`muonfx.hyperparams.check_group_values`, numbers under the names whose
    defaults are numbers) and the group's transform built from them (a static setting
    it refuses, such as ``ns_steps=0`` or an unknown ``ns_method``). If they raised on a
    rank, it raises its error and the others :class:`RankFailed`; if a parameter has a
    gradient on some ranks only, every rank raises :class:`GradientsDiffer`. Else the
    list of :class:`~muonfx.optim.groups.GroupWork` is returned, one per group (None for a
    group without gradients).
    """
    from ..optim.groups import gather

    present = [p.grad is not None for g in param_groups for p in g["params"]]
    err: BaseException | None = None
    work: list = []
    try:
        for rec, group_ in zip(records, param_groups):
            w = gather(rec, group_)
            if w is not None:
                _check_work(rec, w)
            work.append(w)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    failed, counts = _flags(err, [int(x) for x in present], group, device)
    _raise(err, failed, what, group)
    world = dist.get_world_size(group)
    odd = [i for i, c in enumerate(counts) if 0 < c < world]
    if odd:
        raise GradientsDiffer(_who_has(records, odd, present, group, device))
    return work


def _who_has(records, odd: list[int], present: list[bool], group, device) -> dict[str, tuple[list[int], list[int]]]:
    """Which ranks have the gradients of parameters ``odd`` (flat positions): one more
    small all-reduce, on the error path only."""
    from ..core import key_str

    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, len(odd), dtype=torch.int32)
    table[me] = torch.tensor([int(present[i]) for i in odd], dtype=torch.int32)
    table = table.to(device)
    dist.all_reduce(table, group=group)
    table = table.cpu()
    names = [key_str(k) for rec in records for k in rec.keys]
    glob = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    out = {}
    for c, i in enumerate(odd):
        col = table[:, c].tolist()
        out[names[i]] = ([glob[r] for r in range(world) if col[r]], [glob[r] for r in range(world) if not col[r]])
    return out


def _check_work(rec, w) -> None:
    """What can fail on one rank alone before the exchange, for one group's work."""
    from ..core import check_like, key_str
    from ..counts import Counts
    from ..hyperparams import check_group_values
    from ..wrappers import hyperparam_values, signature

    sig = signature(rec.factory).parameters
    numeric = {n for n, p in sig.items()
               if isinstance(p.default, (int, float, tuple)) and not isinstance(p.default, bool)}
    check_group_values(w.hp, numeric)
    count = getattr(rec.state, "count", 0)
    # a static setting the transform refuses raises here (at each count its parameters are at)
    for c in (sorted(set(count.values)) or [0]) if isinstance(count, Counts) else [count]:
        rec.factory(**hyperparam_values(w.hp, c))
    for i, p, g in zip(w.idx, w.params, w.grads):
        key = rec.keys[i]
        check_like(key, g, p, "gradient", "the parameter")
        if not g.dtype.is_floating_point:
            raise TypeError(f"parameter {key_str(key)!r} has a gradient of dtype {g.dtype}; gradients must be "
                            "floating point")
        if type(p).__name__ == "DTensor":
            gl = g.to_local() if type(g).__name__ == "DTensor" else g
            if tuple(gl.shape) != tuple(p.to_local().shape):
                raise ValueError(f"parameter {key_str(key)!r}: this rank's gradient shard has shape "
                                 f"{tuple(gl.shape)}, its parameter shard {tuple(p.to_local().shape)}")
