"""Per-row (per-neuron) second-moment normalisation after orthogonalisation (NorMuon)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from ..base import GradientTransformation, aligned, build, leaves
from ..hyperparams import check
from ._matrix import matrix_dims


class RowNormalizeState(NamedTuple):
    """State of :func:`row_normalize`.

    Attributes:
        v: EMA of each matrix row's mean square (each column's, for wide matrices with
            ``axis="larger"``), shaped like the matrix view without its last dim (its
            second-to-last) (``[A]`` for ``A x B``, ``[E, A]`` for expert stacks, ``[out]``
            for conv weights); zeros at init.
    """

    v: TensorDict


def _rows_view(key, t: torch.Tensor) -> torch.Tensor:
    matrix_dims(key, t, "row_normalize")  # validates ndim >= 2
    return t if t.ndim <= 3 else t.flatten(1)


AXES = ("rows", "larger")


def _reduce_dim(axis: str, view: torch.Tensor) -> int:
    """The dim the mean square runs over: the columns (one statistic per row), or for
    ``axis="larger"`` and a wide matrix (rows < columns) the rows (one per column)."""
    return -2 if axis == "larger" and view.shape[-2] < view.shape[-1] else -1


def row_normalize(beta2: float = 0.95, eps: float = 1e-8, *, axis: str = "rows") -> GradientTransformation:
    """NorMuon-style neuron-wise normalisation of an orthogonalised update.

    Formula, per matrix ``O`` (rows ``i``)::

        v_i <- lerp(v_i, mean_j O_ij^2, 1 - beta2)
        P   =  O / (sqrt(v) + eps)                 (row-wise)
        out =  P * ||O||_F / ||P||_F               (keeps Muon's update norm)

    ``axis="larger"`` keeps one statistic per index of the larger dimension, as
    modded-nanogpt's NorMuon does: per row for tall and square matrices, per column
    (``v_j <- lerp(v_j, mean_i O_ij^2, 1 - beta2)``) for wide ones.

    NorMuon (Li et al., 2025) follows the normalisation with a 0.2-RMS lr scale; here
    the update keeps the orthogonalised update's Frobenius norm so the usual
    :func:`scale_by_shape` modes and Muon learning rates carry over. Place it right
    after :func:`newton_schulz`. Works on DTensor shards (row statistics of row
    shards are local; the two norms are small all-reduces).

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
    if axis not in AXES:
        raise ValueError(f"row_normalize: axis must be one of {AXES}, got {axis!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        views = [_rows_view(k, p) for k, p in zip(keys, ps)]
        return RowNormalizeState(build(keys, [torch.zeros_like(v.select(_reduce_dim(axis, v), 0)) for v in views]))

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        vs = aligned(state.v, keys, "row_normalize state (v)")
        outs, new_vs = [], []
        for k, u, v in zip(keys, us, vs):
            o = _rows_view(k, u)
            dim = _reduce_dim(axis, o)
            nv = torch.lerp(v.to(o.dtype), o.square().mean(dim=dim), 1.0 - beta2)
            p = o / (nv.sqrt().unsqueeze(dim) + eps)
            dims = (-2, -1)
            ratio = torch.linalg.vector_norm(o, dim=dims, keepdim=True) / torch.linalg.vector_norm(
                p, dim=dims, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
            outs.append((p * ratio).reshape(u.shape))
            new_vs.append(nv.to(v.dtype))
        return build(keys, outs), RowNormalizeState(build(keys, new_vs))

    return GradientTransformation(init_fn, update_fn)
