"""Schedules: functions ``step -> value`` for learning rates, momentum and any
hyperparameter given to :func:`muonfx.inject_hyperparams` or
:func:`muonfx.scale_by_learning_rate`.

Each schedule is a small picklable object; call it with the (0-based) step count.

Example::

    >>> from muonfx import schedules
    >>> s = schedules.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=110)
    >>> round(s(5), 3), round(s(10), 3), round(s(110), 3)
    (0.5, 1.0, 0.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from .hyperparams import check

Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]

__all__ = ["Schedule", "ScalarOrSchedule", "constant", "linear", "cosine_decay",
           "warmup_cosine_decay", "join", "evaluate", "traceable", "ScheduleNotTraceable",
           "FLOAT_MIN_MAX_MISCOMPILED", "momentum_warmup"]


def _step(count) -> int:
    return int(count.item()) if isinstance(count, torch.Tensor) else int(count)


@dataclass(frozen=True)
class constant:
    """``value`` at every step."""

    value: float

    def __call__(self, count) -> float:
        return float(self.value)


@dataclass(frozen=True)
class linear:
    """Linear from ``init_value`` to ``end_value`` over ``transition_steps`` steps,
    starting at ``transition_begin``; constant outside that window.

    Formula: ``init + (end - init) * clip((t - begin) / steps, 0, 1)``.
    """

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __post_init__(self):
        if self.transition_steps < 0:
            raise ValueError(f"transition_steps must be >= 0, got {self.transition_steps}")

    def __call__(self, count) -> float:
        t = _step(count) - self.transition_begin
        if self.transition_steps == 0:
            frac = 1.0 if t >= 0 else 0.0
        else:
            # clipped as an integer, then divided: the same value as clip(t / steps, 0, 1);
            # traced (a compiled step), torch 2.10/2.11's C++ code of min/max on a float
            # casts it to int64, freezing the schedule at its first value. Divided as floats
            # (the same value): traced, an int's true division added to a late-bound
            # init/end value (muon_with_momentum_warmup's) would pin that value in the graph
            frac = float(min(max(t, 0), self.transition_steps)) / float(self.transition_steps)
        return float(self.init_value + (self.end_value - self.init_value) * frac)


@dataclass(frozen=True)
class cosine_decay:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Formula: ``init * ((1 - alpha) * 0.5 * (1 + cos(pi * min(t, T) / T)) + alpha)``.
    """

    init_value: float
    decay_steps: int
    alpha: float = 0.0

    def __post_init__(self):
        if self.decay_steps <= 0:
            raise ValueError(f"decay_steps must be > 0, got {self.decay_steps}")

    def __call__(self, count) -> float:
        t = min(_step(count), self.decay_steps)
        cos = 0.5 * (1.0 + math.cos(math.pi * t / self.decay_steps))
        return float(self.init_value * ((1.0 - self.alpha) * cos + self.alpha))


@dataclass(frozen=True)
class join:
    """Run ``schedules[i]`` between ``boundaries[i-1]`` and ``boundaries[i]``.

    Each schedule sees the step count relative to its own start (optax's
    ``join_schedules``).
    """

    schedules: Sequence[Schedule]
    boundaries: Sequence[int]

    def __post_init__(self):
        if len(self.boundaries) != len(self.schedules) - 1:
            raise ValueError(
                f"join needs len(boundaries) == len(schedules) - 1, got "
                f"{len(self.boundaries)} boundaries for {len(self.schedules)} schedules"
            )
        if list(self.boundaries) != sorted(self.boundaries):
            raise ValueError(f"join boundaries must be increasing, got {list(self.boundaries)}")

    def __call__(self, count) -> float:
        t = _step(count)
        # bisect_right, written out: torch.compile traces it (it cannot trace bisect)
        i = 0
        while i < len(self.boundaries) and self.boundaries[i] <= t:
            i += 1
        start = 0 if i == 0 else self.boundaries[i - 1]
        return float(self.schedules[i](t - start))


def warmup_cosine_decay(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> join:
    """Linear warm-up ``init_value -> peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at step ``decay_steps`` (counted from 0, warm-up included)."""
    if decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")
    alpha = end_value / peak_value if peak_value else 0.0
    return join(
        [linear(init_value, peak_value, warmup_steps), cosine_decay(peak_value, decay_steps - warmup_steps, alpha)],
        [warmup_steps],
    )


#: torch 2.10 and 2.11 (2.12 not measured) compile ``min``/``max`` of a traced float to
#: C++ that casts it to int64 (2.13 does not): a schedule such as
#: ``lambda step: min(step / 100, 1.0)``, evaluated in a compiled step on the symbolic step
#: counter, then reads 0 and stays at its first value. muonfx's schedules clip integers.
FLOAT_MIN_MAX_MISCOMPILED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


class ScheduleNotTraceable(RuntimeError):
    """Raised while ``torch.compile`` traces a schedule that is not one of
    :mod:`muonfx.schedules` on a torch that miscompiles ``min``/``max`` of traced floats
    (:data:`FLOAT_MIN_MAX_MISCOMPILED`). The optimizer adapter's executor takes it as the
    compiler's failure and runs the step eagerly (a warning says why); in a loop compiled
    by hand dynamo breaks the graph there (the schedule is then evaluated eagerly), or,
    with ``fullgraph=True``, raises its ``Unsupported`` error chained from this one."""


def traceable(value: Schedule) -> bool:
    """True for muonfx's own schedules (and ``join`` of them): written for the compiler,
    they clip the integer step and never take ``min``/``max`` of a float, so a compiled
    step follows them on every torch.

    Example::

        >>> from muonfx import schedules
        >>> schedules.traceable(schedules.warmup_cosine_decay(0.0, 1.0, 10, 100))
        True
        >>> schedules.traceable(lambda step: min(step / 100, 1.0))
        False
    """
    if isinstance(value, (constant, linear, cosine_decay)):
        return True
    return isinstance(value, join) and all(traceable(s) for s in value.schedules)


def evaluate(name: str, value: ScalarOrSchedule, count) -> float:
    """The value of a hyperparameter at ``count``: ``value(count)`` for schedules.

    The value is checked by :func:`muonfx.hyperparams.check` (the rules shared by every
    entry point): ``TypeError`` naming ``name`` if it is not a number (a schedule that
    returned None, a string or a multi-element tensor), ``ValueError`` if it is NaN,
    infinite or out of ``name``'s range (a negative ``lr``, say).
    """
    if callable(value):
        if FLOAT_MIN_MAX_MISCOMPILED and torch.compiler.is_compiling() and not traceable(value):
            raise ScheduleNotTraceable(
                f"the schedule {value!r} of {name!r} is not one of muonfx.schedules: on torch "
                f"{torch.__version__} a compiled step could freeze it at its first value (min/max of a "
                "traced float compile to an integer cast), so it is not compiled; use muonfx.schedules "
                "or a torch.optim.lr_scheduler to keep the step compiled (torch 2.13 compiles any schedule)")
        return _number(check(name, value(count), count, value))
    return _number(check(name, value, count))


def _number(v):
    """A checked value as a float; a tensor (a tensor hyperparameter inside a compiled
    step, checked before it) stays a tensor."""
    return v if isinstance(v, torch.Tensor) else float(v)


def momentum_warmup(start: float = 0.85, end: float = 0.95, steps: int = 300) -> linear:
    """The momentum schedule ``start -> end`` linearly over ``steps``, then ``end``.

    Formula: ``mu(t) = start + (end - start) * min(t / steps, 1)``; defaults from
    nanochat / modded-nanogpt (0.85 -> 0.95 over the first 300 steps).

    Example::

        >>> import muonfx as mfx
        >>> s = mfx.momentum_warmup()
        >>> [round(s(t), 6) for t in (0, 150, 300, 1000)]
        [0.85, 0.9, 0.95, 0.95]
    """
    return linear(start, end, steps)
