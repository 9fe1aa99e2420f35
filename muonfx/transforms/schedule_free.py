"""Schedule-Free: an average of the iterates instead of a learning-rate schedule
(Defazio et al., 2024, arXiv 2405.15682)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from tensordict import TensorDict

from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, takes_extra_args
from ..counts import Counts, advance, by_count, common, zeros
from ..hyperparams import VALUES_ARG, Slot, check
from ..ops import foreach
from .scaling import ScaleByScheduleState


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


def read(value: Any, extra_args: dict) -> Any:
    """``value``, or the number a :class:`muonfx.hyperparams.Slot` stands for in this
    update (``extra_args[VALUES_ARG][slot.key]``)."""
    return extra_args[VALUES_ARG][value.key] if type(value) is Slot else value


def check_warmup_steps(value: Any) -> Any:
    """``value`` if it is an int ``>= 0`` (or a :class:`muonfx.hyperparams.Slot`, checked
    where it is read), else ``ValueError`` naming ``warmup_steps``."""
    if type(value) is Slot:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 0:
        raise ValueError(f"hyperparameter 'warmup_steps' must be an int >= 0, got {value!r}")
    return value


def warmup_lr(lr: Any, warmup_steps: Any, k: Any) -> Any:
    """The learning rate of step ``k`` (from 0) under a linear warm-up over
    ``warmup_steps`` steps: ``lr * min(1, (k + 1) / warmup_steps)`` (the reference's, to
    the bit: ``(k + 1) / (k + 1)`` is 1 exactly). Written without a branch on ``k``: a
    compiled step reads it as a value, and the end of the warm-up compiles nothing again."""
    return lr * ((k + 1) / max(warmup_steps, k + 1))


class WarmupWeight(NamedTuple):
    """The averaging weight of ``schedulefree.AdamWScheduleFreeReference``, for
    :func:`schedule_free`'s ``weight``: step ``k`` weighs ``(k + 1)^r * lr_k^weight_lr_power``
    with ``lr_k`` the warmed-up lr (:func:`warmup_lr`: with a constant ``lr`` it does not
    decrease, so it is the reference's ``lr_max``; an ``lr`` lowered by a scheduler weighs
    by the current one). Each number may be a :class:`muonfx.hyperparams.Slot`, read at
    each update (:func:`muonfx.schedule_free_adamw` is late-bound).

    Example::

        >>> from muonfx.transforms.schedule_free import WarmupWeight
        >>> WarmupWeight(0.1, 2, 0.0, 2.0).at(0, {})   # (0.1 * 1/2)^2
        0.0025000000000000005
    """

    lr: Any
    warmup_steps: Any
    r: Any
    weight_lr_power: Any

    def values(self, extra_args: dict) -> tuple:
        """``(lr, warmup_steps, r, weight_lr_power)`` of this update, ``warmup_steps`` checked."""
        return (read(self.lr, extra_args), check_warmup_steps(read(self.warmup_steps, extra_args)),
                read(self.r, extra_args), read(self.weight_lr_power, extra_args))

    def at(self, k: Any, extra_args: dict) -> Any:
        """The weight of step ``k``."""
        lr, warmup, r, power = self.values(extra_args)
        return ((k + 1) ** r) * (warmup_lr(lr, warmup, k) ** power)

    def lr_link(self) -> GradientTransformation:
        """``out = -lr_t * u`` with ``lr_t`` :func:`warmup_lr` at each parameter's own count
        (the chain's last link; its state a :class:`~muonfx.ScaleByScheduleState`)."""
        return _scale_by_warmup_lr(self)


def _scale_by_warmup_lr(weight: WarmupWeight) -> GradientTransformation:
    def init_fn(params):
        return ScaleByScheduleState(count=zeros(leaves(params, "params")[0]))

    def update_fn(updates, state, params=None, **extra_args):
        lr, warmup, _, _ = weight.values(extra_args)
        keys, us = leaves(updates)
        groups = by_count(state.count, keys, "scale_by_learning_rate state (count)")
        if len(groups) <= 1:
            value = _number(warmup_lr(lr, warmup, groups[0][0] if groups else common(state.count)))
        else:  # parameters with counts of their own: each at its count
            value = [0.0] * len(keys)
            for count, pos in groups:
                v = _number(warmup_lr(lr, warmup, count))
                for j in pos:
                    value[j] = v
        return build(keys, foreach("neg_mul", us, value)), ScaleByScheduleState(advance(state.count))

    return LeafwiseTransformation(init_fn, update_fn)


def _number(v: Any) -> Any:
    """A value as a float (as :func:`muonfx.schedules.evaluate` gives it); a tensor stays one."""
    return v if isinstance(v, torch.Tensor) else float(v)


def averaged(weight_sum: Any, w: Any) -> tuple[Any, Any]:
    """``(new weight sum, c)``: the sum with ``w`` added and the step's share of the
    average ``c = w / sum`` (0 while the sum is 0)."""
    total = weight_sum + w
    return total, (w / total if total != 0 else 0.0)


def schedule_free(inner: GradientTransformation, b1: float = 0.9,
                  weight: Callable[[int], float] | WarmupWeight | None = None) -> GradientTransformation:
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
    (:class:`WarmupWeight`, :func:`~muonfx.schedule_free_adamw`). With an ``inner`` of no
    learning-rate schedule (a constant lr, or a warm-up only) the average does the
    annealing. The optimizer's ``eval()`` puts ``x`` into the parameters and ``train()``
    puts ``y`` back, as the reference's do (:class:`~muonfx.TransformOptimizer`); a step
    in eval mode is refused. Checkpoints hold ``z``, ``x`` and the mode, so a run resumes
    in either mode. ``b1`` may be a :class:`muonfx.hyperparams.Slot`, read at each
    update; the extra arguments of a call reach ``inner`` where it takes them. State:
    ``z`` and ``x`` (8 bytes per float32 element) and ``inner``'s. Not leafwise: ``k``
    and the weight sum are the group's.

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
    if weight is not None and not callable(weight) and not isinstance(weight, WarmupWeight):
        raise TypeError(f"schedule_free: weight must be a function of the step or None, got {weight!r}")
    takes = takes_extra_args(inner)

    def weigh(k: int, extra_args: dict) -> Any:
        if weight is None:
            return 1.0
        w = weight.at(k, extra_args) if isinstance(weight, WarmupWeight) else weight(k)
        return w if torch.compiler.is_compiling() else float(w)

    def init_fn(params):
        keys, ps = leaves(params, "params")
        copies = lambda: build(keys, [p.detach().clone() for p in ps])  # noqa: E731
        return ScheduleFreeState(0, 0.0, True, copies(), copies(), inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("schedule_free needs params (the training point y)")
        if not state.train_mode:
            raise RuntimeError("schedule_free: a step in eval mode (the parameters hold the average x); "
                               "call opt.train() before stepping")
        b1_ = read(b1, extra_args)
        w = weigh(state.k, extra_args)
        keys, ys = leaves(params, "params")
        u, inner_state = (inner.update(updates, state.inner_state, params, **extra_args) if takes
                          else inner.update(updates, state.inner_state, params))
        _, us = leaves(u)
        zs = aligned(state.z, keys, "schedule_free state (z)", like=us)
        xs = aligned(state.x, keys, "schedule_free state (x)", like=us)
        total, c = averaged(state.weight_sum, w)
        new_z = foreach("add", zs, us)
        # as lerps: where x == z (at the start, and while the gradients are zero) x and y
        # stay exactly where they are, and the update is exactly zero
        new_x = foreach("lerp", xs, new_z, c)
        new_y = foreach("lerp", new_z, new_x, b1_)
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
