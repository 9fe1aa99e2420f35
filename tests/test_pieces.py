"""A large leafwise group runs in pieces (its step plan says so): each piece computed and
written before the next, so a step's extra memory is bounded by the largest piece (the
one budget, ``muonfx.linalg.batch_bytes``), not by the model. The pieces compute what the
whole step computes, everything muonfx can detect is detected before the first write,
and an error of a transform of one's own in a later piece says what was stepped."""

from __future__ import annotations

import math

import pytest
import torch

import muonfx as mfx
import muonfx.counts
from muonfx.tree import tensors as tree_tensors
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
    """The same optimizer with pieces turned off (the reference): its plan is built under
    a budget that holds the whole group, and keeps it (a plan holds its settings)."""
    old = mfx.linalg.set_batch_bytes(1 << 40, "cpu")
    try:
        assert opt.plan.groups[0].pieces is None
    finally:
        mfx.linalg.set_batch_bytes(old, "cpu")
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
    (mfx.adamw, {"lr": 1e-2, "weight_decay": 0.1, "fused": False}),  # the chain, not the fused kernel
    (mfx.muon_adamw, {"lr": 0.02, "ns_dtype": torch.float32, "adamw_lr": 1e-2}),
], ids=["muon", "adamw", "muon_adamw"])
def test_pieces_compute_what_the_whole_step_computes(budget, factory, kw):
    shapes = {k: v for k, v in SHAPES.items() if factory is not mfx.muon or k != "bias"}
    a, b = _named(shapes), _named(shapes)
    got = mfx.TransformOptimizer(a, factory, **kw)
    ref = _whole(mfx.TransformOptimizer(b, factory, **kw))
    _steps([(a, got), (b, ref)], 5)
    plan = got.plan.groups[0].pieces
    assert plan is not None and len(plan) >= len(shapes) - 2, plan  # about one matrix a piece
    # same-shape matrices together, every parameter exactly once
    assert sorted(j for piece in plan for j in piece) == list(range(len(shapes)))
    assert f"{len(plan)} pieces" in str(got.plan)
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
    for step in range(3):
        _grads(a, step)
        _grads(clipped, step)
        _grads(ref_named, step)
        opt.step()
        opt2.step()
        ref.step()
    assert opt.plan.groups[0].pieces is None
    assert opt2.plan.groups[0].pieces is None
    for (n, x), (_, y) in zip(clipped, ref_named):
        assert torch.equal(x, y), n


def _matrices(seed=0):
    return [(n, p) for n, p in _named(seed=seed) if n != "bias"]


def test_pieces_from_the_first_step_and_with_missing_gradients(budget):
    """The group runs in pieces from its first step on, also at step 2, where ``w1`` has
    no gradient (it keeps its counts: torch's per-parameter ``step``; the plan leaves it
    out), and at steps 3-4, where ``w1`` steps one count behind the others (per-parameter
    counts: the momentum schedule at its own count, in the same pieces). Parameters,
    state and counts end exactly as with whole steps."""
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32, momentum=lambda step: 0.9 + 0.01 * min(step, 5))
    got = mfx.TransformOptimizer(a, mfx.muon, **kw)
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    for i, skip in enumerate([(), (), ("w1",), (), ()]):
        _grads(a, i, skip)
        _grads(b, i, skip)
        got.step()
        ref_budget = mfx.linalg.set_batch_bytes(1 << 40, "cpu")
        ref.step()
        mfx.linalg.set_batch_bytes(ref_budget, "cpu")
        g = got.plan.groups[0]
        assert g.pieces is not None and g.partial == (i == 2), (i, g)
        assert ref.plan.groups[0].pieces is None
        assert ("w1",) not in g.keys if i == 2 else ("w1",) in g.keys
    sd = got.state_dict()["state"]
    assert sd[1]["count"] == sd[0]["count"] - 1 == 4
    _same(a, b, got, ref)


def test_a_parameter_resized_before_a_step_in_pieces_raises_before_anything_is_written(budget):
    """A parameter resized between steps (its state made for the old shape) in the last
    piece: the plan's dry run finds the mismatch before the first piece is written, and
    the step changes nothing (it used to leave the first pieces stepped)."""
    a = _matrices()
    opt = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, ns_dtype=torch.float32)
    for step in range(2):
        _grads(a, step)
        opt.step()
    assert opt.plan.groups[0].pieces is not None
    name, last = a[-1]
    params = [p.detach().clone() for _, p in a[:-1]]
    state = [t.clone() for t in tree_tensors(opt.transform_state(0))]
    last.data = torch.randn(last.shape[0] + 4, last.shape[1])
    _grads(a, 2)
    with pytest.raises(ValueError, match=f"'{name}'.*shape"):
        opt.step()
    for (n, p), q in zip(a, params):
        assert torch.equal(p, q), n
    for s, t in zip(tree_tensors(opt.transform_state(0)), state):
        assert torch.equal(s, t)
    assert opt.transform_state(0).count == 2


class _Counted(__import__("typing").NamedTuple):
    count: object


def _raises_on_tall(exc: BaseException) -> mfx.GradientTransformation:
    """A leafwise transform of one's own (``-0.1 * u``, counted per parameter) that raises
    ``exc`` when its update meets parameter "tall" from its third step on."""

    def update(updates, state, params=None):
        keys, us = mfx.core.leaves(updates)
        if ("tall",) in keys and max(mfx.counts.values_of(state.count)) >= 2:
            raise exc
        return mfx.core.build(keys, [-0.1 * u for u in us]), state._replace(count=mfx.counts.advance(state.count))

    return mfx.leafwise(mfx.GradientTransformation(
        lambda p: _Counted(mfx.counts.zeros(mfx.core.leaves(p, "params")[0])), update))


def test_an_error_of_your_own_in_a_later_piece_says_what_was_stepped(budget):
    """A transform of one's own that raises on one parameter, met in a later piece: the
    step ends with PartialStepError naming the parameters stepped before it; their state
    and counts moved with them, the others' did not, and the next good step goes on."""

    a = _matrices()
    opt = mfx.TransformOptimizer(a, _raises_on_tall(RuntimeError("my transform refuses 'tall' from its third step")))
    for step in range(2):
        _grads(a, step)
        opt.step()
    pieces = opt.plan.groups[0].pieces
    assert pieces is not None and pieces[-1] == (len(a) - 1,)  # "tall" alone, last
    before = [p.detach().clone() for _, p in a]
    _grads(a, 2)
    with pytest.raises(mfx.optim.PartialStepError, match="refuses 'tall'") as info:
        opt.step()
    assert info.value.pending == ["tall"] and "w0" in info.value.stepped and "tall" not in info.value.stepped
    moved = {n for (n, p), q in zip(a, before) if not torch.equal(p, q)}
    assert moved == {n for n, _ in a} - {"tall"}
    counts = {n: e["count"] for n, e in zip([n for n, _ in a], opt.state_dict()["state"].values())}
    assert counts["tall"] == 2 and all(c == 3 for n, c in counts.items() if n != "tall")


def test_an_interrupt_between_pieces_keeps_counts_with_their_parameters(budget):
    """A Ctrl-C (KeyboardInterrupt) that lands while a later piece is computed: it goes on
    as it is (a note names what was stepped), and the pieces written before it keep their
    state and counts, so every parameter's count is the number of steps it made (a count
    left behind would put every later bias correction one step off, silently)."""

    a = _matrices()
    opt = mfx.TransformOptimizer(a, _raises_on_tall(KeyboardInterrupt()))
    for step in range(2):
        _grads(a, step)
        opt.step()
    assert opt.plan.groups[0].pieces is not None and opt.plan.groups[0].pieces[-1] == (len(a) - 1,)
    before = [p.detach().clone() for _, p in a]
    _grads(a, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    assert any("stepped" in n and "w0" in n for n in getattr(info.value, "__notes__", ["stepped w0"]))
    moved = {n for (n, p), q in zip(a, before) if not torch.equal(p, q)}
    assert moved == {n for n, _ in a} - {"tall"}
    counts = {n: e["count"] for n, e in zip([n for n, _ in a], opt.state_dict()["state"].values())}
    assert counts["tall"] == 2 and all(c == 3 for n, c in counts.items() if n != "tall"), counts


@pytest.mark.parametrize("bad", ["nan_lr", "schedule"])
def test_a_raising_step_in_pieces_changes_nothing(budget, bad):
    a = _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    if bad == "schedule":
        kw["weight_decay"] = lambda step: 0.1 if step < 3 else float("nan")
    opt = mfx.TransformOptimizer(a, mfx.muon, **kw)
    for step in range(3):
        _grads(a, step)
        opt.step()
    assert opt.plan.groups[0].pieces is not None
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


@pytest.mark.slow
def test_compiled_pieces_match_eager(budget):
    """A compiled group with matrix work larger than the budget runs one graph per piece
    (the plan says so: the dry run saw its matrix work), from its first step."""
    torch._dynamo.reset()
    shapes = {k: v for k, v in SHAPES.items() if k != "bias"}
    a, b = _named(shapes), _named(shapes)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    comp = mfx.TransformOptimizer(a, mfx.muon, **kw).compile(backend="aot_eager")
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    _steps([(a, comp), (b, ref)], 4)
    g = comp.plan.groups[0]
    assert g.path == "compiled" and g.pieces is not None and len(g.pieces) > 1, comp.plan
    graphs = comp.compiled_graphs
    assert len(graphs) == len(g.pieces) and all(k == ("piece", (0,)) for k in graphs), graphs
    _same(a, b, comp, ref, exact=False)


def test_pieces_survive_a_checkpoint(budget):
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    got = mfx.TransformOptimizer(a, mfx.muon, **kw)
    for step in range(3):
        _grads(a, step)
        got.step()
    sd = got.state_dict()
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    again = mfx.TransformOptimizer(b, mfx.muon, **kw)
    again.load_state_dict(sd)
    _steps([(a, got), (b, again)], 3, first=3)
    _same(a, b, got, again)
    assert math.isfinite(sum(p.sum().item() for _, p in a))


@pytest.mark.slow
def test_a_compiled_elementwise_step_stays_one_graph(budget):
    """AdamW's compiled step is elementwise work alone (no matrix work, the dry run
    says): inductor stores it in place, so it stays one graph (pieces would only cost a
    graph and a call each)."""
    torch._dynamo.reset()
    a, b = _named(), _named()
    comp = mfx.TransformOptimizer(a, mfx.adamw, lr=1e-2, weight_decay=0.1).compile()
    ref = mfx.TransformOptimizer(b, mfx.adamw, lr=1e-2, weight_decay=0.1)
    _steps([(a, comp), (b, ref)], 4)
    assert comp.plan.groups[0].pieces is None and comp.plan.groups[0].path == "compiled"
    assert comp.compiled_graphs == (("whole", (0,)),)
    for (n, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_a_compiled_step_leaves_a_running_profiler_alone_and_prints_nothing(budget, capfd):
    """Nothing is measured by default: a compiled step under the user's own profiler
    leaves the user's profile its events, and no step writes profiler lines
    (``profiler_start``, ``CPUAllocator.cpp``) to stderr."""
    from torch.profiler import profile

    torch._dynamo.reset()
    a, b = _matrices(), _matrices()
    kw = dict(lr=0.02, ns_dtype=torch.float32)
    comp = mfx.TransformOptimizer(a, mfx.muon, **kw).compile(backend="aot_eager")
    ref = _whole(mfx.TransformOptimizer(b, mfx.muon, **kw))
    _steps([(a, comp), (b, ref)], 1)
    out = capfd.readouterr()
    assert "profiler_start" not in out.err and "CPUAllocator" not in out.err, out.err[-500:]
    with profile() as prof:
        _steps([(a, comp), (b, ref)], 2, first=1)
    # the profile survived (Newton-Schulz's products: 2-D on the CPU, batched elsewhere)
    assert any(e.name in ("aten::bmm", "aten::mm", "aten::addmm") for e in prof.events())
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
