"""A small GPT (pre-norm transformer, causal attention) with GPT-2's parameter names.

Names follow GPT-2 (``transformer.wte``, ``transformer.wpe``, ``transformer.h.0.attn.c_attn``,
``...mlp.c_fc``, ``transformer.ln_f``, ``lm_head``), so
:func:`muonfx.default_muon_labels` sends the embeddings (``wte``, ``wpe``), the head
(``lm_head``), the LayerNorms and biases to AdamW, and the attention/MLP matrices
to Muon.

Sizes (``MODELS``): ``tiny`` 4 layers, d=128, 4 heads, context 128 (the CPU
default; ~0.8M parameters with the 166-character vocabulary); ``small`` 6 layers,
d=256, 8 heads, context 256; ``gpt2`` the GPT-2 124M configuration (12 layers,
d=768, 12 heads, context 1024, biases, tied embedding/head) for real hardware. With
a character vocabulary instead of GPT-2's 50257 tokens it has ~86M parameters.

tiny and small use PyTorch's default initialisation (as ``examples/fsdp_muon.py``;
on the stdlib corpus it trains AdamW markedly faster in 600 steps than GPT-2's
N(0, 0.02) init: val 1.80 against 2.10, while Muon barely cares); gpt2 uses GPT-2's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import QKLogitRecorder
from ..transforms.qk import QKLayout
from .sizes import MODELS, GPTConfig

__all__ = ["GPTConfig", "GPT", "MODELS"]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, name: str = "attn") -> None:
        super().__init__()
        self.heads = cfg.heads
        self.name = name
        #: a muonfx.QKLogitRecorder the training forward passes record their logits in, or None
        self.recorder: QKLogitRecorder | None = None
        self.c_attn = nn.Linear(cfg.d, 3 * cfg.d, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d, cfg.d, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if self.recorder is not None and self.training:
            self.recorder.record(self.name, q, k, is_causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d, 4 * cfg.d, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.d, cfg.d, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, name: str = "attn") -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d, bias=cfg.bias)
        self.attn = Attention(cfg, name)
        self.ln_2 = nn.LayerNorm(cfg.d, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``GPT(cfg)(idx) -> logits``; ``idx`` is ``(batch, time)`` token ids, ``time <= cfg.context``.

    Example::

        >>> import torch
        >>> from muonfx.cli.model import GPT, GPTConfig
        >>> m = GPT(GPTConfig(layers=1, d=16, heads=2, context=8, vocab=10))
        >>> m(torch.zeros(3, 8, dtype=torch.long)).shape
        torch.Size([3, 8, 10])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, cfg.d),
            wpe=nn.Embedding(cfg.context, cfg.d),
            h=nn.ModuleList(Block(cfg, f"h.{i}") for i in range(cfg.layers)),
            ln_f=nn.LayerNorm(cfg.d, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        if cfg.init == "gpt2":
            self._gpt2_init()

    def _gpt2_init(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        cfg = self.cfg
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def record_logits(self, recorder: QKLogitRecorder | None) -> None:
        """Record every layer's per-head max logit in ``recorder`` (layers ``"h.0"``, ``"h.1"``,
        ...) in training forward passes; ``None`` stops recording."""
        for block in self.transformer.h:
            block.attn.recorder = recorder

    def qk_layout(self) -> dict[str, QKLayout]:
        """The layout of every layer's fused ``c_attn`` for :func:`muonfx.qk_clip`.

        Example::

            >>> from muonfx.cli.model import GPT, GPTConfig
            >>> m = GPT(GPTConfig(layers=1, d=16, heads=2, context=8, vocab=10, bias=True))
            >>> m.qk_layout()["h.0"].keys()
            ('transformer.h.0.attn.c_attn.weight', 'transformer.h.0.attn.c_attn.bias')
        """
        cfg = self.cfg
        return {f"h.{i}": QKLayout.fused(f"transformer.h.{i}.attn.c_attn.weight", heads=cfg.heads,
                                         head_dim=cfg.d // cfg.heads,
                                         bias=f"transformer.h.{i}.attn.c_attn.bias" if cfg.bias else None)
                for i in range(cfg.layers)}

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.context}")
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(T, device=idx.device))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
