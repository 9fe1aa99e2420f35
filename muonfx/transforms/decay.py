"""Decoupled weight decay."""

from __future__ import annotations

from ..combine import MaskSpec, masked
from ..core import EmptyState, GradientTransformation, LeafwiseTransformation, aligned, build, leaves
from ..hyperparams import VALUES_ARG, Slot, check
from ..ops import foreach


def _decay(weight_decay: float, mask: MaskSpec | None, cautious: bool, who: str) -> GradientTransformation:
    """The decoupled decay of :func:`decoupled_decay` and :func:`cautious_decay`: one
    validation (the shared rule of ``weight_decay``), one mask, one update.
    ``weight_decay`` may be a :class:`muonfx.hyperparams.Slot`, read at each update."""
    weight_decay = check("weight_decay", weight_decay)
    late = type(weight_decay) is Slot
    if not late:
        weight_decay = float(weight_decay)
    if mask is not None:
        return masked(_decay(weight_decay, None, cautious, who), mask)

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        wd = float(extra_args[VALUES_ARG][weight_decay.key]) if late else weight_decay
        keys, us = leaves(updates)
        ps = aligned(params, keys, f"params (needed by {who})", like=us)
        if wd == 0.0:
            return updates, state
        if not cautious:
            return build(keys, foreach("add", us, ps, alpha=wd)), state
        # gate = sign(p) * sign(u) in {-1, 0, 1} -> [signs agree and u != 0] -> p * gate,
        # all in p's dtype, so the decay term is exactly wd * p where it applies
        gated = foreach("sign", ps)
        foreach("mul_", gated, foreach("sign", us))
        foreach("clamp_min_", gated, 0.0)
        foreach("mul_", gated, ps)
        return build(keys, foreach("add", us, gated, alpha=wd)), state

    return LeafwiseTransformation(init_fn, update_fn)


def decoupled_decay(weight_decay: float, mask: MaskSpec | None = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to the update: ``out = u + wd * p``.

    Placed before :func:`scale_by_learning_rate` the decay is multiplied by the
    learning rate, ``p <- p - lr * (u + wd * p)``, exactly as torch.optim.AdamW and
    torch.optim.Muon decay (with the unadjusted lr). ``mask`` (a predicate
    ``(key, tensor) -> bool`` or a TensorDict of bools) limits decay to the selected
    leaves. Needs ``params``. ``weight_decay`` must be finite and ``>= 0``
    (:mod:`muonfx.hyperparams`).

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
    return _decay(weight_decay, mask, False, "decoupled_decay")


def cautious_decay(weight_decay: float, mask: MaskSpec | None = None) -> GradientTransformation:
    """Weight decay only where the update and the parameter agree in sign.

    Formula (elementwise; needs ``params``)::

        out = u + weight_decay * p * [sign(u) == sign(p)]

    Cautious Weight Decay (Chen et al., 2025, arXiv 2510.12402): decay pulls a
    coordinate towards zero only where the update already moves it that way
    (``-lr * u`` shrinks ``|p|``), so it never fights the optimizer. The paper's
    indicator is ``u * p >= 0``; here a zero update gets no decay either (a
    parameter that received no gradient is left alone). Where the signs agree the
    result is exactly :func:`decoupled_decay`'s ``u + wd * p``, and ``weight_decay``
    and ``mask`` are checked and applied as there. Place it where ``decoupled_decay``
    goes (after any positive scaling, before the lr). Elementwise: runs on DTensor shards.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.tensor([2.0, 2.0, -2.0, 2.0])}, [])
        >>> u = TensorDict({"w": torch.tensor([1.0, -1.0, -1.0, 0.0])}, [])
        >>> out, _ = mfx.cautious_decay(0.1).update(u, mfx.EmptyState(), p)
        >>> [round(x, 6) for x in out["w"].tolist()]
        [1.2, -1.0, -1.2, 0.0]
    """
    return _decay(weight_decay, mask, True, "cautious_decay")
