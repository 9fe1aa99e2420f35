"""The step: the adapter computes exactly what the functional loop computes, for any
transform (a user's plain-Python combinator included), commits nothing when anything
in a step raises, runs by a plan chosen by rules (measured only by opt.tune()), and
stays cheap in Python (its calls do not grow with the parameters)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfx as mfx
from muonfx.tree import tensors as tree_tensors

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def plain_chain(*transforms):
    """A user's own optax-style chain, written with plain Python (no muonfx helpers)."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        new = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new.append(s)
        return updates, tuple(new)

    return mfx.GradientTransformation(init, update)


def _named(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in shapes.items()]


def _grads(named, step, only=None):
    gen = torch.Generator().manual_seed(1000 + step)
    for k, p in named:
        g = torch.randn(p.shape, generator=gen)
        p.grad = g if only is None or k in only else None


def _bitwise_equal(a, b, what):
    la, lb = list(tree_tensors(a)), list(tree_tensors(b))
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, i)
        assert torch.equal(x, y), f"{what}: tensor {i} differs by {(x - y).abs().max().item()}"


def adapter_vs_loop(tx, shapes, steps=4):
    """Run ``tx`` through TransformOptimizer and through the functional loop; assert
    parameters and state are bitwise equal after every step."""
    named = _named(shapes)
    keys = [tuple(k.split(".")) for k, _ in named]
    loop_params = TensorDict({k: p.detach().clone() for k, (_, p) in zip(keys, named)}, [])
    state = tx.init(loop_params)
    opt = mfx.TransformOptimizer(named, tx)
    for step in range(steps):
        _grads(named, step)
        grads = TensorDict({k: p.grad.clone() for k, (_, p) in zip(keys, named)}, [])
        updates, state = tx.update(grads, state, loop_params)
        loop_params = mfx.apply_updates(loop_params, updates)
        opt.step()
        for k, (name, p) in zip(keys, named):
            assert torch.equal(p.detach(), loop_params[k]), (
                f"step {step}: {name} differs by {(p.detach() - loop_params[k]).abs().max().item()}")
        _bitwise_equal(opt.transform_state(0).inner_state, state, f"step {step} state")


SHAPES = {"w": (12, 8), "v": (8, 8), "experts": (3, 6, 10), "b": (12,)}
MATRICES = {k: s for k, s in SHAPES.items() if len(s) >= 2}


# ---------------------------------------------------------------------------
# purity: the adapter computes what the functional loop computes, bit for bit
# ---------------------------------------------------------------------------


def test_users_plain_python_chain_through_the_adapter_equals_the_loop():
    """The issue's case: a 6-line user chain of momentum(0.9) and scale(-0.1) ended 0.315
    away in the momentum buffer when the adapter threaded donation through transforms."""
    adapter_vs_loop(plain_chain(mfx.momentum(0.9), mfx.scale(-0.1)), SHAPES)


def test_user_transform_keeping_its_input_in_the_state_is_safe():
    """A transform that returns its input update as (part of) its new state: the
    adapter's write-back and ``p += u`` must not let one write change the other."""

    def keep_last():
        def init(params):
            return {"last": params.apply(torch.zeros_like)}

        def update(updates, state, params=None):
            return updates, {"last": updates}

        return mfx.GradientTransformation(init, update)

    adapter_vs_loop(plain_chain(keep_last(), mfx.scale(-0.1), keep_last()), SHAPES)


#: every built-in transform, by name: (factory, matrices only)
BUILTINS = {
    "momentum": (lambda: mfx.momentum(0.9), False),
    "nesterov": (lambda: mfx.momentum(0.8, nesterov=True), False),
    "scale": (lambda: mfx.scale(-0.5), False),
    "scale_by_learning_rate": (lambda: mfx.scale_by_learning_rate(0.1), False),
    "scheduled_lr": (lambda: mfx.scale_by_learning_rate(mfx.schedules.linear(0.1, 0.01, 5)), False),
    "row_normalize": (lambda: mfx.row_normalize(), True),
    "decoupled_decay": (lambda: mfx.decoupled_decay(0.1), False),
    "scale_by_adam": (lambda: mfx.scale_by_adam(), False),
    "clip_by_global_norm": (lambda: mfx.clip_by_global_norm(1.0), False),
    "newton_schulz": (lambda: mfx.newton_schulz(dtype=torch.float32), True),
    "scale_by_shape": (lambda: mfx.scale_by_shape("original"), True),
    "mask_by_ndim": (lambda: mfx.mask_by_ndim(mfx.newton_schulz(dtype=torch.float32), {2, 3}), False),
    "accumulate": (lambda: mfx.accumulate(mfx.momentum(0.9), 2), False),
    "apply_if_finite": (lambda: mfx.apply_if_finite(mfx.scale_by_adam()), False),
    "muon": (lambda: mfx.muon(ns_dtype=torch.float32), True),
    "adamw": (lambda: mfx.adamw(weight_decay=0.1), False),
    "muon_adamw": (lambda: mfx.muon_adamw(ns_dtype=torch.float32, weight_decay=0.1), False),
    "lion": (lambda: mfx.lion(weight_decay=0.1), False),
    "adopt": (lambda: mfx.adopt(weight_decay=0.1), False),
    "laprop": (lambda: mfx.laprop(weight_decay=0.1), False),
    "cautious_adamw": (lambda: mfx.cautious_adamw(weight_decay=0.1), False),
    "mars_adamw": (lambda: mfx.mars_adamw(weight_decay=0.1), False),
    "schedule_free_adamw": (lambda: mfx.schedule_free_adamw(weight_decay=0.1), False),
    "dion2": (lambda: mfx.dion2(ns_dtype=torch.float32), True),
    "soap": (lambda: mfx.soap(precondition_frequency=2), False),
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_transform_through_the_adapter_equals_the_loop(name):
    factory, matrices = BUILTINS[name]
    adapter_vs_loop(plain_chain(factory()), MATRICES if matrices else SHAPES)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(st.lists(st.sampled_from(sorted(BUILTINS)), min_size=1, max_size=4))
def test_random_chains_through_the_adapter_equal_the_loop(names):
    matrices = any(BUILTINS[n][1] for n in names)
    adapter_vs_loop(plain_chain(*(BUILTINS[n][0]() for n in names)), MATRICES if matrices else SHAPES, steps=3)


# ---------------------------------------------------------------------------
# failure atomicity: a raising step changes nothing
# ---------------------------------------------------------------------------


def _everything(opt):
    """Every parameter, state tensor (with its identity) and param group value."""
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = [(id(t), t.clone()) for rec in opt.records for t in tree_tensors(rec.state)]
    scalars = [repr(rec.state._replace(inner_state=None)) for rec in opt.records]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, scalars, groups


def _assert_same(before, after):
    (p0, s0, c0, g0), (p1, s1, c1, g1) = before, after
    assert len(p0) == len(p1) and all(torch.equal(a, b) for a, b in zip(p0, p1)), "a parameter moved"
    assert [i for i, _ in s0] == [i for i, _ in s1], "a state buffer was replaced"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(s0, s1)), "a state tensor changed"
    assert c0 == c1, "a step counter or hyperparameter in the state changed"
    assert repr(g0) == repr(g1), "a param group changed"


def _hybrid(named, compiled):
    groups = [{"params": [p for k, p in named if p.ndim >= 2], "param_names": [k for k, p in named if p.ndim >= 2],
               "tx": mfx.muon, "lr": 0.02, "ns_dtype": torch.float32},
              {"params": [p for k, p in named if p.ndim < 2], "param_names": [k for k, p in named if p.ndim < 2],
               "tx": mfx.adamw, "lr": 1e-3}]
    opt = mfx.TransformOptimizer(groups, mfx.adamw)
    return opt.compile(backend="aot_eager") if compiled else opt


def _two_good_steps(opt, named, only=None):
    """Two good steps (``only``: the parameters that get gradients), then every
    parameter's gradient for the step that is to raise."""
    for step in range(2):
        _grads(named, step, only)
        opt.step()
    _grads(named, 2)


def _trigger_nan_lr(compiled):
    """A NaN lr in the AdamW group, after the Muon group's update was computed."""
    named = _named(SHAPES)
    opt = _hybrid(named, compiled)
    _two_good_steps(opt, named)
    opt.param_groups[1]["lr"] = float("nan")
    return opt, ValueError, "lr"


def _trigger_schedule_nan(compiled):
    """A schedule inside a chain returning NaN at step 2, after momentum ran."""
    sched = lambda count: 0.1 if int(count) < 2 else float("nan")  # noqa: E731
    named = _named(SHAPES)
    opt = mfx.TransformOptimizer(named, mfx.chain(mfx.momentum(0.9), mfx.scale_by_learning_rate(sched)))
    if compiled:
        opt.compile(backend="aot_eager")
    _two_good_steps(opt, named)
    return opt, ValueError, "nan"


def _trigger_vector_gets_grad_in_muon_group(compiled):
    """A 1-D parameter of a Muon group gets its first gradient (after the 2-D ones stepped)."""
    named = _named({"w": (12, 8), "b": (12,)})
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02, ns_dtype=torch.float32)
    if compiled:
        opt.compile(backend="aot_eager")
    _two_good_steps(opt, named, only={"w"})
    return opt, ValueError, "'b'"


def _trigger_sparse_grad_in_second_group(compiled):
    named = _named(SHAPES)
    opt = _hybrid(named, compiled)
    _two_good_steps(opt, named)
    named[-1][1].grad = named[-1][1].grad.to_sparse()
    return opt, ValueError, "sparse"


def _trigger_user_transform_raises(compiled):
    """A user's transform in the second group raises on its third update."""

    def flaky():
        def init(params):
            return {"n": 0}

        def update(updates, state, params=None):
            if state["n"] >= 2:
                raise RuntimeError("flaky transform gave up")
            return updates, {"n": state["n"] + 1}

        return mfx.GradientTransformation(init, update)

    named = _named(SHAPES)
    groups = [{"params": [p for _, p in named[:2]], "param_names": [k for k, _ in named[:2]], "tx": mfx.adamw},
              {"params": [p for _, p in named[2:]], "param_names": [k for k, _ in named[2:]],
               "tx": plain_chain(mfx.momentum(0.9), flaky())}]
    opt = mfx.TransformOptimizer(groups, mfx.adamw)
    if compiled:
        opt.compile(backend="aot_eager")
    _two_good_steps(opt, named)
    return opt, RuntimeError, "flaky"


TRIGGERS = {f.__name__[len("_trigger_"):]: f for f in (
    _trigger_nan_lr, _trigger_schedule_nan, _trigger_vector_gets_grad_in_muon_group,
    _trigger_sparse_grad_in_second_group, _trigger_user_transform_raises)}


@pytest.mark.parametrize("trigger,compiled", [  # compiled: one trigger by default, every one in the slow run
    pytest.param(t, c, id=f"{t}-{'compiled' if c else 'eager'}", marks=pytest.mark.slow if c and t != "nan_lr" else ())
    for t in sorted(TRIGGERS) for c in (False, True)])
def test_a_raising_step_changes_nothing(trigger, compiled):
    torch._dynamo.reset()
    opt, exc, match = TRIGGERS[trigger](compiled)
    before = _everything(opt)
    with pytest.raises(exc, match=match):
        opt.step()
    _assert_same(before, _everything(opt))


def test_after_a_raising_step_the_next_good_step_is_the_uninterrupted_one():
    """The NaN lr is fixed and the step retried: training continues exactly as if the
    bad step had never been attempted."""
    opt, _, _ = _trigger_nan_lr(False)
    ref, _, _ = _trigger_nan_lr(False)
    with pytest.raises(ValueError):
        opt.step()
    for o in (opt, ref):
        o.param_groups[1]["lr"] = 1e-3
        o.step()
    for a, b in zip(_everything(opt)[0], _everything(ref)[0]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# the step's own costs
# ---------------------------------------------------------------------------


def test_state_buffers_keep_their_identity_and_opt_state_follows():
    named = _named(SHAPES)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
    _grads(named, 0)
    opt.step()
    held = dict(opt.state[named[0][1]])
    _grads(named, 1)
    opt.step()
    now = opt.state[named[0][1]]
    for k, v in held.items():
        if isinstance(v, torch.Tensor):
            assert now[k] is v, k
    assert now["count"] == 2


def test_the_transform_is_built_once_while_static_hyperparameters_stay():
    calls = []

    def counted_muon(lr=0.02, momentum=0.95, ns_dtype=None):
        calls.append((lr, momentum))
        return mfx.muon(lr=lr, momentum=momentum, ns_dtype=ns_dtype)

    named = _named(MATRICES)
    opt = mfx.TransformOptimizer(named, counted_muon, lr=0.02)
    for step in range(4):
        _grads(named, step)
        opt.step()
    assert len(calls) == 1, calls  # init built it; four steps reused it
    opt.param_groups[0]["lr"] = 0.01
    _grads(named, 4)
    opt.step()
    assert len(calls) == 2 and calls[-1][0] == 0.01


def test_changing_betas_builds_no_new_transform():
    """Tuples of numbers (Adam's betas) live in the injected state like lr: a scheduler
    or hand edit changing them every step must not build (and keep) a transform each time."""
    named = _named(SHAPES)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
    for step in range(5):
        _grads(named, step)
        opt.param_groups[0]["betas"] = (0.9 - 0.01 * step, 0.999)
        opt.step()
    assert len(opt.records[0].transforms) == 1
    assert opt.transform_state(0).hyperparams["betas"] == (0.9 - 0.04, 0.999)


def _count_muonfx_calls(fn) -> int:
    root = os.path.dirname(mfx.__file__)
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "call" and frame.f_code.co_filename.startswith(root):
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_a_muon_optimizer_steps_python_work_does_not_grow_with_the_model():
    """GPT-2-like hidden matrices (4 shapes, 8 layers, 32 matrices): the Python work of a
    step (muonfx's own calls) stays bounded, and twice the layers add (nearly) nothing:
    TensorDicts are walked and built without a Python call per leaf, counts advance per
    group, the plan is built once. (``benchmarks/host_cost.py`` counts every module's
    calls against torch.optim.Muon's.)"""
    shapes = {}
    for i in range(8):
        shapes |= {f"h.{i}.attn": (32, 96), f"h.{i}.proj": (32, 32), f"h.{i}.fc": (32, 128), f"h.{i}.out": (128, 32)}
    named = _named(shapes)
    opt = mfx.MuonOptimizer([p for _, p in named], lr=0.02)
    _two_good_steps(opt, named)
    calls = _count_muonfx_calls(opt.step)
    assert calls <= 260, calls
    named2 = _named({f"{k}.x": s for k, s in shapes.items()} | shapes)
    opt2 = mfx.MuonOptimizer([p for _, p in named2], lr=0.02)
    for step in range(2):
        _grads(named2, step)
        opt2.step()
    assert _count_muonfx_calls(opt2.step) <= calls + 4


def test_a_missing_gradient_keeps_one_update_call_and_the_cost_of_a_full_step():
    """After a step where one of 20 matrices has no gradient, its counts differ from the
    others' for good: later full steps are still one update call per group, costing
    (nearly) what they cost before (per-parameter counts, not cohorts)."""
    named = _named({f"w{i}": (16, 16) for i in range(20)})
    opt = mfx.MuonOptimizer([p for _, p in named], lr=0.02)
    _two_good_steps(opt, named)
    before = _count_muonfx_calls(opt.step)
    _grads(named, 5, only={k for k, _ in named[1:]})
    opt.step()
    assert opt.plan.groups[0].partial and len(opt.plan.groups[0].keys) == 19
    _grads(named, 6)
    opt.step()
    after = _count_muonfx_calls(opt.step)
    assert after <= 1.15 * before, (before, after)
    sd = opt.state_dict()["state"]
    assert sd[0]["count"] == sd[1]["count"] - 1



# ---------------------------------------------------------------------------
# the path of a step: by rules, in the plan; measured only by opt.tune()
# ---------------------------------------------------------------------------


_real_compile = torch.compile


def _aot_eager_compile(fn, **kwargs):
    return _real_compile(fn, **{**kwargs, "backend": "aot_eager"})


def test_nothing_compiles_unless_asked_and_adamw_runs_the_fused_kernel(monkeypatch):
    """By the rule (``"compile": None``) nothing is compiled, whatever a group's size: a
    group built with ``mfx.adamw`` runs torch's fused kernel, any other chain runs eagerly;
    ``"compile": True`` compiles (from its first step, nothing timed), ``"fused": False``
    runs the chain link by link. The plan says which and why, and all of them train alike."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", _aot_eager_compile)
    big = [("w", torch.nn.Parameter(torch.zeros(4096, 4096)))]  # 2^24 elements: once the compile rule's threshold
    plan = mfx.TransformOptimizer(big, mfx.adamw).plan.groups[0]
    assert plan.path == "fused" and "torch._fused_adamw_" in plan.why, plan
    plan = mfx.TransformOptimizer(big, lambda lr=1e-3: mfx.chain(mfx.scale(-lr))).plan.groups[0]
    assert plan.path == "eager" and "only when asked" in plan.why, plan
    named, ref, chain = _named(SHAPES), _named(SHAPES), _named(SHAPES)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
    fused = mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2)
    eager = mfx.TransformOptimizer(chain, mfx.adamw, lr=1e-2)
    opt.param_groups[0]["compile"] = True
    eager.param_groups[0]["fused"] = False
    for step in range(4):
        for x in (named, ref, chain):
            _grads(x, step)
        opt.step()
        fused.step()
        eager.step()
        assert opt.plan.groups[0].path == "compiled", opt.plan
    assert fused.plan.groups[0].path == "fused"
    assert eager.plan.groups[0].path == "eager" and eager.plan.groups[0].why == "fused=False"
    assert "compiled (compile=True)" in str(opt.plan)
    for (n, a), (_, b), (_, c) in zip(ref, named, chain):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_tune_times_both_paths_keeps_the_faster_and_changes_nothing(monkeypatch):
    """``opt.tune()``: eager and compiled steps timed in turn on the current gradients
    (here a fake clock), the parameters and state put back after each, the faster kept in
    the group's "compile" setting (saved in the state_dict); training continues as if
    tune had not run."""
    from muonfx.optim.step import tune as tune_mod

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", _aot_eager_compile)
    for eager_s, compiled_s, want in ((1.0, 0.5, True), (1.0, 0.99, False)):
        named, ref = _named(SHAPES), _named(SHAPES)
        opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
        twin = mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2)
        twin.param_groups[0]["compile"] = False
        _grads(named, 0)
        _grads(ref, 0)
        opt.step()
        twin.step()
        _grads(named, 1)
        _grads(ref, 1)
        ticks = iter([0.0, 1.0] * 2 + sum(([0.0, eager_s, 0.0, compiled_s] for _ in range(3)), []))
        monkeypatch.setattr(tune_mod.time, "perf_counter", lambda: next(ticks))
        before = [p.detach().clone() for _, p in named]
        got = opt.tune()
        assert got["compile"] is want and got["groups"] == [0], got
        assert all(torch.equal(a, p) for a, (_, p) in zip(before, named)), "tune moved a parameter"
        assert opt.param_groups[0]["compile"] is want
        assert opt.state_dict()["param_groups"][0]["compile"] is want
        assert opt.transform_state(0).count == 1
        opt.step()
        twin.step()
        assert opt.plan.groups[0].path == ("compiled" if want else "fused")
        for (n, a), (_, b) in zip(ref, named):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("error", [
    torch._dynamo.exc.TorchDynamoException("backend failed: no C++ compiler"),
    # dynamo's per-code recompile limit under fullgraph=True (not a TorchDynamoException)
    torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True"),
], ids=["dynamo-error", "recompile-limit"])
def test_a_compile_that_fails_steps_eagerly_and_says_so_once(monkeypatch, caplog, error):
    import logging

    from muonfx import logs

    torch._dynamo.reset()

    def failing(fn, **kwargs):
        def run(*args):
            raise error
        return run

    monkeypatch.setattr(torch, "compile", failing)
    monkeypatch.setattr(logs, "_said", set())
    named, ref = _named(SHAPES), _named(SHAPES)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2).compile()
    eager = mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2)
    with caplog.at_level(logging.INFO, logger="muonfx"):
        for step in range(5):
            _grads(named, step)
            _grads(ref, step)
            opt.step()
            eager.step()
    said = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert str(error).split(":")[0] in said[0].getMessage()
    # the group goes back to its path by the rule: AdamW's fused kernel
    assert opt.plan.groups[0].path == "fused" and opt.plan.groups[0].why.endswith("torch.compile failed on it")
    for (n, a), (_, b) in zip(ref, named):
        assert torch.equal(a, b), n


def test_under_a_dispatch_mode_the_compiled_optimizer_steps_eagerly():
    """dynamo skips frames under a Python dispatch mode (e.g. a memory counter) and runs
    them eagerly; the runner then takes the eager step instead of the compiled one."""
    from muonfx.memory import FreshMemory

    torch._dynamo.reset()
    named, ref = _named(SHAPES), _named(SHAPES)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2).compile(backend="aot_eager")
    eager = mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2)
    for step in range(4):
        _grads(named, step)
        _grads(ref, step)
        if step == 2:
            with FreshMemory() as m:
                opt.step()
            assert m.peak > 0
        else:
            opt.step()
        eager.step()
    assert opt.transform_state(0).count == 4
    for (n, a), (_, b) in zip(ref, named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_settings_are_read_when_the_plan_is_built_not_mid_run():
    """With an lr scheduler the preset is rebuilt whenever lr changes; a
    set_default_ns_dtype between steps still does not switch a running optimizer's
    Newton-Schulz dtype: its plan holds the pin it was built with (print(opt.plan) says
    which), until opt.replan() reads the settings again."""
    from muonfx.linalg.precision import pinned_ns_dtype

    before = pinned_ns_dtype()  # (the test suite pins one: tests/conftest.py)
    named, ref = _named(MATRICES), _named(MATRICES)
    opts = [mfx.TransformOptimizer(n, mfx.muon, lr=0.02) for n in (named, ref)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9) for o in opts]
    try:
        for step in range(4):
            _grads(named, step)
            _grads(ref, step)
            if step == 2:  # a change between steps, for the first optimizer's step only
                mfx.linalg.set_default_ns_dtype(torch.float16)
            opts[0].step()
            mfx.linalg.set_default_ns_dtype(before)
            opts[1].step()
            for s in scheds:
                s.step()
        assert opts[0].plan.settings.ns_dtype == before
        for (n, a), (_, b) in zip(named, ref):
            assert torch.equal(a, b), n
        mfx.linalg.set_default_ns_dtype(torch.float16)
        opts[0].replan()
        assert opts[0].plan.settings.ns_dtype == torch.float16 and "float16" in str(opts[0].plan)
    finally:
        mfx.linalg.set_default_ns_dtype(before)


def test_cautious_decay_refuses_what_decoupled_decay_refuses():
    for bad in (float("nan"), float("inf"), -0.1):
        for tx in (mfx.decoupled_decay, mfx.cautious_decay):
            with pytest.raises(ValueError, match="weight_decay"):
                tx(bad)
