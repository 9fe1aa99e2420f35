"""Cautious updates: keep the update elements that agree in sign with the gradient
(Liang et al., 2024, arXiv 2411.16085)."""

from __future__ import annotations

from typing import Callable

import torch

from .. import seam
from ..core import GradientTransformation, build, leafwise_if, leaves
from ..ops import foreach


def sums_over(tensors: list, dims_of: Callable[[torch.Tensor], tuple[int, ...]]) -> list:
    """Each tensor summed over ``dims_of(tensor)`` (``keepdim=True``) through
    :func:`muonfx.seam.sum_over`, one call per distinct set of dims (a DTensor's
    sharded dims reduced across its shards)."""
    out: list = [None] * len(tensors)
    by_dims: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dims.setdefault(dims_of(t), []).append(i)
    for dims, idx in by_dims.items():
        for i, r in zip(idx, seam.sum_over([tensors[i] for i in idx], dims)):
            out[i] = r
    return out


def _totals(tensors: list) -> list:
    """Each tensor summed over all its elements."""
    return sums_over(tensors, lambda t: tuple(range(-t.ndim, 0)))


def cautious(inner: GradientTransformation) -> GradientTransformation:
    """Mask the elements of ``inner``'s update whose sign disagrees with the gradient's.

    Formula (per parameter of ``n`` elements; ``g`` the incoming update, ``u`` the
    inner transform's output)::

        mask = [u * g > 0]
        out  = u * mask * n / (sum(mask) + 1)

    The rescaling (the authors' C-Optim code: ``mask.numel() / (mask.sum() + 1)``) keeps
    the update's average size where part of it is masked. Wrap the *direction* of a
    chain (the part before weight decay and the learning rate: its output points along
    the gradient), as ``chain(cautious(scale_by_adam()), decoupled_decay(wd),
    scale_by_learning_rate(lr))`` does: C-AdamW. The state is ``inner``'s, unchanged;
    leafwise when ``inner`` is. The sum is over the whole parameter (under FSDP2 the
    shards' counts are added through :mod:`muonfx.seam`).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.tensor([1.0, -1.0, 1.0])}, [])
        >>> tx = mfx.cautious(mfx.scale(-1.0))          # every element disagrees
        >>> tx.update(g, tx.init(g))[0]["w"].tolist()
        [-0.0, 0.0, -0.0]
        >>> tx = mfx.cautious(mfx.scale(2.0))           # all 3 agree: 2 * g * 3 / (3 + 1)
        >>> tx.update(g, tx.init(g))[0]["w"].tolist()
        [1.5, -1.5, 1.5]
    """

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        out, new_state = inner.update(updates, state, params)
        if not keys:
            return out, new_state
        _, us = leaves(out)
        agree = foreach("mul", us, gs)
        masks = [(a > 0).to(u.dtype) for a, u in zip(agree, us)]
        # n / (sum + 1), one 0-D-like tensor per parameter (no read-back to the host)
        scales = [u.numel() / (s + 1.0) for u, s in zip(us, _totals(masks))]
        return build(keys, foreach("mul", us, [m * s for m, s in zip(masks, scales)])), new_state

    return leafwise_if(GradientTransformation(inner.init, update_fn), inner)
