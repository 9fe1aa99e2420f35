"""The transform contract: :class:`GradientTransformation`, its leafwise declaration,
:class:`EmptyState` and :func:`identity`.

A *transform* is a pair of pure functions (:class:`GradientTransformation`):

* ``init(params) -> state`` builds the transform's state, eagerly and completely;
* ``update(updates, state, params=None, **extra_args) -> (new_updates, new_state)``
  maps a TensorDict of updates (gradients, at the start of a chain) to new updates.

*Extra arguments* (optax's ``GradientTransformationExtraArgs``): whoever runs a
transform may pass keyword arguments after ``params`` (a step's context: a value the
model computed, a loss, a per-step setting). A transform whose ``update`` takes
``**extra_args`` receives all of them and reads those it knows; one whose ``update``
takes none (the plain ``update(updates, state, params=None)``) is called without them:
:func:`takes_extra_args` tells which, :func:`with_extra_args_support` turns the latter
into the former, and every combinator, wrapper and the adapter's step pass them on.

``params`` and ``updates`` are :class:`tensordict.TensorDict` s keyed like
``TensorDict.from_module(model)``: nested keys are tuples of strings, shown to users
as dotted names (``"layers.0.weight"``). ``update`` never mutates its inputs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple, Protocol

from tensordict import TensorDictBase

__all__ = ["GradientTransformation", "LeafwiseTransformation", "leafwise", "is_leafwise", "leafwise_if",
           "EmptyState", "identity", "InitFn", "UpdateFn", "UpdateFnExtraArgs", "takes_extra_args",
           "with_extra_args_support"]


class InitFn(Protocol):
    """``init(params) -> state``: the state of a transform, built eagerly and completely."""

    def __call__(self, params: TensorDictBase) -> Any: ...


class UpdateFn(Protocol):
    """``update(updates, state, params=None) -> (new_updates, new_state)``: a transform
    that takes no extra arguments (it is called without them)."""

    def __call__(self, updates: TensorDictBase, state: Any,
                 params: TensorDictBase | None = None) -> tuple[TensorDictBase, Any]: ...


class UpdateFnExtraArgs(Protocol):
    """``update(updates, state, params=None, **extra_args) -> (new_updates, new_state)``:
    a transform that receives every extra argument of the call, reads those it knows and
    ignores the others (a combinator passes all of them on)."""

    def __call__(self, updates: TensorDictBase, state: Any, params: TensorDictBase | None = None,
                 **extra_args: Any) -> tuple[TensorDictBase, Any]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer transform: ``(init, update)``.

    ``init(params: TensorDict) -> state``
        Creates the full state eagerly. State holds only tensors, TensorDicts and
        numbers (typically a NamedTuple of them), and has the same structure on every
        rank and at every step.

    ``update(updates: TensorDict, state, params: TensorDict | None = None, **extra_args) -> (TensorDict, state)``
        Returns new updates and the new state. It never mutates ``updates``,
        ``state`` or ``params``. ``**extra_args`` is optional (:class:`UpdateFn` or
        :class:`UpdateFnExtraArgs`): an ``update`` that declares it receives the extra
        arguments of the call (a step's context); one that does not is called without
        them (:func:`takes_extra_args`).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> params = TensorDict({"w": torch.ones(2, 2)}, [])
        >>> tx = mfx.chain(mfx.momentum(0.9), mfx.scale_by_learning_rate(0.1))
        >>> state = tx.init(params)
        >>> updates, state = tx.update(params.clone(), state, params)
        >>> round(mfx.apply_updates(params, updates)["w"][0, 0].item(), 6)
        0.99
    """

    init: InitFn | Callable[[TensorDictBase], Any]
    update: UpdateFn | UpdateFnExtraArgs | Callable[..., tuple[TensorDictBase, Any]]


class LeafwiseTransformation(GradientTransformation):
    """A :class:`GradientTransformation` declared *leafwise* by :func:`leafwise`: the
    same ``(init, update)`` pair, the same tuple, and a statement about what it computes."""

    __slots__ = ()


def leafwise(tx: GradientTransformation) -> GradientTransformation:
    """Declare that ``tx`` treats the leaves of the tree independently.

    A transform is leafwise when, for every leaf ``k``, the update and the new state of
    ``k`` depend only on ``k``'s update, state and parameter, and on scalars that every
    leaf shares and advances alike (step counters, injected hyperparameters). Then the
    update of any split of the tree, merged, is the update of the whole tree:

        update(u, s, p)[k] == update(u[K], s[K], p[K])[k]   for every subset K holding k

    Elementwise transforms are leafwise; so are per-matrix ones (Newton-Schulz, per-row
    statistics: each matrix is a leaf, or a stack of independent matrices), and
    combinators of leafwise transforms (:func:`muonfx.chain`, :func:`muonfx.partition`,
    :func:`muonfx.masked`, ...), which declare themselves so. A transform that reduces
    over several leaves (a global norm, a finite check over all updates) is not.

    The declaration changes nothing about what ``tx`` computes. It lets whoever runs
    the transform split a large tree: the adapter's executor runs a leafwise group in
    pieces of bounded size (each piece computed and written before the next), so a
    step's extra memory is bounded by the piece, not by the model.
    :func:`muonfx.testing.check_transform` checks a declaration (law ``leafwise``).
    Undeclared transforms (your own, by default) always run on the whole tree.

    Example::

        >>> import muonfx as mfx
        >>> from muonfx.core import GradientTransformation
        >>> double = GradientTransformation(lambda p: (), lambda u, s, p=None: (u.apply(lambda t: 2 * t), s))
        >>> mfx.is_leafwise(double), mfx.is_leafwise(mfx.leafwise(double))
        (False, True)
        >>> mfx.is_leafwise(mfx.chain(mfx.leafwise(double), mfx.scale(0.5)))
        True
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"leafwise takes a GradientTransformation, got {type(tx).__name__}")
    return tx if isinstance(tx, LeafwiseTransformation) else LeafwiseTransformation(tx.init, tx.update)


def is_leafwise(tx: Any) -> bool:
    """Whether ``tx`` is declared leafwise (see :func:`leafwise`)."""
    return isinstance(tx, LeafwiseTransformation)


def leafwise_if(tx: GradientTransformation, *inner: GradientTransformation) -> GradientTransformation:
    """``tx`` declared leafwise when every transform in ``inner`` is (for combinators)."""
    return leafwise(tx) if all(isinstance(t, LeafwiseTransformation) for t in inner) else tx


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged (the unit of :func:`chain`)."""

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        return updates, state

    return LeafwiseTransformation(init_fn, update_fn)



def takes_extra_args(tx: GradientTransformation) -> bool:
    """Whether ``tx.update`` takes extra arguments (declares ``**extra_args``,
    :class:`UpdateFnExtraArgs`): such a transform is called with every extra argument of
    a call, one that does not (:class:`UpdateFn`) without any.

    Example::

        >>> import muonfx as mfx
        >>> from muonfx.core import takes_extra_args
        >>> takes_extra_args(mfx.scale(2.0)), takes_extra_args(mfx.chain(mfx.scale(2.0)))
        (False, True)
    """
    fn = tx.update
    code = getattr(fn, "__code__", None)  # (a function or bound method: no signature to build)
    if code is not None:
        return bool(code.co_flags & inspect.CO_VARKEYWORDS)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): called without extra arguments
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` with an ``update`` that takes extra arguments (:class:`UpdateFnExtraArgs`):
    ``tx`` itself where it does (:func:`takes_extra_args`), else the same transform whose
    update ignores them (optax's ``with_extra_args_support``). Leafwise when ``tx`` is.

    The combinators and wrappers of muonfx do the same without the extra call: each
    passes a call's extra arguments to the transforms that take them and calls the
    others without.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.core import with_extra_args_support
        >>> tx = with_extra_args_support(mfx.scale(2.0))
        >>> u = TensorDict({"w": torch.ones(1)}, [])
        >>> tx.update(u, tx.init(u), None, loss=torch.tensor(3.0))[0]["w"].item()
        2.0
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"with_extra_args_support takes a GradientTransformation, got {type(tx).__name__}")
    if takes_extra_args(tx):
        return tx
    inner = tx.update

    def update_fn(updates, state, params=None, **extra_args):
        return inner(updates, state, params)

    return type(tx)(tx.init, update_fn)
