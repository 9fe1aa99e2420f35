"""The matrix view of a parameter: which of its dims are the matrix, which the batch.

Every matrix transform (Newton-Schulz, shape scales, per-row statistics, blocks), the
step plan's table and the DTensor overview read a tensor through one
:class:`MatrixView`. The default (:func:`default_view`):

* 2-D ``[A, B]``: one ``A x B`` matrix;
* 3-D ``[E, A, B]``: a batch of ``E`` matrices (MoE expert stacks);
* 4-D and more (conv weights ``[out, in, kh, kw]``): one ``out x (in*kh*kw)`` matrix.

A user overrides it per parameter with ``dims=`` (:data:`Dims`: a mapping or a callable
dotted name -> view), as optax's ``muon_weight_dimension_numbers``.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple, Sequence, Union

import torch

__all__ = ["MatrixView", "Dims", "default_view", "view_of", "views_for", "labelled", "label_of", "batched_matrix"]


def _dims(d: int | Sequence[int]) -> tuple[int, ...]:
    return (int(d),) if isinstance(d, int) else tuple(int(x) for x in d)


class MatrixView(NamedTuple):
    """Which dims of a tensor are the rows and the columns of its matrices; the others,
    in their order, are the batch (optax's ``MuonDimensionNumbers``: ``rows`` is its
    ``reduction_axis``, ``cols`` its ``output_axis``).

    A tensor of shape ``s`` is read as a ``[k, m, n]`` stack with ``k = prod(s[batch])``,
    ``m = prod(s[rows])``, ``n = prod(s[cols])``: permuted to ``batch + rows + cols``,
    then reshaped. Negative dims count from the end.

    Example::

        >>> import torch, muonfx as mfx
        >>> w = torch.randn(8, 3, 2, 2)                      # a conv weight [out, in, kh, kw]
        >>> mfx.MatrixView(rows=0, cols=(1, 2, 3)).shape(w.shape)
        (1, 8, 12)
        >>> v = mfx.MatrixView(rows=(1, 2, 3), cols=0)      # the transposed view
        >>> v.stack(w).shape, torch.equal(v.unstack(v.stack(w), w.shape), w)
        (torch.Size([1, 12, 8]), True)
        >>> v.describe(w.shape)
        '12x8 matrix (dims 1*2*3 x 0)'
    """

    rows: int | tuple[int, ...] = 0
    cols: int | tuple[int, ...] = 1

    def split(self, ndim: int, who: str = "matrix view") -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(batch, rows, cols)`` as non-negative dims of an ``ndim``-D tensor; raises
        ``ValueError`` for dims out of range, repeated, or an empty side."""
        rows = tuple(d % ndim if -ndim <= d < ndim else d for d in _dims(self.rows))
        cols = tuple(d % ndim if -ndim <= d < ndim else d for d in _dims(self.cols))
        both = rows + cols
        if not rows or not cols or any(not 0 <= d < ndim for d in both) or len(set(both)) != len(both):
            raise ValueError(f"{who}: {self!r} does not fit a {ndim}-D tensor: rows and cols must be distinct, "
                             f"non-empty dims in [-{ndim}, {ndim})")
        return tuple(d for d in range(ndim) if d not in both), rows, cols

    def shape(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """``(k, m, n)``: the stack shape a tensor of ``shape`` is read as."""
        batch, rows, cols = self.split(len(shape))
        return (math.prod(shape[d] for d in batch), math.prod(shape[d] for d in rows),
                math.prod(shape[d] for d in cols))

    def _perm(self, ndim: int) -> tuple[int, ...]:
        batch, rows, cols = self.split(ndim)
        return batch + rows + cols

    def stack(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as its ``[k, m, n]`` stack, contiguous (a permuted view is copied: the
        matrices are then laid out as if they had been made by hand)."""
        kmn = self.shape(tuple(t.shape))
        perm = self._perm(t.ndim)
        return (t if perm == tuple(range(t.ndim)) else t.permute(perm)).reshape(kmn).contiguous()

    def unstack(self, out: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The inverse of :meth:`stack`: a ``[k, m, n]`` result back in ``shape``."""
        perm = self._perm(len(shape))
        if perm == tuple(range(len(shape))):
            return out.reshape(tuple(shape))
        inverse = [0] * len(perm)
        for i, d in enumerate(perm):
            inverse[d] = i
        return out.reshape([shape[d] for d in perm]).permute(inverse).contiguous()

    def describe(self, shape: Sequence[int]) -> str:
        """The view in words, e.g. ``"batch dim 0 (4) of 16x8 matrices (dims 1 x 2)"``."""
        batch, rows, cols = self.split(len(shape))
        k, m, n = self.shape(shape)
        side = lambda ds: "*".join(str(d) for d in ds)  # noqa: E731
        what = f"{m}x{n} matri{'ces' if batch else 'x'} (dims {side(rows)} x {side(cols)})"
        if not batch:
            return what
        return f"batch dim{'s' if len(batch) > 1 else ''} {side(batch)} ({k}) of {what}"


_DEFAULTS: dict[int, MatrixView] = {2: MatrixView(0, 1), 3: MatrixView(1, 2)}


def default_view(ndim: int) -> MatrixView | None:
    """The default view of an ``ndim``-D tensor (module doc); ``None`` below 2-D (not a
    matrix)."""
    if ndim < 2:
        return None
    view = _DEFAULTS.get(ndim)
    return view if view is not None else MatrixView(0, tuple(range(1, ndim)))


def batched_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` by its default view with the batch dim kept: ``[A, B]``, ``[E, A, B]``, or a
    4-D+ ``[out, in, kh, kw]`` as ``[out, in*kh*kw]`` (per-row statistics and blocks)."""
    return t if t.ndim <= 3 else t.flatten(1)


#: a per-parameter override of the matrix view: a mapping dotted name -> view (names not
#: in it keep the default), or a callable ``(name, tensor) -> view | None`` (``None``: the
#: default), as optax's ``muon_weight_dimension_numbers``
Dims = Union[Mapping[str, MatrixView], Callable[[str, torch.Tensor], Union[MatrixView, None]], None]


def view_of(dims: Dims, name: str, t: torch.Tensor) -> MatrixView | None:
    """The view of the leaf ``name`` (dotted) under ``dims``: the override, or the default."""
    given = None
    if dims is not None:
        given = dims.get(name) if isinstance(dims, Mapping) else dims(name, t)
    if given is None:
        return default_view(t.ndim)
    if not isinstance(given, MatrixView):
        raise TypeError(f"dims: leaf {name!r} got {given!r}; give a muonfx.MatrixView(rows=..., cols=...)")
    given.split(t.ndim, f"dims: leaf {name!r} of shape {tuple(t.shape)}")
    return given


def views_for(dims: Dims, names: Sequence[str], ts: Sequence[torch.Tensor]) -> list[MatrixView | None] | None:
    """Each leaf's view where ``dims`` overrides some (``None`` at a leaf: its default is
    kept; ``None`` for all: no override, the caller's default path)."""
    if dims is None:
        return None
    out: list[MatrixView | None] = []
    for name, t in zip(names, ts):
        v = view_of(dims, name, t)
        out.append(None if v == default_view(t.ndim) else v)
    return out if any(v is not None for v in out) else None


def labelled(stack: torch.Tensor, view: MatrixView, shape: Sequence[int]) -> torch.Tensor:
    """``stack`` (made by ``view.stack`` from a tensor of ``shape``) marked with the view it
    was read by, for what reports the matrix work (the step plan's dry run reads it back
    with :func:`label_of`). Only overridden views are marked; it changes no arithmetic."""
    stack.muonfx_matrix_view = (view, tuple(shape))
    return stack


def label_of(stack: torch.Tensor) -> tuple[MatrixView, tuple[int, ...]] | None:
    """``(view, shape)`` a stack was marked with by :func:`labelled`, else ``None``."""
    return getattr(stack, "muonfx_matrix_view", None)
