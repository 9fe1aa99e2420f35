"""What a model measures in its attention for the optimizer: the largest pre-softmax logit
of every head (:class:`QKLogitRecorder`), read by :func:`muonfx.qk_clip`."""

from __future__ import annotations

import math

import torch

__all__ = ["QKLogitRecorder", "max_logits"]


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None, is_causal: bool = False,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The largest pre-softmax logit of every query head: ``max_{b, i, j} q_bi . k_bj * scale``.

    ``q`` is ``(..., heads, L, d)`` and ``k`` ``(..., kv_heads, S, d)`` as
    ``torch.nn.functional.scaled_dot_product_attention`` takes them (``heads`` a
    multiple of ``kv_heads``: grouped-query attention); ``scale`` defaults to
    ``1 / sqrt(d)``. ``is_causal`` and a boolean ``attn_mask`` (``True``: attend) leave
    out the masked logits, as SDPA does. Computed in float32 (float64 for float64
    inputs), without gradient; it materialises the ``L x S`` logits, so kernels that
    return their row maxima (FlexAttention's auxiliary output) should pass those to
    :meth:`QKLogitRecorder.record_max` instead.

    Example::

        >>> import torch
        >>> from muonfx.attention import max_logits
        >>> q = torch.tensor([[[[1.0, 0.0]], [[0.0, 2.0]]]])          # (1, 2 heads, 1, 2)
        >>> k = torch.tensor([[[[4.0, 4.0]], [[1.0, 1.0]]]])
        >>> max_logits(q, k, scale=1.0).tolist()
        [4.0, 2.0]
    """
    if q.ndim < 3 or k.ndim != q.ndim or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"max_logits: q {tuple(q.shape)} and k {tuple(k.shape)} must be (..., heads, L, d) "
                         "and (..., kv_heads, S, d)")
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"max_logits: {heads} query heads are not a multiple of {kv_heads} key heads")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=-3)
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2))
    s = s * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        L, S = s.shape[-2], s.shape[-1]
        keep = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError("max_logits: attn_mask must be boolean (True: attend); an additive mask changes the "
                             "logits: add it to the scores yourself and pass their maximum to record_max")
        s = s.masked_fill(~attn_mask, float("-inf"))
    return s.transpose(0, -3).reshape(heads, -1).amax(-1)


class QKLogitRecorder:
    """Records the largest attention logit of every head over a step's forward passes.

    The model calls :meth:`record` (from ``q`` and ``k``) or :meth:`record_max` (a
    per-head maximum it computed) in each attention layer, under a name of its choice
    (the keys of :func:`muonfx.qk_clip`'s ``layout``). Each call takes the elementwise
    maximum with what the layer recorded before in the step, so gradient accumulation
    (several forward passes per step) gives the maximum over micro-batches and
    activation recomputation (a forward pass run again) changes nothing. The buffers are
    made once per layer and updated in place, so a ``torch.compile``-d model records
    without recompiling. :meth:`maxima` gives ``{name: tensor([heads])}``, the step's
    statistics; :meth:`reset` (called by the optimizer after every step, skipped ones
    included) sets them to ``-inf``.

    Example::

        >>> import torch, muonfx as mfx
        >>> rec = mfx.QKLogitRecorder()
        >>> rec.record_max("layer0", torch.tensor([1.0, 5.0]))
        >>> rec.record_max("layer0", torch.tensor([3.0, 2.0]))     # a second micro-batch
        >>> rec.maxima()["layer0"].tolist()
        [3.0, 5.0]
        >>> rec.reset(); rec.maxima()["layer0"].tolist()
        [-inf, -inf]
    """

    def __init__(self) -> None:
        self._max: dict[str, torch.Tensor] = {}

    def record(self, name: str, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
               is_causal: bool = False, attn_mask: torch.Tensor | None = None) -> None:
        """Record the per-head maximum logit of ``q`` and ``k`` (:func:`max_logits`) under ``name``."""
        self.record_max(name, max_logits(q, k, scale=scale, is_causal=is_causal, attn_mask=attn_mask))

    @torch.no_grad()
    def record_max(self, name: str, per_head_max: torch.Tensor) -> None:
        """Record a precomputed per-head maximum (``[heads]``) under ``name``."""
        m = per_head_max.detach()
        if m.ndim != 1:
            raise ValueError(f"QKLogitRecorder: layer {name!r} recorded shape {tuple(m.shape)}; one max per head "
                             "([heads]) is expected")
        buf = self._max.get(name)
        if buf is None:
            self._max[name] = m.to(torch.float32, copy=True)
        elif buf.shape != m.shape:
            raise ValueError(f"QKLogitRecorder: layer {name!r} recorded {m.shape[0]} heads after {buf.shape[0]}")
        else:
            torch.maximum(buf, m.to(buf.dtype), out=buf)

    def maxima(self) -> dict[str, torch.Tensor]:
        """``{name: per-head maximum}`` recorded since the last :meth:`reset` (``-inf`` where
        a layer recorded nothing since): copies, which a later :meth:`reset` leaves alone."""
        return {n: b.clone() for n, b in self._max.items()}

    def reset(self) -> None:
        """Forget the step's maxima (in place: the buffers stay the same tensors)."""
        for buf in self._max.values():
            buf.fill_(float("-inf"))

    def names(self) -> list[str]:
        """The names recorded so far."""
        return list(self._max)
