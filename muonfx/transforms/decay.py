"""Decoupled weight decay."""

from __future__ import annotations

from ..base import EmptyState, GradientTransformation, LeafwiseTransformation, aligned, build, foreach, leaves
from ..combine import MaskSpec, masked
from ..hyperparams import check


def decoupled_decay(weight_decay: float, mask: MaskSpec | None = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to the update: ``out = u + wd * p``.

    Placed before :func:`scale_by_learning_rate` the decay is multiplied by the
    learning rate, ``p <- p - lr * (u + wd * p)``, exactly as torch.optim.AdamW and
    torch.optim.Muon decay (with the unadjusted lr). ``mask`` (a predicate
    ``(key, tensor) -> bool`` or a TensorDict of bools) limits decay to the selected
    leaves. Needs ``params``.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.full((2,), 2.0), "b": torch.ones(2)}, [])
        >>> u = TensorDict({"w": torch.zeros(2), "b": torch.zeros(2)}, [])
        >>> tx = mfx.decoupled_decay(0.1, mask=lambda k, t: k != "b")
        >>> out, _ = tx.update(u, tx.init(p), p)
        >>> [round(x, 6) for x in out["w"].tolist()], out["b"].tolist()
        ([0.2, 0.2], [0.0, 0.0])
    """
    weight_decay = float(check("weight_decay", weight_decay))
    if mask is not None:
        return masked(decoupled_decay(weight_decay), mask)

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        ps = aligned(params, keys, "params (needed by decoupled_decay)", like=us)
        if weight_decay == 0.0:
            return updates, state
        return build(keys, foreach("add", us, ps, alpha=weight_decay)), state

    return LeafwiseTransformation(init_fn, update_fn)
