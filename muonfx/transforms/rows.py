"""Per-row (per-neuron) second-moment normalisation after orthogonalisation (NorMuon)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from .. import seam
from ..base import GradientTransformation, aligned, build, leaves
from ._matrix import matrix_dims


class RowNormalizeState(NamedTuple):
    """State of :func:`row_normalize`.

    Attributes:
        v: EMA of each matrix row's mean square, shaped like the matrix view without
            its last dim (``[A]`` for ``A x B``, ``[E, A]`` for expert stacks, ``[out]``
            for conv weights); zeros at init.
    """

    v: TensorDict


def _rows_view(key, t: torch.Tensor) -> torch.Tensor:
    matrix_dims(key, t, "row_normalize")  # validates ndim >= 2
    return t if t.ndim <= 3 else t.flatten(1)


def row_normalize(beta2: float = 0.95, eps: float = 1e-8) -> GradientTransformation:
    """NorMuon-style neuron-wise normalisation of an orthogonalised update.

    Formula, per matrix ``O`` (rows ``i``)::

        v_i <- lerp(v_i, mean_j O_ij^2, 1 - beta2)
        P   =  O / (sqrt(v) + eps)                 (row-wise)
        out =  P * ||O||_F / ||P||_F               (keeps Muon's update norm)

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
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"row_normalize: beta2 must be in [0, 1), got {beta2!r}")

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return RowNormalizeState(build(keys, [torch.zeros_like(_rows_view(k, p)[..., 0]) for k, p in zip(keys, ps)]))

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        vs = aligned(state.v, keys, "row_normalize state (v)")
        os_ = [_rows_view(k, u) for k, u in zip(keys, us)]
        # per-row sums of squares, then per-matrix [||O||^2, ||P||^2]: two seam reductions
        # for all leaves (on shards: one collective each at most, none for row shards' rows)
        row_sq = seam.sum_over([o.square() for o in os_], (-1,))
        new_vs, scales, pairs = [], [], []
        for o, v, rs in zip(os_, vs, row_sq):
            nv = torch.lerp(v.to(o.dtype), rs.squeeze(-1) / o.shape[-1], 1.0 - beta2)
            s = (nv.sqrt() + eps).unsqueeze(-1)
            new_vs.append(nv.to(v.dtype))
            scales.append(s)
            pairs.append(torch.cat([rs, rs / s.square()], dim=-1))
        totals = seam.sum_over(pairs, (-2,))
        outs = []
        for k, u, o, s, tot in zip(keys, us, os_, scales, totals):
            ratio = tot[..., :1].sqrt() / tot[..., 1:].sqrt().clamp_min(torch.finfo(o.dtype).tiny)
            outs.append((o / s * ratio).reshape(u.shape))
        return build(keys, outs), RowNormalizeState(build(keys, new_vs))

    return GradientTransformation(init_fn, update_fn)
