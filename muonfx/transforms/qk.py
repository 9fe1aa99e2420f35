"""QK-clip (Kimi K2's "MuonClip"): after the update, shrink the query and key rows of the
attention heads whose largest pre-softmax logit went above ``tau``.

The statistics (the step's largest logit per head, measured in the forward pass by
:class:`muonfx.QKLogitRecorder`) reach the transform as the extra argument
``qk_logit_max`` of ``update`` (the step context); :class:`QKLayout` says which rows of
which weight belong to which head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .._compat.dtensor import is_dtensor, local, local_indices, rewrap_all
from ..core import EmptyState, GradientTransformation, Key, LeafwiseTransformation, aligned, build, key_str, leaves
from ..hyperparams import check

__all__ = ["QKLayout", "qk_clip", "qk_factors", "QK_STAT"]

#: the name of the extra argument of ``update`` that carries the per-head maxima
QK_STAT = "qk_logit_max"


@dataclass(frozen=True)
class QKLayout:
    """Where one attention layer's heads live in its weights.

    Build it with :meth:`fused` (one ``c_attn``-style QKV matrix) or :meth:`separate`
    (``q_proj`` and ``k_proj``). Keys are the dotted parameter names
    (``model.named_parameters()``).

    Rows: an ``nn.Linear`` weight is ``(out, in)``; its output rows ``[h*d, (h+1)*d)``
    of the query part are head ``h``'s (``d = head_dim``). A fused weight holds the
    query rows (``heads * d``), then the key rows (``kv_heads * d``), then the value
    rows (GPT-2, nanoGPT, LLaMA-style packed QKV). ``transposed=True`` reads the weight
    as ``(in, out)`` (HF's GPT-2 ``Conv1D``: ``c_attn.weight`` is ``(768, 2304)``), the
    "rows" being its columns. A bias of the query or key projection, named by
    ``qkv_bias``/``q_bias``/``k_bias``, is scaled with its rows (the logits stay
    bilinear in the scaled projections).

    Not supported (and refused): layouts where part of every key is shared by all
    heads, such as DeepSeek's multi-head latent attention (MLA: one rotary key
    ``k_rope`` for all heads), since no per-head scaling of rows scales one head's
    logits alone; interleaved per-head QKV (``(heads, 3, d)`` packing, GPT-NeoX);
    and QK-norm (a norm after the projection undoes any scaling of the rows).

    Example::

        >>> import muonfx as mfx
        >>> lay = mfx.QKLayout.fused("h.0.attn.c_attn.weight", heads=4, head_dim=8, bias="h.0.attn.c_attn.bias")
        >>> lay.keys()
        ('h.0.attn.c_attn.weight', 'h.0.attn.c_attn.bias')
    """

    heads: int
    head_dim: int
    kv_heads: int
    qkv: str | None = None
    q: str | None = None
    k: str | None = None
    qkv_bias: str | None = None
    q_bias: str | None = None
    k_bias: str | None = None
    transposed: bool = False

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"QKLayout: {name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"QKLayout: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if (self.qkv is None) == (self.q is None or self.k is None):
            raise ValueError("QKLayout: give either qkv (a fused weight) or both q and k")

    @classmethod
    def fused(cls, weight: str, *, heads: int, head_dim: int, kv_heads: int | None = None,
              bias: str | None = None, transposed: bool = False) -> "QKLayout":
        """A fused QKV weight ``weight`` (rows: all query heads, all key heads, values)."""
        return cls(heads, head_dim, kv_heads or heads, qkv=weight, qkv_bias=bias, transposed=transposed)

    @classmethod
    def separate(cls, q: str, k: str, *, heads: int, head_dim: int, kv_heads: int | None = None,
                 q_bias: str | None = None, k_bias: str | None = None, transposed: bool = False,
                 shared_rope_key: str | None = None) -> "QKLayout":
        """Separate query and key weights ``q`` and ``k``. ``shared_rope_key``, the key
        projection all heads share in MLA, is refused: QK-clip is not defined here for it."""
        if shared_rope_key is not None:
            raise ValueError(
                f"QKLayout: a rotary key shared by all heads ({shared_rope_key!r}, as in MLA) is not supported: "
                "scaling it would change every head's logits, not the clipped head's. Clip only the per-head "
                "q/k parts yourself, or leave this layer out of the layout.")
        return cls(heads, head_dim, kv_heads or heads, q=q, k=k, q_bias=q_bias, k_bias=k_bias,
                   transposed=transposed)

    def keys(self) -> tuple[str, ...]:
        """Every parameter this layer's clip scales (dotted names)."""
        return tuple(k for k in (self.qkv, self.q, self.k, self.qkv_bias, self.q_bias, self.k_bias) if k)

    def row_factors(self, key: str, q_factor: torch.Tensor, k_factor: torch.Tensor, rows: int) -> torch.Tensor:
        """The factor of every output row of parameter ``key`` (1 for value rows)."""
        d = self.head_dim
        q_rows, k_rows = q_factor.repeat_interleave(d), k_factor.repeat_interleave(d)
        if key in (self.qkv, self.qkv_bias):
            want = (self.heads + 2 * self.kv_heads) * d
            parts = [q_rows, k_rows, torch.ones(self.kv_heads * d, dtype=q_rows.dtype, device=q_rows.device)]
        elif key in (self.q, self.q_bias):
            want, parts = self.heads * d, [q_rows]
        else:
            want, parts = self.kv_heads * d, [k_rows]
        if rows != want:
            raise ValueError(f"qk_clip: parameter {key!r} has {rows} output rows; its layout (heads={self.heads}, "
                             f"kv_heads={self.kv_heads}, head_dim={d}) needs {want}")
        return torch.cat(parts)


def qk_factors(stat: torch.Tensor, tau: float, alpha: float, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query factor per head, key factor per kv head)``.

    Formula: ``gamma_h = min(1, tau / S_h)``; query rows of head ``h`` get
    ``gamma_h ** alpha``; key rows of kv head ``g`` get ``gamma_g ** (1 - alpha)`` with
    ``gamma_g = min(1, tau / max_{h in g} S_h)`` (grouped-query attention: the group's
    largest logit). With one kv head per head the logits of head ``h`` are scaled by
    exactly ``gamma_h``. A maximum that is not finite (a forward pass that overflowed)
    clips nothing: ``gamma = 1`` (not 0, which would erase the head); the step's own
    finite check (:func:`muonfx.apply_if_finite`) is the guard against such a step.

    Example::

        >>> import torch
        >>> from muonfx.transforms.qk import qk_factors
        >>> qf, kf = qk_factors(torch.tensor([50.0, 400.0]), tau=100.0, alpha=0.5, kv_heads=2)
        >>> qf.tolist(), kf.tolist()
        ([1.0, 0.5], [1.0, 0.5])
    """
    s = stat.to(torch.float64)
    one = torch.ones((), dtype=s.dtype, device=s.device)

    def gamma(x: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isfinite(x) & (x > tau), tau / x.clamp_min(tau), one)

    g_kv = gamma(s.view(kv_heads, -1).amax(-1))
    return gamma(s) ** alpha, g_kv ** (1.0 - alpha)


def qk_clip(tau: float = 100.0, alpha: float = 0.5, layout: Mapping[str, QKLayout] | None = None
            ) -> GradientTransformation:
    """QK-clip: bound every attention head's largest logit by ``tau`` after the update.

    For each layer ``name`` of ``layout`` and head ``h``, ``S_h`` is
    ``qk_logit_max[name][h]``, the largest pre-softmax logit ``q_i . k_j * scale`` of the
    step's forward passes (:class:`muonfx.QKLogitRecorder`), passed as the extra argument
    ``update(..., qk_logit_max={name: tensor([heads])})``. With
    ``gamma_h = min(1, tau / S_h)`` (:func:`qk_factors`), the new weights are::

        W_q[rows of h] <- gamma_h ** alpha       * (W_q + u_q)[rows of h]
        W_k[rows of h] <- gamma_h ** (1 - alpha) * (W_k + u_k)[rows of h]

    so the update returned on those rows is ``gamma * (W + u) - W``; every other row
    (value rows, heads at or under ``tau``, parameters outside the layout) keeps its
    update bit for bit, and no state changes (the optimizer's moments are untouched).
    Grouped-query attention scales the shared key rows by the group's largest logit.
    Defaults: ``tau = 100``, ``alpha = 0.5`` (Kimi K2, arXiv 2507.20534).

    Put it last in the chain (it needs the final update) and pass ``params``. A group
    holding only some of a layer's parameters (biases in an AdamW group) scales those it
    holds. On DTensor shards (FSDP2 and HSDP ``Shard(0)``, tensor parallel, FSDP2 + TP's
    ``_StridedShard(0), Shard(0)``, uneven and empty shards) each rank scales the rows it
    holds, no communication; the statistics of the heads whose rows a rank holds must be
    the same on every rank that holds them (:class:`muonfx.QKClip` reduces them over the
    ranks in one all-reduce).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> layout = {"attn": mfx.QKLayout.separate("q", "k", heads=2, head_dim=1)}
        >>> tx = mfx.qk_clip(tau=100.0, layout=layout)
        >>> p = TensorDict({"q": torch.ones(2, 3), "k": torch.ones(2, 3)}, [])
        >>> u = TensorDict({"q": torch.ones(2, 3), "k": torch.ones(2, 3)}, [])
        >>> out, _ = tx.update(u, tx.init(p), p, qk_logit_max={"attn": torch.tensor([50.0, 400.0])})
        >>> mfx.apply_updates(p, out)["q"][:, 0].tolist()      # head 1: (1 + 1) * (100 / 400) ** 0.5
        [2.0, 1.0]
    """
    tau, alpha = float(check("tau", tau)), float(alpha)
    if not tau > 0:
        raise ValueError(f"qk_clip: tau must be > 0, got {tau!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip: alpha must be in [0, 1], got {alpha!r}")
    layout = dict(layout or {})
    by_key: dict[str, str] = {}
    for name, lay in layout.items():
        if not isinstance(lay, QKLayout):
            raise TypeError(f"qk_clip: layout[{name!r}] is a {type(lay).__name__}, not a QKLayout")
        for k in lay.keys():
            if k in by_key:
                raise ValueError(f"qk_clip: parameter {k!r} is in the layout of both {by_key[k]!r} and {name!r}")
            by_key[k] = name

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        keys, us = leaves(updates)
        mine = [i for i, k in enumerate(keys) if key_str(k) in by_key]
        if not mine:
            return updates, state
        stats = extra_args.get(QK_STAT)
        if stats is None:
            raise ValueError(f"qk_clip: no statistics: pass {QK_STAT}={{layer: per-head max logit}} to update() "
                             "(TransformOptimizer(qk_clip=...) passes the recorder's)")
        if params is None:
            raise ValueError("qk_clip needs the parameters: pass params=... to update()")
        ps = aligned(params, keys, "params", like=us)
        factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        out = list(us)
        for i in mine:
            name = key_str(keys[i])
            layer = by_key[name]
            lay = layout[layer]
            if layer not in factors:
                s = stats.get(layer) if isinstance(stats, Mapping) else None
                if s is None:
                    raise ValueError(f"qk_clip: no statistics for layer {layer!r} (parameter {name!r}) this step: "
                                     "record its logits in the forward pass (QKLogitRecorder.record)")
                s = torch.as_tensor(s)
                if s.shape != (lay.heads,):
                    raise ValueError(f"qk_clip: statistics of layer {layer!r} have shape {tuple(s.shape)}, "
                                     f"expected ({lay.heads},) (one max per query head)")
                factors[layer] = qk_factors(s.to(us[i].device), tau, alpha, lay.kv_heads)
            out[i] = _clip_rows(name, lay, us[i], ps[i], *factors[layer])
        return build(keys, out), state

    # leafwise: a leaf's result depends on its own update and parameter and on the statistics,
    # which every leaf shares (the adapter passes them to every piece of a large group)
    return LeafwiseTransformation(init_fn, update_fn)


def _clip_rows(name: str, lay: QKLayout, u: torch.Tensor, w: torch.Tensor, qf: torch.Tensor,
               kf: torch.Tensor) -> torch.Tensor:
    """``gamma * (w + u) - w`` on the rows whose factor is below 1, ``u`` elsewhere."""
    is_bias = name in (lay.qkv_bias, lay.q_bias, lay.k_bias)
    if is_bias and u.ndim != 1 or not is_bias and u.ndim != 2:
        raise ValueError(f"qk_clip: parameter {name!r} has shape {tuple(u.shape)}; expected a "
                         f"{'1-D bias' if is_bias else '2-D weight'}")
    rows_dim = 0 if is_bias or not lay.transposed else 1
    f = lay.row_factors(name, qf, kf, u.shape[rows_dim])
    if is_dtensor(u):  # a shard (FSDP2, HSDP, tensor parallel, both): the factors of the rows it holds
        rows = local_indices(u, rows_dim)
        if not torch.equal(rows, local_indices(w, rows_dim)):
            raise ValueError(f"qk_clip: parameter {name!r}: the update is sharded {tuple(u.placements)} and the "
                             f"parameter {tuple(w.placements)}; their local rows differ")
        out = _scale_rows(local(u), local(w), f[rows.to(f.device)], is_bias, rows_dim)
        return rewrap_all([out], [u])[0]
    return _scale_rows(u, w, f, is_bias, rows_dim)


def _scale_rows(u: torch.Tensor, w: torch.Tensor, f: torch.Tensor, is_bias: bool, rows_dim: int) -> torch.Tensor:
    wide = torch.promote_types(torch.promote_types(u.dtype, w.dtype), torch.float32)
    f = f.to(wide)
    shape = (-1,) if is_bias else ((-1, 1) if rows_dim == 0 else (1, -1))
    fs = f.view(shape)
    clipped = (fs * (w.to(wide) + u.to(wide)) - w.to(wide)).to(u.dtype)
    return torch.where((f < 1).view(shape), clipped, u)
