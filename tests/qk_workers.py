"""Worker of ``tests/test_qk_clip_fsdp.py``: QK-clip on an FSDP2 model against one process."""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import muonfx as mfx  # noqa: E402

D, HEADS, VOCAB = 9, 3, 13  # c_attn has 27 rows: shards of 14 and 13, a head cut across ranks


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.recorder = None
        self.wte = nn.Embedding(VOCAB, D)
        # no q/k/v bias: a k-bias has a mathematically zero gradient that Adam amplifies from
        # rounding noise, and it shifts the logits (not the softmax): it would swamp parity
        self.c_attn = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        self.recorder.record("attn", q, k, is_causal=True)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.proj(y.transpose(1, 2).reshape(B, T, D)))

    def loss(self, idx):
        return nn.functional.cross_entropy(self(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


LAYOUT = {"attn": mfx.QKLayout.fused("c_attn.weight", heads=HEADS, head_dim=D // HEADS)}


def _build(tau: float):
    torch.manual_seed(0)
    model = Attn()
    with torch.no_grad():
        model.c_attn.weight.mul_(6.0)
    model.recorder = rec = mfx.QKLogitRecorder()
    return model, rec


def qk_clip_fsdp(rank: int, world: int, steps: int = 3, tau: float = 4.0) -> dict:
    torch.set_num_threads(1)
    ref, ref_rec = _build(tau)
    model, rec = _build(tau)
    fully_shard(model)
    opts = dict(muon_lr=0.05, adamw_lr=1e-2, ns_dtype=torch.float32)
    ref_opt = mfx.create_hybrid_optimizer(ref, qk_clip=mfx.QKClip(ref_rec, LAYOUT, tau=tau), **opts)
    opt = mfx.create_hybrid_optimizer(model, qk_clip=mfx.QKClip(rec, LAYOUT, tau=tau), **opts)
    gen = torch.Generator().manual_seed(1)
    clipped = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (2 * world, 7), generator=gen)
        ref.loss(idx).backward()
        clipped.append(int((ref_rec.maxima()["attn"] > tau).sum()))
        ref_opt.step()
        ref_opt.zero_grad()
        model.loss(idx[2 * rank:2 * rank + 2]).backward()  # this rank's share of the batch
        opt.step()
        opt.zero_grad()
    errors = {}
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor().detach()
        errors[n] = float((full - r.detach()).abs().max() / r.detach().abs().max())
    return {"errors": errors, "clipped": clipped, "reset": bool(torch.isneginf(rec.maxima()["attn"]).all())}


def missing_on_one_rank(rank: int, world: int) -> str:
    """Rank 1 records nothing: every rank raises the same error."""
    torch.set_num_threads(1)
    model, rec = _build(4.0)
    fully_shard(model)
    opt = mfx.create_hybrid_optimizer(model, qk_clip=mfx.QKClip(rec, LAYOUT, tau=4.0))
    idx = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(rank))
    model.loss(idx).backward()
    if rank == 1:
        rec.reset()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"
