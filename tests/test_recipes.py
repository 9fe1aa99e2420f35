"""The variant recipes of muonfx.presets.variants: each test checks the property that defines the
variant (not just that it runs). Comparisons are ``torch.equal`` where both sides run the
same arithmetic, and a stated tolerance where they compute differently."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfx as mfx
from muonfx import seam
from muonfx.presets.predecessor import fsdp_muon
from muonfx.presets.options import MuonOptions, muon_options_of, takes_muon_options
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
    # float64: the point is the formula (split blocks are batched with others, so float32
    # would compare two kernels' rounding)
    rows = td(qkv=torch.randn(24, 8, dtype=torch.float64), gqa=torch.randn(16, 8, dtype=torch.float64))
    cols = td(w=torch.randn(6, 12, dtype=torch.float64))
    ns = mfx.newton_schulz()
    cases = [(rows, {"qkv": 8, "gqa": [8, 4, 4]}, 0), (cols, {"w": [4, 8]}, 1)]
    for g, split, dim in cases:
        for key, sizes in split.items():
            out, _ = mfx.split_newton_schulz(sizes, dim=dim).update(td(x=g[key]), mfx.EmptyState())
            blocks = g[key].split(sizes, dim=dim)
            ref = torch.cat([ns.update(td(x=b.contiguous()), mfx.EmptyState())[0]["x"] for b in blocks], dim=dim)
            torch.testing.assert_close(out["x"], ref, rtol=1e-12, atol=1e-14)
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


def test_blockwise_counters_follow_their_parameter_under_the_adapter():
    """Adam inside blockwise on row blocks computes what Adam on the whole matrix does,
    also when a parameter gets no gradient in a step: its blocks' counter stays where the
    parameter's is (the adapter keeps per-parameter counters; a block's key is the
    parameter's key with a "block<i>" appended)."""
    def run_adapter(tx):
        gen = torch.Generator().manual_seed(0)
        a = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
        b = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
        opt = mfx.TransformOptimizer([("a", a), ("b", b)], tx)
        for step in range(4):
            a.grad = torch.randn(8, 4, generator=gen)
            b.grad = None if step == 1 else torch.randn(8, 4, generator=gen)
            opt.step()
        return a.detach(), b.detach(), opt.state_dict()["state"]

    lr = mfx.scale_by_learning_rate(0.1)
    a, b, state = run_adapter(mfx.chain(mfx.blockwise(mfx.scale_by_adam(), 4), lr))
    ref_a, ref_b, ref_state = run_adapter(mfx.chain(mfx.scale_by_adam(), lr))
    torch.testing.assert_close(a, ref_a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b, ref_b, rtol=1e-6, atol=1e-7)
    assert [s["0.count"] for s in state.values()] == [s["0.count"] for s in ref_state.values()] == [4, 3]


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
    # (the 5-step keller schedule leaves singular values in [0.68, 1.13], so the norms differ
    # a little: measured 4.8 % here, against the 1e4-fold gradients)
    torch.testing.assert_close(norms, norms.mean().expand_as(norms), rtol=0.1, atol=0.0)
    # scale_by_shape uses each expert's (m, n), not (E*m, n)
    u = td(experts=torch.ones(e, m, n))
    for mode, s in [("original", math.sqrt(m / n)), ("match_rms_adamw", 0.2 * math.sqrt(m)), ("spectral", math.sqrt(m / n))]:
        out, _ = mfx.scale_by_shape(mode).update(u, mfx.EmptyState())
        torch.testing.assert_close(out["experts"], torch.full((e, m, n), s))


# ---------------------------------------------------------------------------
# 7. one Muon option set, forwarded by every builder; ``eps`` means one thing
# ---------------------------------------------------------------------------

#: every builder that runs Muon, with the defaults it gives some options
MUON_BUILDERS = {
    mfx.muon: {},
    mfx.muon_adamw: {},
    mfx.moonlight: {"lr": 1e-3, "weight_decay": 0.1, "adjust_lr": "match_rms_adamw"},
    mfx.normuon: {},
    mfx.muon_cautious: {"weight_decay": 0.01},
    mfx.muon_with_momentum_warmup: {},
    mfx.muon_per_head: {},
    fsdp_muon: {"weight_decay": 0.01},
    mfx.MuonOptimizer: {"nesterov": False},
    mfx.create_hybrid_optimizer: {},
    mfx.FSDPMuonOptimizer: {"weight_decay": 0.01},
}

#: keyword names and defaults of each builder before the options were forwarded
#: (muonfx 0.1.0); every one is still accepted with the same default, except the
#: ``eps`` renames of the "Changed" entry: ``moonlight(eps=)`` (Adam's) is ``adamw_eps``,
#: ``moonlight(ns_eps=)``/``normuon(ns_eps=)`` are ``eps``, ``normuon(eps=)`` and
#: ``fsdp_muon``/``FSDPMuonOptimizer(eps=)`` (row normalisation's) are ``row_eps``.
#: ``ns_method``'s default is ``"standard"`` again, torch.optim.Muon's iteration (for a while
#: it was ``"auto"``, the Gram form on rectangular bf16 matrices: CHANGELOG). Passing
#: ``eps`` to ``moonlight`` or ``normuon`` warns (its old meaning is a new keyword's).
BEFORE = {
    mfx.muon: dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="keller", weight_decay=0.0,
                   adjust_lr="original", eps=1e-07, ns_dtype=None, ns_method="standard", mu_dtype=None),
    mfx.muon_adamw: dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="keller",
                         weight_decay=0.0, adjust_lr="original", eps=1e-07, ns_dtype=None, adamw_lr=0.001,
                         adamw_betas=(0.9, 0.95), adamw_eps=1e-08, adamw_weight_decay=0.01, labels=None),
    mfx.moonlight: dict(lr=0.001, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                        ns_coefficients="keller", betas=(0.9, 0.95), adamw_eps=1e-08, eps=1e-07, ns_dtype=None,
                        labels=None),
    mfx.normuon: dict(lr=0.02, momentum=0.95, beta2=0.95, nesterov=True, ns_steps=5, ns_coefficients="keller",
                      weight_decay=0.0, adjust_lr="original", row_eps=1e-10, eps=1e-07, ns_dtype=None),
    mfx.muon_cautious: dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5,
                            ns_coefficients="keller", adjust_lr="original", eps=1e-07, ns_dtype=None),
    mfx.muon_with_momentum_warmup: dict(lr=0.02, momentum_start=0.85, momentum_end=0.95, warmup_steps=300),
    mfx.muon_per_head: dict(qkv_pattern="qkv|c_attn", dim=0, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                            ns_coefficients="keller", weight_decay=0.0, adjust_lr="original", eps=1e-07,
                            ns_dtype=None),
    fsdp_muon: dict(lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True, ns_steps=5, ns_stepsize=1.0,
                    beta2=None, row_eps=1e-08, gradient_accumulation_steps=1, adjust_lr="original",
                    ns_dtype=None),
    mfx.MuonOptimizer: dict(lr=0.02, momentum=0.95, weight_decay=0.0, nesterov=False, ns_steps=5,
                            ns_coefficients="keller", adjust_lr="original", eps=1e-07, ns_dtype=None),
    mfx.create_hybrid_optimizer: dict(muon_lr=0.02, adamw_lr=0.001, adamw_weight_decay=0.01, muon_momentum=0.95,
                                      muon_weight_decay=0.0, nesterov=True, ns_steps=5, ns_coefficients="keller",
                                      adjust_lr="original", ns_dtype=None, adamw_betas=(0.9, 0.95),
                                      adamw_eps=1e-08, labels=None),
    mfx.FSDPMuonOptimizer: dict(params=None, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5,
                                ns_stepsize=1.0, beta2=None, row_eps=1e-08, gradient_accumulation_steps=1,
                                adamw_lr=0.001, adamw_betas=(0.9, 0.95), adamw_weight_decay=0.01, ns_dtype=None),
}

_IDS = [b.__name__ for b in MUON_BUILDERS]


@pytest.mark.parametrize("builder", list(MUON_BUILDERS), ids=_IDS)
def test_every_muon_builder_lists_every_muon_option(builder):
    """``inspect.signature`` (what TransformOptimizer reads for param_groups) lists every
    Muon option with MuonOptions' default, or the builder's documented one."""
    import inspect

    params = inspect.signature(builder).parameters
    public = muon_options_of(builder)
    expected = {f.name: f.default for f in dataclasses.fields(MuonOptions)}
    expected.update(MUON_BUILDERS[builder])
    if builder is mfx.muon_with_momentum_warmup:
        del expected["momentum"]  # the warm-up schedule is its momentum
    assert set(public) == set(expected)
    for name, default in expected.items():
        assert public[name] in params, (builder.__name__, name)
        assert params[public[name]].default == default, (builder.__name__, name)
    assert params[public["eps"]].default == 1e-7  # the Newton-Schulz floor, torch.optim.Muon's


@pytest.mark.parametrize("builder", list(BEFORE), ids=[b.__name__ for b in BEFORE])
def test_keyword_names_and_defaults_kept(builder):
    import inspect

    params = inspect.signature(builder).parameters
    for name, default in BEFORE[builder].items():
        assert name in params, (builder.__name__, name)
        assert params[name].default == default, (builder.__name__, name)


def test_old_eps_names_are_refused_by_name():
    for call in (lambda: mfx.moonlight(ns_eps=1e-7), lambda: mfx.normuon(ns_eps=1e-7)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'ns_eps'"):
            call()
    with pytest.raises(TypeError, match=r"muon_adamw\(\) got an unexpected keyword argument 'ns_epsilon'"):
        mfx.muon_adamw(ns_epsilon=1.0)
    with pytest.raises(TypeError, match="positional"):
        mfx.normuon(0.02, 0.95)  # only lr is positional: normuon's beta2 used to be the third


# a full set of options, none at its default
OPTS = dict(lr=0.05, momentum=0.9, nesterov=False, ns_steps=3, ns_coefficients="you", weight_decay=0.1,
            adjust_lr="match_rms_adamw", eps=1e-3, ns_dtype=torch.float64, ns_method="gram", mu_dtype=torch.bfloat16)


def _matrices():
    torch.manual_seed(0)
    params = td(w=torch.randn(16, 8), x=torch.randn(8, 24), e=torch.randn(3, 8, 4))
    grads = [params.apply(lambda t: 0.01 * torch.randn_like(t)) for _ in range(3)]
    return params, grads


#: the options above give moonlight/normuon an eps other than the default on purpose
EPS_MEANS_THE_FLOOR = "ignore::muonfx.MeaningChangedWarning"


@pytest.mark.filterwarnings(EPS_MEANS_THE_FLOOR)
@pytest.mark.parametrize("name", ["muon_adamw", "moonlight", "muon_cautious", "muon_per_head", "fsdp_muon",
                                  "muon_with_momentum_warmup"])
def test_builders_forward_every_option_to_muon(name):
    """With every option away from its default, each builder's Muon part computes
    bitwise what ``mfx.muon`` computes with the same options (zero parameters, so the
    cautious and decoupled decays agree; no key matches the per-head pattern)."""
    params, grads = _matrices()
    params = params.apply(torch.zeros_like)
    build = {
        "muon_adamw": lambda: mfx.muon_adamw(**OPTS),
        "moonlight": lambda: mfx.moonlight(**OPTS),
        "muon_cautious": lambda: mfx.muon_cautious(**OPTS),
        "muon_per_head": lambda: mfx.muon_per_head(4, qkv_pattern="^nothing$", **OPTS),
        "fsdp_muon": lambda: fsdp_muon(**OPTS),
        "muon_with_momentum_warmup": lambda: mfx.muon_with_momentum_warmup(
            momentum_start=OPTS["momentum"], momentum_end=OPTS["momentum"],
            **{k: v for k, v in OPTS.items() if k != "momentum"}),
    }[name]
    out, _ = run(build(), grads, params)
    ref, _ = run(mfx.muon(**OPTS), grads, params)
    default, _ = run(mfx.muon(), grads, params)
    for k in ("w", "x", "e"):
        assert torch.equal(out[k], ref[k]), k
        assert not torch.allclose(out[k], default[k]), k


@pytest.mark.filterwarnings(EPS_MEANS_THE_FLOOR)
def test_optimizers_forward_every_option_to_their_muon_group():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
    renamed = {"lr": "muon_lr", "momentum": "muon_momentum", "weight_decay": "muon_weight_decay"}
    built = [
        mfx.MuonOptimizer([model[1].weight], **OPTS),
        mfx.create_hybrid_optimizer(model, **{renamed.get(k, k): v for k, v in OPTS.items()}),
        mfx.FSDPMuonOptimizer(model, **OPTS),
    ]
    for opt in built:
        group = opt.param_groups[0]
        assert {k: group[k] for k in OPTS} == OPTS, type(opt).__name__


@pytest.mark.filterwarnings(EPS_MEANS_THE_FLOOR)
def test_eps_is_the_newton_schulz_floor_everywhere():
    """A floor far above the gradients' norms (1e6) shrinks every Muon update (by about
    ``||G|| / eps`` times the iteration's small-input gain, ~500 for Keller's five
    steps), in every builder; Adam's epsilon (``adamw_eps``) and the row normaliser's
    (``row_eps``) touch only their own parts."""
    torch.manual_seed(0)
    params = td(w=torch.randn(16, 8), b=torch.randn(8))
    g = [td(w=torch.randn(16, 8), b=torch.randn(8))]
    no_decay = dict(weight_decay=0.0)
    hybrids = {"muon_adamw": lambda **kw: mfx.muon_adamw(adamw_weight_decay=0.0, **no_decay, **kw),
               "moonlight": lambda **kw: mfx.moonlight(**no_decay, **kw)}
    matrix_only = {"muon": mfx.muon, "normuon": mfx.normuon, "muon_cautious": mfx.muon_cautious,
                   "muon_per_head": lambda **kw: mfx.muon_per_head(4, **kw), "fsdp_muon": fsdp_muon,
                   "muon_with_momentum_warmup": mfx.muon_with_momentum_warmup}
    w_only = td(w=params["w"])
    for name, builder in matrix_only.items():
        small, _ = run(builder(eps=1e6, **no_decay), [td(w=g[0]["w"])], w_only)
        plain, _ = run(builder(**no_decay), [td(w=g[0]["w"])], w_only)
        ratio = (small["w"].norm() / plain["w"].norm()).item()
        assert ratio < 0.05, (name, ratio)
    for name, builder in hybrids.items():
        plain, _ = run(builder(), g, params)
        ns, _ = run(builder(eps=1e6), g, params)
        adam, _ = run(builder(adamw_eps=1e3), g, params)
        assert (ns["w"].norm() / plain["w"].norm()).item() < 0.05 and torch.equal(ns["b"], plain["b"]), name
        assert (adam["b"].norm() / plain["b"].norm()).item() < 0.05 and torch.equal(adam["w"], plain["w"]), name
    # normuon's row normaliser has its own epsilon
    grads = [td(w=1e-6 * torch.randn(16, 8)) for _ in range(2)]
    assert not torch.equal(run(mfx.normuon(row_eps=1.0), grads, w_only)[0]["w"],
                           run(mfx.normuon(), grads, w_only)[0]["w"])
    # the optimizers: eps in the Muon group, adamw_eps in the AdamW group
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    for opt in (mfx.create_hybrid_optimizer(model, eps=1e-5, adamw_eps=1e-6),
                mfx.FSDPMuonOptimizer(model, eps=1e-5, adamw_eps=1e-6, row_eps=1e-4)):
        muon_group, adamw_group = opt.param_groups
        assert muon_group["eps"] == 1e-5 and adamw_group["eps"] == 1e-6
    assert mfx.MuonOptimizer([model[1].weight], eps=1e-5).param_groups[0]["eps"] == 1e-5


def test_a_builder_of_ones_own_takes_the_options():
    """``takes_muon_options``: how the built-in builders take the set, usable for one's own."""
    import inspect

    @takes_muon_options(defaults={"weight_decay": 0.1}, rename={"lr": "muon_lr"})
    def clipped_muon(*, clip: float = 1.0, **options):
        assert set(options) == {f.name for f in dataclasses.fields(MuonOptions)}
        return mfx.chain(mfx.clip_by_global_norm(clip), mfx.muon(**options))

    sig = inspect.signature(clipped_muon)
    assert list(sig.parameters)[0] == "muon_lr" and list(sig.parameters)[-1] == "clip"
    assert sig.parameters["weight_decay"].default == 0.1
    params, grads = _matrices()
    opt = mfx.TransformOptimizer([("w", torch.nn.Parameter(params["w"].clone()))], clipped_muon, muon_lr=0.01)
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["clip"] == 1.0
    with pytest.raises(TypeError, match="not Muon options"):
        takes_muon_options(defaults={"not_an_option": 1})
    with pytest.raises(TypeError, match="named like Muon options"):
        takes_muon_options()(lambda lr=1.0, **options: None)


def test_an_eps_that_once_meant_something_else_warns():
    """moonlight's eps was Adam's epsilon and normuon's the row normaliser's in earlier
    versions; now both are the Newton-Schulz floor. Passing one other than the default
    warns, naming the keyword that took over the old meaning; the defaults, the new
    keywords and the adapter's own calls with the defaults stay silent."""
    import warnings

    with pytest.warns(mfx.MeaningChangedWarning, match=r"moonlight\(eps=1e-06\): eps is the Newton-Schulz floor.*adamw_eps="):
        mfx.moonlight(eps=1e-6)
    with pytest.warns(mfx.MeaningChangedWarning, match=r"normuon\(eps=1e-08\): eps is the Newton-Schulz floor.*row_eps="):
        mfx.normuon(eps=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mfx.moonlight(adamw_eps=1e-6), mfx.moonlight(eps=1e-7), mfx.normuon(row_eps=1e-8), mfx.muon(eps=1e-6)
        model = torch.nn.Linear(4, 4)
        opt = mfx.TransformOptimizer(model.named_parameters(), mfx.moonlight, lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
