"""Hypothesis strategies for testing code built on muonfx, and a conformance check.

:func:`check_transform` runs muonfx's laws on a transform you wrote: the transform laws
(purity, eager state, dtypes, zero gradients, the combinator laws, and for a transform
declared leafwise that a split of the tree computes what the whole does), then the
adapter laws (:class:`muonfx.TransformOptimizer` computes what the functional loop
computes, a ``state_dict`` round-trip, a parameter without a gradient), and raises
:class:`ConformanceError` naming the broken law with a minimal example; a broken adapter
law is reported as the adapter's.

The package's modules: :mod:`.strategies` (hypothesis strategies), :mod:`.compare`
(tree comparisons), :mod:`.laws`, :mod:`.adapter_laws`, :mod:`.compiled_law` and
:mod:`.check` (:func:`check_transform`).

This module imports `hypothesis <https://hypothesis.readthedocs.io>`_, which is
not a runtime dependency of muonfx: import it only from tests.

Every strategy keeps its examples small (sides of at most 8 to 16) so that
property suites stay fast. Tensor values come from a drawn integer seed fed to a
``torch.Generator``, not element by element: hypothesis shrinks the seed, the
shapes and the key structure, not individual numbers.

Example::

    >>> from hypothesis import given, settings
    >>> from muonfx.testing import params_and_grads
    >>> import muonfx as mfx
    >>> @settings(max_examples=10, deadline=None)
    ... @given(params_and_grads())
    ... def test_adamw_keeps_keys(pg):
    ...     params, grads = pg
    ...     tx = mfx.adamw()
    ...     out, _ = tx.update(grads, tx.init(params), params)
    ...     assert set(out.keys(True, True)) == set(grads.keys(True, True))
    >>> test_adamw_keeps_keys()
"""

from __future__ import annotations

# Imports flow one way: strategies <- compare <- laws <- adapter_laws, compiled_law
# <- check <- this module, which only re-exports.
from . import strategies as _strategies
from .check import ADAPTER_LAW_NAMES, COMPILED_RTOL, LAWS, OPT_IN_LAWS, ConformanceError, check_transform
from .qk_law import QKClipLawError, check_qk_clip
from .strategies import (DEFAULT_DTYPES, as_dtensors, key_paths, keys, matrices, param_tensordicts,
                         params_and_grads, random_tensor, seeds, shapes, sharded_params_and_grads,
                         singular_values)

__all__ = [
    *_strategies.__all__,
    "LAWS",
    "ADAPTER_LAW_NAMES",
    "OPT_IN_LAWS",
    "COMPILED_RTOL",
    "ConformanceError",
    "check_transform",
    "check_qk_clip",
    "QKClipLawError",
]
