"""The executor runs a large leafwise group in pieces: each piece computed and written
before the next, so a step's extra memory is bounded by the largest piece (the one
budget, ``muonfx.linalg.batch_bytes``), not by the model. The pieces compute what the
whole step computes, and a raising step still changes nothing."""

from __future__ import annotations

import math

import pytest
import torch

import muonfx as mfx
from muonfx.base import tree_tensors
from muonfx.memory import step_memory

MAT = (64, 96)
PIECE = MAT[0] * MAT[1] * 4  # one float32 matrix: the budget of the tests below
SHAPES = {**{f"w{i}": MAT for i in range(6)}, "stack": (3, 32, 48), "tall": (96, 64), "bias": (96,)}


@pytest.fixture
def budget():
    mfx.linalg.set_batch_bytes(PIECE, "cpu")
    yield PIECE
    mfx.linalg.set_batch_bytes(None, "cpu")


def _named(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in shapes.items()]


def _grads(named, step, skip=()):
    gen = torch.Generator().manual_seed(1000 + step)
    for k, p in named:
        g = torch.randn(p.shape, generator=gen)
        p.grad = None if k in skip else g


def _steps(pairs, steps, first=0):
    """Step every ``(named, opt)`` of ``pairs`` ``steps`` times on the same gradients."""
    for step in range(first, first + steps):
        for named, opt in pairs:
            _grads(named, step)
            opt.step()


def _whole(opt):
    """The same optimizer with pieces turned off (the reference)."""
    opt.executor._all_runs = lambda work: (None, [])
    return opt


def _same(a, b, got, ref, exact=True):
    for (n, x), (_, y) in zip(a, b):
        if exact:
            assert torch.equal(x, y), (n, (x - y).abs().max().item())
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    for i, (s, t) in enumerate(zip(tree_tensors(got.transform_state(0)), tree_tensors(ref.transform_state(0)))):
        assert torch.equal(s, t) if exact else torch.allclose(s, t, rtol=1e-5, atol=1e-6), i
    assert got.transform_state(0).count == ref.transform_state(0).count


@pytest.mark.parametrize("factory,kw", [
    (mfx.muon, {"lr": 0.02, "weight_decay": 0.1, "ns_dtype": torch.float32}),
    (mfx.adamw, {"lr": 1e-2, "weight_decay": 0.1}),
    (mfx.muon_adamw, {"lr": 0.02, "ns_dtype": torch.float32, "adamw_lr": 1e-2}),
], ids=["muon", "adamw", "muon_adamw"])
def test_pieces_compute_what_the_whole_step_computes(budget, factory, kw):
    shapes = {k: v for k, v in SHAPES.items() if factory is not mfx.muon or k != "bias"}
    a, b = _named(shapes), _named(shapes)
    got = mfx.TransformOptimizer(a, factory, **kw)
    ref = _whole(mfx.TransformOptimizer(b, factory, **kw))
    for o in (got, ref):
        o.executor.auto = False
    _steps([(a, got), (b, ref)], 5)
    _grads(a, 5)
    plan = got.executor.pieces(_work(got))
    assert plan is not None and len(plan) >= len(shapes) - 2, plan  # about one matrix a piece
    # same-shape matrices together, every parameter exactly once
    assert sorted(j for piece in plan for j in piece) == list(range(len(shapes)))
    _same(a, b, got, ref)


def test_the_pieces_bound_the_step_memory(budget):
    """12 matrices: the whole eager step holds the new state and two links of the chain
    (about 3.5 P); in pieces it holds a few pieces' worth, whatever the model's size."""
    shapes = {f"w{i}": MAT for i in range(12)}
    a, b = _named(shapes), _named(shapes)
    got = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, ns_dtype=torch.float32)
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, lr=0.02, ns_dtype=torch.float32))
    mems = {}
    for name, named, opt in (("pieces", a, got), ("whole", b, ref)):
        opt.executor.auto = False
        for step in range(3):
            _grads(named, step)
            mems[name] = step_memory(opt.step, torch.device("cpu"))
    model = 12 * PIECE
    assert mems["whole"] >= 3 * model, mems["whole"] / model
    assert mems["pieces"] <= 8 * PIECE, mems["pieces"] / PIECE
    # twice the matrices: the same bound
    shapes = {f"w{i}": MAT for i in range(24)}
    c = _named(shapes)
    opt = mfx.TransformOptimizer(c, mfx.muon, lr=0.02, ns_dtype=torch.float32)
    opt.executor.auto = False
    for step in range(3):
        _grads(c, step)
        mem = step_memory(opt.step, torch.device("cpu"))
    assert mem <= 8 * PIECE, mem / PIECE


def test_groups_at_most_the_budget_and_transforms_that_are_not_leafwise_run_whole(budget):
    small = {"w0": MAT}  # one piece would hold it all
    a = _named(small)
    opt = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, ns_dtype=torch.float32)
    clipped = _named(seed=1)
    # a global norm over all parameters: splitting would change it
    tx = mfx.chain(mfx.clip_by_global_norm(1e-3), mfx.scale(-0.1))
    assert not mfx.is_leafwise(tx)
    opt2 = mfx.TransformOptimizer(clipped, tx)
    ref_named = _named(seed=1)
    ref = _whole(mfx.TransformOptimizer(ref_named, tx))
    for o in (opt, opt2, ref):
        o.executor.auto = False
    for step in range(3):
        _grads(a, step)
        _grads(clipped, step)
        _grads(ref_named, step)
        opt.step()
        opt2.step()
        ref.step()
    assert opt.executor.pieces(_work(opt)) is None
    assert opt2.executor.pieces(_work(opt2)) is None
    for (n, x), (_, y) in zip(clipped, ref_named):
        assert torch.equal(x, y), n


def _counting(opt):
    """``opt`` recording the positions of every piece its executor runs after the first."""
    runs = []
    real = opt.executor._eager_piece
    opt.executor._eager_piece = lambda ctx, n, result: (runs.append(tuple(ctx.pieces[n][1].idx)), real(ctx, n, result))[1]
    return runs


def _matrices(seed=0):
    return [(n, p) for n, p in _named(seed=seed) if n != "bias"]


def test_the_first_step_runs_whole_and_cohorts_run_in_pieces(budget):
    """Step 0 creates the state (whole); from step 1 on the group runs in pieces, also at
    step 2, where ``w1`` has no gradient (it keeps its counters: torch's per-parameter
    ``step``), and at steps 3-4, where ``w1`` steps one count behind the others (a cohort
    of its own, in pieces from its own counters). Parameters, state and counters end
    exactly as with whole steps."""
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32, momentum=lambda step: 0.9 + 0.01 * min(step, 5))
    got = mfx.TransformOptimizer(a, mfx.muon, **kw)
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    got.executor.auto = ref.executor.auto = False
    runs = _counting(got)
    for i, skip in enumerate([(), (), ("w1",), (), ()]):
        _grads(a, i, skip)
        _grads(b, i, skip)
        before = len(runs)
        got.step()
        ref.step()
        assert (len(runs) > before) == (i >= 1), (i, runs)
        assert got.records[0].own == ref.records[0].own, i
    assert set(got.records[0].own) == {("w1",)}
    _same(a, b, got, ref)


def test_a_new_static_hyperparameter_makes_a_whole_step_first(budget):
    a = _matrices()
    got = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, ns_dtype=torch.float32)
    got.executor.auto = False
    runs = _counting(got)
    for step in range(5):
        if step == 3:
            got.param_groups[0]["adjust_lr"] = "spectral"  # another transform
        before = len(runs)
        _grads(a, step)
        got.step()
        assert (len(runs) > before) == (step in (1, 2, 4)), step


@pytest.mark.parametrize("bad", ["nan_lr", "schedule"])
def test_a_raising_step_in_pieces_changes_nothing(budget, bad):
    a = _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    if bad == "schedule":
        kw["weight_decay"] = lambda step: 0.1 if step < 3 else float("nan")
    opt = mfx.TransformOptimizer(a, mfx.muon, **kw)
    opt.executor.auto = False
    for step in range(3):
        _grads(a, step)
        opt.step()
    assert opt.executor.pieces(_work(opt)) is not None
    if bad == "nan_lr":
        opt.param_groups[0]["lr"] = float("nan")
    params = [p.detach().clone() for _, p in a]
    state = [t.clone() for t in tree_tensors(opt.transform_state(0))]
    count = opt.transform_state(0).count
    _grads(a, 3)
    with pytest.raises(ValueError, match="lr" if bad == "nan_lr" else "weight_decay"):
        opt.step()
    for (n, p), q in zip(a, params):
        assert torch.equal(p, q), n
    for s, t in zip(tree_tensors(opt.transform_state(0)), state):
        assert torch.equal(s, t)
    assert opt.transform_state(0).count == count


def _work(opt):
    from muonfx.optim.groups import gather

    return gather(opt.records[0], opt.param_groups[0])


@pytest.mark.slow
def test_compiled_pieces_match_eager_and_bound_the_graphs_memory(budget):
    torch._dynamo.reset()
    shapes = {k: v for k, v in SHAPES.items() if k != "bias"}
    a, b = _named(shapes), _named(shapes)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    comp = mfx.TransformOptimizer(a, mfx.muon, **kw).compile(backend="aot_eager")
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    ref.executor.auto = False
    _steps([(a, comp), (b, ref)], 4)
    # the first compiled step ran one graph and measured it (aot_eager fuses nothing: it
    # holds the whole chain), so later steps run one graph per piece
    assert list(comp.executor._compiled_mode.values()) == ["pieces"]
    graphs = [k for k, f in comp.executor._compiled.items() if f is not None]
    pieces = [k for k in graphs if k[0] == "piece"]
    assert len(graphs) == len(pieces) + 1 and all(len(k[1][1]) < len(shapes) for k in pieces), graphs
    _same(a, b, comp, ref, exact=False)


def test_pieces_survive_a_checkpoint(budget):
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    got = mfx.TransformOptimizer(a, mfx.muon, **kw)
    got.executor.auto = False
    for step in range(3):
        _grads(a, step)
        got.step()
    sd = got.state_dict()
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    again = mfx.TransformOptimizer(b, mfx.muon, **kw)
    again.executor.auto = False
    again.load_state_dict(sd)
    _steps([(a, got), (b, again)], 3, first=3)
    _same(a, b, got, again)
    assert math.isfinite(sum(p.sum().item() for _, p in a))


@pytest.mark.slow
def test_the_measured_choice_compiles_a_group_that_runs_in_pieces(budget, monkeypatch):
    """The automatic choice times pieces eagerly and compiled; a faster compiled step is
    kept (its graphs are the pieces', not one for the whole group)."""
    torch._dynamo.reset()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"}))
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    opt = mfx.TransformOptimizer(a, mfx.muon, **kw)
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    ref.executor.auto = False
    opt.executor.auto_min_elements = 0
    ticks = iter([0.0, 1.0, 10.0, 10.5, 20.0, 21.0, 30.0, 30.5, 40.0, 41.0, 50.0, 50.5])  # eager 1 s, compiled 0.5 s
    opt.executor._clock = lambda: next(ticks)
    # steps: 0 creates the state, 1 eager timed, 2 builds the one graph and measures its
    # memory (too much: pieces), 3 builds the pieces' graphs, 4-8 C, E, C, E, C (timed):
    # chosen
    _steps([(a, opt), (b, ref)], 9)
    assert list(opt.executor.choices.values()) == ["compiled"]
    assert list(opt.executor._compiled_mode.values()) == ["pieces"]
    pieces = [k for k, f in opt.executor._compiled.items() if f is not None and k[0] == "piece"]
    assert len(pieces) > 1 and all(len(k[1][1]) < len(a) for k in pieces), pieces
    _same(a, b, opt, ref, exact=False)


@pytest.mark.slow
def test_a_compiled_step_that_stores_in_place_stays_one_graph(budget):
    """Inductor compiles AdamW's whole step into in-place loops: the measured first
    compiled step holds (almost) nothing, so it stays one graph (pieces would only cost
    a graph and a call each)."""
    torch._dynamo.reset()
    a, b = _named(), _named()
    comp = mfx.TransformOptimizer(a, mfx.adamw, lr=1e-2, weight_decay=0.1).compile()
    ref = mfx.TransformOptimizer(b, mfx.adamw, lr=1e-2, weight_decay=0.1)
    ref.executor.auto = False
    _steps([(a, comp), (b, ref)], 4)
    assert list(comp.executor._compiled_mode.values()) == ["whole"]
    assert not [k for k, f in comp.executor._compiled.items() if f is not None and k[0] == "piece"]
    for (n, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_the_first_compiled_step_leaves_a_running_profiler_alone(budget):
    """Under the user's own profiler the first compiled step cannot measure its memory
    without ending the user's profiling session: it does not measure (one graph stays),
    and the user's profile keeps its events."""
    from torch.profiler import profile

    torch._dynamo.reset()
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    comp = mfx.TransformOptimizer(a, mfx.muon, **kw).compile(backend="aot_eager")
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    ref.executor.auto = False
    with profile() as prof:
        _steps([(a, comp), (b, ref)], 3)
    assert list(comp.executor._compiled_mode.values()) == ["whole"]
    assert any(e.name == "aten::bmm" for e in prof.events())  # the profile survived
    _same(a, b, comp, ref, exact=False)


def test_set_batch_bytes_returns_the_setting_it_replaced_and_refuses_bad_budgets():
    from muonfx.linalg import batch_bytes, set_batch_bytes

    default = batch_bytes("cpu")
    assert set_batch_bytes(1 << 20, "cpu") is None          # the default was in force
    assert set_batch_bytes(1 << 10, "cpu") == 1 << 20
    assert set_batch_bytes(None, "cpu") == 1 << 10
    assert batch_bytes("cpu") == default
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="nbytes"):
            set_batch_bytes(bad, "cpu")
    assert batch_bytes("cpu") == default                     # nothing changed
