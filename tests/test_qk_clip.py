"""QK-clip: the arithmetic (its three laws on every supported layout), the recorder, the
refusals, and the optimizers' qk_clip= option."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.attention import max_logits
from muonfx.transforms.qk import qk_factors
from muonfx.testing import QKClipLawError, check_qk_clip

F64 = torch.float64


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (..., T, d): a position-dependent rotation of pairs of dims."""
    T, d = x.shape[-2], x.shape[-1]
    pos = torch.arange(T, dtype=x.dtype)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = pos * freq
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def _case(kind: str, heads=4, kv_heads=4, d=4, D=16, rope=False, bias=False, seed=0):
    """(params, grads, layout, logits(params) -> {"a": [heads, T, T]}) of one attention layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, D, generator=g, dtype=F64)
    qn, kn = heads * d, kv_heads * d
    ps, lay = {}, None
    if kind in ("fused", "conv1d"):
        rows = qn + 2 * kn
        ps["c_attn.weight"] = torch.randn(rows, D, generator=g, dtype=F64) / D ** 0.5
        if kind == "conv1d":
            ps["c_attn.weight"] = ps["c_attn.weight"].T.contiguous()
        if bias:
            ps["c_attn.bias"] = torch.randn(rows, generator=g, dtype=F64)
        lay = mfx.QKLayout.fused("c_attn.weight", heads=heads, head_dim=d, kv_heads=kv_heads,
                                 bias="c_attn.bias" if bias else None, transposed=kind == "conv1d")
    else:
        ps["q.weight"] = torch.randn(qn, D, generator=g, dtype=F64) / D ** 0.5
        ps["k.weight"] = torch.randn(kn, D, generator=g, dtype=F64) / D ** 0.5
        ps["v.weight"] = torch.randn(kn, D, generator=g, dtype=F64) / D ** 0.5
        if bias:
            ps["q.bias"] = torch.randn(qn, generator=g, dtype=F64)
            ps["k.bias"] = torch.randn(kn, generator=g, dtype=F64)
        lay = mfx.QKLayout.separate("q.weight", "k.weight", heads=heads, head_dim=d, kv_heads=kv_heads,
                                    q_bias="q.bias" if bias else None, k_bias="k.bias" if bias else None)
    ps["mlp.weight"] = torch.randn(D, D, generator=g, dtype=F64)
    params = TensorDict(ps, [])
    grads = params.apply(lambda t: torch.randn(t.shape, generator=g, dtype=F64))

    def qk(p):
        if kind in ("fused", "conv1d"):
            w = p["c_attn.weight"] if kind == "fused" else p["c_attn.weight"].T
            y = x @ w.T + (p["c_attn.bias"] if bias else 0)
            q, k = y[..., :qn], y[..., qn:qn + kn]
        else:
            q = x @ p["q.weight"].T + (p["q.bias"] if bias else 0)
            k = x @ p["k.weight"].T + (p["k.bias"] if bias else 0)
        q = q.view(2, 6, heads, d).transpose(1, 2)
        k = k.view(2, 6, kv_heads, d).transpose(1, 2)
        if rope:
            q, k = _rope(q), _rope(k)
        return q, k.repeat_interleave(heads // kv_heads, dim=1)

    def logits(p):
        q, k = qk(p)
        return {"a": (q @ k.mT / d ** 0.5).transpose(0, 1)}

    return params, grads, {"a": lay}, logits, qk


@pytest.mark.parametrize("kind", ["fused", "conv1d", "separate"])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_laws_multi_head(kind, rope, bias):
    params, grads, layout, logits, qk = _case(kind, rope=rope, bias=bias)
    inner = mfx.chain(mfx.momentum(0.9), mfx.scale(-0.3))
    u0, _ = inner.update(grads, inner.init(params), params)
    S = max_logits(*qk(mfx.apply_updates(params, u0)))
    tau = float(S.sort().values[1]) + 1e-9  # two heads at or under tau, two above
    out = check_qk_clip(inner, layout, params, grads, logits, {"a": S}, tau=tau)
    assert out["clipped heads"] == {"a": sorted(torch.nonzero(S > tau).flatten().tolist())}
    assert len(out["clipped heads"]["a"]) == 2
    assert out["max error"] < 1e-12
    # with the step's own statistics, the clipped weights' largest logit is tau
    u1, _ = mfx.qk_clip(tau, 0.5, layout).update(u0, (), params, qk_logit_max={"a": S})
    S1 = max_logits(*qk(mfx.apply_updates(params, u1)))
    assert torch.allclose(S1, torch.minimum(S, torch.full_like(S, tau)), rtol=1e-12)


@pytest.mark.parametrize("kind", ["fused", "separate"])
@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_laws_grouped_query(kind, alpha):
    params, grads, layout, logits, qk = _case(kind, heads=4, kv_heads=2, rope=True)
    S = torch.tensor([50.0, 300.0, 80.0, 90.0], dtype=F64)  # group 0 clipped (its max 300), group 1 not
    out = check_qk_clip(mfx.scale(-0.1), layout, params, grads, logits, {"a": S}, tau=100.0, alpha=alpha)
    assert out["clipped heads"] == {"a": [0, 1]}  # head 0 is under tau but shares its keys with head 1
    # the shared key rows take the group's gamma: 100/300
    u1, _ = mfx.qk_clip(100.0, alpha, layout).update(grads, (), params, qk_logit_max={"a": S})
    w = params[("c_attn.weight",) if kind == "fused" else ("k.weight",)]
    start = 16 if kind == "fused" else 0
    krow = (w + grads[("c_attn.weight",) if kind == "fused" else ("k.weight",)])[start]
    new = mfx.apply_updates(params, u1)[("c_attn.weight",) if kind == "fused" else ("k.weight",)][start]
    assert torch.allclose(new, (100.0 / 300.0) ** (1 - alpha) * krow, rtol=1e-12)


def test_law_catches_a_wrong_clip():
    """The law fails a clip that scales the update instead of the new weights (a common mistake)."""
    params, grads, layout, logits, qk = _case("fused")
    S = torch.tensor([500.0, 50.0, 50.0, 50.0], dtype=F64)

    def wrong_update(u, s, p=None, **extra):
        out = u.clone()
        out["c_attn.weight"][:4] *= 0.2 ** 0.5
        return out, s

    wrong = mfx.GradientTransformation(lambda p: (), wrong_update)
    with pytest.raises(QKClipLawError, match="logits|rows"):
        import muonfx.testing.qk_law as law

        real = law.qk_clip
        law.qk_clip = lambda *a, **k: wrong
        try:
            check_qk_clip(mfx.scale(-0.1), layout, params, grads, logits, {"a": S}, tau=100.0)
        finally:
            law.qk_clip = real


def test_under_tau_is_bit_for_bit():
    params, grads, layout, logits, _ = _case("fused", bias=True)
    params = params.apply(lambda t: t.float())
    grads = grads.apply(lambda t: t.float())
    S = torch.tensor([100.0, 99.0, -3.0, 0.0])  # at or under tau everywhere
    out, _ = mfx.qk_clip(100.0, 0.5, layout).update(grads, (), params, qk_logit_max={"a": S})
    for k in grads.keys(True, True):
        assert torch.equal(out[k], grads[k]) and out[k].dtype == grads[k].dtype


def test_recorder_accumulates_is_idempotent_and_resets():
    rec = mfx.QKLogitRecorder()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    q2 = torch.randn(2, 3, 5, 4, generator=g)
    rec.record("a", q, k, is_causal=True)
    first = rec.maxima()["a"]
    rec.record("a", q, k, is_causal=True)  # activation recomputation: the same pass again
    assert torch.equal(rec.maxima()["a"], first)
    rec.record("a", q2, k, is_causal=True)  # a second micro-batch
    both = torch.maximum(first, max_logits(q2, k, is_causal=True))
    assert torch.equal(rec.maxima()["a"], both)
    # the causal mask leaves the future out: same as the explicit boolean mask
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(max_logits(q, k, is_causal=True), max_logits(q, k, attn_mask=mask))
    # the reference: the full logits, masked
    ref = (q @ k.mT / 2.0).masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(first, ref)
    buf = rec._max["a"]
    rec.reset()
    assert rec._max["a"] is buf and torch.isneginf(rec.maxima()["a"]).all()


def test_recorder_under_torch_compile():
    rec = mfx.QKLogitRecorder()

    def attn(q, k, v):
        rec.record("a", q, k, is_causal=True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(attn, backend="aot_eager", fullgraph=False)
    g = torch.Generator().manual_seed(2)
    qs = [torch.randn(1, 2, 4, 8, generator=g) for _ in range(3)]
    k, v = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    compiled(qs[0], k, v)
    compiled(qs[1], k, v)
    want = torch.maximum(max_logits(qs[0], k, is_causal=True), max_logits(qs[1], k, is_causal=True))
    assert torch.allclose(rec.maxima()["a"], want)
    rec.reset()
    compiled(qs[2], k, v)
    assert torch.allclose(rec.maxima()["a"], max_logits(qs[2], k, is_causal=True))


def test_refusals():
    with pytest.raises(ValueError, match="MLA"):
        mfx.QKLayout.separate("q", "k", heads=2, head_dim=4, shared_rope_key="kv_a.weight")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        mfx.QKLayout.fused("w", heads=3, head_dim=4, kv_heads=2)
    lay = {"a": mfx.QKLayout.fused("w", heads=2, head_dim=4)}
    tx = mfx.qk_clip(100.0, layout=lay)
    p = TensorDict({"w": torch.ones(20, 8)}, [])
    with pytest.raises(ValueError, match="'w' has 20 output rows.*needs 24"):
        tx.update(p, (), p, qk_logit_max={"a": torch.tensor([200.0, 1.0])})
    p = TensorDict({"w": torch.ones(24, 8)}, [])
    with pytest.raises(ValueError, match="no statistics for layer 'a'"):
        tx.update(p, (), p, qk_logit_max={})
    with pytest.raises(ValueError, match="pass qk_logit_max"):
        tx.update(p, (), p)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        tx.update(p, (), p, qk_logit_max={"a": torch.ones(3)})
    with pytest.raises(ValueError, match="tau must be > 0"):
        mfx.qk_clip(0.0, layout=lay)
    with pytest.raises(ValueError, match="both 'a' and 'b'"):
        mfx.qk_clip(layout={"a": lay["a"], "b": lay["a"]})


# ---------------------------------------------------------------------------
# the optimizers' qk_clip= option
# ---------------------------------------------------------------------------


class _Attn(torch.nn.Module):
    """A fused-QKV attention (nn.Linear (3d, d) with a bias), a hidden matrix, an embedding."""

    def __init__(self, d=16, heads=2, vocab=11):
        super().__init__()
        self.heads, self.recorder = heads, None
        self.wte = torch.nn.Embedding(vocab, d)
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.mlp = torch.nn.Linear(d, d)

    def forward(self, idx):
        x = self.wte(idx)
        B, T, D = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if self.recorder is not None:
            self.recorder.record("attn", q, k, is_causal=True)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.mlp(y.transpose(1, 2).reshape(B, T, D)).sum()

    def layout(self):
        return {"attn": mfx.QKLayout.fused("c_attn.weight", heads=self.heads, head_dim=8, bias="c_attn.bias")}


def _recording() -> tuple[_Attn, mfx.QKLogitRecorder]:
    """A seeded _Attn that records into a new recorder."""
    torch.manual_seed(0)
    m = _Attn()
    m.recorder = rec = mfx.QKLogitRecorder()
    return m, rec


def _twins(build):
    """(model, opt, recorder) with the clip, and (model, opt) without, from one initialisation."""
    torch.manual_seed(0)
    a = _Attn()
    with torch.no_grad():
        a.c_attn.weight.mul_(8.0)  # large logits: both heads above tau
    b = _Attn()
    b.load_state_dict(a.state_dict())
    rec = mfx.QKLogitRecorder()
    a.recorder = rec
    return a, build(a, mfx.QKClip(rec, a.layout(), tau=5.0)), rec, b, build(b, None)


BUILDERS = {
    "hybrid": lambda m, c: mfx.create_hybrid_optimizer(m, muon_lr=0.05, qk_clip=c),
    "MuonOptimizer": lambda m, c: mfx.MuonOptimizer(m, lr=0.05, qk_clip=c),
    "TransformOptimizer": lambda m, c: mfx.TransformOptimizer(m.named_parameters(), mfx.adamw, lr=0.01, qk_clip=c),
    "FSDPMuonOptimizer": lambda m, c: mfx.FSDPMuonOptimizer(m, lr=0.05, qk_clip=c),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_optimizer_option_clips_after_the_update(name):
    a, opt_a, rec, b, opt_b = _twins(BUILDERS[name])
    idx = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(3))
    w0 = {n: p.detach().clone() for n, p in a.named_parameters()}
    a(idx).backward()
    b(idx).backward()
    S = rec.maxima()["attn"]
    assert (S > 5.0).all()
    opt_a.step()
    opt_b.step()
    assert torch.isneginf(rec.maxima()["attn"]).all()  # reset by the step
    qf, kf = qk_factors(S, 5.0, 0.5, 2)
    f = torch.cat([qf.repeat_interleave(8), kf.repeat_interleave(8), torch.ones(16, dtype=qf.dtype)]).float()
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for n in pa:
        if n.startswith("c_attn"):
            fs = f.view(-1, *([1] * (pa[n].ndim - 1)))
            # clipped rows: gamma * (W + u), W + u being what the optimizer without the clip gives
            torch.testing.assert_close(pa[n][:32], (fs * pb[n])[:32], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(pa[n][32:], pb[n][32:], rtol=1e-5, atol=1e-6)  # value rows
            assert not torch.equal(pa[n][:32], w0[n][:32])
        else:
            # outside the layout: unchanged by the clip (an AdamW group holding the bias runs its
            # chain rather than torch's fused kernel: the same arithmetic, rounded apart)
            torch.testing.assert_close(pa[n], pb[n], rtol=1e-6, atol=1e-7)
    if name != "TransformOptimizer":  # (its one AdamW group is fused without the clip)
        # a Muon matrix: without the clip its group runs Muon's lowering (torch.optim.Muon's
        # form of the update), with the clip the chain; the same arithmetic, rounded apart
        torch.testing.assert_close(pa["mlp.weight"], pb["mlp.weight"], rtol=1e-6, atol=1e-7)


def test_optimizer_matches_the_functional_chain():
    """TransformOptimizer(qk_clip=...) computes what chain(muon, qk_clip) computes with the
    recorder's statistics, bit for bit."""
    torch.manual_seed(0)
    m = _Attn()
    with torch.no_grad():
        m.c_attn.weight.mul_(8.0)
    rec = mfx.QKLogitRecorder()
    m.recorder = rec
    layout = {"attn": mfx.QKLayout.fused("c_attn.weight", heads=2, head_dim=8)}
    named = [(n, p) for n, p in m.named_parameters() if p.ndim == 2]
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.05, qk_clip=mfx.QKClip(rec, layout, tau=5.0))
    params = TensorDict({n: p.detach().clone() for n, p in named}, [])
    m(torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(4))).backward()
    grads = TensorDict({n: p.grad.clone() for n, p in named}, [])
    tx = mfx.chain(mfx.muon(lr=0.05), mfx.qk_clip(5.0, 0.5, layout))
    u, _ = tx.update(grads, tx.init(params), params, qk_logit_max=rec.maxima())
    want = mfx.apply_updates(params, u)
    opt.step()
    for n, p in named:
        assert torch.equal(p.detach(), want[n]), n


def test_option_errors_change_nothing():
    m, rec = _recording()
    bad = {"attn": mfx.QKLayout.fused("attn.c_attn.weight", heads=2, head_dim=8)}
    with pytest.raises(ValueError, match="does not hold.*attn.c_attn.weight"):
        mfx.create_hybrid_optimizer(m, qk_clip=mfx.QKClip(rec, bad))
    with pytest.raises(TypeError, match="QKClip"):
        mfx.create_hybrid_optimizer(m, qk_clip=5.0)
    opt = mfx.create_hybrid_optimizer(m, qk_clip=mfx.QKClip(rec, m.layout(), tau=5.0))
    m.recorder = None  # the model forgot to record
    m(torch.randint(0, 11, (2, 6))).backward()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"no attention logits recorded this step for \['attn'\]"):
        opt.step()
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())

    # another number of heads (a tensor-parallel rank's own heads, without tp_mesh): named
    m.recorder = rec
    rec.reset()
    rec.record_max("attn", torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"layer 'attn' recorded a number of heads other than 2: under tensor "
                                         r"parallelism.*tp_mesh=mesh\['tp'\]"):
        opt.step()
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())


def test_a_skipped_step_resets_the_recorder_and_clips_nothing_at_inf():
    m, rec = _recording()

    def skipping(lr: float = 0.1) -> mfx.GradientTransformation:
        return mfx.apply_if_finite(mfx.scale(-lr))

    opt = mfx.TransformOptimizer(m.named_parameters(), skipping, qk_clip=mfx.QKClip(rec, m.layout(), tau=5.0))
    m(torch.randint(0, 11, (2, 6))).backward()
    rec.record_max("attn", torch.tensor([float("inf"), 1.0]))  # an overflowed forward pass
    for p in m.parameters():
        p.grad.fill_(float("nan"))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt.step()
    assert torch.isneginf(rec.maxima()["attn"]).all()
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())


def test_optimizer_with_qk_clip_copies_and_pickles():
    import copy
    import pickle

    m, rec = _recording()
    opt = mfx.create_hybrid_optimizer(m, qk_clip=mfx.QKClip(rec, m.layout(), tau=5.0))
    m(torch.randint(0, 11, (2, 6))).backward()
    opt.step()
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.qk_clip.tau == 5.0 and set(other.qk_clip.layout) == {"attn"}
    sd = opt.state_dict()
    opt.load_state_dict(sd)


def test_a_group_in_pieces_clips_as_the_whole_group():
    """qk_clip is leafwise: a Muon group cut into pieces (a small batch budget) gets the
    statistics in every piece and computes what it computes whole."""
    results = []
    for budget in (None, 2048):
        old = mfx.linalg.set_batch_bytes(budget, "cpu")
        try:
            a, opt, rec, _, _ = _twins(lambda m, c: mfx.create_hybrid_optimizer(m, muon_lr=0.05, qk_clip=c)
                                       if c else None)
            a(torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(5))).backward()
            opt.step()
            muon_group = opt.plan.groups[0]
            results.append((muon_group.pieces, {n: p.detach().clone() for n, p in a.named_parameters()}))
        finally:
            mfx.linalg.set_batch_bytes(old, "cpu")
    (whole, ref), (pieces, got) = results
    assert whole is None and pieces is not None and len(pieces) > 1
    for n in ref:
        assert torch.equal(ref[n], got[n]), n


# ---------------------------------------------------------------------------
# muonfx train --qk-clip
# ---------------------------------------------------------------------------


def test_train_qk_clip_reports_and_bounds_the_logits(tmp_path, capsys):
    """muonfx train --qk-clip TAU on the built-in GPT: the per-head max logit in the progress
    line and summary.json; with tau below the first steps' logits, every head is clipped
    to tau and the next step starts near it."""
    import json

    from helpers import run_main

    args = ["train", "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4",
            "--context", "32", "--threads", "1", "--no-progress"]
    assert run_main(args + ["--log-max-logit", "--out", str(tmp_path / "plain")]) == 0
    assert run_main(args + ["--qk-clip", "1.0", "--out", str(tmp_path / "clip")]) == 0
    out = capsys.readouterr().out
    assert "| max logit " in out
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())["runs"]["muon_adamw"]
    clip = json.loads((tmp_path / "clip" / "summary.json").read_text())
    assert clip["settings"]["qk_clip"] == 1.0
    run = clip["runs"]["muon_adamw"]
    assert run["qk_clip"] == 1.0 and plain["qk_clip"] is None
    assert [s for s, _ in run["max_logit_curve"]] == [1, 2, 3, 4]
    assert set(run["final_max_logit_per_head"]) == {"h.0", "h.1", "h.2", "h.3"}
    assert all(len(v) == 4 for v in run["final_max_logit_per_head"].values())
    # the first step is measured before any clip: the same in both runs
    assert run["max_logit_curve"][0] == plain["max_logit_curve"][0] and plain["max_logit_curve"][0][1] > 1.0
    # after the clip the largest logit is tau plus one step's growth, below the run without
    assert run["max_logit_curve"][-1][1] < plain["max_logit_curve"][-1][1]


def test_fsdp_muon_optimizer_refuses_qk_clip_with_its_own_accumulation():
    m = _Attn()
    rec = mfx.QKLogitRecorder()
    with pytest.raises(ValueError, match="gradient_accumulation_steps > 1 would clip at every micro-batch"):
        mfx.FSDPMuonOptimizer(m, gradient_accumulation_steps=2, qk_clip=mfx.QKClip(rec, m.layout()))


@pytest.mark.slow
def test_compiled_step_clips_as_the_eager_one():
    """opt.compile(): the statistics are inputs of the compiled graph; the step ends where the
    eager one does, within the compiled-vs-eager rounding of the same optimizer without the
    clip (measured: 2.05e-6 on c_attn.weight, entries ~2, with and without the clip)."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        a, opt, rec, _, _ = _twins(lambda m, c: mfx.create_hybrid_optimizer(
            m, muon_lr=0.05, ns_dtype=torch.float32, qk_clip=c) if c else None)
        if compiled:
            opt.compile(backend="eager")
        a(torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(0))).backward()
        opt.step()
        assert compiled is False or all(g.path == "compiled" for g in opt.plan.groups), opt.plan
        assert torch.isneginf(rec.maxima()["attn"]).all()
        results.append({n: p.detach().clone() for n, p in a.named_parameters()})
    for n in results[0]:
        torch.testing.assert_close(results[1][n], results[0][n], rtol=1e-5, atol=1e-5)


def test_a_fused_layout_under_tensor_parallelism_is_refused():
    """ColwiseParallel cuts a fused QKV matrix into contiguous row blocks, not per head:
    refused up front, naming the layer, rather than clipping the wrong rows."""
    rec = mfx.QKLogitRecorder()
    layout = {"attn": mfx.QKLayout.fused("c_attn.weight", heads=2, head_dim=8)}
    with pytest.raises(ValueError, match=r"fused QKV layout under tensor parallelism.*\['attn'\]"):
        mfx.QKClip(rec, layout, tau=5.0, tp_mesh=object())
    mfx.QKClip(rec, layout, tau=5.0)  # without tensor parallelism: accepted
