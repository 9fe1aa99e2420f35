"""The ground floor of muonfx: the transform contract and the leaf toolkit every transform
uses.

* :mod:`muonfx.core.contract`: :class:`GradientTransformation` (``init``/``update``), its
  leafwise declaration (:func:`leafwise`, :func:`is_leafwise`, :func:`leafwise_if`),
  :class:`EmptyState` and :func:`identity`;
* :mod:`muonfx.core.leaves`: keys (:data:`Key`, :func:`key_str`), the leaf checks
  (:func:`leaves`, :func:`aligned`, :func:`check_keys`, :func:`check_like`) and
  :func:`apply_updates`;
* :mod:`muonfx.core.view`: :class:`MatrixView`, which dims of a tensor are the matrix and
  which the batch (:func:`default_view`, overridden per parameter by :data:`Dims`);
* :func:`build` and :func:`td_items`, TensorDicts made and walked without a Python call per
  leaf (defined in :mod:`muonfx._compat.tensordict`, the one module touching tensordict's
  private fields).

It imports torch, tensordict and :mod:`muonfx._compat` only; everything else in muonfx
sits above it.
"""

from .._compat.tensordict import build, td_items
from .contract import EmptyState, GradientTransformation, InitFn, LeafwiseTransformation, UpdateFn, UpdateFnExtraArgs, \
    identity, is_leafwise, leafwise, leafwise_if, takes_extra_args, with_extra_args_support
from .leaves import Key, aligned, apply_updates, check_keys, check_like, key_str, leaves, zeros_like_leaves
from .view import Dims, MatrixView, default_view, view_of, views_for

__all__ = ["GradientTransformation", "LeafwiseTransformation", "leafwise", "is_leafwise", "leafwise_if", "EmptyState",
           "identity", "apply_updates", "Key", "key_str", "leaves", "aligned", "build", "check_keys", "check_like",
           "td_items", "InitFn", "UpdateFn", "UpdateFnExtraArgs", "takes_extra_args", "with_extra_args_support",
           "MatrixView", "Dims", "default_view", "view_of", "views_for", "zeros_like_leaves"]
