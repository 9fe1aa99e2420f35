"""Injected (schedulable) hyperparameters: :func:`inject_hyperparams`, the wrapper that
keeps a transform factory's numbers in the state, evaluates schedules at each
parameter's count and passes the values to the transform at each update (re-exported by
:mod:`muonfx.wrappers`)."""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any, Callable, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from . import tree
from .core import GradientTransformation, LeafwiseTransformation, aligned, build, is_leafwise, leafwise, \
    takes_extra_args, td_items
from .counts import Counts, advance, by_count, common, zeros
from .hyperparams import VALUES_ARG, Slot, check, check_unmixed, late_bound_names
from .schedules import constant, cosine_decay, evaluate, join, linear

__all__ = ["inject_hyperparams", "InjectHyperparamsState", "is_schedule", "hyperparam_values", "signature"]


def _pick(td: TensorDictBase, keys: list) -> TensorDict:
    """The leaves of ``td`` at ``keys`` (a subset of its keys), as a new TensorDict."""
    have = dict(zip(*td_items(td)))
    missing = [k for k in keys if k not in have]
    if missing:
        aligned(td, keys, "params")  # the error naming them
    return build(keys, [have[k] for k in keys])


class InjectHyperparamsState(NamedTuple):
    """State of a transform built by :func:`inject_hyperparams`.

    Attributes:
        count: updates made so far, per parameter (the schedules' argument): a
            parameter left out of an update keeps its own count, and schedules are
            evaluated at each parameter's count.
        hyperparams: ``{name: current value}``; edit it between steps to change a
            hyperparameter (a scheduled one is overwritten by its schedule at each step).
        inner_state: the inner transform's state.
    """

    count: Counts
    hyperparams: dict
    inner_state: Any


@functools.lru_cache(maxsize=256)
def signature(factory: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature``, cached: adapters rebuild injected transforms every step."""
    return inspect.signature(factory)


#: muonfx's own schedules (:mod:`muonfx.schedules`)
OWN_SCHEDULES = (constant, linear, cosine_decay, join)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_schedule(v: Any) -> bool:
    """True for a callable that takes one positional argument (a schedule ``step -> value``).

    Other callables given as hyperparameters (``labels=lambda key, tensor: ...`` of
    :func:`muonfx.muon_adamw`, a mask predicate) are passed to the factory as they are.

    Example::

        >>> from muonfx.wrappers import is_schedule
        >>> is_schedule(lambda step: 0.1), is_schedule(lambda key, tensor: "adamw")
        (True, False)
    """
    if not callable(v) or isinstance(v, (type, torch.Tensor)):
        return False
    if isinstance(v, OWN_SCHEDULES):  # (no signature to read: also inside a compiled step)
        return True
    try:
        inspect.signature(v).bind(0)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): take it for a schedule, as before
        return True
    return True


def _is_injectable(v: Any) -> bool:
    """Numbers, schedules, and tuples of numbers (e.g. Adam's ``betas``)."""
    if isinstance(v, (tuple, list)):
        return len(v) > 0 and all(_is_number(x) or isinstance(x, torch.Tensor) for x in v)
    return _is_number(v) or (isinstance(v, torch.Tensor) and v.numel() == 1) or is_schedule(v)


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: tuple[str, ...] = ()
) -> Callable[..., GradientTransformation]:
    """Make a transform factory's numeric hyperparameters live in the state.

    ``inject_hyperparams(factory)(**hparams)`` returns a transform whose state is an
    :class:`InjectHyperparamsState`. Every numeric argument, tuple of numbers (such
    as ``betas``) and callable (read as a schedule ``step -> value``) not named in
    ``static_args`` is stored in
    ``state.hyperparams``; at each update the schedules are evaluated at
    ``state.count`` and the inner transform runs with the current values, so values
    written into the state between steps take effect. For a factory declared
    :func:`muonfx.hyperparams.late_bound` (:func:`muonfx.muon`, :func:`muonfx.adamw`,
    :func:`muonfx.muon_adamw`) the inner transform is built once, with a
    :class:`muonfx.hyperparams.Slot` for each late-bound hyperparameter, and the values
    reach it at each update as the extra argument
    :data:`muonfx.hyperparams.VALUES_ARG` (with those of an enclosing
    ``inject_hyperparams`` transform, if any): a new value calls the factory no more (only a
    change of one of its other numbers, such as ``ns_steps``, builds it again); any
    other factory is called again whenever a value changes. ``state.count`` is per
    parameter: where parameters have different counts (one was left out of an update)
    the schedules are evaluated at each count, and the inner transform updates each set
    of parameters that share a count with that count's values. Every value is checked by
    :func:`muonfx.hyperparams.check` at every update: a value (or a schedule's value)
    that is NaN, infinite, out of range, ``None`` or a string raises an error naming the
    hyperparameter. Callables that do not take one argument (label functions, mask
    predicates) are not schedules: they go to the factory unchanged.
    The extra arguments of a call reach the inner transform when it takes them.

    The transform is leafwise (:func:`muonfx.leafwise`) when ``factory``'s transform
    built from the initial values is (the hyperparameters are scalars every leaf
    shares); a later value for which the factory builds a transform that is not
    leafwise raises ``ValueError``.

    Example (momentum warm-up 0.85 -> 0.95 over 300 steps, as in nanochat)::

        >>> import muonfx as mfx
        >>> tx = mfx.inject_hyperparams(mfx.muon)(
        ...     lr=0.02, momentum=mfx.schedules.linear(0.85, 0.95, 300))
        >>> # state.hyperparams["lr"] = 0.01 between steps changes the lr
    """
    sig = signature(factory)
    name = getattr(factory, "__name__", "factory")

    def make(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        hparams = dict(bound.arguments)
        bad = [n for n in static_args if n not in sig.parameters]
        if bad:
            raise ValueError(f"inject_hyperparams: static_args {bad} are not parameters of {factory.__name__}")
        injected = {n: v for n, v in hparams.items() if n not in static_args and _is_injectable(v)}
        static = {n: v for n, v in hparams.items() if n not in injected}

        def values_at(count, current: dict) -> dict:
            return {
                n: evaluate(n, injected[n], count) if callable(injected[n])
                else _checked(n, current[n], count)
                for n in injected
            }

        # The late-bound hyperparameters (see late_bound): a Slot each (one per element of a
        # tuple such as betas) in the transform built once; their values reach it at each
        # update. The other numbers build it again when they change (the last one kept).
        names = late_bound_names(factory)
        late = {n: (tuple(f"{n}[{i}]" for i in range(len(v))) if isinstance(v, (tuple, list)) else None)
                for n, v in injected.items() if n in names}
        fixed = tuple(n for n in injected if n not in late)
        slots = {n: Slot(n) if keys is None else tuple(Slot(k) for k in keys) for n, keys in late.items()}
        last: list = []  # [values of `fixed`, the transform built for them]

        def with_slots(hp: dict) -> GradientTransformation:
            return factory(**static, **{n: hp[n] for n in fixed}, **slots)

        # Leafwise iff the factory's transform is, decided once on the one built from the
        # initial values. Initial values the factory refuses declare nothing: init raises
        # that error itself, naming the hyperparameter.
        try:
            first = values_at(0, injected)
            if late:
                try:
                    last[:] = [tuple(map(first.__getitem__, fixed)), with_slots(first)]
                except Exception:  # refused with slots: built from the values, as any factory
                    late = {}
            declared = is_leafwise(last[1] if last else factory(**static, **first))
        except Exception:
            declared = False
        late_items = tuple(late.items())
        takes = bool(last) and takes_extra_args(last[1])

        def not_leafwise(hp: dict) -> ValueError:
            return ValueError(
                f"inject_hyperparams: {name} built a leafwise transform from the initial "
                f"hyperparameters but not from {hp}; the declaration (mfx.leafwise) cannot change "
                "between steps: name the hyperparameter that decides it in static_args")

        scheduled = any(callable(v) for v in injected.values())

        def built(hp: dict) -> GradientTransformation:
            tx = factory(**static, **hp)
            if declared and not isinstance(tx, LeafwiseTransformation):  # (inline: every step)
                raise not_leafwise(hp)
            return tx

        def slotted(hp: dict) -> dict | None:
            """The values of the slots (``{key: value}``), or None where a value no longer
            fits its slots (a pair become a number): then built from the values."""
            vals: dict = {}
            for n, keys in late_items:
                v = hp[n]
                if keys is None:
                    if isinstance(v, (tuple, list)):
                        return None
                    vals[n] = v
                elif isinstance(v, (tuple, list)) and len(v) == len(keys):
                    vals.update(zip(keys, v))
                else:
                    return None
            return vals

        def same(key: tuple) -> bool:
            try:
                return bool(key == last[0])
            except (RuntimeError, TypeError, ValueError):  # e.g. multi-element tensors
                return False

        def rebuilt(hp: dict, key: tuple) -> GradientTransformation:
            """The transform with slots, built again for the values ``key`` of ``fixed``."""
            tx = with_slots(hp)
            if declared and not isinstance(tx, LeafwiseTransformation):
                raise not_leafwise(hp)
            last[:] = [key, tx]
            return tx

        def run(hp: dict, updates, inner, params, extra_args: dict):
            """The inner transform's update with the values ``hp`` (in a step: no call
            more than one of the values needs)."""
            vals = slotted(hp) if late_items else None
            if vals is None:
                tx = built(hp)
                if extra_args and takes_extra_args(tx):
                    return tx.update(updates, inner, params, **extra_args)
                return tx.update(updates, inner, params)
            tx = last[1]
            if fixed:
                key = tuple(map(hp.__getitem__, fixed))
                try:  # (same(key), inline: every step)
                    stale = bool(key != last[0])
                except (RuntimeError, TypeError, ValueError):
                    stale = True
                if stale:
                    tx = rebuilt(hp, key)
            if takes:
                # (added to an enclosing one's: a slot of it given to the factory is read there)
                outer = extra_args.get(VALUES_ARG)
                vals = {**outer, **vals} if outer else vals
                return tx.update(updates, inner, params, **{**extra_args, VALUES_ARG: vals})
            return tx.update(updates, inner, params)

        def init_fn(params):
            hp = values_at(0, injected)
            keys = td_items(params)[0] if isinstance(params, TensorDictBase) else []
            if late_items and slotted(hp) is not None:
                key = tuple(map(hp.__getitem__, fixed))
                tx = last[1] if same(key) else rebuilt(hp, key)
            else:
                tx = built(hp)
            return InjectHyperparamsState(zeros(keys), hp, tx.init(params))

        def update_fn(updates, state, params=None, **extra_args):
            missing = set(injected) - set(state.hyperparams)
            if missing:
                raise ValueError(f"inject_hyperparams: state lacks hyperparameters {sorted(missing)}")
            keys = td_items(updates)[0] if isinstance(updates, TensorDictBase) else []
            groups = by_count(state.count, keys, "inject_hyperparams state (count)")
            current = state.hyperparams
            if len(groups) <= 1 or not (scheduled or any([is_schedule(v) for v in current.values()])):
                hp = values_at(groups[0][0] if groups else common(state.count), current)
                new_u, new_inner = run(hp, updates, state.inner_state, params, extra_args)
                return new_u, InjectHyperparamsState(advance(state.count), hp, new_inner)
            # parameters with step counts of their own and a schedule: each count has its
            # own values, so each set of parameters sharing a count gets its own update
            outs: dict = {}
            inner = state.inner_state
            us = td_items(updates)[1]
            for t, pos in groups:
                ks = [keys[j] for j in pos]
                hp = values_at(t, current)
                sub_p = None if params is None else _pick(params, ks)
                u, new_sub = run(hp, build(ks, [us[j] for j in pos]), tree.restrict(inner, ks), sub_p, extra_args)
                inner = tree.merge(inner, new_sub)
                outs.update(zip(*td_items(u)))
            last_count = max(groups)[0]  # the values of the most advanced parameters, for the record
            return (build(keys, [outs[k] for k in keys]),
                    InjectHyperparamsState(advance(state.count), values_at(last_count, current), inner))

        tx = GradientTransformation(init_fn, update_fn)
        return leafwise(tx) if declared else tx

    make.__name__ = f"inject_hyperparams({name})"
    make.__doc__ = factory.__doc__
    return make


def hyperparam_values(hparams: dict[str, Any], count: Any) -> dict[str, Any]:
    """The values a factory gets from :func:`inject_hyperparams` at step ``count``:
    schedules evaluated, numbers (and tuples of them) checked by
    :func:`muonfx.hyperparams.check`, anything else (strings, dtypes, label functions)
    as it is. Raises the error naming the hyperparameter.

    Example::

        >>> from muonfx.wrappers import hyperparam_values
        >>> hyperparam_values({"lr": lambda step: 0.1 * step, "betas": (0.9, 0.99), "adjust_lr": None}, 3)
        {'lr': 0.30000000000000004, 'betas': (0.9, 0.99), 'adjust_lr': None}
    """
    out = {}
    for n, v in hparams.items():
        if is_schedule(v):
            out[n] = evaluate(n, v, count)
        elif _is_injectable(v) or isinstance(v, torch.Tensor):
            out[n] = _checked(n, v, count)
        else:
            out[n] = v
    return out


def _checked(name: str, value: Any, count: int) -> Any:
    """Validate a stored (non-schedule) hyperparameter, keeping ints as ints."""
    if type(value) is float or type(value) is int:  # the common case first
        return check(name, value, count)
    if isinstance(value, (tuple, list)):
        check_unmixed(name, value)
        return tuple(_checked(f"{name}[{i}]", v, count) for i, v in enumerate(value))
    if is_schedule(value):  # a schedule written into the state between steps
        return evaluate(name, value, count)
    return check(name, value, count)
