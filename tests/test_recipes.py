"""The variant recipes of muonfx.recipes: each test checks the property that defines the
variant (not just that it runs). Comparisons are ``torch.equal`` where both sides run the
same arithmetic, and a stated tolerance where they compute differently."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfx as mfx
from muonfx import seam
from muonfx.testing import params_and_grads


def td(**leaves):
    return TensorDict(leaves, batch_size=[])


def rms(t: torch.Tensor) -> float:
    return t.square().mean().sqrt().item()


def run(tx, grads_seq, params):
    state = tx.init(params)
    out = None
    for g in grads_seq:
        out, state = tx.update(g, state, params)
    return out, state


# ---------------------------------------------------------------------------
# 1. Moonlight
# ---------------------------------------------------------------------------


def test_moonlight_matrix_update_rms_is_0_2_lr():
    torch.manual_seed(0)
    lr, (a, b) = 3e-3, (64, 32)
    params = td(w=torch.zeros(a, b))          # zero params: no decay term in this test
    g = td(w=torch.randn(a, b))
    # the shape scale times the RMS of an exact polar factor is exactly 0.2
    u_, _, vh = torch.linalg.svd(g["w"].double(), full_matrices=False)
    assert math.isclose(0.2 * math.sqrt(max(a, b)) * rms(u_ @ vh), 0.2, rel_tol=1e-9)
    # the update is -lr * 0.2 * sqrt(max(A, B)) * NS(g) (first Nesterov step: a positive multiple of g)
    tx = mfx.moonlight(lr=lr, weight_decay=0.1)
    out, _ = run(tx, [g], params)
    ns, _ = mfx.newton_schulz().update(g, mfx.EmptyState())
    torch.testing.assert_close(out["w"], -lr * 0.2 * math.sqrt(max(a, b)) * ns["w"], rtol=1e-5, atol=1e-8)
    # with an accurate NS schedule (singular values within ~3 % of 1) the RMS is 0.2 * lr
    out, _ = run(mfx.moonlight(lr=lr, ns_coefficients="you"), [g], params)
    assert abs(rms(out["w"]) / lr - 0.2) < 0.01


def test_moonlight_shares_lr_and_decays_with_lr():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.proj = torch.nn.Linear(8, 16)
            self.lm_head = torch.nn.Linear(16, 10, bias=False)

    torch.manual_seed(0)
    params = TensorDict.from_module(Net()).detach()
    lr, wd = 2e-3, 0.1
    tx = mfx.moonlight(lr=lr, weight_decay=wd)
    state = tx.init(params)
    muon_keys = set(state.inner_states["muon"]["momentum"].mu.keys(True, True))
    assert muon_keys == {("proj", "weight")}                     # embeddings, head, bias: AdamW
    # zero gradients: every leaf (Muon's and AdamW's) moves by exactly -lr * wd * p
    zeros = params.apply(torch.zeros_like)
    out, _ = tx.update(zeros, state, params)
    for k, p in params.items(True, True):
        torch.testing.assert_close(out[k], -lr * wd * p, rtol=1e-6, atol=0.0)
    # lr = 0 changes nothing (what torch.distributed.checkpoint's dummy step relies on)
    out, _ = mfx.moonlight(lr=0.0, weight_decay=wd).update(zeros, state, params)
    assert all(bool((v == 0).all()) for v in out.values(True, True))
    # the AdamW side runs at the same lr: a first Adam step is -lr * sign(g)
    g = params.apply(torch.randn_like)
    out, _ = mfx.moonlight(lr=lr, weight_decay=0.0).update(g, state, params)
    torch.testing.assert_close(out["proj", "bias"], -lr * g["proj", "bias"].sign(), rtol=1e-5, atol=0.0)


# ---------------------------------------------------------------------------
# 2. NorMuon
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (32, 32)])
def test_normuon_equalises_row_rms_and_keeps_the_norm(shape):
    torch.manual_seed(0)
    a, b = shape
    row_scales = torch.logspace(-2, 1, a).unsqueeze(1)            # rows differ 1000-fold
    direction = torch.randn(shape)
    grads = [td(w=row_scales * (direction + 0.3 * torch.randn(shape))) for _ in range(5)]
    params = td(w=torch.zeros(shape))
    nor, _ = run(mfx.normuon(lr=1.0), grads, params)
    plain, _ = run(mfx.muon(lr=1.0), grads, params)

    def spread(t):
        r = t.square().mean(dim=1).sqrt()
        return (r.max() / r.min()).item()

    assert spread(nor["w"]) < 2.0
    assert spread(plain["w"]) > 2.0 * spread(nor["w"])
    # same momentum, same NS: row_normalize keeps the orthogonalised update's Frobenius norm
    torch.testing.assert_close(nor["w"].norm(), plain["w"].norm(), rtol=1e-5, atol=0.0)


def test_normuon_constant_gradient_rows_exactly_equal():
    torch.manual_seed(0)
    g = td(w=torch.logspace(-2, 1, 24).unsqueeze(1) * torch.randn(24, 8))
    out, state = run(mfx.normuon(lr=1.0), [g] * 3, td(w=torch.zeros(24, 8)))
    r = out["w"].square().mean(dim=1).sqrt()
    torch.testing.assert_close(r, r.mean().expand_as(r), rtol=1e-4, atol=0.0)
    assert list(state) == ["momentum", "orthogonalize", "row_normalize", "scale_by_shape", "weight_decay", "lr"]


# ---------------------------------------------------------------------------
# 3. cautious weight decay
# ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(params_and_grads(dtypes=(torch.float32, torch.float64, torch.bfloat16)), st.floats(0.0, 1.0),
       st.integers(0, 2**31 - 1))
def test_cautious_decay_law(pg, wd, seed):
    params, grads = pg
    gen = torch.Generator().manual_seed(seed)
    # zero out some updates and some params, so ties and zeros are exercised
    grads = grads.apply(lambda u: torch.where(torch.rand(u.shape, generator=gen) < 0.2, 0, u))
    params = params.apply(lambda p: torch.where(torch.rand(p.shape, generator=gen) < 0.1, 0, p))
    tx = mfx.cautious_decay(wd)
    out, _ = tx.update(grads, tx.init(params), params)
    full, _ = mfx.decoupled_decay(wd).update(grads, mfx.EmptyState(), params)
    for k, u in grads.items(True, True):
        p = params[k]
        agree = (torch.sign(u) == torch.sign(p)) & (u != 0)
        assert out[k].dtype == full[k].dtype
        assert torch.equal(out[k][agree], full[k][agree])                        # exactly u + wd * p
        assert torch.equal(out[k][~agree], u[~agree].to(out[k].dtype))           # no decay at all
        assert bool((out[k][u == 0] == 0).all())                                 # zero update: no decay


def test_cautious_decay_mask_and_errors():
    p = td(w=torch.full((3,), 2.0), b=torch.full((3,), 2.0))
    u = td(w=torch.ones(3), b=torch.ones(3))
    tx = mfx.cautious_decay(0.5, mask=lambda k, t: k == "w")
    out, _ = tx.update(u, tx.init(p), p)
    assert out["w"].tolist() == [2.0] * 3 and out["b"].tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="params"):
        mfx.cautious_decay(0.1).update(u, mfx.EmptyState())
    with pytest.raises(ValueError, match="weight_decay"):
        mfx.cautious_decay(-1.0)


def test_muon_cautious_decays_only_where_signs_agree():
    torch.manual_seed(0)
    lr, wd = 0.02, 0.1
    params = td(w=torch.randn(16, 8), v=torch.randn(3, 8, 4))
    grads = [params.apply(torch.randn_like) for _ in range(2)]
    cautious, _ = run(mfx.muon_cautious(lr=lr, weight_decay=wd), grads, params)
    no_decay, _ = run(mfx.muon(lr=lr, weight_decay=0.0), grads, params)
    decay, _ = run(mfx.muon(lr=lr, weight_decay=wd), grads, params)
    for k, p in params.items(True, True):
        # the pre-lr update is -no_decay / lr: signs agree where it and p have the same sign
        agree = torch.sign(-no_decay[k]) == torch.sign(p)
        assert 0 < int(agree.sum()) < agree.numel()
        expected = torch.where(agree, decay[k], no_decay[k])
        torch.testing.assert_close(cautious[k], expected, rtol=0.0, atol=0.0)


# ---------------------------------------------------------------------------
# 4. momentum warm-up
# ---------------------------------------------------------------------------


def test_momentum_warmup_schedule():
    s = mfx.momentum_warmup()
    assert isinstance(s, mfx.schedules.linear)
    for t, v in [(0, 0.85), (150, 0.90), (300, 0.95), (301, 0.95), (10_000, 0.95)]:
        assert math.isclose(s(t), v, abs_tol=1e-12), t


@pytest.mark.parametrize("step, expected", [(0, 0.85), (150, 0.90), (300, 0.95), (1000, 0.95)])
def test_muon_with_momentum_warmup_uses_the_scheduled_momentum(step, expected):
    torch.manual_seed(0)
    params = td(w=torch.randn(8, 4))
    tx = mfx.muon_with_momentum_warmup(lr=0.02, weight_decay=0.01)
    state = tx.init(params)
    assert state.hyperparams["momentum"] == 0.85
    for _ in range(2):                      # a non-zero momentum buffer, so momentum matters
        _, state = tx.update(params.apply(torch.randn_like), state, params)
    state = state._replace(count=step)
    g = params.apply(torch.randn_like)
    inner_before = state.inner_state
    out, state = tx.update(g, state, params)
    assert math.isclose(state.hyperparams["momentum"], expected, abs_tol=1e-12)
    assert state.count == step + 1
    ref, _ = mfx.muon(lr=0.02, weight_decay=0.01, momentum=expected).update(g, inner_before, params)
    assert torch.equal(out["w"], ref["w"])
    other, _ = mfx.muon(lr=0.02, weight_decay=0.01, momentum=expected - 0.05).update(g, inner_before, params)
    assert not torch.allclose(out["w"], other["w"])


# ---------------------------------------------------------------------------
# 5. per-block (per-head) orthogonalisation
# ---------------------------------------------------------------------------


def test_split_newton_schulz_equals_ns_per_block():
    torch.manual_seed(0)
    rows = td(qkv=torch.randn(24, 8), gqa=torch.randn(16, 8))       # q, k, v of 8 rows; q 8, k 4, v 4
    cols = td(w=torch.randn(6, 12))
    ns = mfx.newton_schulz()
    cases = [(rows, {"qkv": 8, "gqa": [8, 4, 4]}, 0), (cols, {"w": [4, 8]}, 1)]
    for g, split, dim in cases:
        for key, sizes in split.items():
            out, _ = mfx.split_newton_schulz(sizes, dim=dim).update(td(x=g[key]), mfx.EmptyState())
            blocks = g[key].split(sizes, dim=dim)
            ref = torch.cat([ns.update(td(x=b.contiguous()), mfx.EmptyState())[0]["x"] for b in blocks], dim=dim)
            torch.testing.assert_close(out["x"], ref, rtol=1e-5, atol=1e-6)
            whole, _ = ns.update(td(x=g[key]), mfx.EmptyState())
            assert not torch.allclose(out["x"], whole["x"], atol=1e-2)


def test_split_newton_schulz_batches_same_shape_blocks(monkeypatch):
    calls = []
    real = seam.map_matrices

    def spy(fn, stacks, *args, **kwargs):
        calls.append([tuple(s.shape) for s in stacks])
        return real(fn, stacks, *args, **kwargs)

    monkeypatch.setattr(seam, "map_matrices", spy)
    g = td(a=torch.randn(12, 4), b=torch.randn(8, 4), experts=torch.randn(2, 8, 4))
    out, _ = mfx.split_newton_schulz(4).update(g, mfx.EmptyState())
    assert calls == [[(1, 4, 4)] * 5 + [(2, 4, 4)] * 2]             # one seam call, all blocks
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in g.items()}


def test_muon_per_head_equals_muon_on_separate_q_k_v():
    torch.manual_seed(0)
    d, lr, wd = 8, 0.02, 0.05
    fused = td(attn=td(qkv=torch.randn(3 * d, d)), mlp=torch.randn(4 * d, d))
    grads = [fused.apply(torch.randn_like) for _ in range(3)]

    def separate(t):
        q, k, v = t["attn", "qkv"].split(d)
        return td(q=q.clone(), k=k.clone(), v=v.clone(), mlp=t["mlp"].clone())

    tx = mfx.muon_per_head(split_sizes=d, qkv_pattern=r"qkv", lr=lr, weight_decay=wd)
    state = tx.init(fused)
    assert list(state) == ["momentum", "orthogonalize", "weight_decay", "lr"]
    out, _ = run(tx, grads, fused)
    ref, _ = run(mfx.muon(lr=lr, weight_decay=wd), [separate(g) for g in grads], separate(fused))
    torch.testing.assert_close(out["attn", "qkv"], torch.cat([ref["q"], ref["k"], ref["v"]]), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["mlp"], ref["mlp"], rtol=1e-5, atol=1e-7)
    # whole-matrix Muon on the fused weight is a different update
    whole, _ = run(mfx.muon(lr=lr, weight_decay=wd), grads, fused)
    assert not torch.allclose(out["attn", "qkv"], whole["attn", "qkv"], atol=1e-3)


def test_blockwise_errors_name_the_key():
    with pytest.raises(ValueError, match="split_sizes"):
        mfx.split_newton_schulz(0)
    with pytest.raises(ValueError, match="dim"):
        mfx.split_newton_schulz(4, dim=2)
    with pytest.raises(ValueError, match="'attn.qkv'.*multiple"):
        mfx.split_newton_schulz(5).update(td(attn=td(qkv=torch.randn(12, 4))), mfx.EmptyState())
    with pytest.raises(ValueError, match="'w'.*sum to 7"):
        mfx.split_newton_schulz([3, 4]).update(td(w=torch.randn(12, 4)), mfx.EmptyState())
    with pytest.raises(ValueError, match="'b'"):
        mfx.split_newton_schulz(2).update(td(b=torch.randn(4)), mfx.EmptyState())


# ---------------------------------------------------------------------------
# 6. MoE expert stacks
# ---------------------------------------------------------------------------


def test_muon_on_expert_stack_equals_per_expert_muon():
    torch.manual_seed(0)
    e, m, n = 4, 16, 8                                   # tall experts: the shape scale matters
    scales = torch.tensor([1e-2, 1.0, 10.0, 100.0]).view(e, 1, 1)   # experts of very different sizes
    stacked = td(experts=torch.randn(e, m, n))
    grads = [td(experts=scales * torch.randn(e, m, n)) for _ in range(3)]

    def split(t):
        return td(**{f"e{i}": t["experts"][i].clone() for i in range(e)})

    tx = mfx.muon(lr=0.02, weight_decay=0.01)
    out, _ = run(tx, grads, stacked)
    ref, _ = run(tx, [split(g) for g in grads], split(stacked))
    torch.testing.assert_close(out["experts"], torch.stack([ref[f"e{i}"] for i in range(e)]), rtol=1e-5, atol=1e-7)
    # each expert is normalised on its own: all have the same update norm despite 1e4-fold grads
    no_decay, _ = run(mfx.muon(lr=1.0), grads, stacked)
    norms = no_decay["experts"].flatten(1).norm(dim=1)
    torch.testing.assert_close(norms, norms.mean().expand_as(norms), rtol=0.05, atol=0.0)
    # scale_by_shape uses each expert's (m, n), not (E*m, n)
    u = td(experts=torch.ones(e, m, n))
    for mode, s in [("original", math.sqrt(m / n)), ("match_rms_adamw", 0.2 * math.sqrt(m)), ("spectral", math.sqrt(m / n))]:
        out, _ = mfx.scale_by_shape(mode).update(u, mfx.EmptyState())
        torch.testing.assert_close(out["experts"], torch.full((e, m, n), s))
