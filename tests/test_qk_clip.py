"""QK-clip: the arithmetic (its three laws on every supported layout), the recorder, the
refusals, and the optimizers' qk_clip= option."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.attention import max_logits
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
