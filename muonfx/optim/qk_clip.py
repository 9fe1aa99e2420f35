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
        process_group: the ranks the statistics are reduced over by one MAX all-reduce
            (``None``: the default group, every rank, when torch.distributed is
            initialised). Over data-parallel ranks (FSDP2, HSDP) it takes the largest
            logit of their batches; over tensor-parallel ranks it assembles the heads
            (each head lives on one tp rank, the others give ``-inf`` for it); a rank that
            recorded nothing makes every rank of the group raise the same error.
        tp_mesh: under tensor parallelism, the 1-D mesh (``mesh["tp"]``) or process
            group whose ranks split the heads (``ColwiseParallel`` q/k projections): a
            rank records its own ``heads // tp`` heads, which are global heads
            ``[r * heads // tp, (r + 1) * heads // tp)`` on tp rank ``r`` (grouped-query
            attention: ``kv_heads // tp`` key heads each). ``None``: every rank records
            every head.

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
    tp_mesh: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.recorder, QKLogitRecorder):
            raise TypeError(f"QKClip: recorder must be a muonfx.QKLogitRecorder, got {type(self.recorder).__name__}")
        object.__setattr__(self, "layout", dict(self.layout))
        self.transform()  # checks tau, alpha and the layout now
        if self.tp_mesh is not None:
            fused = sorted(name for name, lay in self.layout.items() if lay.qkv is not None)
            if fused:
                # ColwiseParallel cuts a fused QKV matrix into contiguous row blocks, not per
                # head: a tp rank's rows are not its heads' q and k rows
                raise ValueError(f"QKClip: a fused QKV layout under tensor parallelism (tp_mesh) is not supported "
                                 f"({fused}); give the model separate q and k projections "
                                 "(QKLayout.separate) to clip under tensor parallelism")

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

    def _tp(self) -> tuple[int, int]:
        """``(size, this rank's index)`` of :attr:`tp_mesh` (``(1, 0)`` without one)."""
        tp = self.tp_mesh
        if tp is None:
            return 1, 0
        if hasattr(tp, "get_local_rank"):  # a DeviceMesh
            if tp.ndim != 1:
                raise ValueError(f"QKClip: tp_mesh must be a 1-D mesh (mesh['tp']), got a {tp.ndim}-D one")
            return tp.size(), tp.get_local_rank()
        dist = torch.distributed
        return dist.get_world_size(tp), dist.get_rank(tp)

    def statistics(self) -> dict[str, torch.Tensor]:
        """The step's ``{layer: per-head max logit}`` over every head of the layer, reduced
        over :attr:`process_group` (one MAX all-reduce of all layers packed).

        A layer's recording holds every head (``[heads]``), or with :attr:`tp_mesh` this
        tensor-parallel rank's own heads (``[heads // tp]``), which are global heads
        ``[r * heads // tp, (r + 1) * heads // tp)`` on tp rank ``r``: placed there, with
        ``-inf`` for the other ranks' heads, so that the MAX over the ranks takes the
        largest logit of every head over the data-parallel ranks and assembles the heads
        over the tensor-parallel ones. A layer recorded on no rank, on some ranks only, or
        with another number of heads raises ``ValueError`` on every rank, with the same
        message naming the layers and the ranks (one more small all-reduce, on the error
        path only)."""
        got = self.recorder.maxima()
        names = sorted(self.layout)
        tp, tp_rank = self._tp()
        device = next((s.device for s in got.values()), torch.device("cpu"))
        parts, codes = [], []
        for n in names:
            s, heads = got.get(n), self.layout[n].heads
            vals = torch.full((heads,), float("-inf"), device=device)
            if s is None or s.ndim != 1 or bool(torch.isneginf(s).all()):
                code = 1  # nothing recorded since the last step
            elif s.shape[0] == heads:
                code, vals = 0, s.to(device, torch.float32)
            elif tp > 1 and heads % tp == 0 and s.shape[0] == heads // tp:
                code, per = 0, heads // tp
                vals[tp_rank * per:(tp_rank + 1) * per] = s.to(device, torch.float32)
            else:
                code = 2  # another number of heads
            codes.append(code)
            parts.append(torch.cat([vals, torch.tensor([float(code > 0)], device=device)]))
        packed = torch.cat(parts)
        dist = torch.distributed
        spread = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        if spread:
            if dist.get_backend(self.process_group) == "nccl" and packed.device.type != "cuda":
                packed = packed.cuda()
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.process_group)
        out, at, bad = {}, 0, []
        for i, n in enumerate(names):
            heads = self.layout[n].heads
            out[n] = packed[at:at + heads].to(device)
            if packed[at + heads] > 0:
                bad.append(i)
            at += heads + 1
        if bad:
            raise ValueError(self._bad_message(names, bad, codes, spread, tp, packed.device))
        return out

    def _bad_message(self, names: list[str], bad: list[int], codes: list[int], spread: bool, tp: int,
                     device: torch.device) -> str:
        """The same message on every rank: which layers recorded nothing, or another number
        of heads, on which ranks."""
        if spread:  # which ranks: one all-reduce of a ranks x (2 flags per layer) table
            from ..distributed.agree import who_has

            table = who_has([codes[i] == 1 for i in bad] + [codes[i] == 2 for i in bad], self.process_group, device)
            lack, wrong = table[:len(bad)], table[len(bad):]
        else:
            lack = [([0], []) if codes[i] == 1 else ([], [0]) for i in bad]
            wrong = [([0], []) if codes[i] == 2 else ([], [0]) for i in bad]
        msg = []
        lacking = [(names[i], on, has) for i, (on, has) in zip(bad, lack) if on]
        if lacking:
            where = "; ".join(f"{n!r} on rank(s) {on}, recorded on rank(s) {has}" for n, on, has in lacking)
            msg.append(f"no attention logits recorded this step for {[n for n, _, _ in lacking]}"
                       f"{f' ({where})' if spread else ''}: the model must call recorder.record(name, q, k) (or "
                       "record_max) in each of these layers' forward passes before step(), on every rank")
        for i, (on, _) in zip(bad, wrong):
            if on:
                heads = self.layout[names[i]].heads
                want = f"{heads}" + (f" (or {heads // tp}, this tensor-parallel rank's own heads of tp_mesh)"
                                     if tp > 1 and heads % tp == 0 else "")
                hint = ("" if tp > 1 else ": under tensor parallelism, where each rank computes attention for its "
                        "own heads, pass QKClip(..., tp_mesh=mesh['tp'])")
                msg.append(f"layer {names[i]!r} recorded a number of heads other than {want}"
                           f"{f' on rank(s) {on}' if spread else ''}{hint}")
        return "qk_clip: " + "; ".join(msg) + ". No parameter changed."

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
