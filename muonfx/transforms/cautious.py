"""Cautious updates: keep the update elements that agree in sign with the gradient
(Liang et al., 2024, arXiv 2411.16085)."""

from __future__ import annotations

from ..core import GradientTransformation, build, leafwise_if, leaves
from .. import seam
from ..ops import foreach


def _totals(masks: list) -> list:
    """Each mask summed over all its elements (through the seam: a DTensor's whole sum)."""
    out: list = [None] * len(masks)
    by_ndim: dict[int, list[int]] = {}
    for i, m in enumerate(masks):
        by_ndim.setdefault(m.ndim, []).append(i)
    for nd, idx in by_ndim.items():
        if nd == 0:
            sums = [masks[i] for i in idx]
        else:
            sums = seam.sum_over([masks[i] for i in idx], tuple(range(-nd, 0)))
        for i, s in zip(idx, sums):
            out[i] = s
    return out


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
