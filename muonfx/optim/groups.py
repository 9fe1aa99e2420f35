"""A param group's record for the adapter: its transform factory, keys, state, and
how its hyperparameters are read from ``param_groups``."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

from ..core.cache import LRU
from ..core import GradientTransformation, Key, build, key_str, leafwise_if, leaves, takes_extra_args
from ..hyperparams import VALUES_ARG, Slot, late_bound
from ..ops import foreach
from ..wrappers import InjectHyperparamsState, inject_hyperparams, signature

__all__ = ["GroupRecord", "lr_multiplier", "as_factory", "factory_defaults", "check_known", "serialisable",
           "ADAPTER_KEYS", "GroupWork", "gather", "static_key"]

TxOrFactory = Union[GradientTransformation, Callable[..., GradientTransformation]]

#: param-group keys that belong to the adapter, not to the transform factory (``"compile"``
#: and ``"fused"``: ``None`` for the rule, ``True``/``False``; see :mod:`muonfx.optim.step.plan`)
ADAPTER_KEYS = frozenset({"params", "param_names", "name", "sparse_grad", "initial_lr", "compile", "fused"})


def lr_multiplier(tx: GradientTransformation) -> Callable[..., GradientTransformation]:
    """A factory ``(lr=1.0) -> tx`` whose output is multiplied by ``lr``.

    :class:`muonfx.TransformOptimizer` uses it for pre-built transforms, so that
    ``group["lr"]`` (and any lr scheduler) scales the whole update: ``out = lr * tx(u)``.
    With ``lr == 1`` the update is exactly ``tx``'s. Leafwise (:func:`muonfx.leafwise`)
    when ``tx`` is; the extra arguments of a call reach ``tx`` when it takes them. ``lr``
    is late-bound (:func:`muonfx.hyperparams.late_bound`): an lr scheduler builds nothing.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.lr_multiplier(mfx.scale(-1.0))(lr=0.5)
        >>> u = TensorDict({"w": torch.ones(2)}, [])
        >>> tx.update(u, tx.init(u))[0]["w"].tolist()
        [-0.5, -0.5]
    """

    takes = takes_extra_args(tx)

    @late_bound("lr")
    def with_lr(lr: float = 1.0) -> GradientTransformation:
        late = type(lr) is Slot

        def update_fn(updates, state, params=None, **extra_args):
            value = extra_args[VALUES_ARG][lr.key] if late else lr
            out, state = tx.update(updates, state, params, **(extra_args if takes else {}))
            if value == 1.0:
                return out, state
            keys, us = leaves(out)
            return type(out)(dict(zip(keys, foreach("mul", us, float(value)))), batch_size=[]), state

        return leafwise_if(GradientTransformation(tx.init, update_fn), tx)

    return with_lr


def as_factory(tx: TxOrFactory) -> Callable[..., GradientTransformation]:
    factory = lr_multiplier(tx) if isinstance(tx, GradientTransformation) else tx
    if not callable(factory):
        raise TypeError(f"tx must be a GradientTransformation or a factory returning one, got {type(tx).__name__}")
    return factory


def serialisable(v: Any) -> bool:
    """True for values that ``torch.load(weights_only=True)`` reads back."""
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype, torch.Tensor)):
        return True
    if isinstance(v, (tuple, list)):
        return all(serialisable(x) for x in v)
    return False


def factory_defaults(factory: Callable[..., Any]) -> dict[str, Any]:
    """The factory's keyword defaults that can live in ``param_groups`` (and be saved)."""
    out = {}
    for name, p in signature(factory).parameters.items():
        if p.default is not inspect.Parameter.empty and serialisable(p.default):
            out[name] = p.default
    return out


def check_known(factory: Callable[..., Any], given: dict[str, Any], what: str) -> None:
    """``TypeError`` naming the keys of ``given`` that ``factory`` does not take."""
    sig = signature(factory)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    unknown = sorted(n for n in given if n not in sig.parameters and n not in ADAPTER_KEYS)
    if unknown:
        raise TypeError(
            f"{what} {unknown} are not arguments of {getattr(factory, '__name__', factory)!r}; "
            f"it takes {list(sig.parameters)}"
        )


def static_key(hp: dict[str, Any]) -> tuple:
    """The hyperparameters that select a transform (and a compiled step): everything but
    numbers and tuples of numbers (``betas``), which live in the injected state.

    Example::

        >>> static_key({"lr": 0.1, "betas": (0.9, 0.99), "adjust_lr": "original"})
        (('betas', 2), ('adjust_lr', 'original'))
    """
    out = []
    for n, v in hp.items():
        if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool):
            continue
        if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out.append((n, len(v)))
            continue
        out.append((n, v if isinstance(v, (str, bool, type(None), torch.dtype)) else id(v)))
    return tuple(out)


def numeric_values(hp: dict[str, Any]) -> tuple:
    """The numbers (and tuples of numbers, such as ``betas``) among the hyperparameters
    ``hp``: what :func:`static_key` leaves to the injected state, and the values a
    compiled step is pinned to on a torch that specialises them (see
    :class:`muonfx.optim.step.compiled.CompiledSteps`).

    Example::

        >>> numeric_values({"lr": 0.1, "betas": (0.9, 0.99), "adjust_lr": "original"})
        (('lr', 0.1), ('betas', (0.9, 0.99)))
    """
    out = []
    for n, v in hp.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((n, v))
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out.append((n, tuple(v)))
    return tuple(out)


def _reuse_last(factory: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """``factory``, returning its last transform again when called with equal arguments.

    :func:`muonfx.inject_hyperparams` builds the inner transform of a factory that is
    not :func:`muonfx.hyperparams.late_bound` from the current hyperparameters at every
    update; between steps they rarely change, and a factory is a pure function of its
    arguments, so the last transform serves as it is.
    """
    last: list = []

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        if last:
            try:
                if last[0] == args and last[1] == kwargs:
                    return last[2]
            except (RuntimeError, TypeError, ValueError):  # e.g. multi-element tensors
                pass
        tx = factory(*args, **kwargs)
        last[:] = [args, kwargs, tx]
        return tx

    return build


@dataclass
class GroupRecord:
    """What the adapter keeps for one param group.

    Attributes:
        factory: the transform factory (hyperparameters are its keyword arguments).
        keys: the TensorDict key of every parameter of the group, in order.
        base_lr: ``lr`` at creation (other ``*_lr`` hyperparameters follow its ratio).
        state: the transform's state (an :class:`InjectHyperparamsState`); its counts are
            per parameter (:class:`muonfx.counts.Counts`), so a parameter that gets no
            gradient in a step keeps them, as torch keeps ``state[p]["step"]``.
        transforms: the group's injected transforms, one per set of static
            hyperparameters (numbers live in the state: a new lr or momentum selects
            the same one). For a factory declared
            :func:`muonfx.hyperparams.late_bound` (:func:`muonfx.muon`,
            :func:`muonfx.adamw`, :func:`muonfx.muon_adamw`, a pre-built transform's
            :func:`lr_multiplier`) its :func:`muonfx.inject_hyperparams` built the inner
            transform once and passes the new numbers at each update, calling the factory
            no more; any other factory is called again with the new numbers (equal
            numbers reuse the last inner transform). Rebuilt after a copy or an
            unpickling.
        checked: the arguments other than the late-bound numbers that the factory last
            accepted in a DTensor step's checks (:mod:`muonfx.optim.agreement`), or None.
    """

    factory: Callable[..., GradientTransformation]
    keys: list[Key]
    base_lr: float | None
    state: Any = None
    transforms: dict[Any, GradientTransformation] = field(default_factory=lambda: LRU(GroupRecord.TRANSFORMS))
    checked: Any = None

    #: transforms kept per group (one per set of static hyperparameters; a new schedule
    #: object at every step would otherwise add one each step)
    TRANSFORMS = 16

    def __getstate__(self) -> dict:
        # the built transforms are closures (not picklable) and are rebuilt on use
        return {"factory": self.factory, "keys": self.keys, "base_lr": self.base_lr, "state": self.state}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.transforms = LRU(GroupRecord.TRANSFORMS)
        self.checked = None

    @classmethod
    def create(cls, factory: Callable[..., GradientTransformation], names: list[str],
               group: dict[str, Any]) -> "GroupRecord":
        """The record of a new param group, its transform state created eagerly."""
        keys = [tuple(str(n).split(".")) for n in names]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate parameter names in a param group: {names}")
        lr0 = group.get("lr")
        one = isinstance(lr0, (int, float)) or isinstance(lr0, torch.Tensor) and lr0.numel() == 1
        rec = cls(factory, keys, float(lr0) if one else None)  # anything else is refused by the transform
        with torch.no_grad():
            rec.state = rec.transform(rec.hyperparams(group)).init(
                build(keys, list(group["params"])))
        return rec

    @property
    def names(self) -> list[str]:
        """The dotted name of every parameter of the group."""
        return [key_str(k) for k in self.keys]

    def hyperparams(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's hyperparameters as the transform sees them.

        Other learning rates of a factory (``adamw_lr`` of ``mfx.muon_adamw``, any
        ``*_lr``) follow ``lr``: they are multiplied by ``lr / lr_at_creation``, so a
        scheduler (or DCP's lr=0 initialisation step) drives every part of the update.
        """
        hp = {n: group[n] for n in signature(self.factory).parameters if n in group}
        base = self.base_lr
        lr = hp.get("lr")
        if base and (type(lr) is float or isinstance(lr, (int, float)) and not isinstance(lr, bool)
                     or isinstance(lr, torch.Tensor) and lr.numel() == 1):
            # (anything else, a string, None, is refused by name when the transform is built)
            ratio = float(lr) / base
            if ratio != 1.0:
                for n, v in hp.items():
                    if n.endswith("_lr") and isinstance(v, (int, float)) and not isinstance(v, bool):
                        hp[n] = v * ratio
        return hp

    def transform(self, hp: dict[str, Any]) -> GradientTransformation:
        """The injected transform for ``hp``, built once per set of static values (the
        plan's settings reach it at each step as an extra argument, see
        :mod:`muonfx.optim.step.plan`)."""
        # numbers (and tuples of them, such as betas) live in the state; anything
        # else (strings, dtypes, schedules) selects the transform
        key = static_key(hp)
        tx = self.transforms.get(key)
        if tx is None:
            tx = self.transforms[key] = inject_hyperparams(_reuse_last(self.factory))(**hp)
        return tx

    def current_state(self, hp: dict[str, Any]) -> InjectHyperparamsState:
        """The state carrying ``hp``'s values of the injected hyperparameters."""
        st = self.state
        cur = st.hyperparams
        for n in cur:
            if n in hp and cur[n] is not hp[n]:
                return st._replace(hyperparams={n: hp.get(n, v) for n, v in cur.items()})
        return st


_SPARSE_HINT = (
    "Muon and the other matrix transforms need dense gradients. Use "
    "nn.Embedding(..., sparse=False), or route this parameter to AdamW: "
    "mfx.create_hybrid_optimizer(model, ...) does so for embeddings, or pass it in a "
    "param group {'params': [...], 'tx': mfx.adamw, 'sparse_grad': 'densify'} "
    "(its sparse gradient is then densified before the AdamW step)."
)


@dataclass
class GroupWork:
    """One group's share of a step: its record, hyperparameters, and the parameters
    (positions ``idx`` in the group) that have gradients."""

    record: GroupRecord
    hp: dict[str, Any]
    idx: list[int]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]


def gather(rec: GroupRecord, group: dict[str, Any]) -> GroupWork | None:
    """The group's parameters that have gradients, with those gradients (checked: a
    sparse gradient needs ``"sparse_grad": "densify"``, complex ones are refused); None
    when no parameter of the group has a gradient."""
    idx, params, grads = [], [], []
    for i, p in enumerate(group["params"]):
        g = p.grad
        if g is None:
            continue
        if g.layout != torch.strided:
            if group.get("sparse_grad", "error") != "densify":
                raise ValueError(f"parameter {key_str(rec.keys[i])!r} has a sparse gradient ({g.layout}). {_SPARSE_HINT}")
            g = g.to_dense()
        if g.is_complex():
            raise TypeError(f"parameter {key_str(rec.keys[i])!r} has a complex gradient; muonfx takes real tensors only")
        idx.append(i)
        params.append(p)
        grads.append(g)
    if not idx:
        return None
    return GroupWork(rec, rec.hyperparams(group), idx, params, grads)
