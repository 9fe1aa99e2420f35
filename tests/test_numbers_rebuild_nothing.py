"""Numbers change, nothing rebuilds: an lr scheduler, a momentum (or betas) change and a
weight-decay change between steps run a group's chain with the new values, without
calling its preset again (Muon, AdamW, the hybrid optimizer); a change of a static
setting (``nesterov``, ``ns_steps``) builds the chain again. Every step computes what
the optimizer computed when it called the preset again at each change, bit for bit."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx
import muonfx.presets.standard as standard
import muonfx.inject as inject

STEPS = 20


@pytest.fixture
def builds(monkeypatch):
    """How many chains :func:`muonfx.muon` and :func:`muonfx.adamw` have built (each
    build of either, and of :func:`muonfx.muon_adamw`, goes through ``named_chain``)."""
    n = [0]
    real = standard.named_chain

    def counted(*named):
        n[0] += 1
        return real(*named)

    monkeypatch.setattr(standard, "named_chain", counted)
    return n


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
        self.w1 = torch.nn.Parameter(torch.randn(12, 8, generator=gen))
        self.w2 = torch.nn.Parameter(torch.randn(2, 8, 12, generator=gen))
        self.b1 = torch.nn.Parameter(torch.randn(12, generator=gen))


def _grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _matrices(model):
    return [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]


MAKERS = {
    "muon": lambda m: mfx.TransformOptimizer(_matrices(m), mfx.muon, lr=0.02, momentum=0.95, weight_decay=0.01),
    "adamw": lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.adamw, lr=1e-2, weight_decay=0.01),
    "adamw_chain": lambda m: mfx.TransformOptimizer(
        [{"params": [p for _, p in m.named_parameters()], "param_names": [n for n, _ in m.named_parameters()],
          "fused": False}], mfx.adamw, lr=1e-2, weight_decay=0.01),
    "hybrid": lambda m: mfx.create_hybrid_optimizer(m, muon_lr=0.02, adamw_lr=1e-2, muon_weight_decay=0.01),
    "muon_optimizer": lambda m: mfx.MuonOptimizer(m.named_parameters(), lr=0.02, momentum=0.95, weight_decay=0.01),
}


def _train(make, change=None, counts=None):
    """20 steps under an lr scheduler, the momentum (Adam's betas) changed at step 6 and
    the weight decay at step 11 (and ``change(step, group)`` if given); the parameters
    after them, and (``counts``: the build counter) the builds after construction and
    after every step."""
    model = Net()
    opt = make(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    seen = [counts[0]] if counts is not None else []
    for step in range(STEPS):
        for group in opt.param_groups:
            if step == 6:
                if "momentum" in group:
                    group["momentum"] = 0.9
                if "betas" in group:
                    group["betas"] = (0.85, 0.99)
            if step == 11:
                group["weight_decay"] = 0.05
            if change is not None:
                change(step, group)
        _grads(model, step)
        opt.step()
        sched.step()
        if counts is not None:
            seen.append(counts[0])
    return opt, [p.detach().clone() for p in model.parameters()], seen


def _rebuilding(make, monkeypatch, change=None):
    """The same training, each group's preset called again whenever a number changes (no
    late-bound hyperparameters: how the optimizer stepped before they existed)."""
    with monkeypatch.context() as m:
        m.setattr(inject, "late_bound_names", lambda factory: frozenset())
        return _train(make, change)[1]


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_schedule_and_changed_numbers_build_no_chain(name, builds, monkeypatch):
    want = _rebuilding(MAKERS[name], monkeypatch)
    builds[0] = 0
    opt, got, seen = _train(MAKERS[name], counts=builds)
    # the groups' chains were built with the optimizer (one per Muon or AdamW group), never again
    assert seen[0] == len(opt.param_groups), seen
    assert seen == [seen[0]] * (STEPS + 1), seen
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()
    for group in opt.param_groups:  # the numbers each step used are the group's
        assert group["weight_decay"] == 0.05
    if name in ("adamw", "hybrid", "muon_optimizer"):  # AdamW groups still run torch's fused kernel
        paths = {g.index: g.path for g in opt.plan.groups}
        adamw_groups = [i for i, r in enumerate(opt.records) if "betas" in opt.param_groups[i]]
        assert adamw_groups and all(paths[i] == "fused" for i in adamw_groups), opt.plan


def test_the_fused_adamw_path_under_changing_numbers_is_torch_fused_adamw(builds):
    model, ref = Net(), Net()
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw, lr=1e-2, weight_decay=0.01)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9) for o in (opt, torch_opt)]
    built = builds[0]
    for step in range(STEPS):
        for o in (opt, torch_opt):
            if step == 6:
                o.param_groups[0]["betas"] = (0.85, 0.99)
            if step == 11:
                o.param_groups[0]["weight_decay"] = 0.05
        _grads(model, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
        for s in scheds:
            s.step()
    assert builds[0] == built
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def _nesterov_off(step, group):
    if step == 5 and "nesterov" in group:
        group["nesterov"] = False


def _fewer_ns_steps(step, group):
    if step == 5 and "ns_steps" in group:
        group["ns_steps"] = 3  # a number, but one the chain's structure depends on


def _chain(make):
    """``make`` with every group on its chain (``"fused": False``): Muon's lowering
    (tests/test_fused_muon.py) reads a changed ``ns_steps`` as a value and builds no chain."""
    def made(m):
        opt = make(m)
        for g in opt.param_groups:
            g["fused"] = False
        return opt
    return made


@pytest.mark.parametrize("change", [_nesterov_off, _fewer_ns_steps], ids=["nesterov", "ns_steps"])
@pytest.mark.parametrize("name", ["muon", "hybrid"])
def test_a_static_setting_change_builds_the_chain_again_and_steps_by_it(name, change, builds, monkeypatch):
    make = _chain(MAKERS[name])
    want = _rebuilding(make, monkeypatch, change)
    builds[0] = 0
    opt, got, seen = _train(make, change, counts=builds)
    # the Muon group's chain built once more, at step 5; the numbers after it built nothing
    assert seen[:6] == [seen[0]] * 6 and seen[6:] == [seen[0] + 1] * (STEPS - 5), seen
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()


def test_a_static_setting_change_steps_as_the_chain_built_for_it():
    """The functional loop, the chain built again for the new setting on the same state:
    what the optimizer computes after ``nesterov`` changes."""
    model = Net()
    named = _matrices(model)
    params = [p for _, p in named]
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02, weight_decay=0.01, fused=False)  # the chain
    ref = [p.detach().clone() for p in params]
    keys = [n for n, _ in named]
    td = lambda ts: mfx.core.build([(k,) for k in keys], list(ts))  # noqa: E731
    state = mfx.muon(lr=0.02, weight_decay=0.01).init(td(ref))
    for step in range(8):
        nesterov = step < 4
        opt.param_groups[0]["nesterov"] = nesterov
        opt.param_groups[0]["lr"] = 0.02 * 0.9 ** step
        _grads(model, step)
        opt.step()
        tx = mfx.muon(lr=0.02 * 0.9 ** step, weight_decay=0.01, nesterov=nesterov)
        upd, state = tx.update(td([p.grad for p in params]), state, td(ref))
        ref = [r + upd[(k,)] for r, k in zip(ref, keys)]
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r)


def test_a_factory_without_late_bound_numbers_is_called_again_for_new_numbers():
    """A factory of one's own (not :func:`muonfx.hyperparams.late_bound`) builds its
    transform from the numbers: called again when one changes, not when none does."""
    calls = []

    def my_sgd(lr=0.1, momentum=0.9):
        calls.append((lr, momentum))
        return mfx.chain(mfx.momentum(momentum), mfx.scale_by_learning_rate(lr))

    model = Net()
    opt = mfx.TransformOptimizer(_matrices(model), my_sgd)
    for step in range(3):
        _grads(model, step)
        opt.step()
    assert len(calls) == 1  # the transform of the initial values, reused while they stay
    opt.param_groups[0]["lr"] = 0.05
    _grads(model, 3)
    opt.step()
    assert len(calls) == 2 and calls[-1] == (0.05, 0.9)
    declared = mfx.hyperparams.late_bound("lr", "momentum")(my_sgd)
    calls.clear()
    model = Net()
    opt = mfx.TransformOptimizer(_matrices(model), declared)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(4):
        _grads(model, step)
        opt.param_groups[0]["momentum"] = 0.9 - 0.1 * step
        opt.step()
        sched.step()
    assert len(calls) == 1 and opt.transform_state(0).hyperparams == {"lr": 0.1 * 0.5 ** 3, "momentum": 0.9 - 0.1 * 3}


def test_a_compiled_step_builds_its_chains_once_and_follows_the_numbers(builds, monkeypatch):
    """``opt.compile()``: the graph's chains are built when it is (once), and the
    scheduler's lr, the new momentum and weight decay reach it as inputs: no chain built,
    nothing recompiled, the eager training's parameters."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = lambda m: MAKERS["hybrid"](m).compile(backend=counter)  # noqa: E731
    want = _rebuilding(MAKERS["hybrid"], monkeypatch)
    builds[0] = 0
    _, got, seen = _train(compiled, counts=builds)
    assert counter.frame_count == 1
    assert seen[1:] == [seen[1]] * STEPS, seen  # built with the optimizer and with its graph, then never
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


#: the catalogue presets and Muon variants whose lr and weight decay (and, where their
#: transforms read them at update time, momentum, betas, eps, NorMuon's beta2 and row_eps,
#: the momentum warm-up's numbers) are late-bound
LATE_PRESETS = {
    "lion": {"lr": 1e-3, "weight_decay": 0.1}, "adopt": {"lr": 1e-3, "weight_decay": 0.1},
    "laprop": {"lr": 1e-3, "weight_decay": 0.1}, "cautious_adamw": {"lr": 1e-3, "weight_decay": 0.1},
    "mars_adamw": {"lr": 1e-3, "weight_decay": 0.1},
    "dion2": {"lr": 1e-2, "weight_decay": 0.1}, "soap": {"lr": 1e-3, "weight_decay": 0.1},
    "mars_muon": {"lr": 0.02, "weight_decay": 0.1}, "moonlight": {"lr": 1e-3, "weight_decay": 0.1},
    "muon_cautious": {"lr": 0.02, "weight_decay": 0.1},
    "muon_per_head": {"lr": 0.02, "weight_decay": 0.1, "split_sizes": 4, "qkv_pattern": "w1"},
    "optax_muon": {"lr": 0.02, "weight_decay": 0.1},
    "normuon": {"lr": 0.02, "weight_decay": 0.1},
    "modded_nanogpt_normuon": {"lr": 0.02, "weight_decay": 0.1},
    "muon_with_momentum_warmup": {"lr": 0.02, "weight_decay": 0.1, "warmup_steps": 4},
    "schedule_free_adamw": {"lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 3},
}


def _another(name, value):
    """Another value of the number ``name``, as a user sets one between steps: an lr 10 %
    lower, a weight decay 0.01 higher, a momentum or beta 0.02 lower, an epsilon ten
    times larger, a step count two more."""
    if isinstance(value, (tuple, list)):
        return tuple(_another(name, v) for v in value)
    if isinstance(value, int):
        return value + 2
    if name == "lr":
        return value * 0.9
    if name == "weight_decay":
        return value + 0.01
    return value * 10 if "eps" in name else value - 0.02


def _other_numbers(factory, group):
    """The late-bound numbers of ``factory`` in ``group`` but lr and weight decay."""
    return sorted(n for n in mfx.hyperparams.late_bound_names(factory)
                  if n in group and n not in ("lr", "weight_decay") and not callable(group[n]))


def _counted(factory):
    """``factory`` wrapped to count its calls (the wrapper keeps its name and late-bound
    declaration), and the one-element list that counts them."""
    import functools

    calls = [0]

    @functools.wraps(factory)
    def counted(*args, **kwargs):
        calls[0] += 1
        return factory(*args, **kwargs)

    return counted, calls


@pytest.mark.filterwarnings("ignore::muonfx.MeaningChangedWarning")  # a new eps, on purpose
@pytest.mark.parametrize("name", sorted(LATE_PRESETS))
def test_late_bound_presets_build_once_under_a_scheduler_and_a_new_weight_decay(name, monkeypatch):
    """The preset is called once (when the optimizer is built) for 10 steps under an lr
    scheduler with the weight decay changed at step 5 and every other late-bound number
    at step 7, and the steps are bit for bit what calling it again at each change computes."""
    counted, calls = _counted(getattr(mfx, name))

    def run(factory):
        model = Net()
        opt = mfx.TransformOptimizer(_matrices(model), factory, **LATE_PRESETS[name])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        built = calls[0]
        group = opt.param_groups[0]
        others = _other_numbers(getattr(mfx, name), group)
        for step in range(10):
            if step == 5:
                group["weight_decay"] = 0.02
            if step == 7:
                changed.extend(others)
                for n in others:
                    group[n] = _another(n, group[n])
            _grads(model, step)
            opt.step()
            sched.step()
        return [p.detach().clone() for p in model.parameters()], calls[0] - built

    changed: list = []
    got, more = run(counted)
    assert more == 0, f"{name}: called {more} more times after the optimizer was built (numbers changed: {changed})"
    with monkeypatch.context() as m:
        m.setattr(inject, "late_bound_names", lambda factory: frozenset())
        want, rebuilt = run(counted)
    assert rebuilt > 0  # the comparison is with a path that did call it again
    for a, b in zip(got, want):
        assert torch.equal(a, b), (name, (a - b).abs().max())


#: the Muon variants whose every number is late-bound, with the numbers a compiled step
#: must follow without compiling again; ``eps`` is left out: Newton-Schulz passes it to its
#: operator as a float, which the compiler pins (a new eps compiles again for every Muon
#: preset, ``muon`` too)
COMPILED_NUMBERS = {
    "normuon": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "beta2": 0.95, "row_eps": 1e-10},
    "modded_nanogpt_normuon": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "beta2": 0.95, "row_eps": 1e-10},
    "muon_with_momentum_warmup": {"lr": 0.02, "weight_decay": 0.1, "momentum_start": 0.85, "momentum_end": 0.95,
                                  "warmup_steps": 6},
}


@pytest.mark.parametrize("name", sorted(COMPILED_NUMBERS))
def test_a_compiled_variant_follows_every_new_number_without_compiling_again(name, monkeypatch):
    """``opt.compile()`` with a new value of every late-bound number (lr and weight decay
    included) at each step: the preset is called when the optimizer and its graph are
    built, never again; the graph is compiled once (no recompilation, the group's
    ``"compile"`` setting stays True) and steps as the eager optimizer does."""
    import torch._dynamo.testing

    counted, calls = _counted(getattr(mfx, name))

    def run(compiled):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        model = Net()
        opt = mfx.TransformOptimizer(_matrices(model), counted, **COMPILED_NUMBERS[name])
        if compiled:
            opt.compile(backend=counter)
        seen = []
        for step in range(8):
            if step >= 2:  # steps 0 and 1 with the first numbers, then a new value of each
                for n in COMPILED_NUMBERS[name]:
                    opt.param_groups[0][n] = _another(n, opt.param_groups[0][n])
            _grads(model, step)
            opt.step()
            seen.append((calls[0], counter.frame_count))
        return opt, [p.detach().clone() for p in model.parameters()], seen

    want = run(compiled=False)[1]
    calls[0] = 0
    opt, got, seen = run(compiled=True)
    assert seen[0][1] >= 1 and seen == [seen[0]] * len(seen), seen  # built and compiled at step 0, then nothing
    assert opt.param_groups[0]["compile"] is True and opt.plan.groups[0].path == "compiled", opt.plan
    assert len(opt.compiled_graphs) == 1, opt.compiled_graphs
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_number_of_normuon_that_once_meant_another_warns_from_the_optimizer_too():
    """normuon's ``eps`` is late-bound, so the optimizer gives the preset a slot for it;
    the warning of its changed meaning (the row epsilon is ``row_eps`` now) still comes,
    once, when the group is made, and not for the default."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mfx.TransformOptimizer(_matrices(Net()), mfx.normuon)
        assert not [w for w in caught if w.category is mfx.MeaningChangedWarning]
        mfx.TransformOptimizer(_matrices(Net()), mfx.normuon, eps=1e-8)
    said = [w for w in caught if w.category is mfx.MeaningChangedWarning]
    assert len(said) == 1 and "normuon(eps=1e-08)" in str(said[0].message) and said[0].filename == __file__, said


def test_the_momentum_warmup_steps_as_muon_with_its_momentum_set_by_hand():
    """``muon_with_momentum_warmup`` under an lr scheduler, with its weight decay, ``eps``,
    ``ns_steps`` and warm-up end changed between steps, steps bit for bit as ``muon`` whose
    momentum is set by hand to the warm-up's value at each step: every number reaches it."""
    def run(factory, **kw):
        model = Net()
        opt = mfx.TransformOptimizer(_matrices(model), factory, lr=0.02, weight_decay=0.01, fused=False, **kw)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        group, end = opt.param_groups[0], 0.95
        for step in range(8):
            if step == 2:
                group["weight_decay"], group["eps"] = 0.05, 1e-3
            if step == 3:
                group["ns_steps"] = 3
            if step == 4:
                end = 0.9
                if factory is mfx.muon_with_momentum_warmup:
                    group["momentum_end"] = end
            if factory is mfx.muon:
                group["momentum"] = mfx.momentum_warmup(0.85, end, 6)(step)
            _grads(model, step)
            opt.step()
            sched.step()
        return [p.detach().clone() for p in model.parameters()]

    got = run(mfx.muon_with_momentum_warmup, warmup_steps=6)
    want = run(mfx.muon)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()


def _schedule_free_run(fused=None, compiled=None):
    """:func:`muonfx.schedule_free_adamw` for ``STEPS`` steps under an lr scheduler, every
    other number changed once; the optimizer and the training weights after them."""
    model = Net()
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.schedule_free_adamw, lr=1e-2, weight_decay=0.1,
                                 warmup_steps=3, fused=fused)
    if compiled is not None:
        opt.compile(backend=compiled)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for step in range(STEPS):
        group = opt.param_groups[0]
        if step == 4:
            group["warmup_steps"] = 8
        if step == 7:
            group["betas"], group["eps"] = (0.8, 0.99), 1e-6
        if step == 9:
            group["r"], group["weight_lr_power"] = 0.5, 1.0
        if step == 11:
            group["weight_decay"] = 0.02
        _grads(model, step)
        opt.step()
        sched.step()
    return opt, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fused", [None, False], ids=["lowered", "chain"])
def test_schedule_free_adamw_builds_once_whatever_number_changes(fused, monkeypatch):
    """``schedule_free_adamw``'s numbers are all late-bound (lr, betas, eps, weight decay,
    warm-up steps, r, weight_lr_power): under a scheduler and a change of each, the preset
    is called once (its chain and the plan's lowering alike), and every step of the chain is
    bit for bit what calling it again computes."""
    import muonfx.presets.catalogue as catalogue

    calls = [0]
    real = catalogue.schedule_free

    def counted(*args, **kwargs):  # one call per build of the preset
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(catalogue, "schedule_free", counted)

    def run():
        built = calls[0]
        opt, y = _schedule_free_run(fused)
        assert opt.plan.groups[0].path == ("eager" if fused is False else "fused")
        opt.eval()
        return y + [p.detach().clone() for p in opt.param_groups[0]["params"]], calls[0] - built

    got, built = run()
    assert built == 1, f"called {built} times: once when the optimizer was built, then never"
    with monkeypatch.context() as m:
        m.setattr(inject, "late_bound_names", lambda factory: frozenset())
        want, rebuilt = run()
    # the chain's comparison is with a path that calls it again at each new lr (the lowering
    # reads the numbers as values in both: tests/test_fused_schedule_free.py compares it with the chain)
    assert rebuilt >= STEPS if fused is False else rebuilt == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()


def test_a_compiled_schedule_free_adamw_step_compiles_once_whatever_number_changes(monkeypatch):
    """``opt.compile()``: every number of ``schedule_free_adamw`` reaches the graph as an
    input (the warm-up written without a branch on the step), so a scheduler, the end of
    the warm-up and a change of each number compile nothing again; the steps are the
    eager chain's within the compiler's float32 rounding."""
    import torch._dynamo.testing

    def run(compiled):
        opt, y = _schedule_free_run(False, compiled)
        assert opt.plan.groups[0].path == ("eager" if compiled is None else "compiled")
        return y

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    got = run(counter)
    assert counter.frame_count == 1
    for a, b in zip(got, run(None)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
