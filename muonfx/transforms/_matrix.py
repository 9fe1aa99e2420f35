"""The matrix view shared by every matrix transform (Newton-Schulz, shape scales), read
through :class:`muonfx.core.MatrixView` (:func:`muonfx.core.default_view`):

* 2-D ``[A, B]``: one matrix;
* 3-D ``[E, A, B]``: a batch of ``E`` matrices (MoE expert stacks);
* 4-D and more (conv weights ``[out, in, kh, kw]``): one matrix ``[out, in*kh*kw]``.

A transform's ``dims=`` overrides it per leaf (:func:`leaf_views`); the default path
keeps its inline spelling of the 2-D and 3-D cases (the per-step hot path).
0-D and 1-D leaves are not matrices: an error names the key and the way out.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._compat.dtensor import dtensor_class, dtensor_stack_views, unstack_like
from ..core import Dims, Key, MatrixView, default_view, key_str, views_for
from ..core.view import labelled


def _require_matrix(key: Key, t: torch.Tensor, who: str) -> None:
    if t.ndim < 2:
        raise ValueError(
            f"{who} needs matrices, but leaf {key_str(key)!r} has shape {tuple(t.shape)} "
            f"({t.ndim}-D). Route 0-D/1-D parameters elsewhere with "
            f"mfx.mask_by_ndim({who}(...), ndim={{2, 3, 4}}) or mfx.partition "
            "(mfx.muon_adamw does this for you)."
        )


def matrix_dims(key: Key, t: torch.Tensor, who: str) -> tuple[int, int]:
    """``(A, B)`` = (rows, cols) of the matrix view of ``t``."""
    _require_matrix(key, t, who)
    if t.ndim == 2:  # default_view's rule, inline for the hot path
        return int(t.shape[0]), int(t.shape[1])
    if t.ndim == 3:
        return int(t.shape[1]), int(t.shape[2])
    _, a, b = default_view(t.ndim).shape(t.shape)  # type: ignore[union-attr]
    return int(a), int(b)


def as_stack(key: Key, t: torch.Tensor, who: str) -> torch.Tensor:
    """``t`` viewed as a ``[k, A, B]`` stack of matrices."""
    _require_matrix(key, t, who)
    if t.ndim == 3:
        return t
    a, b = matrix_dims(key, t, who)
    return t.reshape(1, a, b)


def leaf_views(dims: Dims, keys: list[Key], ts: list[torch.Tensor], who: str) -> list[MatrixView | None] | None:
    """Each leaf's view under ``dims`` (``None`` at a leaf that keeps its default; ``None``
    when no leaf is overridden). Checks that every leaf is a matrix."""
    if dims is None:
        return None
    for k, t in zip(keys, ts):
        _require_matrix(k, t, who)
    return views_for(dims, [key_str(k) for k in keys], ts)


def matrix_shapes(keys: list[Key], ts: list[torch.Tensor], who: str,
                  views: Sequence[MatrixView | None] | None = None) -> list[tuple[int, int]]:
    """``(A, B)`` of every leaf's matrix view, in one call (the per-leaf work inline);
    ``views`` (:func:`leaf_views`) overrides some."""
    if views is not None:
        return [matrix_dims(k, t, who) if v is None else v.shape(t.shape)[1:] for k, t, v in zip(keys, ts, views)]
    out = []
    for k, t in zip(keys, ts):
        nd = t.ndim
        if nd == 2:
            out.append((t.shape[0], t.shape[1]))
        elif nd == 3:
            out.append((t.shape[1], t.shape[2]))
        else:
            out.append(matrix_dims(k, t, who))  # 4-D+, or the error for 0-D/1-D
    return out


def as_stacks(keys: list[Key], ts: list[torch.Tensor], who: str,
              views: Sequence[MatrixView | None] | None = None) -> list[torch.Tensor]:
    """Every leaf viewed as a ``[k, A, B]`` stack (see :func:`as_stack`), in one call;
    ``views`` (:func:`leaf_views`) overrides some."""
    if views is not None:
        return [as_stack(k, t, who) if v is None else labelled(v.stack(t), v, t.shape) for k, t, v in zip(keys, ts, views)]
    out: list = []
    cls = dtensor_class()
    fast = cls is not None and not torch.is_grad_enabled()  # 2-D DTensors: dtensor_stack_views
    views: list = []  # (position, tensor, (a, b))
    for (a, b), t in zip(matrix_shapes(keys, ts, who), ts):
        if t.ndim == 3:
            out.append(t)
        elif fast and t.ndim == 2 and isinstance(t, cls):
            views.append((len(out), t, (a, b)))
            out.append(None)
        else:
            out.append(t.reshape(1, a, b))
    if views:
        for (i, _, _), v in zip(views, dtensor_stack_views([v[1] for v in views], [v[2] for v in views])):
            out[i] = v
    return out


def from_stacks(outs: list[torch.Tensor], ts: list[torch.Tensor],
                views: Sequence[MatrixView | None] | None = None) -> list[torch.Tensor]:
    """The inverse of :func:`as_stacks`: each ``[k, A, B]`` result in its leaf's shape."""
    if views is None:
        return unstack_like(outs, ts)
    return [unstack_like([o], [t])[0] if v is None else v.unstack(o, t.shape) for o, t, v in zip(outs, ts, views)]
