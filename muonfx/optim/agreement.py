"""Gathering and checking a step's work on every rank before the agreement: the adapter's
side of :mod:`muonfx.distributed.agree`.

On DTensor parameters :class:`~muonfx.TransformOptimizer` gathers and checks every param
group (:func:`agreed_work`) inside the agreement primitive
(:func:`muonfx.distributed.agree.agree_counts`): an error on one rank raises on every
rank before the step's other collectives, and a parameter with a gradient on some ranks
and ``grad=None`` on others raises :class:`GradientsDiffer` on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core import check_like, key_str
from ..counts import Counts
from ..distributed.agree import agree_counts, who_has
from ..hyperparams import check_group_values, late_bound_names
from ..wrappers import hyperparam_values, signature
from .groups import gather

__all__ = ["agreed_work", "agree_settings", "GradientsDiffer", "SettingsDiffer"]


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
    late = late_bound_names(rec.factory)
    # a static setting the transform refuses raises here (at each count its parameters are at)
    for c in (sorted(set(count.values)) or [0]) if isinstance(count, Counts) else [count]:
        vals = hyperparam_values(w.hp, c)
        if late:
            # the late-bound numbers were checked just now, by their rules; the factory is
            # called for the other arguments only when one of them changes
            others = [(n, v) for n, v in vals.items() if n not in late]
            try:
                if others == rec.checked:
                    continue
            except (RuntimeError, TypeError, ValueError):  # e.g. multi-element tensors
                pass
            rec.factory(**vals)
            rec.checked = others
        else:
            rec.factory(**vals)
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


class SettingsDiffer(ValueError):
    """Raised on every rank, with the same message, when the ranks of a DTensor step do not
    share what they must: the Newton-Schulz dtype of the exchange, the batch budget, the
    parameters (their names, in order, and how many per group), a group's static settings
    or its numbers (lr, betas, ns_steps, ...). No rank changed anything.

    Attributes:
        setting: what differs (e.g. ``"the Newton-Schulz dtype on cpu"``).
        values: ``{value: [ranks]}``.
    """

    def __init__(self, setting: str, values: dict[str, list[int]], hint: str) -> None:
        self.setting, self.values = setting, values
        shown = "; ".join(f"rank(s) {ranks}: {value}" for value, ranks in values.items())
        super().__init__(f"step(): the ranks disagree on {setting} ({shown}); {hint}. No rank changed anything.")


#: what each slot of the digest covers, and what to do about a difference
_SLOTS = (
    ("layout", "build the optimizer with the same param groups and parameters on every rank"),
    ("names", "build the optimizer from the same model on every rank, its parameters in the same order"),
    ("static", "give every rank the same settings"),
    ("numbers", "give every rank the same hyperparameters"),
    ("ns_dtype", "set MUONFX_NS_DTYPE (or ns_dtype, or muonfx.linalg.set_default_ns_dtype) the same on every node"),
    ("budget", "call muonfx.linalg.set_batch_bytes with the same value on every rank (or on none)"),
)


def _stable(value: Any) -> str:
    """A text for ``value`` that is the same in every process (no object ids)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_stable(v) for v in value) + ")"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _readable(records: Sequence[Any], param_groups: Sequence[dict], device_types: list[str],
              agreed: torch.dtype | None = None) -> list[list]:
    """Per slot, ``[(label, text)]``: what every rank must share (the Newton-Schulz dtype:
    the pinned one, else the ranks' ``agreed`` one, else the device's own default, marked
    ``(default)`` so that the rule of :func:`agree_settings` can tell)."""
    from ..linalg import batching, precision

    pinned = precision.pinned_ns_dtype()
    out: list[list] = [[("the number of param groups", str(len(param_groups)))], [], [], [], [], []]
    for gi, (rec, group) in enumerate(zip(records, param_groups)):
        out[0].append((f"the number of parameters of param group {gi}", str(len(group["params"]))))
        names = getattr(rec, "_names_text", None)
        if names is None:
            names = rec._names_text = "\n".join(rec.names)
        out[1].append((f"the parameter names (in order) of param group {gi}", names))
        for k in sorted(group):
            if k in ("params", "param_names", "initial_lr"):
                continue
            v = group[k]
            number = (isinstance(v, (int, float)) and not isinstance(v, bool)) or \
                (isinstance(v, torch.Tensor) and v.numel() == 1) or \
                (isinstance(v, (tuple, list)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            for x in v))
            out[3 if number else 2].append((f"{k!r} of param group {gi}", _stable(v)))
        out[2].append((f"the transform of param group {gi}", _stable(rec.factory) if not callable(rec.factory) else
                       f"{getattr(rec.factory, '__module__', '')}.{getattr(rec.factory, '__qualname__', '')}"))
    for d in device_types:
        dt = pinned if pinned is not None else agreed if agreed is not None else precision.device_ns_dtype(
            torch.device(d))
        mark = " (default)" if pinned is None and agreed is None else ""
        out[4].append((f"the Newton-Schulz dtype on {d}", str(dt).removeprefix("torch.") + mark))
        out[5].append((f"the batch budget on {d}", f"{batching.batch_bytes(d)} bytes"))
    return out


def _digest(slot: list) -> int:
    h = hashlib.sha256("\x00".join(f"{a}\x01{b}" for a, b in slot).encode()).digest()
    return int.from_bytes(h[:8], "little", signed=True)


def agree_settings(records: Sequence[Any], param_groups: Sequence[dict], group, device, runner: Any = None) -> None:
    """Check that every rank of the step shares what the exchange and the transforms need
    to agree on (the slots of :data:`_SLOTS`), in one all-gather of a few fixed-size
    digests: the step's first collective, so a difference raises the same
    :class:`SettingsDiffer` on every rank instead of a mismatched collective (an abort,
    or a wait until the process group's timeout) or a silently wrong update (parameters
    listed in another order). The readable values are gathered only when a digest differs.

    One difference has a rule instead of an error: where no rank pins a Newton-Schulz
    dtype and the ranks' devices default to different ones (nodes of different CPU
    generations: bf16 where it is native, float32 elsewhere), every rank takes float32
    (which every device computes natively) for this optimizer's plans (``runner``'s
    ``agreed_ns_dtype``), and the ``muonfx`` logger says so once."""
    agreed = getattr(runner, "agreed_ns_dtype", None)
    slots = _readable(records, param_groups, [torch.device(device).type], agreed)  # (the mesh's device)
    mine = torch.tensor([_digest(s) for s in slots], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every)
    differ = [i for i in range(len(slots)) if bool((table[:, i] != table[0, i]).any())]
    if not differ:
        return
    texts: list = [None] * world
    dist.all_gather_object(texts, slots, group=group)  # the error path only
    if differ == [4] and runner is not None and all(v.endswith(" (default)") for t in texts for _, v in t[4]):
        # only the devices' own defaults differ: one dtype by rule, the same on every rank
        from ..logs import say_once

        shown = "; ".join(f"rank {r}: {', '.join(v for _, v in t[4])}" for r, t in enumerate(texts))
        say_once("ns dtype by rule", "muonfx: the ranks' devices default to different Newton-Schulz dtypes (%s): "
                 "every rank computes in float32; pin MUONFX_NS_DTYPE (or ns_dtype) on every node to choose",
                 shown)
        runner.agreed_ns_dtype = torch.float32
        runner.forget()
        return
    for i in differ:
        labels = [dict(t[i]) for t in texts]
        anywhere = [{lab: v for slot in t for lab, v in slot} for t in texts]  # (a number on one rank, a string on another)
        for label in dict.fromkeys(lab for t in labels for lab in t):
            by_value: dict[str, list[int]] = {}
            for r, t in enumerate(labels):
                v = t.get(label, anywhere[r].get(label, "(none)"))
                by_value.setdefault(v if len(v) < 200 else v[:197] + "...", []).append(r)
            if len(by_value) > 1:
                if i == 1:  # names: say where they first differ, not the whole lists
                    by_value = _first_difference(labels, label)
                raise SettingsDiffer(label, by_value, _SLOTS[i][1])
    raise SettingsDiffer(_SLOTS[differ[0]][0], {}, _SLOTS[differ[0]][1])  # (digests differ, texts do not)


def _first_difference(labels: list[dict], label: str) -> dict[str, list[int]]:
    lists = [t.get(label, "").split("\n") for t in labels]
    n = next((j for j in range(max(map(len, lists))) if len({tuple(x[j:j + 1]) for x in lists}) > 1), 0)
    out: dict[str, list[int]] = {}
    for r, x in enumerate(lists):
        out.setdefault(f"parameter {n}: {x[n] if n < len(x) else '(none)'!r}", []).append(r)
    return out
