"""The ``qk_clip=`` option of the optimizers: :class:`QKClip` appends
:func:`muonfx.qk_clip` to the chain of every group holding a clipped weight, and hands
the recorder's statistics to each step (reduced over the data-parallel ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..attention import QKLogitRecorder
from ..combine import chain
from ..core import GradientTransformation
from ..transforms.qk import QK_STAT, QKLayout, qk_clip

__all__ = ["QKClip", "unclipped"]


@dataclass(frozen=True)
class QKClip:
    """QK-clip for an optimizer: ``TransformOptimizer(..., qk_clip=QKClip(recorder, layout))``.

    Args:
        recorder: the :class:`muonfx.QKLogitRecorder` the model's attention records into.
        layout: ``{recorder name: QKLayout}``, which weights belong to which layer's heads.
        tau: the largest logit a head may keep (100, Kimi K2).
        alpha: the share of the scaling the query rows take (0.5).
        process_group: the data-parallel ranks the statistics are reduced over by one
            MAX all-reduce (``None``: the default group, when torch.distributed is
            initialised; a head must live on one rank of every other dimension).

    The optimizer appends ``qk_clip(tau, alpha, layout)`` to the transform of every
    param group holding a parameter of the layout (the AdamW group of a hybrid optimizer
    too, where the query/key biases are), passes ``qk_logit_max=recorder.maxima()`` to
    every step and resets the recorder after it (a step an ``apply_if_finite`` skipped
    included; a step that raises keeps the statistics). Every layer of the layout must
    have recorded something since the last step: otherwise the step raises, on every
    rank, naming the layer.

    Example::

        >>> import torch, muonfx as mfx
        >>> rec = mfx.QKLogitRecorder()
        >>> model = torch.nn.ModuleDict({"qkv": torch.nn.Linear(8, 24)})
        >>> clip = mfx.QKClip(rec, {"attn": mfx.QKLayout.fused("qkv.weight", heads=2, head_dim=4,
        ...                                                    bias="qkv.bias")})
        >>> opt = mfx.create_hybrid_optimizer(model, qk_clip=clip)
        >>> x = torch.randn(3, 5, 8)
        >>> q, k, v = model["qkv"](x).view(3, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        >>> rec.record("attn", q, k, is_causal=True)
        >>> torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> rec.maxima()["attn"].tolist()                     # reset by the step
        [-inf, -inf]
    """

    recorder: QKLogitRecorder
    layout: Mapping[str, QKLayout]
    tau: float = 100.0
    alpha: float = 0.5
    process_group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.recorder, QKLogitRecorder):
            raise TypeError(f"QKClip: recorder must be a muonfx.QKLogitRecorder, got {type(self.recorder).__name__}")
        object.__setattr__(self, "layout", dict(self.layout))
        self.transform()  # checks tau, alpha and the layout now

    def transform(self) -> GradientTransformation:
        """The ``qk_clip`` transform the groups' chains end with."""
        return qk_clip(self.tau, self.alpha, self.layout)

    def keys(self) -> set[str]:
        """Every parameter the clip scales (dotted names)."""
        return {k for lay in self.layout.values() for k in lay.keys()}

    def follow(self, factory: Callable[..., GradientTransformation], names: list[str]
               ) -> Callable[..., GradientTransformation]:
        """``factory`` followed by the clip, for a group with parameters ``names`` (the
        factory itself when none is clipped: a fused AdamW group stays fused)."""
        return _Clipped(factory, self) if self.keys() & set(names) else factory

    def check_params(self, names: set[str]) -> None:
        """``ValueError`` naming the layout's parameters the optimizer does not hold."""
        missing = sorted(self.keys() - names)
        if missing:
            raise ValueError(f"qk_clip: the layout names parameters the optimizer does not hold: {missing} "
                             "(names as model.named_parameters() gives them)")

    def statistics(self) -> dict[str, torch.Tensor]:
        """The step's ``{layer: per-head max logit}``, reduced over the data-parallel
        ranks (one MAX all-reduce of all layers packed); ``ValueError`` (on every rank)
        naming the layers with nothing recorded."""
        got = self.recorder.maxima()
        names = sorted(self.layout)
        parts, device = [], None
        for n in names:
            s = got.get(n)
            device = device or (s.device if s is not None else None)
        device = device or torch.device("cpu")
        for n in names:
            s = got.get(n)
            heads = self.layout[n].heads
            missing = s is None or s.shape != (heads,) or bool(torch.isneginf(s).all())
            vals = torch.full((heads,), float("-inf"), device=device) if missing else s.to(device, torch.float32)
            parts.append(torch.cat([vals, torch.tensor([1.0 if missing else 0.0], device=device)]))
        packed = torch.cat(parts)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            if dist.get_backend(self.process_group) == "nccl" and packed.device.type != "cuda":
                packed = packed.cuda()
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.process_group)
        out, at, missing_layers = {}, 0, []
        for n in names:
            heads = self.layout[n].heads
            out[n] = packed[at:at + heads].to(device)
            if packed[at + heads] > 0:
                missing_layers.append(n)
            at += heads + 1
        if missing_layers:
            raise ValueError(f"qk_clip: no attention logits recorded this step for {missing_layers} (on some rank): "
                             "the model must call recorder.record(name, q, k) (or record_max) in each of these "
                             "layers' forward passes before step()")
        return out

    def extra_args(self) -> dict[str, Any]:
        """The step's extra arguments: ``{"qk_logit_max": self.statistics()}``."""
        return {QK_STAT: self.statistics()}


class _Clipped:
    """``factory`` followed by a clip: a picklable factory with ``factory``'s signature
    (``inspect.signature`` follows ``__wrapped__``)."""

    def __init__(self, factory: Callable[..., GradientTransformation], clip: QKClip) -> None:
        self.__wrapped__ = factory
        self.__name__ = getattr(factory, "__name__", type(factory).__name__)
        self.clip = clip

    def __call__(self, *args: Any, **kwargs: Any) -> GradientTransformation:
        return chain(self.__wrapped__(*args, **kwargs), self.clip.transform())


def unclipped(factory: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """The factory a group had before :meth:`QKClip.follow` appended the clip."""
    return factory.__wrapped__ if isinstance(factory, _Clipped) else factory
