"""Per-row (per-neuron) second-moment normalisation after orthogonalisation (NorMuon)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from .. import seam
from ..core import Dims, GradientTransformation, LeafwiseTransformation, MatrixView, aligned, build, leaves
from ..hyperparams import VALUES_ARG, Slot, check, check_float_dtype
from ..ops import foreach
from ..core.view import batched_matrix
from ._dtypes import widen
from ._matrix import leaf_views, matrix_dims


class RowNormalizeState(NamedTuple):
    """State of :func:`row_normalize`.

    Attributes:
        v: EMA of each matrix row's mean square (each column's, for wide matrices with
            ``axis="larger"``), shaped like the matrix view without its last dim (its
            second-to-last) (``[A]`` for ``A x B``, ``[E, A]`` for expert stacks, ``[out]``
            for conv weights); zeros at init.
    """

    v: TensorDict


def _rows_view(key, t: torch.Tensor, view: MatrixView | None = None) -> torch.Tensor:
    """``t`` as ``[*batch, A, B]`` by its default view (the batch dim of a 3-D stack kept),
    or as ``view``'s ``[k, A, B]`` stack."""
    if view is not None:
        return view.stack(t)
    matrix_dims(key, t, "row_normalize")  # validates ndim >= 2
    return batched_matrix(t)


AXES = ("rows", "larger")


def _reduce_dim(axis: str, view: torch.Tensor) -> int:
    """The dim the mean square runs over: the columns (one statistic per row), or for
    ``axis="larger"`` and a wide matrix (rows < columns) the rows (one per column)."""
    return -2 if axis == "larger" and view.shape[-2] < view.shape[-1] else -1


def row_normalize(beta2: float = 0.95, eps: float = 1e-8, *, axis: str = "rows",
                  mu_dtype: torch.dtype | None = None, dims: Dims = None) -> GradientTransformation:
    """NorMuon-style neuron-wise normalisation of an orthogonalised update.

    Formula, per matrix ``O`` (rows ``i``)::

        v_i <- lerp(v_i, mean_j O_ij^2, 1 - beta2)
        P   =  O / (sqrt(v) + eps)                 (row-wise)
        out =  P * ||O||_F / ||P||_F               (keeps Muon's update norm)

    ``mu_dtype`` stores the statistics ``v`` in that dtype (``None``: the parameter's);
    they are computed in the wider of it and the update's dtype (float32 statistics of
    bf16 parameters accumulate in float32), the output has the update's dtype.
    ``dims`` overrides the matrix view per leaf, as :func:`newton_schulz`'s (``v`` is then
    ``[k, A]`` for the view's ``[k, A, B]`` stack). ``beta2`` and ``eps`` may be
    :class:`muonfx.hyperparams.Slot` s, read at each update.

    ``axis="larger"`` keeps one statistic per index of the larger dimension, as
    modded-nanogpt's NorMuon does: per row for tall and square matrices, per column
    (``v_j <- lerp(v_j, mean_i O_ij^2, 1 - beta2)``) for wide ones.

    NorMuon (Li et al., 2025) follows the normalisation with a 0.2-RMS lr scale; here
    the update keeps the orthogonalised update's Frobenius norm so the usual
    :func:`scale_by_shape` modes and Muon learning rates carry over. Place it right
    after :func:`newton_schulz`. The row sums and the two norms (``||P||_F`` is
    ``sqrt(sum_i rowsq_i / (sqrt(v_i) + eps)^2)``, from the same row sums) go through
    :func:`muonfx.seam.sum_over`: on DTensor shards, row shards' row sums are local and
    the norms of all matrices are one all-reduce.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.chain(mfx.newton_schulz(), mfx.row_normalize(0.95))
        >>> g = TensorDict({"w": torch.randn(8, 16)}, [])
        >>> out, _ = tx.update(g, tx.init(g))
        >>> out["w"].shape
        torch.Size([8, 16])
    """
    beta2, eps = check("beta2", beta2), check("eps", eps)
    late_beta2, late_eps = type(beta2) is Slot, type(eps) is Slot  # numbers read at each update
    check_float_dtype("mu_dtype", mu_dtype)
    if axis not in AXES:
        raise ValueError(f"row_normalize: axis must be one of {AXES}, got {axis!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        over = (None if dims is None else leaf_views(dims, keys, ps, "row_normalize")) or [None] * len(keys)
        views = [_rows_view(k, p, w) for k, p, w in zip(keys, ps, over)]
        return RowNormalizeState(build(keys, [torch.zeros_like(v.select(_reduce_dim(axis, v), 0), dtype=mu_dtype)
                                              for v in views]))

    def update_fn(updates, state, params=None, **extra_args):
        b2 = extra_args[VALUES_ARG][beta2.key] if late_beta2 else beta2
        e = extra_args[VALUES_ARG][eps.key] if late_eps else eps
        keys, us = leaves(updates)
        vs = aligned(state.v, keys, "row_normalize state (v)")
        # axis="larger" on a wide matrix: statistics per column, i.e. per row of its transpose
        over = (None if dims is None else leaf_views(dims, keys, us, "row_normalize")) or [None] * len(keys)
        flips = [_reduce_dim(axis, _rows_view(k, u, w)) == -2 for k, u, w in zip(keys, us, over)]
        os_ = [_rows_view(k, u, w).mT if f else _rows_view(k, u, w) for k, u, f, w in zip(keys, us, flips, over)]
        # per-row sums of squares, then per-matrix [||O||^2, ||P||^2]: two seam reductions
        # for all leaves (on shards: one collective each at most, none for row shards' rows)
        # the statistics' arithmetic in the wider of their dtype and the update's
        vs_c, os_c, _ = widen(vs, os_)
        row_sq = seam.sum_over([o.square() for o in os_c], (-1,))
        new_vs, scales, pairs = [], [], []
        # v <- lerp(v, mean_sq, 1 - beta2) as foreach's "ema": traced, beta2 stays an operand
        # (a schedule of it recompiles nothing on torch 2.10 / 2.11)
        nvs = foreach("ema", vs_c, [rs.squeeze(-1) / o.shape[-1] for o, rs in zip(os_, row_sq)], b2)
        for o, v, rs, nv in zip(os_, vs, row_sq, nvs):
            s = (nv.sqrt() + e).unsqueeze(-1)
            new_vs.append(nv.to(v.dtype))
            scales.append(s)
            pairs.append(torch.cat([rs, rs / s.square()], dim=-1))
        totals = seam.sum_over(pairs, (-2,))
        outs = []
        for k, u, o, s, tot, f, w in zip(keys, us, os_, scales, totals, flips, over):
            ratio = tot[..., :1].sqrt() / tot[..., 1:].sqrt().clamp_min(torch.finfo(o.dtype).tiny)
            out = o / s * ratio
            out = out if out.dtype == u.dtype else out.to(u.dtype)
            out = out.mT if f else out
            outs.append(out.reshape(u.shape) if w is None else w.unstack(out, u.shape))
        return build(keys, outs), RowNormalizeState(build(keys, new_vs))

    return LeafwiseTransformation(init_fn, update_fn)
