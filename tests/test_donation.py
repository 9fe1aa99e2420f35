"""Buffer donation in the adapter: state buffers are reused in place, results unchanged."""

import math

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.base import donating, foreach, protect


def _opt(tx, shapes=((8, 4), (5,)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    named = [(f"p{i}", torch.nn.Parameter(torch.randn(*s, generator=gen))) for i, s in enumerate(shapes)]
    return mfx.TransformOptimizer(named, tx), named


def _grads(named, gen):
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("tx", [mfx.adamw, mfx.momentum, mfx.muon_adamw])
def test_state_buffers_are_reused_across_steps(tx):
    opt, named = _opt(tx)
    gen = torch.Generator().manual_seed(1)
    _grads(named, gen)
    opt.step()  # the first step allocates (and surfaces structural errors untouched)
    before = {n: {k: v.data_ptr() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
              for n, p in named}
    assert any(before.values())
    for _ in range(3):
        _grads(named, gen)
        opt.step()
    after = {n: {k: v.data_ptr() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for n, p in named}
    assert after == before


@pytest.mark.parametrize("make", [
    lambda: mfx.adamw(lr=1e-2, weight_decay=0.1),
    lambda: mfx.chain(mfx.momentum(0.9), mfx.scale_by_shape(), mfx.scale(-0.1)),
    lambda: mfx.muon(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
])
def test_donating_adapter_equals_allocating_adapter(make):
    results = []
    for donate in (True, False):
        opt, named = _opt(make(), shapes=((8, 4), (6, 6)))
        opt.donate_buffers = donate
        gen = torch.Generator().manual_seed(2)
        for _ in range(5):
            _grads(named, gen)
            opt.step()
        results.append([p.detach().clone() for _, p in named])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_skipped_step_keeps_the_inner_state_under_donation():
    opt, named = _opt(mfx.apply_if_finite(mfx.adamw(lr=1e-2), max_consecutive_errors=5))
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        _grads(named, gen)
        opt.step()
    snapshot = {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
                for n, p in named}
    params = [p.detach().clone() for _, p in named]
    _grads(named, gen)
    named[0][1].grad[0, 0] = math.nan
    opt.step()
    for (n, p), before in zip(named, params):
        assert torch.equal(p.detach(), before)
        for k, v in snapshot[n].items():
            now = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(now, v), (n, k)
            elif k not in ("notfinite_count", "last_finite", "total_notfinite", "count"):  # counters move
                assert now == v, (n, k)


def test_reuse_only_inside_donating_and_only_for_writable_tensors():
    a, b = torch.ones(4), torch.ones(4)
    out = foreach("mul", [a], 2.0, reuse=True)[0]
    assert out is not a and torch.equal(a, torch.ones(4))  # outside: never in place
    with donating([a]):
        out = foreach("mul", [a], 2.0, reuse=True)[0]
        assert out is a and torch.equal(a, torch.full((4,), 2.0))
        out_b = foreach("mul", [b], 2.0, reuse=True)[0]
        assert out_b is not b  # b was not donated
        fresh = foreach("add", [out_b], 1.0, reuse=True)[0]
        assert fresh is out_b  # results made inside the block are scratch
        protect([out_b])
        assert foreach("add", [out_b], 1.0, reuse=True)[0] is not out_b
    half = torch.ones(4, dtype=torch.bfloat16)
    with donating([half]):
        assert foreach("mul", [half], 0.01, reuse=True)[0] is not half  # bf16 never in place


def test_functional_update_stays_pure():
    tx = mfx.adamw(lr=1e-2, weight_decay=0.1)
    p = TensorDict({"w": torch.randn(4, 4)}, [])
    s = tx.init(p)
    g = TensorDict({"w": torch.randn(4, 4)}, [])
    copies = (p.clone(), g.clone(), s["adam"].mu.clone(), s["adam"].nu.clone())
    tx.update(g, s, p)
    for a, b in zip(copies, (p, g, s["adam"].mu, s["adam"].nu)):
        assert (a == b).all()


def test_lr_multiplier_does_not_scale_state_that_is_also_the_output():
    """Plain momentum returns its new state as the update; the adapter's lr multiplier
    must not scale that buffer in place (found by the law tests' review)."""
    results = []
    for donate in (True, False):
        w = torch.nn.Parameter(torch.zeros(3))
        opt = mfx.TransformOptimizer([("w", w)], mfx.momentum(0.9), lr=0.5)
        opt.donate_buffers = donate
        for _ in range(3):
            w.grad = torch.ones(3)
            opt.step()
        results.append(w.detach().clone())
    assert torch.equal(results[0], results[1])


def test_donated_grads_carry_the_whole_muon_update_in_place():
    """With the state and the gradients donated, every transform of Muon works in the
    gradient buffers (Newton-Schulz writes each same-shape group back as it finishes):
    the returned updates are the gradient tensors, with the pure result's values."""
    gen = torch.Generator().manual_seed(5)
    params = TensorDict({"a": torch.randn(16, 8, generator=gen), "b": torch.randn(16, 8, generator=gen),
                         "c": torch.randn(3, 6, 10, generator=gen)}, [])
    grads = params.apply(lambda t: torch.randn(t.shape, generator=gen))
    tx = mfx.muon(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    state = tx.init(params)
    want, want_state = tx.update(grads, state, params)
    donated_grads = grads.clone()
    donated_state = tx.init(params)
    with donating(list(donated_grads.values(True, True)) + list(donated_state["momentum"].mu.values(True, True))):
        got, got_state = tx.update(donated_grads, donated_state, params)
    for k in ("a", "b", "c"):
        assert got[k].data_ptr() == donated_grads[k].data_ptr()
        assert torch.equal(got[k], want[k])
        assert torch.equal(got_state["momentum"].mu[k], want_state["momentum"].mu[k])


@pytest.mark.parametrize("make, shapes", [
    (lambda: mfx.muon(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32), ((8, 4), (6, 6), (8, 4))),
    (lambda: mfx.muon(lr=0.02, nesterov=False, ns_dtype=torch.float32), ((8, 4), (6, 6), (2, 3, 4))),
    (lambda: mfx.muon_adamw(lr=0.02, ns_dtype=torch.float32), ((8, 4), (6, 6), (5,))),
])
def test_donate_grads_gives_the_same_training(make, shapes):
    results = []
    for donate_grads in (True, False):
        opt, named = _opt(make(), shapes=shapes)
        opt.donate_grads = donate_grads
        gen = torch.Generator().manual_seed(6)
        for _ in range(4):
            _grads(named, gen)
            opt.step()
        results.append([p.detach().clone() for _, p in named])
    for a, b in zip(*results):
        assert torch.equal(a, b)
