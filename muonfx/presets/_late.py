"""Pieces of the variants (:mod:`muonfx.presets.variants`) whose numbers may be late-bound
(:class:`muonfx.hyperparams.Slot` s): where a recipe computes with its numbers (a decay
scaled by ``lr``, a warm-up schedule), these compute at each update with the values the
slots read, so the recipe is built once for every value of them."""

from __future__ import annotations

from typing import Any

from ..core import GradientTransformation, LeafwiseTransformation, leafwise_if
from ..hyperparams import VALUES_ARG, Slot
from ..schedules import momentum_warmup
from ..transforms import cautious_decay

__all__ = ["decay_times_lr", "warming_up"]


def _value(x: Any, extra_args: dict) -> Any:
    """``x``, or the value it reads where it is a slot."""
    return extra_args[VALUES_ARG][x.key] if type(x) is Slot else x


def decay_times_lr(weight_decay: Any, lr: Any) -> GradientTransformation:
    """``cautious_decay(weight_decay * lr)`` (modded-nanogpt's decay); where either is a
    slot, the product of their values at each update (the same number: ``wd * lr`` in
    Python floats).

    Example::

        >>> import torch
        >>> from tensordict import TensorDict
        >>> from muonfx.hyperparams import Slot, VALUES_ARG
        >>> p = TensorDict({"w": torch.full((2,), 2.0)}, [])
        >>> u = TensorDict({"w": torch.ones(2)}, [])
        >>> tx = decay_times_lr(Slot("weight_decay"), Slot("lr"))
        >>> tx.update(u, tx.init(p), p, **{VALUES_ARG: {"weight_decay": 0.5, "lr": 0.5}})[0]["w"].tolist()
        [1.5, 1.5]
    """
    if type(weight_decay) is not Slot and type(lr) is not Slot:
        return cautious_decay(weight_decay * lr)
    product = Slot("weight_decay * lr")
    inner = cautious_decay(product)

    def update_fn(updates, state, params=None, **extra_args):
        value = _value(weight_decay, extra_args) * _value(lr, extra_args)
        return inner.update(updates, state, params, **{**extra_args,
                                                       VALUES_ARG: {**extra_args[VALUES_ARG], product.key: value}})

    return LeafwiseTransformation(inner.init, update_fn)


def warming_up(inner: GradientTransformation, start: Any, end: Any, steps: Any) -> GradientTransformation:
    """``inner``, an :func:`muonfx.inject_hyperparams` transform with a number for its
    ``momentum``, run at each update with ``momentum_warmup(start, end, steps)`` of that
    update's values (slots read, numbers as they are) for it, evaluated by ``inner`` at
    each parameter's count. The state is ``inner``'s without its record of the values
    (``hyperparams`` is ``{}``): traced, a value computed from late-bound numbers and the
    count and returned in the state would pin those numbers in a compiled step's graph.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.hyperparams import Slot, VALUES_ARG
        >>> inner = mfx.inject_hyperparams(mfx.muon, ("lr",))(momentum=0.0, lr=0.02)
        >>> tx = warming_up(inner, Slot("momentum_start"), 0.95, 300)
        >>> g = TensorDict({"w": torch.ones(4, 4)}, [])
        >>> _, state = tx.update(g, tx.init(g), g, **{VALUES_ARG: {"momentum_start": 0.85}})
        >>> state.hyperparams, round(state.inner_state["momentum"].mu["w"].norm().item() / g["w"].norm().item(), 2)
        ({}, 0.15)
    """
    warm = (start, end, steps)

    def init_fn(params):
        return inner.init(params)._replace(hyperparams={})

    def update_fn(updates, state, params=None, **extra_args):
        now = momentum_warmup(*(_value(x, extra_args) for x in warm))
        out, new = inner.update(updates, state._replace(hyperparams={"momentum": now}), params, **extra_args)
        return out, new._replace(hyperparams={})

    return leafwise_if(GradientTransformation(init_fn, update_fn), inner)
