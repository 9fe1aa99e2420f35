"""Optimizer state memory: Muon keeps one buffer per matrix (optionally bf16), AdamW two."""

import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.base import tree_tensors


def _params():
    gen = torch.Generator().manual_seed(0)
    return TensorDict({"a": torch.randn(16, 32, generator=gen), "b": torch.randn(3, 8, 8, generator=gen),
                       "c": torch.randn(4, 2, 3, 3, generator=gen)}, [])


def _state_bytes(state):
    return sum(t.numel() * t.element_size() for t in tree_tensors(state))


def test_muon_state_is_one_buffer_per_matrix():
    p = _params()
    param_bytes = sum(t.numel() * t.element_size() for t in p.values())
    state = mfx.muon().init(p)
    assert len(list(tree_tensors(state))) == 3
    assert _state_bytes(state) == param_bytes
    half = mfx.muon(mu_dtype=torch.bfloat16).init(p)
    assert _state_bytes(half) == param_bytes // 2
    assert all(t.dtype == torch.bfloat16 for t in tree_tensors(half))


def test_adamw_state_is_two_buffers_per_parameter():
    p = _params()
    param_bytes = sum(t.numel() * t.element_size() for t in p.values())
    state = mfx.adamw().init(p)
    assert _state_bytes(state) == 2 * param_bytes


def test_bf16_momentum_tracks_float32_momentum():
    p = _params()
    g = p.apply(lambda t: torch.randn_like(t))
    full, half = mfx.muon(ns_dtype=torch.float32), mfx.muon(ns_dtype=torch.float32, mu_dtype=torch.bfloat16)
    sf, sh = full.init(p), half.init(p)
    for _ in range(3):
        uf, sf = full.update(g, sf, p)
        uh, sh = half.update(g, sh, p)
    for k in ("a", "b", "c"):
        rel = ((uf[k] - uh[k]).norm() / uf[k].norm()).item()
        assert rel < 0.05, (k, rel)  # bf16 storage of the EMA only
