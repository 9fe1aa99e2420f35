"""A step that stops part-way: whatever is raised in a piece, or lands between two
groups' write-backs, leaves each parameter's state and count with it, and the step says
exactly what moved (``PartialStepError`` for an error, a note on a ``KeyboardInterrupt``);
a real Ctrl-C inside one group's write is held until that write is whole.

The groups (budget: one 16 x 24 float32 matrix): group 0 and group 2 are two small
matrices each, compiled whole (one graph); group 1 is three matrices, each a piece of its
own, compiled one graph per piece (its chain does matrix work). Graphs by the "eager"
backend: dynamo traces, nothing is generated (each test about 15 s of tracing on a loaded
2-core machine: two of them in the default run, the others in the slow one)."""

from __future__ import annotations

import typing

import pytest
import torch

import muonfx as mfx
import muonfx.counts
from muonfx.optim.step import run as step_run

MAT = (16, 24)
PIECE = MAT[0] * MAT[1] * 4
BIG = {"w0": MAT, "w1": MAT, "tall": (24, 16)}
SMALL = {"s0": (8, 8), "s1": (8, 8)}
LAST = {"t0": (8, 8), "t1": (8, 4)}


@pytest.fixture
def budget():
    mfx.linalg.set_batch_bytes(PIECE, "cpu")
    torch._dynamo.reset()
    yield PIECE
    mfx.linalg.set_batch_bytes(None, "cpu")


class _Counted(typing.NamedTuple):
    count: object


def _raises(exc: BaseException | None, on: str | None) -> mfx.GradientTransformation:
    """``-0.1 * u`` counted per parameter (leafwise), raising ``exc`` when it meets
    parameter ``on`` from its third step on (while the graph of that piece is traced)."""

    def update(updates, state, params=None):
        keys, us = mfx.core.leaves(updates)
        if exc is not None and (on,) in keys and max(mfx.counts.values_of(state.count)) >= 2:
            raise exc
        return mfx.core.build(keys, [-0.1 * u for u in us]), state._replace(count=mfx.counts.advance(state.count))

    return mfx.leafwise(mfx.GradientTransformation(
        lambda p: _Counted(mfx.counts.zeros(mfx.core.leaves(p, "params")[0])), update))


def _setup(exc=None, on=None):
    gen = torch.Generator().manual_seed(0)
    named = {k: torch.nn.Parameter(torch.randn(*s, generator=gen)) for k, s in {**SMALL, **BIG, **LAST}.items()}
    ns = lambda: mfx.newton_schulz(dtype=torch.float32)  # noqa: E731
    groups = [
        {"params": [(k, named[k]) for k in SMALL], "tx": mfx.chain(ns(), _raises(None, None))},
        {"params": [(k, named[k]) for k in BIG], "tx": mfx.chain(ns(), _raises(exc, on))},
        {"params": [(k, named[k]) for k in LAST], "tx": mfx.chain(ns(), _raises(None, None))},
    ]
    opt = mfx.TransformOptimizer(groups, groups[0]["tx"]).compile(backend="eager")
    return named, opt


def _grads(named, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in named.values():
        p.grad = torch.randn(p.shape, generator=gen)


def _two_steps(named, opt):
    for step in range(2):
        _grads(named, step)
        opt.step()
    plan = opt.plan
    assert [g.path for g in plan.groups] == ["compiled"] * 3, plan
    assert plan.groups[0].pieces is None and plan.groups[2].pieces is None, plan
    assert plan.groups[1].pieces == ((0,), (1,), (2,)), plan
    graphs = [k[0] for k in opt._runner.compiled.graphs]
    assert graphs.count("whole") == 1 and graphs.count("piece") == 3, graphs
    return {k: p.detach().clone() for k, p in named.items()}


def _moved(named, before):
    return {k for k, p in named.items() if not torch.equal(p, before[k])}


def _counts(named, opt):
    return dict(zip(named, [e["count"] for e in opt.state_dict()["state"].values()]))


def _consistent(named, opt, before, moved):
    """Exactly ``moved`` moved, and each parameter's count is the steps it made."""
    assert _moved(named, before) == moved
    counts = _counts(named, opt)
    assert counts == {k: 3 if k in moved else 2 for k in named}, counts


ALL = set(SMALL) | set(BIG) | set(LAST)


@pytest.mark.parametrize("on", ["w0", pytest.param("tall", marks=pytest.mark.slow)], ids=["first-piece", "last-piece"])
def test_an_error_in_a_compiled_piece_after_the_whole_groups_names_what_moved(budget, on):
    """The whole groups' graph has written groups 0 and 2 when piece ``on`` of group 1
    raises: PartialStepError names them (and group 1's pieces before it) as stepped, the
    rest as pending, and counts moved with their parameters."""
    named, opt = _setup(RuntimeError(f"my transform refuses {on!r}"), on)
    before = _two_steps(named, opt)
    _grads(named, 2)
    with pytest.raises(mfx.optim.PartialStepError, match=f"refuses '{on}'") as info:
        opt.step()
    stepped = set(SMALL) | set(LAST) | ({"w0", "w1"} if on == "tall" else set())
    assert set(info.value.stepped) == stepped, info.value.stepped
    assert set(info.value.pending) == ALL - stepped, info.value.pending
    _consistent(named, opt, before, stepped)


@pytest.mark.slow
@pytest.mark.parametrize("on", ["w0", "tall"], ids=["first-piece", "last-piece"])
def test_an_interrupt_in_a_compiled_piece_keeps_counts_with_their_parameters(budget, on):
    named, opt = _setup(KeyboardInterrupt(), on)
    before = _two_steps(named, opt)
    _grads(named, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    stepped = set(SMALL) | set(LAST) | ({"w0", "w1"} if on == "tall" else set())
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and all(k in notes[0] for k in stepped), notes
    _consistent(named, opt, before, stepped)


def test_an_interrupt_between_the_whole_graph_and_the_pieces(budget, monkeypatch):
    named, opt = _setup()
    before = _two_steps(named, opt)
    orig = step_run.Runner._compiled_pieces

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_run.Runner, "_compiled_pieces", interrupted)
    _grads(named, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and all(k in notes[0] for k in set(SMALL) | set(LAST)), notes
    _consistent(named, opt, before, set(SMALL) | set(LAST))
    monkeypatch.setattr(step_run.Runner, "_compiled_pieces", orig)


@pytest.mark.slow
def test_an_interrupt_between_two_whole_groups_bookkeeping(budget, monkeypatch):
    """The whole groups' graph wrote groups 0 and 2; an interrupt as group 2's new state
    (its counts) is taken: group 2's counts still move with its parameters."""
    named, opt = _setup()
    before = _two_steps(named, opt)
    orig = step_run._Group.finish
    calls = []

    def finish(self, kept):
        calls.append(self.plan.index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return orig(self, kept)

    monkeypatch.setattr(step_run._Group, "finish", finish)
    _grads(named, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    assert calls[:2] == [0, 2], calls
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and all(k in notes[0] for k in set(SMALL) | set(LAST)), notes
    _consistent(named, opt, before, set(SMALL) | set(LAST))


# ---------------------------------------------------------------------------
# a real Ctrl-C inside one group's write: held until the write is whole
# ---------------------------------------------------------------------------


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt), also where this process was started
    with SIGINT ignored; put back afterwards."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_a_ctrl_c_between_a_groups_state_and_its_parameters_waits_for_them(python_sigint, monkeypatch):
    """Two eager groups; a real SIGINT sent after group 0's state was written and before
    its parameters are: the KeyboardInterrupt comes once group 0 is whole (parameters,
    state, counts), before group 1 is written, with a note naming group 0."""
    import os
    import signal

    from muonfx.optim.step import writeback

    gen = torch.Generator().manual_seed(0)
    named = {k: torch.nn.Parameter(torch.randn(*s, generator=gen)) for k, s in {**SMALL, **LAST}.items()}
    tx = lambda: mfx.chain(mfx.newton_schulz(dtype=torch.float32), _raises(None, None))  # noqa: E731
    opt = mfx.TransformOptimizer([{"params": [(k, named[k]) for k in SMALL], "tx": tx()},
                                  {"params": [(k, named[k]) for k in LAST], "tx": tx()}], tx())
    for step in range(2):
        _grads(named, step)
        opt.step()
    before = {k: p.detach().clone() for k, p in named.items()}
    orig, sent = writeback.foreach, []

    def foreach(op, *a, **k):
        if op == "add_" and not sent:  # the state is written, the parameters are not
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return orig(op, *a, **k)

    monkeypatch.setattr(writeback, "foreach", foreach)
    _grads(named, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    assert sent
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and "s0, s1" in notes[0] and "t0" not in notes[0], notes
    assert _moved(named, before) == set(SMALL)
    assert _counts(named, opt) == {k: 3 if k in SMALL else 2 for k in named}


def test_held_interrupts_delivers_one_ctrl_c_at_its_end_and_a_second_at_once(python_sigint):
    import os
    import signal

    from muonfx.optim.step.pieces import held_interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the first")
    assert done == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the second")
    assert done == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    got = []  # a program's own handler: called as the block ends, nothing raised
    signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    with held_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        assert got == []
    assert got == [signal.SIGINT]
    with held_interrupts():  # two: both at the second, none lost
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert got == [signal.SIGINT] * 3
    assert got == [signal.SIGINT] * 3
