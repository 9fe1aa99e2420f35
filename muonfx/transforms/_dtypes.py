"""Each moment in its own dtype: the arithmetic of a state buffer runs in the wider of
the buffer's and the update's dtypes (a float32 buffer of bf16 gradients accumulates in
float32; a bf16 buffer of float32 gradients is computed in float32 and stored rounded
once), and the results go back to the dtypes they are stored or passed on in."""

from __future__ import annotations

from typing import Sequence

import torch


def wider(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.dtype]:
    """Per pair, the dtype both promote to (float32 for bf16 and float32, or bf16 and fp16)."""
    return [x.dtype if x.dtype == y.dtype else torch.promote_types(x.dtype, y.dtype) for x, y in zip(a, b)]


def cast(ts: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """``ts`` in ``dtypes`` (a tensor already in its dtype is passed through, not copied)."""
    return [t if t.dtype == d else t.to(d) for t, d in zip(ts, dtypes)]


def dtypes(ts: Sequence[torch.Tensor]) -> list[torch.dtype]:
    return [t.dtype for t in ts]
