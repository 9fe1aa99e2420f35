"""Each moment in its own dtype: the arithmetic of a state buffer runs in the wider of
the buffer's and the update's dtypes (a float32 buffer of bf16 gradients accumulates in
float32; a bf16 buffer of float32 gradients is computed in float32 and stored rounded
once), and the results go back to the dtypes they are stored or passed on in.

Where every pair already shares its dtype (the common case) nothing is cast and
:func:`widen` is the only call (the Python cost of a step must not grow)."""

from __future__ import annotations

import operator
from typing import Sequence

import torch

_dtype = operator.attrgetter("dtype")


def widen(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]):
    """``(a', b', back)``: ``a`` and ``b`` pairwise in the dtype both promote to (float32 for
    bf16 and float32, or for bf16 and fp16), and ``back = (a's dtypes, b's dtypes)`` to
    :func:`narrow` results with; where every pair shares its dtype, ``(a, b, None)``."""
    if torch.compiler.is_compiling():  # dynamo traces comprehensions, not attrgetter
        da, db = [x.dtype for x in a], [y.dtype for y in b]
    else:  # no Python frame per tensor (the step's Python cost)
        da, db = list(map(_dtype, a)), list(map(_dtype, b))
    if da == db:
        return a, b, None
    wide = list(map(torch.promote_types, da, db))
    return narrow(a, wide), narrow(b, wide), (da, db)


def narrow(ts: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """``ts`` in ``dtypes`` (a tensor already in its dtype is passed through, not copied)."""
    return [t if t.dtype == d else t.to(d) for t, d in zip(ts, dtypes)]
