"""Validation of hyperparameter values: one rule per name, shared by every entry point.

The transforms check their own arguments, the presets (:func:`muonfx.muon`,
:func:`muonfx.adamw`, :func:`muonfx.muon_adamw`, :class:`muonfx.MuonOptions`) check
theirs under their public names, schedules are checked where they are evaluated
(:func:`muonfx.schedules.evaluate`), and :func:`muonfx.inject_hyperparams` (hence
:class:`muonfx.TransformOptimizer`, at every step and when loading a checkpoint) checks
the values it injects. All of them call :func:`check`, so a value is refused the same
way wherever it enters, with an error that names the hyperparameter.

Rules, chosen by the name (``adamw_lr`` follows ``lr``, ``betas[1]`` follows ``betas``):

=====================================================  =================
name                                                   allowed values
=====================================================  =================
``lr``, ``*_lr``                                       finite, ``>= 0``
``weight_decay``, ``*_weight_decay``                   finite, ``>= 0``
``eps``, ``*_eps``                                     finite, ``>= 0``
``momentum``, ``*_momentum``, ``beta``                 ``[0, 1]``
``betas``, ``*_betas``, ``b1``, ``b2``, ``beta1``,     ``[0, 1)``
``beta2``
``max_norm``                                           finite, ``> 0``
anything else                                          finite
=====================================================  =================

A value must be a real number (``int``/``float``) or a one-element tensor; ``None``,
strings and booleans raise ``TypeError``; a tensor of another size and a number outside
its range raise ``ValueError`` (torch.optim's error for a tensor ``lr`` of more than one
element).

Example::

    >>> from muonfx.hyperparams import check
    >>> check("adamw_lr", 3e-4)
    0.0003
    >>> try:
    ...     check("weight_decay", float("nan"))
    ... except ValueError as e:
    ...     print(e)
    hyperparameter 'weight_decay' is nan; weight_decay must be >= 0 and finite
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check", "check_args", "check_betas", "check_unmixed", "check_group_values", "rule", "check_float_dtype",
           "Slot", "VALUES_ARG", "late_bound", "late_bound_names"]

#: "finite" is written as ``<= the largest float32`` (the same for every number), never as
#: ``< inf``: traced with a symbolic float built from a schedule's own floats (a cosine
#: in the graph), a comparison with infinity makes torch's value-range analysis raise
#: "sympy expression is NaN" (2.10-2.13), which sent such compiled steps eagerly. The
#: bound is float32's: a step computes in float32 (or narrower), where a larger number
#: (``lr=1e39``) is infinite
_MAX = float(torch.finfo(torch.float32).max)
# (low, low included, high, high included, wording)
_NON_NEGATIVE = (0.0, True, _MAX, True, ">= 0 and finite")
_UNIT_CLOSED = (0.0, True, 1.0, True, "in [0, 1]")
_UNIT_OPEN = (0.0, True, 1.0, False, "in [0, 1)")
_POSITIVE = (0.0, False, _MAX, True, "> 0 and finite")
_FINITE = (-_MAX, True, _MAX, True, "finite")


_RULES: dict[str, tuple] = {}


def rule(name: str) -> tuple:
    """``(low, low_included, high, high_included, wording)`` of the values allowed for ``name``."""
    r = _RULES.get(name)
    if r is None:
        r = _RULES[name] = _rule(name)
    return r


def _rule(name: str) -> tuple:
    base = name.split("[", 1)[0]
    if base == "lr" or base.endswith("_lr") or base == "weight_decay" or base.endswith("_weight_decay") \
            or base == "eps" or base.endswith("_eps"):
        return _NON_NEGATIVE
    if base == "momentum" or base.endswith("_momentum") or base == "beta":
        return _UNIT_CLOSED
    if base in ("betas", "b1", "b2", "beta1", "beta2") or base.endswith("_betas"):
        return _UNIT_OPEN
    if base == "max_norm":
        return _POSITIVE
    return _FINITE


def _where(count: Any, source: Any) -> str:
    out = ""
    if count is not None:
        out += f" at step {int(count.item()) if isinstance(count, torch.Tensor) else count}"
    if source is not None:
        out += f" (returned by the schedule {source!r})"
    return out


def check(name: str, value: Any, count: Any = None, source: Any = None) -> float | int:
    """``value`` as a number (``int`` stays ``int``) if it is allowed for ``name``.

    ``count`` and ``source`` (the schedule that produced ``value``) only enrich the
    message. Raises ``TypeError`` for a value that is not a real number or a
    one-element tensor, ``ValueError`` for a tensor of more than one element and for a
    number out of range (NaN and infinities included); both name ``name``.
    """
    if type(value) is float or type(value) is int:
        v = value
    elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() \
            and value.dtype != torch.bool:
        if torch.compiler.is_compiling():
            # a tensor hyperparameter (a tensor lr) reaches a compiled step as it is: its value
            # is data the graph cannot branch on. The optimizer checks it eagerly before the
            # graph runs (muonfx.optim.step.run), so a bad value still changes nothing.
            return value
        v = value.item()
    elif isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool):
        v = value  # subclasses (numpy floats), and symbolic numbers inside torch.compile
    elif type(value) is Slot:
        return value  # a value read at each update (checked there, by its own name)
    else:
        what = (f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
                if isinstance(value, torch.Tensor) else f"{value!r} (a {type(value).__name__})")
        if isinstance(value, torch.Tensor) and value.numel() != 1:  # torch.optim's error type for it
            raise ValueError(f"hyperparameter {name!r} is {what}{_where(count, source)}; a tensor "
                             "hyperparameter must have one element")
        raise TypeError(f"hyperparameter {name!r} is {what}{_where(count, source)}; it must be a real "
                        "number (or a one-element tensor)")
    r = _RULES.get(name)  # rule(name), inline: this runs for every hyperparameter of every step
    lo, lo_in, hi, hi_in, wording = r if r is not None else rule(name)
    # comparisons only: under torch.compile(dynamic=True) ``v`` may be symbolic, and
    # comparisons become guards where math.isfinite would break the graph
    ok = (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)
    if not ok:
        if wording.endswith("finite") and v == v and abs(v) != float("inf") and abs(v) > _MAX:
            wording += f" in float32 (at most {_MAX:.4g} in size; the step computes in float32)"
        raise ValueError(f"hyperparameter {name!r} is {v}{_where(count, source)}; {name} must be {wording}")
    return v


def check_args(**named: Any) -> None:
    """:func:`check` every argument that is not a schedule (callables are checked where
    they are evaluated); tuples and lists (``betas``) element by element, as
    ``betas[0]``, ``betas[1]``.

    Example::

        >>> from muonfx.hyperparams import check_args
        >>> check_args(lr=lambda step: 0.1, betas=(0.9, 0.999), eps=1e-8)
    """
    for name, value in named.items():
        if callable(value) and not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                check(f"{name}[{i}]", v)
        else:
            check(name, value)


def check_betas(name: str, betas: Any) -> None:
    """The shape of a ``betas`` pair, as torch.optim's Adam family wants it: ``TypeError``
    unless it is a pair, ``ValueError`` where it mixes numbers and tensors (torch
    refuses that too). The values are :func:`check`'s (:func:`check_args`).

    Example::

        >>> import torch
        >>> from muonfx.hyperparams import check_betas
        >>> check_betas("betas", (0.9, 0.999))
        >>> try:
        ...     check_betas("betas", (torch.tensor(0.9), 0.999))
        ... except ValueError as e:
        ...     print(e)
        hyperparameter 'betas' mixes tensors and numbers ((tensor(0.9000), 0.999)); give two numbers or two one-element tensors
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"hyperparameter {name!r} must be a pair (beta1, beta2), got {betas!r}")
    check_unmixed(name, betas)


def check_unmixed(name: str, values: Any) -> None:
    """``ValueError`` naming ``name`` where a tuple hyperparameter mixes tensors and
    numbers (torch's Adam family refuses such ``betas``); the adapter checks every tuple
    of a param group by it at each step."""
    if len(values) > 1 and len({isinstance(v, torch.Tensor) for v in values}) > 1:
        raise ValueError(f"hyperparameter {name!r} mixes tensors and numbers ({tuple(values)!r}); give "
                         f"{'two' if len(values) == 2 else 'all'} numbers or {'two' if len(values) == 2 else 'all'} "
                         "one-element tensors")


def check_group_values(hp: dict[str, Any], numeric: Any = ()) -> None:
    """Check, before a step, what a param group holds: numbers, one-element tensors and
    tuples of them by :func:`check`; a string or ``None`` under a name in ``numeric``
    (the names whose defaults are numbers) is refused too. Schedules and other objects
    (label functions, dtypes, mode names such as ``adjust_lr="original"``) are left to
    the step, which checks schedules' values.

    Example::

        >>> from muonfx.hyperparams import check_group_values
        >>> check_group_values({"lr": 0.02, "betas": (0.9, 0.95), "adjust_lr": "original"}, numeric={"lr"})
        >>> check_group_values({"lr": "abc"}, numeric={"lr"})
        Traceback (most recent call last):
        ...
        TypeError: hyperparameter 'lr' is 'abc' (a str); it must be a real number (or a one-element tensor)
    """
    for name, value in hp.items():
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                if isinstance(v, (int, float, torch.Tensor)) or name in numeric:
                    check(f"{name}[{i}]", v)
        elif isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
            check(name, value)
        elif (isinstance(value, str) or value is None) and name in numeric:
            check(name, value)


def check_float_dtype(name: str, dtype: Any) -> None:
    """``TypeError`` naming ``name`` unless ``dtype`` is ``None`` or a floating torch dtype.

    Example::

        >>> import torch
        >>> from muonfx.hyperparams import check_float_dtype
        >>> check_float_dtype("ns_dtype", torch.bfloat16)
    """
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch dtype (e.g. torch.float32, torch.bfloat16) "
                        f"or None, got {dtype!r}")


#: The extra argument (:mod:`muonfx.core.contract`) that carries the values of the
#: :class:`Slot` s of a transform's hyperparameters: ``{slot key: value}``, passed by
#: :func:`muonfx.inject_hyperparams` to the transform it built from a :func:`late_bound`
#: factory, at each update.
VALUES_ARG = "hyperparam_values"


class Slot:
    """A numeric hyperparameter given to a transform by name, its value read at each
    update from the extra argument :data:`VALUES_ARG` (``extra_args[VALUES_ARG][slot.key]``;
    an update without it raises ``KeyError``).

    :func:`muonfx.inject_hyperparams` builds the transform of a :func:`late_bound`
    factory once, with a slot in place of each late-bound number (``Slot("lr")``, and
    ``Slot("betas[0]")``, ``Slot("betas[1]")`` for a pair), and passes the current
    values at every update: a new learning rate, momentum or weight decay (a scheduler,
    a hand edit, a schedule) runs the same transform with other numbers, and never calls
    the factory again. :func:`check` lets a slot through (its value is checked where it
    is read). The transforms that read slots: :func:`muonfx.momentum` (``beta``),
    :func:`muonfx.newton_schulz` (``eps``), :func:`muonfx.decoupled_decay`,
    :func:`muonfx.cautious_decay`, :func:`muonfx.scale_by_learning_rate`,
    :func:`muonfx.scale_by_adam` (``b1``, ``b2``, ``eps``), :func:`muonfx.row_normalize`
    (``beta2``, ``eps``), :func:`muonfx.schedule_free` (``b1``) with its
    :class:`~muonfx.transforms.schedule_free.WarmupWeight` (``lr``, ``warmup_steps``,
    ``r``, ``weight_lr_power``) and :func:`muonfx.lr_multiplier`'s factory (``lr``). An
    :func:`muonfx.inject_hyperparams` transform inside another passes the enclosing
    values on with its own (a slot given to its factory unchanged is read there).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.hyperparams import Slot, VALUES_ARG
        >>> tx = mfx.scale_by_learning_rate(Slot("lr"))
        >>> u = TensorDict({"w": torch.ones(1)}, [])
        >>> tx.update(u, tx.init(u), None, **{VALUES_ARG: {"lr": 0.5}})[0]["w"].item()
        -0.5
    """

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Slot({self.key!r})"


def late_bound(*names: str) -> Any:
    """Declare that a transform factory's numeric arguments ``names`` may be
    :class:`Slot` s: the factory passes them on to transforms that read slots, unchanged
    (no arithmetic, no branch on their values), so the transform it builds is the same
    for every value of them. :func:`muonfx.inject_hyperparams` (hence
    :class:`muonfx.TransformOptimizer`) then builds it once per set of the other
    arguments and passes those numbers at each update; a factory without the
    declaration is called again whenever a number changes.

    :func:`muonfx.muon`, :func:`muonfx.adamw` and :func:`muonfx.muon_adamw` are
    declared for their learning rates, momentum, betas, epsilons and weight decays; the
    catalogue's presets and the Muon recipes for their learning rate and weight decay
    (the recipes also for momentum); :func:`muonfx.normuon`,
    :func:`muonfx.modded_nanogpt_normuon`, :func:`muonfx.muon_with_momentum_warmup` and
    :func:`muonfx.schedule_free_adamw` for every number.

    Example::

        >>> import muonfx as mfx
        >>> from muonfx.hyperparams import late_bound, late_bound_names
        >>> @late_bound("lr", "momentum")
        ... def heavy_ball(lr=0.1, momentum=0.9):
        ...     return mfx.chain(mfx.momentum(momentum), mfx.scale_by_learning_rate(lr))
        >>> sorted(late_bound_names(heavy_ball))
        ['lr', 'momentum']
    """
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"late_bound takes hyperparameter names, got {n!r}")

    def declare(factory: Any) -> Any:
        factory.__late_bound__ = frozenset(names)
        return factory

    return declare


def late_bound_names(factory: Any) -> frozenset:
    """The names :func:`late_bound` declared for ``factory`` (followed through
    ``__wrapped__``), or an empty set."""
    seen = 0
    while factory is not None and seen < 16:
        names = getattr(factory, "__late_bound__", None)
        if names is not None:
            return names
        factory, seen = getattr(factory, "__wrapped__", None), seen + 1
    return frozenset()
