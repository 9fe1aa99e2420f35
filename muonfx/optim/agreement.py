"""Gathering and checking a step's work on every rank before the agreement: the adapter's
side of :mod:`muonfx.distributed.agree`.

On DTensor parameters :class:`~muonfx.TransformOptimizer` gathers and checks every param
group (:func:`agreed_work`) inside the agreement primitive
(:func:`muonfx.distributed.agree.agree_counts`): an error on one rank raises on every
rank before the step's other collectives, and a parameter with a gradient on some ranks
and ``grad=None`` on others raises :class:`GradientsDiffer` on every rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from ..core import check_like, key_str
from ..counts import Counts
from ..distributed.agree import agree_counts, who_has
from ..hyperparams import check_group_values
from ..wrappers import hyperparam_values, signature
from .groups import gather

__all__ = ["agreed_work", "GradientsDiffer"]


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


def agreed_work(records: Sequence[Any], param_groups: Sequence[dict], group, device, what: str = "step()") -> list:
    """The step's work (:func:`muonfx.optim.groups.gather` of every group), gathered and
    checked on every rank, agreed in one all-reduce.

    The rank-local checks: every gradient (sparse, complex, shape, device and local
    shard against its parameter), every group's hyperparameters
    (:func:`muonfx.hyperparams.check_group_values`, numbers under the names whose
    defaults are numbers) and the group's transform built from them (a static setting
    it refuses, such as ``ns_steps=0`` or an unknown ``ns_method``). If they raised on a
    rank, it raises its error and the others
    :class:`~muonfx.distributed.agree.RankFailed`; if a parameter has a gradient on some
    ranks only, every rank raises :class:`GradientsDiffer`. Else the list of
    :class:`~muonfx.optim.groups.GroupWork` is returned, one per group (None for a group
    without gradients).
    """
    present = [p.grad is not None for g in param_groups for p in g["params"]]

    def gather_and_check() -> list:
        work: list = []
        for rec, group_ in zip(records, param_groups):
            w = gather(rec, group_)
            if w is not None:
                _check_work(rec, w)
            work.append(w)
        return work

    work, counts = agree_counts(gather_and_check, [int(x) for x in present], what, group, device)
    world = dist.get_world_size(group)
    odd = [i for i, c in enumerate(counts) if 0 < c < world]
    if odd:  # which ranks have those gradients: one more small all-reduce, on the error path only
        names = [key_str(k) for rec in records for k in rec.keys]
        raise GradientsDiffer(dict(zip([names[i] for i in odd], who_has([present[i] for i in odd], group, device))))
    return work


def _check_work(rec, w) -> None:
    """What can fail on one rank alone before the exchange, for one group's work."""
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
