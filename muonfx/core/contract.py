"""The transform contract: :class:`GradientTransformation`, its leafwise declaration,
:class:`EmptyState` and :func:`identity`.

A *transform* is a pair of pure functions (:class:`GradientTransformation`):

* ``init(params) -> state`` builds the transform's state, eagerly and completely;
* ``update(updates, state, params=None) -> (new_updates, new_state)`` maps a
  TensorDict of updates (gradients, at the start of a chain) to new updates.

``params`` and ``updates`` are :class:`tensordict.TensorDict` s keyed like
``TensorDict.from_module(model)``: nested keys are tuples of strings, shown to users
as dotted names (``"layers.0.weight"``). ``update`` never mutates its inputs.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from tensordict import TensorDictBase

__all__ = ["GradientTransformation", "LeafwiseTransformation", "leafwise", "is_leafwise", "leafwise_if",
           "EmptyState", "identity"]


class GradientTransformation(NamedTuple):
    """A pure optimizer transform: ``(init, update)``.

    ``init(params: TensorDict) -> state``
        Creates the full state eagerly. State holds only tensors, TensorDicts and
        numbers (typically a NamedTuple of them), and has the same structure on every
        rank and at every step.

    ``update(updates: TensorDict, state, params: TensorDict | None = None) -> (TensorDict, state)``
        Returns new updates and the new state. It never mutates ``updates``,
        ``state`` or ``params``.

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

    init: Callable[[TensorDictBase], Any]
    update: Callable[..., tuple[TensorDictBase, Any]]


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

