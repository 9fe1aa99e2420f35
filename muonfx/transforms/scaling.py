"""Scalings: by a constant, by the learning rate (or its schedule), by matrix shape."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..core import Dims, EmptyState, GradientTransformation, LeafwiseTransformation, build, leaves
from ..counts import Counts, advance, by_count, common, zeros
from ..hyperparams import VALUES_ARG, Slot
from ..ops import foreach
from ..schedules import ScalarOrSchedule, evaluate
from ._matrix import leaf_views, matrix_shapes

SHAPE_MODES = ("original", "match_rms_adamw", "spectral", "none")


def scale(factor: float) -> GradientTransformation:
    """Multiply every update by ``factor``: ``out = factor * u``.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> u = TensorDict({"w": torch.ones(2)}, [])
        >>> mfx.scale(3.0).update(u, None)[0]["w"].tolist()
        [3.0, 3.0]
    """
    factor = float(factor)

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        return build(keys, foreach("mul", us, factor)), state

    return LeafwiseTransformation(init_fn, update_fn)


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule.

    Attributes:
        count: updates made so far, per parameter (the schedule's argument): a parameter
            left out of an update keeps its own.
    """

    count: Counts


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """Multiply by ``-lr`` (descent): ``out = -lr(t) * u``.

    ``lr`` is a float or a schedule ``step -> float`` (see :mod:`muonfx.schedules`),
    evaluated at the number of updates already made (each parameter's own count: one
    left out of an update keeps it). A schedule value that is NaN or infinite raises
    ``ValueError``. ``lr`` may also be a :class:`muonfx.hyperparams.Slot`, a number read
    at each update.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> u = TensorDict({"w": torch.ones(1)}, [])
        >>> tx = mfx.scale_by_learning_rate(mfx.schedules.linear(1.0, 0.0, 10))
        >>> s = tx.init(u)
        >>> out, s = tx.update(u, s); out["w"].item()
        -1.0
        >>> out, s = tx.update(u, s); out["w"].item()
        -0.8999999761581421
    """
    # "neg_mul": -lr * u, with lr reaching a compiled graph as it is (not negated in
    # Python first: torch 2.10 / 2.11 would then recompile the graph for every new lr)
    if type(lr) is Slot:  # a number read at each update (checked where it was given)
        def read_fn(updates, state, params=None, **extra_args):
            value = extra_args[VALUES_ARG][lr.key]
            if type(value) is not float and not isinstance(value, torch.Tensor):
                value = float(value)  # as evaluate gives it
            keys, us = leaves(updates)
            return build(keys, foreach("neg_mul", us, value)), state

        return LeafwiseTransformation(lambda params: EmptyState(), read_fn)
    if not callable(lr):
        value = evaluate("lr", lr, 0)

        def constant_fn(updates, state, params=None):
            keys, us = leaves(updates)
            return build(keys, foreach("neg_mul", us, value)), state

        return LeafwiseTransformation(lambda params: EmptyState(), constant_fn)

    def init_fn(params):
        return ScaleByScheduleState(count=zeros(leaves(params, "params")[0]))

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        groups = by_count(state.count, keys, "scale_by_learning_rate state (count)")
        if len(groups) <= 1:
            value = evaluate("lr", lr, groups[0][0] if groups else common(state.count))
        else:  # parameters with counts of their own: each at its count
            value = [0.0] * len(keys)
            for count, pos in groups:
                v = evaluate("lr", lr, count)
                for j in pos:
                    value[j] = v
        return build(keys, foreach("neg_mul", us, value)), ScaleByScheduleState(advance(state.count))

    return LeafwiseTransformation(init_fn, update_fn)


def shape_factor(mode: str, a: int, b: int) -> float:
    """The shape scale ``s(A, B)`` of :func:`scale_by_shape`."""
    if mode == "original":
        return math.sqrt(max(1.0, a / b))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    if mode == "spectral":
        return math.sqrt(a / b)
    if mode == "none":
        return 1.0
    raise ValueError(f"unknown scale_by_shape mode {mode!r}; choose one of {SHAPE_MODES}")


def shape_factors(mode: str, keys: list, ts: list, dims: Dims = None) -> list[float]:
    """:func:`shape_factor` of every leaf's matrix view (``dims`` overriding the default
    view, as in :func:`scale_by_shape`), one Python float per leaf.

    Example::

        >>> import torch
        >>> from muonfx.transforms.scaling import shape_factors
        >>> shape_factors("original", [("w",), ("v",)], [torch.zeros(16, 4), torch.zeros(4, 16)])
        [2.0, 1.0]
    """
    known: dict[tuple[int, int], float] = {}
    factors = []
    views = None if dims is None else leaf_views(dims, keys, ts, "scale_by_shape")
    for ab in matrix_shapes(keys, ts, "scale_by_shape", views):
        f = known.get(ab)
        if f is None:
            # an empty matrix (a zero side) has nothing to scale; s(A, 0) would divide by zero
            f = known[ab] = shape_factor(mode, *ab) if ab[0] and ab[1] else 1.0
        factors.append(f)
    return factors


def scale_by_shape(mode: str = "original", *, dims: Dims = None) -> GradientTransformation:
    """Scale each matrix update by a factor of its shape ``A x B`` (rows x cols).

    Modes (``A``, ``B`` taken from the same matrix view Newton-Schulz uses: conv
    weights ``[out, in, kh, kw]`` as ``[out, in*kh*kw]``, 3-D stacks per matrix):

    * ``"original"``: ``sqrt(max(1, A/B))`` (Keller Jordan; torch.optim.Muon's default);
    * ``"match_rms_adamw"``: ``0.2 * sqrt(max(A, B))`` (Moonlight: update RMS matches AdamW's);
    * ``"spectral"``: ``sqrt(A/B)``;
    * ``"none"``: ``1`` (no shape scale: dion's ``adjust_lr=None``).

    ``dims`` overrides the view per leaf, as :func:`newton_schulz`'s (give both the same).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> u = TensorDict({"w": torch.ones(16, 4)}, [])
        >>> mfx.scale_by_shape().update(u, None)[0]["w"][0, 0].item()
        2.0
    """
    shape_factor(mode, 1, 1)  # validate early

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        return build(keys, foreach("mul", us, shape_factors(mode, keys, us, dims))), state

    return LeafwiseTransformation(init_fn, update_fn)
