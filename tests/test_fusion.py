"""Fused fast paths compute the plain path's function: the final scale folded into the
apply step, results written into dead buffers (``foreach(..., into=...)``)."""

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.base import (GradientTransformation, build, donating, final_scales, folding_final_scale, foreach,
                         key_str, leaves)
from muonfx.optim import lr_multiplier


def _td(shapes, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({k: torch.randn(*s, generator=gen) * scale for k, s in shapes.items()}, [])


SHAPES = {"w": (6, 4), "b": (5,), "m": (3, 3)}


def _run_folded(tx, grads, params):
    """What the adapter sees: the updates, the deferred factors, and the factor-applied result."""
    state = tx.init(params)
    with folding_final_scale(tx.update):
        upd, _ = tx.update(grads, state, params)
        keys, us = leaves(upd)
        scales = final_scales(us)
    keys = [key_str(k) for k in keys]
    applied = {k: params.get(k) + s * u for k, u, s in zip(keys, us, scales)}
    return dict(zip(keys, us)), dict(zip(keys, scales)), applied


def _plain(tx, grads, params):
    upd, _ = tx.update(grads, tx.init(params), params)
    return upd


def test_final_learning_rate_is_deferred_and_applies_the_same():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = mfx.adamw(lr=0.1, weight_decay=0.1)
    us, scales, applied = _run_folded(tx, grads, params)
    plain = _plain(tx, grads, params)
    assert set(scales.values()) == {-0.1}  # the lr multiply was deferred for every leaf
    for k in SHAPES:
        torch.testing.assert_close(us[k] * -0.1, plain.get(k))
        torch.testing.assert_close(applied[k], params.get(k) + plain.get(k))


def test_schedule_lr_is_deferred_with_its_current_value():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = mfx.chain(mfx.momentum(0.9), mfx.scale_by_learning_rate(mfx.schedules.linear(0.5, 0.0, 10)))
    _, scales, _ = _run_folded(tx, grads, params)
    assert set(scales.values()) == {-0.5}


def test_only_the_last_scale_of_a_chain_is_deferred():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = mfx.chain(mfx.scale(3.0), mfx.momentum(0.5), mfx.scale(-0.25))
    us, scales, applied = _run_folded(tx, grads, params)
    plain = _plain(tx, grads, params)
    assert set(scales.values()) == {-0.25}
    for k in SHAPES:
        torch.testing.assert_close(us[k] * -0.25, plain.get(k))  # the first scale ran, the last did not
        torch.testing.assert_close(applied[k], params.get(k) + plain.get(k))


def _doubling_wrapper(inner: GradientTransformation) -> GradientTransformation:
    """A user's wrapper that knows nothing of folding: it post-processes its inner output."""

    def update_fn(updates, state, params=None):
        out, state = inner.update(updates, state, params)
        keys, us = leaves(out)
        return build(keys, [2.0 * u for u in us]), state

    return GradientTransformation(inner.init, update_fn)


@pytest.mark.parametrize("wrap", [
    _doubling_wrapper,
    lambda tx: mfx.accumulate(tx, 1),
    lambda tx: mfx.apply_if_finite(tx, 3),
])
def test_nothing_is_deferred_through_a_wrapper_that_does_not_pass_the_token(wrap):
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = wrap(mfx.chain(mfx.momentum(0.9), mfx.scale(-0.1)))
    us, scales, _ = _run_folded(tx, grads, params)
    plain = _plain(tx, grads, params)
    assert set(scales.values()) == {1.0}
    for k in SHAPES:
        torch.testing.assert_close(us[k], plain.get(k), rtol=0, atol=0)


def test_partition_and_masked_defer_per_leaf():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = mfx.partition(
        {"mat": mfx.mask_by_ndim(mfx.chain(mfx.momentum(0.9), mfx.scale(-0.5)), 2),
         "vec": mfx.chain(mfx.scale_by_adam(), mfx.scale(-0.01))},
        lambda k, t: "mat" if t.ndim == 2 else "vec")
    us, scales, applied = _run_folded(tx, grads, params)
    plain = _plain(tx, grads, params)
    assert scales == {"w": -0.5, "m": -0.5, "b": -0.01}
    for k in SHAPES:
        torch.testing.assert_close(applied[k], params.get(k) + plain.get(k))
    # a leaf masked out of the inner chain passes through unscaled
    tx2 = mfx.mask_by_ndim(mfx.chain(mfx.momentum(0.9), mfx.scale(-0.5)), 2)
    us2, scales2, _ = _run_folded(tx2, grads, params)
    assert scales2["b"] == 1.0 and torch.equal(us2["b"], grads.get("b"))


def test_lr_multiplier_composes_with_a_deferred_scale():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    inner = mfx.chain(mfx.momentum(0.9), mfx.scale(-0.1))
    tx = lr_multiplier(inner)(lr=0.5)
    _, scales, applied = _run_folded(tx, grads, params)
    plain = _plain(tx, grads, params)
    assert all(v == pytest.approx(-0.05) for v in scales.values())
    for k in SHAPES:
        torch.testing.assert_close(applied[k], params.get(k) + plain.get(k))


def test_outside_an_adapter_nothing_is_deferred():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = mfx.adamw(lr=0.1, weight_decay=0.0)
    out, _ = tx.update(grads, tx.init(params), params)
    ref = mfx.scale_by_adam().update(grads, mfx.scale_by_adam().init(params))[0]
    for k in SHAPES:
        torch.testing.assert_close(out.get(k), -0.1 * ref.get(k))


@pytest.mark.parametrize("make", [
    lambda: mfx.adamw(lr=1e-2, weight_decay=0.1),
    lambda: mfx.muon_adamw(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
    lambda: mfx.chain(mfx.momentum(0.9, nesterov=True), mfx.scale_by_learning_rate(0.05)),
])
def test_adapter_with_folding_tracks_the_functional_loop(make):
    """10 steps through the adapter (fold, donation) against update + apply_updates."""
    shapes = {"w": (8, 4), "v": (6, 6), "b": (5,)}
    params = _td(shapes, 0)
    named = [(k, torch.nn.Parameter(params.get(k).clone())) for k in shapes]
    opt = mfx.TransformOptimizer(named, make())
    tx = make()
    ref, state = params.clone(), tx.init(params)
    for step in range(10):
        grads = _td(shapes, 100 + step)
        upd, state = tx.update(grads, state, ref)
        ref = mfx.apply_updates(ref, upd)
        for k, p in named:
            p.grad = grads.get(k).clone()
        opt.step()
    for k, p in named:
        torch.testing.assert_close(p.detach(), ref.get(k), rtol=1e-5, atol=1e-6)


# -- into ------------------------------------------------------------------------------


def test_into_is_ignored_outside_donation_unless_owned():
    a, d = torch.rand(4) + 1, torch.rand(4) + 1
    before = d.clone()
    out = foreach("div", [a], [d], into=[d])  # d is not ours and nothing is donated
    assert out[0].data_ptr() != d.data_ptr() and torch.equal(d, before)
    torch.testing.assert_close(out[0], a / d)
    out = foreach("div", [a], [d], into=[d], owned=True)
    assert out[0].data_ptr() == d.data_ptr()
    torch.testing.assert_close(out[0], a / before)


def test_into_writes_donated_buffers_and_only_matching_ones():
    v, g = torch.rand(3, 2), torch.rand(3, 2)
    with donating([g]):
        out = foreach("sqrt", [v], into=[g])
    assert out[0].data_ptr() == g.data_ptr()
    torch.testing.assert_close(out[0], v.sqrt())
    # wrong shape, a 16-bit dtype, or a tensor that is not donated: a fresh result
    for bad, donated in ((torch.rand(6), True), (torch.rand(3, 2, dtype=torch.bfloat16), True),
                         (torch.rand(3, 2), False)):
        with donating([bad] if donated else []):
            out = foreach("sqrt", [v], into=[bad])
        assert out[0].data_ptr() != bad.data_ptr()
        torch.testing.assert_close(out[0], v.sqrt())


def test_adam_computes_in_donated_gradients():
    params, grads = _td(SHAPES, 0), _td(SHAPES, 1)
    tx = mfx.scale_by_adam()
    state = tx.init(params)
    expected, _ = tx.update(grads.clone(), state, params)
    gs = [grads.get(k) for k in SHAPES]
    with donating(gs):
        out, _ = tx.update(grads, state, params)
    for k, g in zip(SHAPES, gs):
        assert out.get(k).data_ptr() == g.data_ptr()  # no fresh buffer: the grads were the scratch
        torch.testing.assert_close(out.get(k), expected.get(k))


# -- Newton-Schulz output layout -------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 40, 20), (3, 20, 40), (2, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_returns_a_fresh_contiguous_tensor_in_the_input_dtype(shape, dtype):
    from muonfx.linalg import newton_schulz_batched, resolve
    g = torch.randn(*shape)
    before = g.clone()
    out = newton_schulz_batched(g, resolve("keller", 5), dtype=dtype)
    assert out.dtype == g.dtype and out.shape == g.shape and out.is_contiguous()
    assert out.data_ptr() != g.data_ptr() and torch.equal(g, before)
    # the cast-and-lay-out in one pass gives the values of the plain cast
    ref = newton_schulz_batched(g.double(), resolve("keller", 5), dtype=dtype)
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=0)


def test_scaled_div_one_pass_form_equals_the_plain_form():
    from muonfx.base import scaled_div
    gen = torch.Generator().manual_seed(3)
    num = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    den = [torch.rand(5, 3, generator=gen) + 0.5, torch.rand(7, generator=gen) + 0.5]
    keep = [d.clone() for d in den]
    plain = scaled_div(num, den, 0.25)  # den not ours: fresh results, den untouched
    assert all(torch.equal(d, k) for d, k in zip(den, keep))
    fused = scaled_div(num, den, 0.25, overwrite_den=True)
    for f, d, p, n, k in zip(fused, den, plain, num, keep):
        assert f.data_ptr() == d.data_ptr()  # written into the denominator's buffer
        torch.testing.assert_close(f, p)
        torch.testing.assert_close(f, 0.25 * n / k)
    # a 16-bit denominator is not overwritten (in-place 16-bit arithmetic would round differently)
    den16 = [d.to(torch.bfloat16) for d in keep]
    out = scaled_div([n.to(torch.bfloat16) for n in num], den16, 0.25, overwrite_den=True)
    assert all(o.data_ptr() != d.data_ptr() for o, d in zip(out, den16))


@pytest.mark.parametrize("shape", [(5, 12, 20), (7, 20, 12)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_chunked_newton_schulz_equals_one_batch(shape, method):
    """Chunks are only a schedule: each matrix gets exactly the one-batch result."""
    from muonfx.linalg import newton_schulz_batched, resolve
    g = torch.randn(*shape, dtype=torch.float64)
    whole = newton_schulz_batched(g, resolve("polar_express", 5), method=method, chunk=shape[0])
    for chunk in (1, 2, 3):
        out = newton_schulz_batched(g, resolve("polar_express", 5), method=method, chunk=chunk)
        assert out.is_contiguous() and out.dtype == g.dtype
        torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="chunk"):
        newton_schulz_batched(g, resolve("keller", 5), chunk=0)


# -- seam batching -----------------------------------------------------------------------


def test_seam_batches_are_cache_sized_on_the_cpu_and_whole_elsewhere():
    from muonfx import seam
    calls = []

    def fn(batch):
        calls.append(batch.shape[0])
        return batch * 2

    small = [torch.randn(1, 64, 64) for _ in range(6)]           # 4096 elements each
    big = torch.randn(2, 1024, 1024)                              # above the limit: alone, uncopied
    limit = seam.CPU_BATCH_ELEMENTS
    seam.CPU_BATCH_ELEMENTS = 3 * 4096
    try:
        out = seam.local_map_matrices(fn, small + [big])
    finally:
        seam.CPU_BATCH_ELEMENTS = limit
    assert sorted(calls) == [2, 3, 3]  # 6 small stacks in batches of <= 3, the big one alone
    for o, s in zip(out, small + [big]):
        torch.testing.assert_close(o, s * 2)
    # another device: one batch per same-shape group
    calls.clear()
    meta = [torch.empty(1, 64, 64, device="meta") for _ in range(6)]
    seam.local_map_matrices(fn, meta)
    assert calls == [6]
