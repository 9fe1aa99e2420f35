"""The extra arguments of a call (optax's ``GradientTransformationExtraArgs``): a
transform whose update takes ``**extra_args`` receives them through every combinator,
wrapper and the adapter's step (whole, in pieces, compiled); the others never see them."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.core import EmptyState, GradientTransformation, leafwise, takes_extra_args, with_extra_args_support


def times(name: str = "k", seen: list | None = None) -> GradientTransformation:
    """Multiplies every update by the extra argument ``name`` (required: a missing one raises)."""

    def update_fn(updates, state, params=None, **extra_args):
        k = extra_args[name]
        if seen is not None:
            seen.append(k)
        return updates.apply(lambda u: u * k), state

    return leafwise(GradientTransformation(lambda p: EmptyState(), update_fn))


def _td(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}, [])


def test_which_transforms_take_extra_args():
    assert not takes_extra_args(mfx.scale(2.0))
    assert takes_extra_args(times())
    for tx in (mfx.chain(mfx.scale(2.0)), mfx.named_chain(("a", mfx.scale(2.0))), mfx.masked(mfx.scale(2.0), {}),
               mfx.partition({"a": mfx.scale(2.0)}, lambda k, t: "a"), mfx.blockwise(mfx.scale(2.0), 1),
               mfx.apply_if_finite(mfx.scale(2.0)), mfx.accumulate(mfx.scale(2.0), 2),
               mfx.inject_hyperparams(mfx.scale)(2.0), mfx.lr_multiplier(mfx.scale(2.0))(lr=0.5)):
        assert takes_extra_args(tx)
    wrapped = with_extra_args_support(mfx.scale(2.0))
    assert takes_extra_args(wrapped) and mfx.is_leafwise(wrapped)
    t = times()
    assert with_extra_args_support(t) is t
    with pytest.raises(TypeError, match="with_extra_args_support"):
        with_extra_args_support(lambda u, s: (u, s))


@pytest.mark.parametrize("build", [
    lambda t: mfx.chain(mfx.scale(3.0), t),
    lambda t: mfx.named_chain(("s", mfx.scale(3.0)), ("t", t)),
    lambda t: mfx.masked(mfx.chain(mfx.scale(3.0), t), lambda k, x: True),
    lambda t: mfx.mask_by_ndim(mfx.chain(mfx.scale(3.0), t), {1, 2}),
    lambda t: mfx.partition({"m": mfx.chain(t, mfx.scale(3.0)), "v": mfx.chain(mfx.scale(3.0), t)},
                            lambda k, x: "m" if k == "w" else "v"),
    lambda t: mfx.blockwise(mfx.chain(mfx.scale(3.0), t), 1),
    lambda t: mfx.apply_if_finite(mfx.chain(mfx.scale(3.0), t)),
    lambda t: mfx.accumulate(mfx.chain(mfx.scale(3.0), t), 1),
    lambda t: mfx.inject_hyperparams(lambda factor=3.0: mfx.chain(mfx.scale(factor), t))(factor=3.0),
    lambda t: mfx.lr_multiplier(mfx.chain(mfx.scale(3.0), t))(lr=1.0),
], ids=["chain", "named_chain", "masked", "mask_by_ndim", "partition", "blockwise", "apply_if_finite",
        "accumulate", "inject_hyperparams", "lr_multiplier"])
def test_extra_args_reach_the_inner_transform(build):
    seen: list = []
    tx = build(times(seen=seen))
    k = torch.tensor(0.5)
    u = TensorDict({"w": _td()["w"], "v": torch.randn(2, 5)}, [])  # matrices (blockwise takes no vectors)
    params = u.apply(torch.zeros_like)
    out, _ = tx.update(u, tx.init(params), params, k=k, other="ignored")
    assert seen and all(s is k for s in seen)
    for key in u.keys():
        torch.testing.assert_close(out[key], u[key] * 1.5, rtol=0, atol=0)


def test_transforms_without_extra_args_are_unaffected():
    u = _td()
    tx = mfx.chain(mfx.momentum(0.9), mfx.scale(-0.1))
    a, sa = tx.update(u, tx.init(u), u)
    b, sb = tx.update(u, tx.init(u), u, k=torch.tensor(2.0), anything=object())
    for key in u.keys():
        assert torch.equal(a[key], b[key])
    with pytest.raises(KeyError):  # the transform that needs one, called without it
        mfx.chain(times()).update(u, (EmptyState(),), u)


SHAPES = {f"w{i}": (16, 24) for i in range(4)}


def _named(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in SHAPES.items()]


def _run(opt, named, steps, extra=lambda step: {}):
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step(**extra(step))
    return [p.detach().clone() for _, p in named]


def _factory_with(t):
    def factory(lr: float = 0.1, momentum: float = 0.9):
        return mfx.chain(mfx.momentum(momentum), t, mfx.scale_by_learning_rate(lr))
    return factory


def _reference(steps):
    """The same steps with the extra argument's values built into the chain."""
    named = _named()

    def factory(lr: float = 0.1, momentum: float = 0.9, k: float = 1.0):
        return mfx.chain(mfx.momentum(momentum), mfx.scale(k), mfx.scale_by_learning_rate(lr))

    opt = mfx.TransformOptimizer(named, factory, k=1.0)
    for step in range(steps):
        opt.param_groups[0]["k"] = 1.0 + step
        gen = torch.Generator().manual_seed(100 + step)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for _, p in named]


@pytest.mark.parametrize("how", ["whole", "pieces", "prebuilt"])
def test_optimizer_step_passes_extra_args(how):
    named = _named()
    seen: list = []
    if how == "prebuilt":
        tx = mfx.chain(mfx.momentum(0.9), times(seen=seen), mfx.scale_by_learning_rate(0.1))
        opt = mfx.TransformOptimizer(named, tx)
    else:
        opt = mfx.TransformOptimizer(named, _factory_with(times(seen=seen)))
    old = mfx.linalg.set_batch_bytes(16 * 24 * 4 if how == "pieces" else None, "cpu")
    try:
        got = _run(opt, named, 3, lambda step: {"k": torch.tensor(1.0 + step)})
        pieces = opt.plan.groups[0].pieces
    finally:
        mfx.linalg.set_batch_bytes(old, "cpu")
    assert (pieces is not None and len(pieces) == 4) if how == "pieces" else pieces is None
    assert seen
    ref = _reference(3)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_compiled_step_takes_extra_args_as_inputs():
    named = _named()
    opt = mfx.TransformOptimizer(named, _factory_with(times())).compile(backend="aot_eager")
    got = _run(opt, named, 3, lambda step: {"k": torch.tensor(1.0 + step)})
    assert opt.plan.groups[0].path == "compiled"
    for a, b in zip(got, _reference(3)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adamw_ignores_extra_args():
    named, ref_named = _named(), _named()
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
    ref = mfx.TransformOptimizer(ref_named, mfx.adamw, lr=1e-2)
    a = _run(opt, named, 2, lambda step: {"k": torch.tensor(5.0)})
    b = _run(ref, ref_named, 2)
    assert opt.plan.groups[0].path == "fused"
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# -- the plan's settings travel with the step ------------------------------------------

import threading  # noqa: E402

from muonfx.linalg import batching, precision, triton_ns  # noqa: E402

MATS = {f"w{i}": (24, 40) for i in range(4)}


def _built(ns_dtype, budget, seed=0):
    """A Muon optimizer whose plan captured ``ns_dtype`` (the process default then) and
    ``budget``; the process defaults are put back afterwards."""
    gen = torch.Generator().manual_seed(seed)
    named = [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in MATS.items()]
    old_budget = batching.set_batch_bytes(budget, "cpu")
    old_dtype = precision._override
    mfx.linalg.set_default_ns_dtype(ns_dtype)
    try:
        opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02, weight_decay=0.1)
        plan = opt.plan
    finally:
        mfx.linalg.set_default_ns_dtype(old_dtype)
        batching.set_batch_bytes(old_budget, "cpu")
    assert plan.settings.ns_dtype == ns_dtype
    return named, opt


def _grads(named, step):
    gen = torch.Generator().manual_seed(500 + step)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen)


def _steps(named, opt, steps, barrier=None):
    for step in range(steps):
        _grads(named, step)
        if barrier is not None:
            barrier.wait()
        opt.step()
    return [p.detach().clone() for _, p in named]


CONFIGS = [(torch.float32, 24 * 40 * 4), (torch.bfloat16, None)]


def test_two_optimizers_in_two_threads_get_their_single_thread_results():
    steps, rounds = 4, 2
    alone = []
    for d, b in CONFIGS:
        named, opt = _built(d, b)
        alone.append([_steps(named, opt, steps) for _ in range(rounds)])
    assert any(not torch.equal(x, y) for x, y in zip(alone[0][0], alone[1][0]))  # the settings matter
    pairs = [_built(d, b) for d, b in CONFIGS]
    assert pairs[0][1].plan.groups[0].pieces is not None and pairs[1][1].plan.groups[0].pieces is None
    for r in range(rounds):  # a second round carries each optimizer's state on
        barrier = threading.Barrier(2)
        out: list = [None, None]
        errors: list = []

        def run(i):
            try:
                out[i] = _steps(*pairs[i], steps, barrier)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i in range(2):
            assert all(torch.equal(x, y) for x, y in zip(out[i], alone[i][r])), (i, r)


def test_a_step_writes_no_process_setting(monkeypatch):
    named, opt = _built(torch.float32, 24 * 40 * 4)
    _steps(named, opt, 1)

    def refuse(*a, **k):
        raise AssertionError("a process setting was written during a step")

    monkeypatch.setattr(batching, "set_batch_bytes", refuse)
    monkeypatch.setattr(triton_ns, "set_enabled", refuse)
    monkeypatch.setattr(precision, "set_default_ns_dtype", refuse)
    before = (dict(batching._overrides), triton_ns._switch, precision._override)
    _steps(named, opt, 2)
    opt.replan()
    _steps(named, opt, 1)
    assert (dict(batching._overrides), triton_ns._switch, precision._override) == before


def test_the_settings_name_is_the_plans_own():
    named, opt = _built(torch.float32, None)
    _grads(named, 0)
    with pytest.raises(ValueError, match="matrix_settings"):
        opt.step(matrix_settings=None)


def test_dion2_reads_the_plans_newton_schulz_dtype():
    """scale_by_dion2 takes the step plan's settings as newton_schulz does: the settings'
    dtype decides its Newton-Schulz where none is given (float32 and bf16 differ)."""
    from tensordict import TensorDict

    from muonfx.linalg.settings import MatrixSettings

    g = TensorDict({"w": torch.randn(8, 16, generator=torch.Generator().manual_seed(0))}, [])
    tx = mfx.scale_by_dion2(0.5)
    outs = {}
    for dt in (torch.float32, torch.bfloat16):
        outs[dt], _ = tx.update(g, tx.init(g), None, matrix_settings=MatrixSettings(dt, (("cpu", 1 << 20),), False))
    ref, _ = mfx.scale_by_dion2(0.5, ns_dtype=torch.float32).update(g, tx.init(g))
    assert torch.equal(outs[torch.float32]["w"], ref["w"])
    assert not torch.equal(outs[torch.float32]["w"], outs[torch.bfloat16]["w"])
