"""Schedule-Free: an average of the iterates instead of a learning-rate schedule
(Defazio et al., 2024, arXiv 2405.15682)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, aligned, build, leaves
from ..counts import Counts
from ..hyperparams import check
from ..ops import foreach


class ScheduleFreeState(NamedTuple):
    """State of :func:`schedule_free`.

    Attributes:
        k: steps made so far (the reference's ``group["k"]``; one number for the group, as
            the reference advances it for every parameter, with a gradient or not).
        weight_sum: the sum of the averaging weights so far.
        train_mode: whether the parameters hold the training point ``y`` (``True``) or the
            average ``x`` (``False``, after ``opt.eval()``).
        z: the base optimizer's iterate, per parameter (a copy of the parameters at init).
        x: the average of the ``z`` iterates, the weights to evaluate with (in eval mode
            the parameters hold it and this field holds ``y``: :func:`swap_values`).
        inner_state: the base optimizer's state.
    """

    k: int
    weight_sum: float
    train_mode: bool
    z: TensorDict
    x: TensorDict
    inner_state: Any


def schedule_free(inner: GradientTransformation, b1: float = 0.9,
                  weight: Callable[[int], float] | None = None) -> GradientTransformation:
    """Schedule-Free over any chain: ``inner`` steps ``z``, the parameters hold ``y``.

    Formula (``u`` the update of ``inner``, a complete step with its learning rate and
    decay, computed at the parameters ``y``; ``k`` counts steps from 0)::

        z <- z + u
        c = w(k) / (w(0) + ... + w(k))
        x <- (1 - c) * x + c * z                  (the weights to evaluate with)
        y <- (1 - b1) * z + b1 * x                (the weights to train with)
        out = y_new - y

    ``weight(k)`` defaults to 1 (``x`` the uniform average of the ``z`` iterates); the
    reference weighs step ``k`` by ``(k + 1)^r * lr_max(k)^weight_lr_power``
    (:func:`~muonfx.schedule_free_adamw`). With an ``inner`` of no learning-rate
    schedule (a constant lr, or a warm-up only) the average does the annealing. The
    optimizer's ``eval()`` puts ``x`` into the parameters and ``train()`` puts ``y`` back,
    as the reference's do (:class:`~muonfx.TransformOptimizer`); a step in eval mode is
    refused. Checkpoints hold ``z``, ``x`` and the mode, so a run resumes in either mode.
    State: ``z`` and ``x`` (8 bytes per float32 element) and ``inner``'s. Not leafwise:
    ``k`` and the weight sum are the group's.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.zeros(1)}, [])
        >>> tx = mfx.schedule_free(mfx.scale_by_learning_rate(1.0), b1=0.5)
        >>> s = tx.init(p)
        >>> u, s = tx.update(TensorDict({"w": torch.ones(1)}, []), s, p)   # z = -1, x = -1
        >>> p = mfx.apply_updates(p, u); p["w"].item()
        -1.0
        >>> u, s = tx.update(TensorDict({"w": torch.ones(1)}, []), s, p)   # z = -2, x = -1.5
        >>> mfx.apply_updates(p, u)["w"].item(), s.x["w"].item()
        (-1.75, -1.5)
    """
    b1 = check("b1", b1)
    if weight is not None and not callable(weight):
        raise TypeError(f"schedule_free: weight must be a function of the step or None, got {weight!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        copies = lambda: build(keys, [p.detach().clone() for p in ps])  # noqa: E731
        return ScheduleFreeState(0, 0.0, True, copies(), copies(), inner.init(params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("schedule_free needs params (the training point y)")
        if not state.train_mode:
            raise RuntimeError("schedule_free: a step in eval mode (the parameters hold the average x); "
                               "call opt.train() before stepping")
        keys, ys = leaves(params, "params")
        u, inner_state = inner.update(updates, state.inner_state, params)
        _, us = leaves(u)
        zs = aligned(state.z, keys, "schedule_free state (z)", like=us)
        xs = aligned(state.x, keys, "schedule_free state (x)", like=us)
        w = 1.0 if weight is None else float(weight(state.k))
        total = state.weight_sum + w
        c = w / total if total != 0 else 0.0
        new_z = foreach("add", zs, us)
        # as lerps: where x == z (at the start, and while the gradients are zero) x and y
        # stay exactly where they are, and the update is exactly zero
        new_x = foreach("lerp", xs, new_z, c)
        new_y = foreach("lerp", new_z, new_x, b1)
        out = foreach("sub_", new_y, ys)
        return build(keys, out), ScheduleFreeState(state.k + 1, total, True, build(keys, new_z),
                                                   build(keys, new_x), inner_state)

    return GradientTransformation(init_fn, update_fn)


def _map_states(node: Any, fn: Callable[[ScheduleFreeState], ScheduleFreeState]) -> Any:
    """``node`` with every :class:`ScheduleFreeState` inside it replaced by ``fn`` of it."""
    if isinstance(node, ScheduleFreeState):
        return fn(node)
    if isinstance(node, (Counts, TensorDict, torch.Tensor)):
        return node
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*[_map_states(c, fn) for c in node])
    if isinstance(node, (tuple, list)):
        return type(node)(_map_states(c, fn) for c in node)
    if isinstance(node, dict):
        return {k: _map_states(v, fn) for k, v in node.items()}
    return node


def swap_values(state: Any, params: dict, train: bool) -> tuple[Any, dict]:
    """``(new_state, values)``: the state with every :func:`schedule_free` inside it put in
    the given mode, and the values its parameters take, by key. The parameters (``params``:
    key -> tensor, their current values) and the state's ``x`` swap places: in eval mode
    the parameters hold ``x`` and the state's ``x`` field holds ``y``, so :meth:`train`
    gives back ``y`` bit for bit, as the reference (which keeps ``y``) does, without a
    third buffer. A state already in the mode asked for is left as it is (no values).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.transforms.schedule_free import swap_values
        >>> tx = mfx.schedule_free(mfx.scale_by_learning_rate(1.0))
        >>> state = tx.init(TensorDict({"w": torch.ones(1)}, []))
        >>> state, values = swap_values(state, {("w",): torch.full((1,), 2.0)}, train=False)
        >>> state.train_mode, values[("w",)].tolist(), state.x["w"].tolist()
        (False, [1.0], [2.0])
    """
    values: dict = {}

    def swap(s: ScheduleFreeState) -> ScheduleFreeState:
        if s.train_mode == train:
            return s
        keys, xs = leaves(s.x)
        held = [params[k].detach().clone() for k in keys]
        values.update(zip(keys, xs))
        return s._replace(train_mode=train, x=build(keys, held))

    return _map_states(state, swap), values
