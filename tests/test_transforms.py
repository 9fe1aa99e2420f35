"""Unit tests of every transform, combinator, wrapper and schedule, against values
computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx import schedules


def td(**kw) -> TensorDict:
    return TensorDict(kw, [])


def t(*values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def keyset(x: TensorDict) -> set[str]:
    return {k if isinstance(k, str) else ".".join(k) for k in x.keys(include_nested=True, leaves_only=True)}


# ---------------------------------------------------------------------------
# momentum
# ---------------------------------------------------------------------------


def test_momentum_ema():
    tx = mfx.momentum(0.9)
    p = td(w=torch.zeros(2))
    s = tx.init(p)
    assert isinstance(s, mfx.MomentumState) and torch.equal(s.mu["w"], torch.zeros(2))
    out, s = tx.update(td(w=t(1.0, -2.0)), s)
    # m1 = 0.9 * 0 + 0.1 * g1
    assert torch.allclose(out["w"], t(0.1, -0.2))
    assert torch.allclose(s.mu["w"], t(0.1, -0.2))
    out, s = tx.update(td(w=t(2.0, 0.0)), s)
    # m2 = 0.9 * m1 + 0.1 * g2
    assert torch.allclose(out["w"], t(0.9 * 0.1 + 0.2, 0.9 * -0.2))
    assert torch.allclose(s.mu["w"], out["w"])


def test_momentum_nesterov():
    tx = mfx.momentum(0.9, nesterov=True)
    s = tx.init(td(w=torch.zeros(1)))
    out, s = tx.update(td(w=t(1.0)), s)
    # m1 = 0.1; out = lerp(g, m, 0.9) = 0.1 * g + 0.9 * m1 = 0.19
    assert out["w"].item() == pytest.approx(0.19, rel=1e-6)
    assert s.mu["w"].item() == pytest.approx(0.1, rel=1e-6)
    out, s = tx.update(td(w=t(2.0)), s)
    # m2 = 0.9 * 0.1 + 0.1 * 2 = 0.29; out = 0.1 * 2 + 0.9 * 0.29 = 0.461
    assert out["w"].item() == pytest.approx(0.461, rel=1e-6)
    assert s.mu["w"].item() == pytest.approx(0.29, rel=1e-6)
    # mfx.nesterov is the same transform
    tx2 = mfx.nesterov(0.9)
    s2 = tx2.init(td(w=torch.zeros(1)))
    _, s2 = tx2.update(td(w=t(1.0)), s2)
    out2, _ = tx2.update(td(w=t(2.0)), s2)
    assert torch.equal(out2["w"], out["w"])


def test_momentum_bf16_storage():
    tx = mfx.momentum(0.9, mu_dtype=torch.bfloat16)
    s = tx.init(td(w=torch.zeros(3)))
    assert s.mu["w"].dtype == torch.bfloat16
    g = t(1.0, 3.0, -7.0)
    out, s = tx.update(td(w=g), s)
    assert out["w"].dtype == torch.float32  # arithmetic in the update's dtype
    assert s.mu["w"].dtype == torch.bfloat16
    m1 = (0.1 * g)
    assert torch.allclose(out["w"], m1, rtol=1e-6)
    assert torch.equal(s.mu["w"], m1.to(torch.bfloat16))
    out, s = tx.update(td(w=g), s)
    # the second step starts from the bf16-rounded buffer
    want = 0.9 * m1.to(torch.bfloat16).float() + 0.1 * g
    assert torch.allclose(out["w"], want, rtol=1e-6)
    assert s.mu["w"].dtype == torch.bfloat16


def test_momentum_does_not_modify_inputs():
    tx = mfx.momentum(0.5, nesterov=True)
    g = td(w=t(1.0, 2.0))
    s = tx.init(g)
    _, s1 = tx.update(g, s)
    _, s2 = tx.update(g, s1)
    assert torch.equal(g["w"], t(1.0, 2.0))
    assert torch.equal(s.mu["w"], torch.zeros(2))
    assert torch.allclose(s1.mu["w"], t(0.5, 1.0))


# ---------------------------------------------------------------------------
# scalings
# ---------------------------------------------------------------------------


def test_scale():
    u = td(a=t(1.0, -2.0), b={"c": t(4.0)})
    out, s = mfx.scale(-0.5).update(u, mfx.scale(-0.5).init(u))
    assert s == mfx.EmptyState()
    assert out["a"].tolist() == [-0.5, 1.0] and out["b", "c"].tolist() == [-2.0]


def test_scale_by_learning_rate_float():
    tx = mfx.scale_by_learning_rate(0.1)
    u = td(w=t(2.0, -4.0))
    s = tx.init(u)
    out, s = tx.update(u, s)
    assert torch.allclose(out["w"], t(-0.2, 0.4))
    out, _ = tx.update(u, s)
    assert torch.allclose(out["w"], t(-0.2, 0.4))


def test_scale_by_learning_rate_schedule_counts():
    tx = mfx.scale_by_learning_rate(lambda count: 1.0 / (1 + int(count)))
    u = td(w=t(6.0))
    s = tx.init(u)
    assert s == mfx.ScaleByScheduleState(count=0)
    got = []
    for i in range(4):
        out, s = tx.update(u, s)
        got.append(out["w"].item())
        assert s.count == i + 1
    assert got == pytest.approx([-6.0, -3.0, -2.0, -1.5])


@pytest.mark.parametrize(
    "shape,original,rms,spectral",
    [
        ((16, 4), 2.0, 0.2 * 4, 2.0),  # tall: A=16, B=4
        ((4, 16), 1.0, 0.2 * 4, 0.5),  # wide
        ((9, 9), 1.0, 0.2 * 3, 1.0),  # square
        ((5, 8, 2), 2.0, 0.2 * math.sqrt(8), 2.0),  # 3-D stack: per matrix [8, 2]
        ((3, 2, 32), 1.0, 0.2 * math.sqrt(32), 0.25),  # 3-D stack of wide [2, 32]
        ((64, 16, 3, 3), 1.0, 0.2 * 12, math.sqrt(64 / 144)),  # conv: [64, 144]
        ((36, 1, 2, 2), 3.0, 0.2 * 6, 3.0),  # conv: [36, 4]
    ],
)
def test_scale_by_shape_modes(shape, original, rms, spectral):
    u = td(w=torch.ones(shape))
    for mode, want in [("original", original), ("match_rms_adamw", rms), ("spectral", spectral)]:
        out, _ = mfx.scale_by_shape(mode).update(u, None)
        assert out["w"].shape == torch.Size(shape)
        assert torch.allclose(out["w"], torch.full(shape, want)), (mode, shape)


def test_scale_by_shape_per_leaf():
    u = td(a=torch.ones(16, 4), b=torch.ones(4, 16), c={"d": torch.ones(25, 1)})
    out, _ = mfx.scale_by_shape().update(u, None)
    assert out["a"].unique().item() == 2.0
    assert out["b"].unique().item() == 1.0
    assert out["c", "d"].unique().item() == 5.0


def test_decoupled_decay_plain_and_zero():
    p = td(w=t(2.0, -4.0), b=t(1.0))
    u = td(w=t(1.0, 1.0), b=t(0.5))
    out, _ = mfx.decoupled_decay(0.1).update(u, None, p)
    assert torch.allclose(out["w"], t(1.2, 0.6)) and torch.allclose(out["b"], t(0.6))
    out, _ = mfx.decoupled_decay(0.0).update(u, None, p)
    assert torch.equal(out["w"], u["w"])


def test_decoupled_decay_with_mask_predicate():
    p = td(w=torch.full((2, 2), 2.0), b=t(3.0))
    u = p.apply(torch.zeros_like)
    seen = []

    def mask(key, tensor):
        seen.append(key)
        return tensor.ndim == 2

    tx = mfx.decoupled_decay(0.5, mask=mask)
    out, _ = tx.update(u, tx.init(p), p)
    assert torch.equal(out["w"], torch.full((2, 2), 1.0))
    assert torch.equal(out["b"], t(0.0))
    assert set(seen) >= {"w", "b"}


def test_decoupled_decay_with_tensordict_mask():
    p = td(layer={"weight": torch.full((2,), 2.0), "bias": torch.full((2,), 2.0)})
    u = p.apply(torch.ones_like)
    mask = td(layer={"weight": torch.tensor(True), "bias": torch.tensor(False)})
    tx = mfx.decoupled_decay(0.25, mask=mask)
    out, _ = tx.update(u, tx.init(p), p)
    assert torch.equal(out["layer", "weight"], torch.full((2,), 1.5))
    assert torch.equal(out["layer", "bias"], torch.ones(2))
    # a dict of dotted keys works the same
    tx = mfx.decoupled_decay(0.25, mask={"layer.weight": False, "layer.bias": True})
    out, _ = tx.update(u, tx.init(p), p)
    assert torch.equal(out["layer", "weight"], torch.ones(2))
    assert torch.equal(out["layer", "bias"], torch.full((2,), 1.5))


# ---------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------


def test_scale_by_adam_two_steps_by_hand():
    b1, b2, eps = 0.9, 0.999, 1e-8
    tx = mfx.scale_by_adam(b1, b2, eps)
    s = tx.init(td(w=torch.zeros(2)))
    assert s.count == 0
    g1, g2 = [1.0, -3.0], [-2.0, 0.5]
    m = [0.0, 0.0]
    v = [0.0, 0.0]
    for step, g in enumerate([g1, g2], start=1):
        out, s = tx.update(td(w=torch.tensor(g)), s)
        assert s.count == step
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        want = [(mi / (1 - b1**step)) / (math.sqrt(vi / (1 - b2**step)) + eps) for mi, vi in zip(m, v)]
        assert out["w"].tolist() == pytest.approx(want, rel=1e-5)
        assert s.mu["w"].tolist() == pytest.approx(m, rel=1e-6)
        assert s.nu["w"].tolist() == pytest.approx(v, rel=1e-6)
    # the first step is sign(g) (up to eps)
    out, _ = tx.update(td(w=t(5.0, -0.01)), tx.init(td(w=torch.zeros(2))))
    assert out["w"].tolist() == pytest.approx([1.0, -1.0], rel=1e-5)


def test_scale_by_adam_mu_dtype():
    tx = mfx.scale_by_adam(mu_dtype=torch.bfloat16)
    s = tx.init(td(w=torch.zeros(3)))
    assert s.mu["w"].dtype == torch.bfloat16 and s.nu["w"].dtype == torch.bfloat16
    out, s = tx.update(td(w=t(1.0, 2.0, 3.0)), s)
    assert out["w"].dtype == torch.float32 and s.mu["w"].dtype == torch.bfloat16


def test_adamw_is_adam_plus_decay_times_lr():
    p = td(w=t(2.0))
    tx = mfx.adamw(lr=0.1, weight_decay=0.5)
    out, s = tx.update(td(w=t(3.0)), tx.init(p), p)
    # -lr * (adam + wd * p) = -0.1 * (1 + 1)
    assert out["w"].item() == pytest.approx(-0.2, rel=1e-6)
    assert sorted(s) == ["adam", "lr", "weight_decay"]


# ---------------------------------------------------------------------------
# clipping
# ---------------------------------------------------------------------------


def test_clip_by_global_norm_clips():
    u = td(a=t(3.0), b={"c": t(0.0, 4.0)})
    assert mfx.global_norm(u).item() == pytest.approx(5.0)
    out, _ = mfx.clip_by_global_norm(1.0).update(u, None)
    assert out["a"].tolist() == pytest.approx([0.6])
    assert out["b", "c"].tolist() == pytest.approx([0.0, 0.8])
    assert mfx.global_norm(out).item() == pytest.approx(1.0, rel=1e-6)


def test_clip_by_global_norm_identity_under_the_norm():
    gen = torch.Generator().manual_seed(0)
    u = td(a=torch.randn(5, 3, generator=gen), b=torch.randn(7, generator=gen).to(torch.bfloat16))
    n = mfx.global_norm(u).item()
    for max_norm in (n * 1.01, n * 10, 0.3 + n):
        out, _ = mfx.clip_by_global_norm(max_norm).update(u, None)
        assert torch.equal(out["a"], u["a"])  # exact, not approximate
        assert torch.equal(out["b"], u["b"]) and out["b"].dtype == torch.bfloat16


def test_clip_by_global_norm_mixed_dtypes():
    u = td(a=t(3.0), b=torch.tensor([4.0], dtype=torch.bfloat16))
    out, _ = mfx.clip_by_global_norm(2.5).update(u, None)
    assert out["a"].item() == pytest.approx(1.5)
    assert out["b"].dtype == torch.bfloat16 and out["b"].item() == pytest.approx(2.0, rel=1e-2)


# ---------------------------------------------------------------------------
# masked / mask_by_ndim / partition
# ---------------------------------------------------------------------------


def test_masked_state_only_for_selected_leaves():
    p = td(w=torch.ones(2, 2), b=torch.ones(2), s=torch.ones(()))
    tx = mfx.masked(mfx.momentum(0.5), lambda key, x: key != "b")
    s = tx.init(p)
    assert isinstance(s, mfx.MaskedState)
    assert keyset(s.inner_state.mu) == {"w", "s"}
    out, s = tx.update(p, s, p)
    assert torch.equal(out["b"], p["b"])  # passed through unchanged
    assert torch.allclose(out["w"], torch.full((2, 2), 0.5))
    assert keyset(s.inner_state.mu) == {"w", "s"}


def test_masked_all_false_is_identity():
    p = td(w=torch.ones(2, 2))
    tx = mfx.masked(mfx.scale(0.0), lambda k, x: False)
    out, s = tx.update(p, tx.init(p), p)
    assert torch.equal(out["w"], p["w"])


def test_mask_by_ndim_state_structure():
    p = td(w=torch.ones(4, 3), e=torch.ones(2, 4, 3), b=torch.ones(4), c=torch.ones(2, 1, 3, 3))
    tx = mfx.mask_by_ndim(mfx.chain(mfx.momentum(0.9), mfx.newton_schulz()), {2, 3, 4})
    s = tx.init(p)
    assert keyset(s.inner_state[0].mu) == {"w", "e", "c"}
    g = p.apply(lambda x: torch.randn(x.shape))
    out, _ = tx.update(g, s, p)
    assert torch.equal(out["b"], g["b"])
    assert keyset(out) == {"w", "e", "b", "c"}
    tx = mfx.mask_by_ndim(mfx.momentum(), 1)
    assert keyset(tx.init(p).inner_state.mu) == {"b"}


def _labelled_params():
    return td(layer={"weight": torch.full((3, 2), 1.0), "bias": torch.full((3,), 1.0)}, head=torch.full((2, 2), 1.0))


@pytest.mark.parametrize(
    "labels",
    [
        lambda key, x: "a" if key.endswith("weight") else "b",
        {"layer.weight": "a", "layer.bias": "b", "head": "b"},
        {("layer", "weight"): "a", ("layer", "bias"): "b", "head": "b"},
        TensorDict({"layer": {"weight": "a", "bias": "b"}, "head": "b"}, []),
    ],
    ids=["function", "dotted-dict", "tuple-dict", "tensordict"],
)
def test_partition_routes_and_splits_state(labels):
    p = _labelled_params()
    tx = mfx.partition({"a": mfx.chain(mfx.momentum(0.5), mfx.scale(2.0)), "b": mfx.scale(-1.0)}, labels)
    s = tx.init(p)
    assert isinstance(s, mfx.PartitionState) and set(s.inner_states) == {"a", "b"}
    assert keyset(s.inner_states["a"][0].mu) == {"layer.weight"}
    assert s.inner_states["b"] == mfx.EmptyState()
    out, s = tx.update(p, s, p)
    assert torch.equal(out["layer", "weight"], torch.full((3, 2), 1.0))  # 2 * 0.5 * 1
    assert torch.equal(out["layer", "bias"], torch.full((3,), -1.0))
    assert torch.equal(out["head"], torch.full((2, 2), -1.0))
    assert list(out.keys(True, True)) == list(p.keys(True, True))  # order kept


def test_partition_with_tensordict_of_int_labels():
    p = _labelled_params()
    labels = td(layer={"weight": torch.tensor(0), "bias": torch.tensor(1)}, head=torch.tensor(1))
    tx = mfx.partition({0: mfx.scale(3.0), 1: mfx.scale(0.0)}, labels)
    out, _ = tx.update(p, tx.init(p), p)
    assert out["layer", "weight"].unique().item() == 3.0 and out["head"].unique().item() == 0.0


def test_partition_label_spec_may_cover_more_keys():
    p = _labelled_params()
    labels = {"layer.weight": "a", "layer.bias": "b", "head": "b", "unused.weight": "a"}
    tx = mfx.partition({"a": mfx.scale(2.0), "b": mfx.scale(1.0)}, labels)
    out, _ = tx.update(p, tx.init(p), p)
    assert out["layer", "weight"].unique().item() == 2.0


def test_partition_empty_share_still_initialised():
    p = td(w=torch.ones(2, 2))
    tx = mfx.partition({"m": mfx.momentum(), "a": mfx.scale_by_adam()}, lambda k, x: "m")
    s = tx.init(p)
    assert keyset(s.inner_states["a"].mu) == set()
    out, s2 = tx.update(p, s, p)
    assert s2.inner_states["a"].count == 1 and keyset(out) == {"w"}


# ---------------------------------------------------------------------------
# named_chain
# ---------------------------------------------------------------------------


def test_named_chain_state_by_name():
    p = td(w=torch.zeros(2))
    tx = mfx.named_chain(("momentum", mfx.momentum(0.5)), ("lr", mfx.scale_by_learning_rate(0.1)))
    s = tx.init(p)
    assert list(s) == ["momentum", "lr"]
    out, s = tx.update(td(w=t(1.0, 2.0)), s, p)
    assert torch.allclose(out["w"], t(-0.05, -0.1))
    assert torch.allclose(s["momentum"].mu["w"], t(0.5, 1.0))
    # state can be edited by name
    s["momentum"] = mfx.MomentumState(td(w=t(10.0, 10.0)))
    out, s = tx.update(td(w=t(0.0, 0.0)), s, p)
    assert torch.allclose(out["w"], t(-0.5, -0.5))


def test_preset_chain_names():
    p = td(w=torch.zeros(3, 3))
    assert list(mfx.muon().init(p)) == ["momentum", "orthogonalize", "scale_by_shape", "weight_decay", "lr"]
    assert list(mfx.adamw().init(p)) == ["adam", "weight_decay", "lr"]


def test_chain_identity_and_order():
    u = td(w=t(1.0))
    out, s = mfx.chain().update(u, mfx.chain().init(u))
    assert torch.equal(out["w"], u["w"]) and s == ()
    tx = mfx.chain(mfx.identity(), mfx.scale(2.0), mfx.decoupled_decay(1.0))
    out, _ = tx.update(u, tx.init(u), td(w=t(5.0)))
    assert out["w"].item() == 7.0  # 2 * 1 + 5: scale first, then decay


# ---------------------------------------------------------------------------
# apply_if_finite
# ---------------------------------------------------------------------------


def test_apply_if_finite():
    tx = mfx.apply_if_finite(mfx.momentum(0.5), max_consecutive_errors=2)
    p = td(w=torch.zeros(2))
    s = tx.init(p)
    assert s == mfx.ApplyIfFiniteState(0, True, 0, s.inner_state)
    out, s = tx.update(td(w=t(1.0, 1.0)), s)
    assert torch.allclose(out["w"], t(0.5, 0.5))
    inner = s.inner_state
    nan = td(w=t(float("nan"), 1.0))
    # a NaN step: zero update, inner state kept, counters up
    out, s = tx.update(nan, s)
    assert torch.equal(out["w"], torch.zeros(2))
    assert s.inner_state is inner
    assert (s.notfinite_count, s.last_finite, s.total_notfinite) == (1, False, 1)
    # a good step resets the consecutive count only
    out, s = tx.update(td(w=t(1.0, 1.0)), s)
    assert torch.allclose(out["w"], t(0.75, 0.75))
    assert (s.notfinite_count, s.last_finite, s.total_notfinite) == (0, True, 1)
    # two bad steps are skipped; the third consecutive one passes (max_consecutive_errors=2)
    inf = td(w=t(float("inf"), 0.0))
    for i in (1, 2):
        out, s = tx.update(inf, s)
        assert torch.equal(out["w"], torch.zeros(2)) and s.notfinite_count == i
    out, s = tx.update(inf, s)
    assert not math.isfinite(out["w"][0].item())  # lerp(m, inf, 0.5) is nan
    assert out["w"][1].item() == pytest.approx(0.375)
    assert (s.notfinite_count, s.last_finite, s.total_notfinite) == (3, False, 4)
    assert not math.isfinite(s.inner_state.mu["w"][0].item())  # the inner state moved on


def test_apply_if_finite_checks_the_output():
    """NaN produced inside the inner transform (not in the gradient) also skips the step."""
    tx = mfx.apply_if_finite(mfx.chain(mfx.scale(0.0), mfx.scale_by_learning_rate(lambda c: 1.0)), 1)
    s = tx.init(td(w=torch.zeros(1)))
    out, s = tx.update(td(w=t(float("inf"))), s)  # 0 * inf = nan
    assert out["w"].item() == 0.0 and s.notfinite_count == 1
    assert s.inner_state[1].count == 0  # schedule count not advanced


# ---------------------------------------------------------------------------
# accumulate
# ---------------------------------------------------------------------------


def test_accumulate_every_3():
    tx = mfx.accumulate(mfx.momentum(0.5), every_k=3)
    p = td(w=torch.zeros(2))
    s = tx.init(p)
    assert s.mini_step == 0 and torch.equal(s.acc["w"], torch.zeros(2))
    out, s = tx.update(td(w=t(1.0, 0.0)), s)
    assert torch.equal(out["w"], torch.zeros(2)) and s.mini_step == 1
    assert torch.equal(s.acc["w"], t(1.0, 0.0))
    out, s = tx.update(td(w=t(2.0, 3.0)), s)
    assert torch.equal(out["w"], torch.zeros(2)) and s.mini_step == 2
    assert torch.equal(s.acc["w"], t(3.0, 3.0))
    assert torch.equal(s.inner_state.mu["w"], torch.zeros(2))  # inner untouched so far
    out, s = tx.update(td(w=t(6.0, 0.0)), s)
    # mean = (3, 1); momentum 0.5 from zero: 0.5 * mean
    assert torch.allclose(out["w"], t(1.5, 0.5))
    assert s.mini_step == 0 and torch.equal(s.acc["w"], torch.zeros(2))  # reset
    # the next cycle continues the inner state
    for g in ([3.0, 1.0], [3.0, 1.0]):
        out, s = tx.update(td(w=torch.tensor(g)), s)
        assert torch.equal(out["w"], torch.zeros(2))
    out, s = tx.update(td(w=t(3.0, 1.0)), s)
    assert torch.allclose(out["w"], t(0.5 * 1.5 + 0.5 * 3.0, 0.5 * 0.5 + 0.5 * 1.0))


def test_accumulate_bf16_grads_sum_in_float32():
    tx = mfx.accumulate(mfx.scale(1.0), every_k=2)
    p = td(w=torch.zeros(1, dtype=torch.bfloat16))
    s = tx.init(p)
    assert s.acc["w"].dtype == torch.float32
    out, s = tx.update(td(w=torch.tensor([1.0], dtype=torch.bfloat16)), s)
    assert out["w"].dtype == torch.bfloat16
    out, s = tx.update(td(w=torch.tensor([2.0], dtype=torch.bfloat16)), s)
    assert out["w"].dtype == torch.bfloat16 and out["w"].item() == 1.5


def _run_side_by_side(a, b, shape, seed, steps=3):
    """Run ``a`` and ``b`` on the same params and gradients; assert equal updates each
    step and return both final states."""
    gen = torch.Generator().manual_seed(seed)
    p = td(w=torch.randn(*shape, generator=gen))
    sa, sb = a.init(p), b.init(p)
    for _ in range(steps):
        g = td(w=torch.randn(*shape, generator=gen))
        ua, sa = a.update(g, sa, p)
        ub, sb = b.update(g, sb, p)
        assert torch.equal(ua["w"], ub["w"])
    return sa, sb


def test_accumulate_one_is_inner():
    _run_side_by_side(mfx.accumulate(mfx.adamw(), 1), mfx.adamw(), (4, 6), seed=1)


# ---------------------------------------------------------------------------
# inject_hyperparams
# ---------------------------------------------------------------------------


def test_inject_hyperparams_readable_and_writable():
    p = td(w=t(1.0, -1.0))
    g = td(w=t(2.0, 2.0))
    tx = mfx.inject_hyperparams(mfx.adamw)(lr=0.1, weight_decay=0.0)
    s = tx.init(p)
    assert isinstance(s, mfx.InjectHyperparamsState)
    assert s.hyperparams == {"lr": 0.1, "weight_decay": 0.0} and s.count == 0
    out, s = tx.update(g, s, p)
    assert out["w"].tolist() == pytest.approx([-0.1, -0.1], rel=1e-6)
    assert s.count == 1
    # writing the lr between steps changes the next step
    s.hyperparams["lr"] = 0.01
    out, s = tx.update(g, s, p)
    assert out["w"].tolist() == pytest.approx([-0.01, -0.01], rel=1e-5)
    assert s.hyperparams["lr"] == 0.01
    s.hyperparams["weight_decay"] = 1.0
    out, s = tx.update(g, s, p)
    # adam direction 1 (constant grads) + wd * p, times -lr
    assert out["w"].tolist() == pytest.approx([-0.01 * 2.0, -0.01 * 0.0], rel=1e-5, abs=1e-8)


def test_inject_hyperparams_matches_plain_transform():
    a = mfx.inject_hyperparams(mfx.muon)(lr=0.02, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    b = mfx.muon(lr=0.02, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    sa, sb = _run_side_by_side(a, b, (6, 4), seed=2)
    assert torch.equal(sa.inner_state["momentum"].mu["w"], sb["momentum"].mu["w"])


def test_inject_hyperparams_momentum_warmup_schedule():
    """nanochat's momentum warm-up 0.85 -> 0.95 over 300 steps."""
    p = td(w=torch.randn(2, 2))
    tx = mfx.inject_hyperparams(mfx.muon)(lr=0.02, momentum=schedules.linear(0.85, 0.95, 300))
    s = tx.init(p)
    assert s.hyperparams["momentum"] == pytest.approx(0.85)
    seen = {}
    for step in range(302):
        _, s = tx.update(p, s, p)  # evaluates the schedule at `step`
        seen[step] = s.hyperparams["momentum"]
        assert s.count == step + 1
    assert seen[0] == pytest.approx(0.85)
    assert seen[150] == pytest.approx(0.90)
    assert seen[300] == pytest.approx(0.95) and seen[301] == pytest.approx(0.95)
    assert s.hyperparams["lr"] == 0.02


def test_inject_hyperparams_schedule_drives_inner_transform():
    tx = mfx.inject_hyperparams(mfx.momentum)(beta=schedules.linear(0.5, 0.0, 2))
    s = tx.init(td(w=torch.zeros(1)))
    got = []
    for _ in range(3):
        out, s = tx.update(td(w=t(1.0)), s)
        got.append(out["w"].item())
    # beta 0.5: m = 0.5; beta 0.25: m = 0.25 * 0.5 + 0.75 = 0.875; beta 0: m = 1
    assert got == pytest.approx([0.5, 0.875, 1.0])


def test_inject_hyperparams_static_args():
    tx = mfx.inject_hyperparams(mfx.muon, static_args=("ns_steps",))(lr=0.02, ns_steps=3)
    s = tx.init(td(w=torch.ones(2, 2)))
    assert "ns_steps" not in s.hyperparams and "lr" in s.hyperparams


# ---------------------------------------------------------------------------
# schedules
# ---------------------------------------------------------------------------


def test_constant_schedule():
    s = schedules.constant(0.3)
    assert s(0) == 0.3 and s(10**6) == 0.3 and s(torch.tensor(5)) == 0.3


def test_linear_schedule():
    s = schedules.linear(1.0, 0.0, 10)
    assert [s(i) for i in (0, 5, 10, 20)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    s = schedules.linear(0.0, 2.0, 4, transition_begin=10)
    assert [s(i) for i in (0, 10, 11, 14, 100)] == pytest.approx([0.0, 0.0, 0.5, 2.0, 2.0])
    s = schedules.linear(1.0, 3.0, 0, transition_begin=5)
    assert (s(4), s(5)) == (1.0, 3.0)


def test_cosine_decay_schedule():
    s = schedules.cosine_decay(2.0, 100)
    assert [s(i) for i in (0, 50, 100, 150)] == pytest.approx([2.0, 1.0, 0.0, 0.0], abs=1e-12)
    assert s(25) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi / 4)))
    s = schedules.cosine_decay(2.0, 100, alpha=0.1)
    assert [s(0), s(50), s(100), s(1000)] == pytest.approx([2.0, 1.1, 0.2, 0.2])


def test_warmup_cosine_decay_schedule():
    s = schedules.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=110)
    assert [s(i) for i in (0, 5, 10, 60, 110, 200)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-12)
    s = schedules.warmup_cosine_decay(0.1, 1.0, warmup_steps=10, decay_steps=110, end_value=0.2)
    assert [s(0), s(10), s(60), s(110)] == pytest.approx([0.1, 1.0, 0.6, 0.2])


def test_join_schedules_boundaries():
    s = schedules.join([schedules.constant(1.0), schedules.linear(2.0, 0.0, 10), schedules.constant(-1.0)],
                       [5, 15])
    # each piece sees the step count relative to its start
    assert [s(i) for i in (0, 4, 5, 10, 14, 15, 100)] == pytest.approx([1.0, 1.0, 2.0, 1.0, 0.2, -1.0, -1.0])
    assert s(torch.tensor(10)) == pytest.approx(1.0)


def test_schedules_are_picklable():
    import pickle

    s = schedules.warmup_cosine_decay(0.0, 1.0, 10, 110)
    assert pickle.loads(pickle.dumps(s))(60) == pytest.approx(s(60))


# ---------------------------------------------------------------------------
# nested keys, muon_adamw
# ---------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = torch.nn.Linear(d, 3 * d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.norm = torch.nn.LayerNorm(d)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([Block(d), Block(d)])
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)


def test_default_muon_labels():
    cases = {
        "embed.weight": ((11, 8), "adamw"),
        "tok_embeddings.weight": ((11, 8), "adamw"),
        "transformer.wte.weight": ((11, 8), "adamw"),
        "transformer.wpe.weight": ((11, 8), "adamw"),
        "model.embedding.weight": ((11, 8), "adamw"),
        "lm_head.weight": ((11, 8), "adamw"),
        "head.weight": ((11, 8), "adamw"),
        "output.weight": ((11, 8), "adamw"),
        "classifier.weight": ((3, 8), "adamw"),
        "layers.0.attn.bias": ((24,), "adamw"),
        "layers.0.norm.weight": ((8,), "adamw"),
        "scale": ((), "adamw"),
        "layers.0.attn.weight": ((24, 8), "muon"),
        "layers.0.mlp.0.weight": ((16, 8), "muon"),
        "layers.0.output_proj.weight": ((8, 8), "muon"),
        "layers.0.heads_proj.weight": ((8, 8), "muon"),
        "experts.w1": ((4, 16, 8), "muon"),
        "conv.weight": ((8, 3, 3, 3), "muon"),
    }
    for key, (shape, want) in cases.items():
        assert mfx.default_muon_labels(key, torch.zeros(shape)) == want, key


def test_muon_adamw_on_nested_module():
    torch.manual_seed(0)
    model = TinyLM()
    params = TensorDict.from_module(model).detach().clone()
    assert ("layers", "0", "mlp", "0", "weight") in params.keys(True, True)
    tx = mfx.muon_adamw(lr=0.02, adamw_lr=1e-3, weight_decay=0.1, ns_dtype=torch.float32)
    s = tx.init(params)
    muon_keys = keyset(s.inner_states["muon"]["momentum"].mu)
    adam_keys = keyset(s.inner_states["adamw"]["adam"].mu)
    hidden = {f"layers.{i}.{n}.weight" for i in range(2) for n in ("attn", "mlp.0", "mlp.2")}
    assert muon_keys == hidden
    assert adam_keys == keyset(params) - hidden
    assert {"embed.weight", "lm_head.weight", "norm.weight", "norm.bias", "layers.0.attn.bias",
            "layers.1.norm.weight", "layers.1.mlp.2.bias"} <= adam_keys

    gen = torch.Generator().manual_seed(3)
    grads = params.apply(lambda x: torch.randn(x.shape, generator=gen))
    out, s = tx.update(grads, s, params)
    assert keyset(out) == keyset(params)

    # each share equals the standalone optimizer on that share
    def share(x, keys):
        return TensorDict({tuple(k.split(".")): x[tuple(k.split("."))] for k in sorted(keys)}, [])

    m = mfx.muon(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    mu_out, _ = m.update(share(grads, hidden), m.init(share(params, hidden)), share(params, hidden))
    a = mfx.adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ad_out, _ = a.update(share(grads, adam_keys), a.init(share(params, adam_keys)), share(params, adam_keys))
    for k in hidden:
        assert torch.equal(out[tuple(k.split("."))], mu_out[tuple(k.split("."))]), k
    for k in adam_keys:
        assert torch.equal(out[tuple(k.split("."))], ad_out[tuple(k.split("."))]), k

    new = mfx.apply_updates(params, out)
    assert keyset(new) == keyset(params)
    # load back into the module
    new.to_module(model)
    assert torch.equal(model.layers[1].mlp[2].weight, new["layers", "1", "mlp", "2", "weight"])


def test_muon_adamw_custom_labels():
    p = td(a=torch.ones(4, 4), b=torch.ones(4, 4))
    tx = mfx.muon_adamw(labels=lambda key, x: "adamw" if key == "a" else "muon")
    s = tx.init(p)
    assert keyset(s.inner_states["muon"]["momentum"].mu) == {"b"}
    assert keyset(s.inner_states["adamw"]["adam"].mu) == {"a"}


def test_apply_updates_keeps_param_dtype_and_inputs():
    p = td(w=torch.ones(2, dtype=torch.bfloat16), v={"x": torch.ones(1, dtype=torch.float64)})
    u = td(w=torch.full((2,), 0.5), v={"x": torch.full((1,), 0.25, dtype=torch.float64)})
    new = mfx.apply_updates(p, u)
    assert new["w"].dtype == torch.bfloat16 and new["w"].tolist() == [1.5, 1.5]
    assert new["v", "x"].dtype == torch.float64 and new["v", "x"].item() == 1.25
    assert p["w"].tolist() == [1.0, 1.0]
