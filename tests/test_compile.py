"""torch.compile: muonfx updates trace without graph breaks, and changing hyperparameters
between steps recompiles nothing (dynamic=True makes them symbolic)."""

from typing import NamedTuple

import pytest
import tensordict
import torch
import torch._dynamo
import torch._dynamo.testing
from tensordict import TensorDict

import muonfx as mfx
from helpers import sweep  # noqa: E402
import catalogue  # noqa: E402

CASES = {
    "adamw": (mfx.adamw, dict(lr=1e-3, weight_decay=0.01)),
    "adamw_amsgrad_maximize": (mfx.adamw, dict(lr=1e-3, weight_decay=0.01, amsgrad=True, maximize=True)),
    "muon": (mfx.muon, dict(lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32)),
    "muon_adamw": (mfx.muon_adamw, dict(lr=0.02, momentum=0.95, weight_decay=0.01, adamw_lr=1e-3)),
    # the spectral form (LAPACK's eigh inside the graph), as "auto" takes it on large CPU matrices
    "muon_spectral": (mfx.muon, dict(lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32,
                                     ns_method="spectral")),
}


def _params(matrices_only=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict({
        "embed": torch.randn(10, 8, generator=gen),
        "blocks": {"0": {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(16, generator=gen)},
                   "experts": torch.randn(3, 8, 12, generator=gen)},
    }, [])
    return td.exclude(("blocks", "0", "b")) if matrices_only else td


def _hp(step, base):
    hp = dict(base)
    hp["lr"] = base["lr"] * (1.0 - 0.1 * step)
    hp["weight_decay"] = 0.01 + 0.02 * step
    if "momentum" in hp:
        hp["momentum"] = 0.85 + 0.03 * step
    return hp


@pytest.mark.parametrize("name", sorted(CASES))
def test_update_compiles_once_and_matches_eager(name):
    torch._dynamo.reset()
    factory, base = CASES[name]
    params = _params(matrices_only=name.startswith("muon") and name != "muon_adamw")
    tx = mfx.inject_hyperparams(factory)(**base)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(tx.update, backend=counter, dynamic=True, fullgraph=True)
    s_eager = tx.init(params)
    s_comp = tx.init(params)
    p_eager, p_comp = params.clone(), params.clone()
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = params.apply(lambda t: torch.randn(t.shape, generator=gen))
        hp = {k: v for k, v in _hp(step, base).items() if k in s_eager.hyperparams}
        s_eager = s_eager._replace(hyperparams=dict(hp))
        s_comp = s_comp._replace(hyperparams=dict(hp))
        u_e, s_eager = tx.update(grads, s_eager, p_eager)
        u_c, s_comp = compiled(grads, s_comp, p_comp)
        p_eager, p_comp = mfx.apply_updates(p_eager, u_e), mfx.apply_updates(p_comp, u_c)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
    # the traced foreach ops round differently from the eager ones (a + (b - a) * w for
    # lerp: an ulp here and there); Newton-Schulz passes that on. Measured (ratio to the
    # tolerance): adamw 0, muon 0.18, muon_adamw 0.21 at rtol 1e-6 / atol 1e-7; the spectral
    # form's float32 eigenvectors amplify it ~5x more (0.99 there): 10x its tolerance
    rtol, atol = (1e-5, 1e-6) if name == "muon_spectral" else (1e-6, 1e-7)
    for k in p_eager.keys(True, True):
        torch.testing.assert_close(p_comp[k], p_eager[k], rtol=rtol, atol=atol)


def test_adapter_compile_follows_the_scheduler_without_recompiling():
    torch._dynamo.reset()
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))  # noqa: E731
    m_eager, m_comp = make(), make()
    m_comp.load_state_dict(m_eager.state_dict())
    counter = torch._dynamo.testing.CompileCounter()
    opts = [mfx.TransformOptimizer(m_eager.named_parameters(), mfx.muon_adamw, lr=0.02, ns_dtype=torch.float32),
            mfx.TransformOptimizer(m_comp.named_parameters(), mfx.muon_adamw, lr=0.02, ns_dtype=torch.float32
                                   ).compile(backend=counter)]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, 5) for o in opts]
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(5):
        for m, o, s in zip((m_eager, m_comp), opts, scheds):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            s.step()
    assert counter.frame_count == 1
    for a, b in zip(m_eager.parameters(), m_comp.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _named(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [("w", torch.nn.Parameter(torch.randn(12, 8, generator=gen))),
            ("v", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
            ("b", torch.nn.Parameter(torch.randn(12, generator=gen)))]


def _grads(named, step):
    gen = torch.Generator().manual_seed(100 + step)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("name", ["adamw", "muon_adamw"])
def test_compiled_step_writes_state_in_place_and_matches_eager(name):
    """aot_eager functionalizes like inductor: the compiled whole step (update, state
    write-back, p += u) writes the new state into the old buffers and trains as eager."""
    torch._dynamo.reset()
    factory = {"adamw": mfx.adamw, "muon_adamw": mfx.muon_adamw}[name]
    kw = dict(lr=0.02, weight_decay=0.1) | ({"ns_dtype": torch.float32} if name == "muon_adamw" else {})
    eager_named, comp_named = _named(), _named()
    eager = mfx.TransformOptimizer(eager_named, factory, **kw)
    comp = mfx.TransformOptimizer(comp_named, factory, **kw).compile(backend="aot_eager")
    for step in range(4):
        _grads(eager_named, step)
        _grads(comp_named, step)
        eager.step()
        held = {k: v for k, v in comp.state[comp_named[0][1]].items() if isinstance(v, torch.Tensor)}
        before = {k: v.clone() for k, v in held.items()}
        comp.step()
        now = {k: v for k, v in comp.state[comp_named[0][1]].items() if isinstance(v, torch.Tensor)}
        assert all(now[k] is held[k] for k in held), "the state buffers were replaced"
        assert any(not torch.equal(held[k], before[k]) for k in held), "the state did not move"
    for (n, a), (_, b) in zip(eager_named, comp_named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_compiled_step_with_two_groups_is_one_graph_and_matches_eager():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    eager_named, comp_named = _named(), _named()

    def groups(named):
        return [{"params": [p for _, p in named[:2]], "param_names": ["w", "v"], "tx": mfx.muon, "lr": 0.02},
                {"params": [named[2][1]], "param_names": ["b"], "tx": mfx.adamw, "lr": 1e-2}]

    eager = mfx.TransformOptimizer(groups(eager_named), mfx.adamw)
    comp = mfx.TransformOptimizer(groups(comp_named), mfx.adamw).compile(backend=counter)
    for step in range(4):
        _grads(eager_named, step)
        _grads(comp_named, step)
        for o in (eager, comp):
            o.param_groups[0]["lr"] = 0.02 * (1 - 0.1 * step)
            o.step()
    assert counter.frame_count == 1
    for (n, a), (_, b) in zip(eager_named, comp_named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_inductor_compiled_spectral_muon_step_matches_eager():
    """The spectral Newton-Schulz form through inductor (C++ on the CPU), as a compiled
    step runs it where "auto" takes it (float32 default, matrices of 320 and more)."""
    torch._dynamo.reset()
    eager_named, comp_named = _named(1)[:2], _named(1)[:2]
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, ns_method="spectral")
    eager = mfx.TransformOptimizer(eager_named, mfx.muon, **kw)
    comp = mfx.TransformOptimizer(comp_named, mfx.muon, **kw).compile()
    for step in range(3):
        _grads(eager_named, step)
        _grads(comp_named, step)
        eager.step()
        comp.step()
    assert comp.plan.groups[0].path == "compiled", comp.plan
    for (n, a), (_, b) in zip(eager_named, comp_named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_inductor_compiled_adamw_step_matches_eager_and_keeps_buffers():
    """The real backend (inductor, C++ on the CPU): fused in-place step, same training."""
    torch._dynamo.reset()
    eager_named, comp_named = _named(1), _named(1)
    eager = mfx.TransformOptimizer(eager_named, mfx.adamw, lr=1e-2, weight_decay=0.1)
    comp = mfx.TransformOptimizer(comp_named, mfx.adamw, lr=1e-2, weight_decay=0.1).compile()
    for step in range(3):
        _grads(eager_named, step)
        _grads(comp_named, step)
        eager.step()
        ptrs = [v.data_ptr() for v in comp.state[comp_named[0][1]].values() if isinstance(v, torch.Tensor)]
        comp.step()
        if step >= 1:
            assert ptrs == [v.data_ptr() for v in comp.state[comp_named[0][1]].values() if isinstance(v, torch.Tensor)]
    for (n, a), (_, b) in zip(eager_named, comp_named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("factory", sweep([mfx.adamw, mfx.muon, mfx.normuon], keep={"muon"},
                                           ids=["adamw", "muon", "normuon"]))
def test_inductor_does_not_recompile_when_lr_momentum_or_weight_decay_change(factory):
    """With the real inductor backend a float reaching a ``_foreach_*`` op (or a scalar
    ``alpha``/``value``/lerp weight) is specialised into the graph; traced, muonfx's
    foreach spells those ops per tensor so the hyperparameters stay symbolic inputs.
    NorMuon's beta2 reaches the graph through ``foreach("ema")`` too. Adam's betas
    and eps go through host arithmetic (``1 - b1``, ``b2 ** t``), which torch 2.10 /
    2.11 specialise: there one recompilation, detected, then eager steps."""
    torch._dynamo.reset()
    named, ref = _named(2), _named(2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    matrices = factory is not mfx.adamw
    kw = {"ns_dtype": torch.float32} if matrices else {}
    params = lambda n: [(k, p) for k, p in n if p.ndim >= 2] if matrices else n  # noqa: E731
    opt = mfx.TransformOptimizer(params(named), factory, lr=1e-2, **kw).compile(backend=counter)
    eager = mfx.TransformOptimizer(params(ref), factory, lr=1e-2, **kw)
    after_first = None
    for step in range(6):
        _grads(named, step)
        _grads(ref, step)
        for o in (opt, eager):
            g = o.param_groups[0]
            g["lr"] = 1e-2 * (1 - 0.1 * step)
            g["weight_decay"] = 0.01 + 0.01 * step
            if "momentum" in g:
                g["momentum"] = 0.9 + 0.01 * step
            if "betas" in g:
                g["betas"] = (0.9 - 0.01 * step, 0.999 - 0.001 * step)
                g["eps"] = 1e-8 * (1 + step)
            if "beta2" in g:
                g["beta2"] = 0.95 - 0.01 * step
            o.step()
        if step == 1:
            after_first = counter.frame_count
    assert after_first >= 1
    if opt.param_groups[0]["compile"] is False:
        # torch 2.10 / 2.11 specialise Adam's betas and eps: step 1's new values recompiled
        # once (counted in after_first), which was detected, and every later step ran
        # eagerly (tests/test_compile.py::test_a_torch_that_specialises...)
        assert factory is mfx.adamw and torch.__version__ < "2.13", "only Adam's betas/eps specialise, on 2.10/2.11"
    assert counter.frame_count == after_first, f"recompiled: {after_first} -> {counter.frame_count} frames"
    for (n, a), (_, b) in zip(params(ref), params(named)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def _scheduled_run(opt, named, steps=6, after_step=None):
    """``steps`` steps with lr and weight decay changing every step (a schedule);
    ``after_step(step)`` is called after each."""
    for step in range(steps):
        _grads(named, step)
        g = opt.param_groups[0]
        g["lr"] = 1e-2 * (1 - 0.1 * step)
        g["weight_decay"] = 0.01 + 0.01 * step
        opt.step()
        if after_step is not None:
            after_step(step)
    return {n: p.detach().clone() for n, p in named}


def test_a_torch_that_specialises_float_hyperparameters_recompiles_once_then_steps_eagerly(monkeypatch, caplog):
    """On torch 2.10 / 2.11 every new lr recompiles a compiled step (up to dynamo's limit,
    then eager). The first recompilation that a changed numeric hyperparameter caused is
    noticed: the group's "compile" setting becomes False (saved in the state_dict, so a
    resumed run steps as this one), the logger says so once, and the group steps eagerly
    from then on. Simulated here (torch 2.13 does not recompile): every compiled call
    counts as a new graph."""
    import itertools
    import logging

    from muonfx.optim.step import compiled as compiled_module

    torch._dynamo.reset()
    monkeypatch.setattr(compiled_module, "_compiled_frames", lambda c=itertools.count(): next(c))
    named, ref = _named(2), _named(2)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2).compile(backend="aot_eager")
    paths = []
    with caplog.at_level(logging.INFO, logger="muonfx"):
        got = _scheduled_run(opt, named, after_step=lambda step: paths.append(opt.plan.groups[0].path))
    want = _scheduled_run(mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2), ref)
    # step 0 compiled, 1 compiled and recompiled (lr changed: noticed), 2-5 by the rule
    # without compiling (AdamW's fused kernel)
    assert paths == ["compiled", "compiled"] + ["fused"] * 4, paths
    assert opt.param_groups[0]["compile"] is False and opt.state_dict()["param_groups"][0]["compile"] is False
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)
    said = [r.getMessage() for r in caplog.records if "numeric hyperparameter changed" in r.getMessage()]
    assert len(said) == 1 and "recompiled" in said[0] and "lr 0.01 -> 0.009000000000000001" in said[0], said


def test_once_known_a_changed_hyperparameter_steps_eagerly_without_recompiling(monkeypatch, caplog):
    """Once it is known that this torch specialises floats, a graph whose numeric
    hyperparameters changed is not called at all: that step and the later ones run
    eagerly, no step skipped, nothing recompiled."""
    import logging

    torch._dynamo.reset()
    named, ref = _named(3), _named(3)
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    opt.compile(backend=counter)
    opt._runner.compiled.floats_specialize = True
    frames = []
    with caplog.at_level(logging.INFO, logger="muonfx"):
        got = _scheduled_run(opt, named, after_step=lambda step: frames.append(counter.frame_count))
    want = _scheduled_run(mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2), ref)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    # built at the first step, never recompiled after it
    assert frames[0] >= 1 and frames == [frames[0]] * 6, frames
    assert opt.param_groups[0]["compile"] is False
    assert any("would recompile" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("factory", [mfx.adamw, mfx.muon, mfx.muon_adamw], ids=["adamw", "muon", "muon_adamw"])
def test_a_learning_rate_schedule_recompiles_nothing_on_every_torch(factory):
    """lr, momentum and weight decay reach the compiled graph only as operands of tensor
    arithmetic (``foreach("neg_mul")``, ``foreach("ema")``, ``foreach("add", alpha=)``),
    so schedules of them (Muon's momentum warm-up by hand or by a callback) recompile
    nothing on torch 2.10 and 2.11 too, whose
    AOTAutograd specialises a float that goes through Python arithmetic (tested there
    with scripts/test-oldest-torch.sh)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    named, ref = _named(4), _named(4)
    kw = {"ns_dtype": torch.float32} if factory is not mfx.adamw else {}
    pick = (lambda n: [(k, p) for k, p in n if p.ndim >= 2]) if factory is mfx.muon else (lambda n: n)
    opt = mfx.TransformOptimizer(pick(named), factory, lr=1e-2, weight_decay=0.1, **kw).compile(backend=counter)
    eager = mfx.TransformOptimizer(pick(ref), factory, lr=1e-2, weight_decay=0.1, **kw)
    frames = []
    for step in range(6):
        _grads(named, step)
        _grads(ref, step)
        for o in (opt, eager):
            o.param_groups[0]["lr"] = 1e-2 * (1 - 0.1 * step)
            o.param_groups[0]["weight_decay"] = 0.1 + 0.01 * step
            if "momentum" in o.param_groups[0]:
                o.param_groups[0]["momentum"] = 0.85 + 0.02 * step
            o.step()
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * 6, frames
    assert opt.param_groups[0]["compile"] is True and opt.plan.groups[0].path == "compiled"
    for (n, a), (_, b) in zip(pick(ref), pick(named)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def _fell_back(opt) -> bool:
    """Whether the compiler could not take the optimizer's step (its plan says so)."""
    return any(g.why == "torch.compile failed on it" for g in opt.plan.groups)


def _lockstep(make, seed, steps):
    """A compiled (aot_eager) and an eager optimizer of ``make()`` stepped side by side
    on the same gradients: the compiled one, and both parameter lists."""
    named, ref = _named(seed), _named(seed)
    opt = mfx.TransformOptimizer(named, make()).compile(backend="aot_eager")
    eager = mfx.TransformOptimizer(ref, make())
    for step in range(steps):
        _grads(named, step)
        _grads(ref, step)
        opt.step()
        eager.step()
    return opt, named, ref


def _bisect_schedule(count):
    """A user's piecewise schedule written with ``bisect``, which dynamo cannot trace."""
    import bisect

    return (1e-2, 5e-3, 1e-3)[bisect.bisect_right([2, 4], int(count))]


def test_a_compiler_failure_while_tracing_steps_eagerly():
    """A schedule the compiler cannot trace (``bisect``, a C builtin: dynamo's own
    Unsupported error, which dynamo reports itself) fails while compiling, before the
    graph ran: the step goes eagerly in place of failing every step; the training is the
    eager one. Other errors raised while compiling (torch 2.10-2.13 raised a bare
    AssertionError on muonfx's own cosine schedules, now traced: see
    test_every_in_graph_schedule_compiles_into_the_step) take the same way, with a log
    line of muonfx's (test_only_errors_raised_while_compiling_count_as_the_compilers)."""
    torch._dynamo.reset()
    make = lambda: mfx.chain(mfx.scale_by_adam(), mfx.scale_by_learning_rate(_bisect_schedule))  # noqa: E731
    opt, named, ref = _lockstep(make, 5, 6)
    for (n, a), (_, b) in zip(ref, named):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert _fell_back(opt)


SCHEDULES = {
    "linear": lambda: mfx.schedules.linear(1e-2, 0.0, 20),
    "cosine_decay": lambda: mfx.schedules.cosine_decay(1e-2, 20, alpha=0.1),
    "warmup_cosine_decay": lambda: mfx.schedules.warmup_cosine_decay(0.0, 1e-2, warmup_steps=3, decay_steps=20),
    "join": lambda: mfx.schedules.join([mfx.schedules.constant(1e-2), mfx.schedules.linear(1e-2, 0.0, 10),
                                        mfx.schedules.constant(0.0)], [5, 15]),
}


@pytest.mark.parametrize("name", sweep(sorted(SCHEDULES), keep={"linear"}))
def test_every_in_graph_schedule_compiles_into_the_step(name):
    """muonfx's schedules evaluated on the step counter inside the compiled step (lr and
    Muon's momentum, through inject_hyperparams) compile: no eager fallback, one graph (plus one per ``join``
    boundary crossed), and the training is the eager one. The cosine schedules used to
    fall back to eager steps: the hyperparameter check's ``lr < inf`` made torch's
    value-range analysis raise "sympy expression is NaN" (2.10-2.13), and ``join``
    called ``bisect``, which dynamo cannot trace."""
    sched = SCHEDULES[name]

    def make():
        return mfx.inject_hyperparams(mfx.muon_adamw)(lr=sched(), momentum=mfx.schedules.linear(0.85, 0.95, 10),
                                                      ns_dtype=torch.float32)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    opt, named, ref = _lockstep(make, 7, 18)
    assert not _fell_back(opt) and opt.param_groups[0]["compile"] is True
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # tensordict before 0.15 (what pip pairs with torch 2.10) guards the step's graph on the
    # length of its tensorclass memo, which grows once between steps: one graph more
    memo = 1 if tuple(int(v) for v in tensordict.__version__.split(".")[:2]) < (0, 15) else 0
    assert 1 <= graphs <= 1 + memo + (2 if name == "join" else 1 if name == "warmup_cosine_decay" else 0), graphs
    for (n, a), (_, b) in zip(ref, named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", sweep(sorted(SCHEDULES), keep={"linear"}))
def test_in_graph_schedules_compiled_by_inductor_follow_the_schedule(name):
    """The real backend (C++ on the CPU): the lr applied at each step is the schedule's
    value at that step. torch 2.10 and 2.11 printed ``min``/``max`` of a traced float
    with int64 casts, so ``linear``'s ``clip(t / steps, 0, 1)`` read 0 and the compiled
    step kept the first lr for good (warm-ups and ``join`` pieces of it too); the
    schedule clips the integer step now."""
    torch._dynamo.reset()
    sched = SCHEDULES[name]()
    w = torch.nn.Parameter(torch.zeros(4, 3))
    opt = mfx.TransformOptimizer([("w", w)], mfx.scale_by_learning_rate(sched)).compile()
    applied = []
    for _ in range(18):
        w.grad = torch.ones(4, 3)
        before = w.detach().clone()
        opt.step()
        applied.append((before - w.detach()).mean().item())
    assert not _fell_back(opt)
    want = [sched(step) for step in range(18)]
    assert applied == pytest.approx(want, rel=1e-5, abs=1e-9), (applied, want)
    assert len(set(round(v, 8) for v in want)) > 3  # the schedule does change


class _CrossState(NamedTuple):
    avg: TensorDict
    acc: TensorDict


def _cross_state():
    """A transform whose new state reads another old state buffer and the parameters:
    ``acc <- acc + avg`` (the old avg), ``avg <- avg / 2 + p / 2``; update ``-0.1 g``."""

    def init(params):
        return _CrossState(params.clone().zero_(), params.clone().zero_())

    def update(g, s, params):
        return g * -0.1, _CrossState(s.avg * 0.5 + params * 0.5, s.acc + s.avg)

    return mfx.GradientTransformation(init, update)


@pytest.mark.parametrize("name", sweep(["cross_state", "accumulate"], keep={"accumulate"}))
def test_a_compiled_step_writes_every_state_buffer_from_the_old_ones(name):
    """Inductor (the real backend) fused the state write-back's ``_foreach_copy_`` into
    one loop that overwrote a buffer before computing another buffer's new value from
    it: ``accumulate(momentum(0.9), 2)`` fed its momentum the zeroed sum (parameters 15 %
    off after 8 steps on 2.10, 2.11 and 2.13; aot_eager was right). The write-back is
    one copy per buffer now: the compiled step trains and stores as eagerly."""
    make = {"cross_state": _cross_state, "accumulate": lambda: mfx.accumulate(mfx.momentum(0.9), 2)}[name]

    def run(compiled):
        torch._dynamo.reset()
        named = _named(11)
        opt = mfx.TransformOptimizer(named, make())
        if compiled:
            opt.compile()
        for step in range(8):
            _grads(named, step)
            opt.step()
        assert not _fell_back(opt)
        state = [t.detach().clone() for t in opt.state_dict()["state"][0].values() if isinstance(t, torch.Tensor)]
        return [p.detach().clone() for _, p in named], state

    (p_e, s_e), (p_c, s_c) = run(False), run(True)
    assert len(s_e) == len(s_c) >= 2
    for a, b in zip(p_e + s_e, p_c + s_c):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _train_public(build, backend, steps):
    """Three small parameters (a matrix, a square, a 3-D stack) trained ``steps`` steps by
    ``build()`` through TransformOptimizer, compiled with ``backend`` (None: eager); the
    final parameters and the optimizer."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    named = [("w", torch.nn.Parameter(torch.randn(12, 8, generator=gen))),
             ("v", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
             ("e", torch.nn.Parameter(torch.randn(2, 8, 6, generator=gen)))]
    opt = mfx.TransformOptimizer(named, build())
    if backend is not None:
        opt.compile(backend=backend)
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for _, p in named], opt


#: public transforms with state of more than one kind (or per-block, per-group, injected):
#: where a write-back or fusion bug of the compiler shows
STATEFUL = sorted(catalogue.select(catalogue.STATEFUL))


@pytest.mark.parametrize("name", sweep(STATEFUL, keep={"scale_by_adam"}))
def test_stateful_public_transforms_compiled_by_inductor_train_as_eager(name, monkeypatch):
    """The real backend, six steps, Newton-Schulz pinned to float32 (bf16 would differ by
    its own rounding between two fusions): parameters within float32 rounding of eager.
    The aot_eager sweep above cannot see inductor's own mistakes (the foreach write-back)."""
    monkeypatch.setenv("MUONFX_NS_DTYPE", "float32")
    build = _public_transforms()[name][1]
    eager, _ = _train_public(build, None, 6)
    compiled, opt = _train_public(build, "inductor", 6)
    assert not _fell_back(opt)
    # measured up to 0.34 of rtol 1e-5 / atol 1e-6 here; inductor's vector code (and its
    # contractions into fused multiply-adds) follows the CPU's ISA: ~10x margin
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=3e-5, atol=3e-6)


def _warmup_lambda(step):
    """The usual warm-up written by hand: ``min`` of a float (miscompiled by torch 2.10/2.11)."""
    return min(step / 10, 1.0) * 1e-2


def _applied_lrs(sched, steps=8):
    """The lr a compiled (inductor) step applies at each step, and the optimizer."""
    torch._dynamo.reset()
    w = torch.nn.Parameter(torch.zeros(4, 3))
    opt = mfx.TransformOptimizer([("w", w)], mfx.scale_by_learning_rate(sched)).compile()
    applied = []
    for _ in range(steps):
        w.grad = torch.ones(4, 3)
        before = w.detach().clone()
        opt.step()
        applied.append((before - w.detach()).mean().item())
    return applied, opt


def test_a_schedule_of_your_own_is_followed_by_the_compiled_step_on_every_torch():
    """``min(step / 10, 1.0)``: on torch 2.10 and 2.11 inductor's C++ casts the traced
    float to an integer, so the compiled step applied lr 0 for good (no training at
    all, silently); there the schedule is refused while tracing and the step runs
    eagerly; torch 2.13 compiles it right. Either way the applied lr is the schedule's."""
    applied, ex = _applied_lrs(_warmup_lambda)
    assert applied == pytest.approx([_warmup_lambda(t) for t in range(8)], rel=1e-5, abs=1e-9)
    assert _fell_back(ex) == mfx.schedules.FLOAT_MIN_MAX_MISCOMPILED


def test_where_torch_miscompiles_min_max_only_muonfxs_schedules_are_traced(monkeypatch, caplog):
    """With FLOAT_MIN_MAX_MISCOMPILED (set here, as on torch 2.10/2.11): a schedule of
    one's own sends the step eagerly with a warning that says why and what keeps it
    compiled, and trains as eagerly; muonfx's schedules (a join of them too) stay
    compiled."""
    import logging

    import muonfx.logs

    monkeypatch.setattr(muonfx.logs, "_said", set())  # said at WARNING even if said before in the process
    monkeypatch.setattr(mfx.schedules, "FLOAT_MIN_MAX_MISCOMPILED", True)
    assert mfx.schedules.traceable(mfx.schedules.warmup_cosine_decay(0.0, 1.0, 3, 20))
    assert mfx.schedules.traceable(mfx.momentum_warmup())
    assert not mfx.schedules.traceable(_warmup_lambda)
    assert not mfx.schedules.traceable(mfx.schedules.join([mfx.schedules.constant(1.0), _warmup_lambda], [3]))
    with caplog.at_level(logging.WARNING, logger="muonfx"):
        applied, ex = _applied_lrs(_warmup_lambda)
    assert _fell_back(ex) and applied == pytest.approx([_warmup_lambda(t) for t in range(8)], rel=1e-5, abs=1e-9)
    assert any("a schedule of your own" in r.getMessage() and "muonfx.schedules" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    sched = mfx.schedules.linear(1e-2, 0.0, 10)
    applied, ex = _applied_lrs(sched)
    assert not _fell_back(ex) and applied == pytest.approx([sched(t) for t in range(8)], rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
def test_a_bad_schedule_value_in_a_compiled_step_is_refused_and_changes_nothing(bad):
    """The check of a schedule's value holds in the compiled step as eagerly: a negative,
    NaN or infinite lr from step 3 on raises ValueError naming lr and the step, and
    leaves the parameters and the state as they were."""
    torch._dynamo.reset()
    sched = lambda count: 1e-2 if count < 3 else bad  # noqa: E731
    named = _named(9)
    opt = mfx.TransformOptimizer(named, mfx.chain(mfx.scale_by_adam(), mfx.scale_by_learning_rate(sched)))
    opt.compile(backend="aot_eager")
    for step in range(3):
        _grads(named, step)
        opt.step()
    _grads(named, 3)
    before = [p.detach().clone() for _, p in named]
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict()["state"].items()}
    with pytest.raises(ValueError, match=r"hyperparameter 'lr' is .* at step 3"):
        opt.step()
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, named))
    assert str(opt.state_dict()["state"]) == str(state)


def test_only_errors_raised_while_compiling_count_as_the_compilers():
    """The rule: dynamo's own errors, and other errors raised from dynamo's frame
    compilation, are the compiler's; the transforms' ValueError / TypeError, and errors
    of a running graph, are raised as they are."""
    from muonfx.optim.step.compiled import compiler_failed as _compiler_failed

    def raised(exc, filename):
        code = compile("raise exc", filename, "exec")
        try:
            exec(code, {"exc": exc})
        except BaseException as e:  # noqa: BLE001
            return e

    site = torch._dynamo.__file__.rsplit("/", 1)[0]
    assert _compiler_failed(raised(AssertionError("sympy expression is NaN"), f"{site}/convert_frame.py"))
    assert _compiler_failed(torch._dynamo.exc.Unsupported("no"))
    assert not _compiler_failed(raised(ValueError("hyperparameter 'lr' is nan"), f"{site}/convert_frame.py"))
    assert not _compiler_failed(raised(RuntimeError("out of memory"), "/tmp/compiled_graph.py"))
    assert not _compiler_failed(raised(KeyboardInterrupt(), f"{site}/convert_frame.py"))


def _public_transforms():
    return {name: (e.kind, e.build, e.check) for name, e in catalogue.select(catalogue.CONFORMANCE).items()}


@pytest.mark.parametrize("name", sweep(sorted(_public_transforms()), keep={"muon"}))
def test_every_public_transform_compiled_trains_as_eager_or_steps_eagerly(name):
    """``opt.compile()`` with every public transform (the conformance list): three steps
    never raise and end where the eager optimizer ends (float rounding apart); where the
    compiler cannot take a transform (``apply_if_finite``'s data-dependent choice) the
    step runs eagerly."""
    build = _public_transforms()[name][1]
    eager, _ = _train_public(build, None, 3)
    compiled, _ = _train_public(build, "aot_eager", 3)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_foreach_neg_mul_and_ema_are_the_eager_ops_and_trace_to_the_same_maths():
    """``foreach("neg_mul", us, s)`` is ``_foreach_mul(us, -s)`` and ``foreach("ema", m, g,
    beta)`` is ``_foreach_lerp(m, g, 1 - beta)`` bit for bit eagerly; traced (where the
    scalars must reach the graph as they are), the same values to float rounding, and a
    new scalar recompiles nothing."""
    from muonfx.ops import foreach

    gen = torch.Generator().manual_seed(7)
    us = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    ms = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    for got, want in zip(foreach("neg_mul", us, 0.37), torch._foreach_mul(us, -0.37)):
        assert torch.equal(got, want)
    for got, want in zip(foreach("ema", ms, us, 0.9), torch._foreach_lerp(ms, us, 1.0 - 0.9)):
        assert torch.equal(got, want)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    traced = torch.compile(lambda m, u, s, b: (foreach("neg_mul", u, s), foreach("ema", m, u, b)),
                           backend=counter, dynamic=True, fullgraph=True)
    for s, b in ((0.37, 0.9), (0.12, 0.95), (0.5, 0.85)):
        neg, ema = traced(ms, us, s, b)
        for got, want in zip(neg, torch._foreach_mul(us, -s)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for got, want in zip(ema, torch._foreach_lerp(ms, us, 1.0 - b)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, counter.frame_count


def test_one_cycle_lr_cycling_adams_beta1_trains_as_eager_compiled():
    """``OneCycleLR`` (``cycle_momentum=True``, its default) sets ``betas[0]`` and ``lr``
    at every step of an optimizer whose defaults hold ``betas``. A compiled AdamW step
    under it trains as the eager one does on every torch: one graph on 2.13; on 2.10 /
    2.11, which specialise the betas, one recompilation (detected), then eager steps,
    never one graph per value."""
    from torch.optim.lr_scheduler import OneCycleLR

    torch._dynamo.reset()
    named, ref = _named(2), _named(2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2).compile(backend=counter)
    eager = mfx.TransformOptimizer(ref, mfx.adamw, lr=1e-2)
    scheds = [OneCycleLR(o, max_lr=1e-2, total_steps=8) for o in (opt, eager)]
    seen, frames = set(), []
    for step in range(7):
        _grads(named, step)
        _grads(ref, step)
        for o, s in zip((opt, eager), scheds):
            o.step()
            s.step()
        seen.add(opt.param_groups[0]["betas"][0])
        frames.append(counter.frame_count)
    assert len(seen) >= 6, seen  # beta1 did change at every step
    specialised = opt.param_groups[0]["compile"] is False
    assert frames[-1] == frames[0] + int(specialised), f"graphs built: {frames}"
    if torch.__version__ >= "2.13":
        assert not specialised
    for (n, a), (_, b) in zip(ref, named):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
