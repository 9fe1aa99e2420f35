"""The plan's Muon lowering: a group built with ``mfx.muon`` runs its elementwise links in
foreach passes (the momentum written in place, decay and lr applied to the parameter as
torch.optim.Muon does) around the group's own Newton-Schulz; what does not match runs the
chain."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx
from muonfx.linalg import set_batch_bytes
from helpers import rel_max, shared_grads

# one matrix of each shape: every Newton-Schulz batch holds one matrix, as torch.optim.Muon
# computes them (the batched products of several same-shape matrices may round otherwise)
UNIQUE = [(24, 40), (40, 24), (32, 32), (8, 64)]
# same-shape matrices (batched together), a 3-D expert stack and a conv weight
MIXED = [(24, 40), (24, 40), (40, 24), (40, 24), (3, 16, 24), (12, 4, 3, 3)]

# The lowered step against the chain (fused=False), max |p_fused - p_chain| / max |p_chain|:
# the momentum, the Nesterov input and the Newton-Schulz output are the chain's bit for bit
# (asserted), so what differs is the parameter update's float32 rounding, W*(1 - lr wd) - lr s o
# against W + (-lr (s o + wd W)): a few ulps a step. Measured over 20 steps, AMD EPYC:
# 9.9e-7 (bf16 Newton-Schulz), 9.5e-7 (float32). Tolerance: ~10x.
CHAIN_TOL = 1e-5
#: the gradients' seed base (the tolerances above were measured with it)
GRAD_SEED = 1000


def _params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for i, s in enumerate(shapes)]


def _like_the_chain(a, b, fused, chain) -> dict:
    """Assert the lowered optimizer's parameters ``a`` are within CHAIN_TOL of the chain's
    ``b``, its momentum and counts the chain's bit for bit; its state dict's state."""
    sa, sb = fused.state_dict()["state"], chain.state_dict()["state"]
    for i, ((n, p), (_, q)) in enumerate(zip(a, b)):
        assert rel_max(p, q) < CHAIN_TOL, (n, rel_max(p, q))
        assert torch.equal(sa[i]["momentum.mu"], sb[i]["momentum.mu"]), n
        assert sa[i]["count"] == sb[i]["count"], n
    return sa


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_fused_muon_is_torch_optim_muon_bit_for_bit(nesterov, adjust_lr):
    """bf16 Newton-Schulz (torch's iteration), 20 steps under an lr scheduler: the
    parameters and the momentum are torch.optim.Muon's, bit for bit."""
    named = _params(UNIQUE)
    ref = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1,
                                 adjust_lr=adjust_lr, ns_dtype=torch.bfloat16, ns_method="standard")
    tor = torch.optim.Muon(ref, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1, adjust_lr_fn=adjust_lr)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, tor)]
    for step in range(20):
        shared_grads([named, [(n, q) for (n, _), q in zip(named, ref)]], step, seed=GRAD_SEED)
        opt.step()
        tor.step()
        for s in scheds:
            s.step()
        assert opt.plan.groups[0].path == "fused", opt.plan
    for (n, p), q in zip(named, ref):
        assert torch.equal(p, q), (n, rel_max(p, q))
        assert torch.equal(opt.state[p]["momentum.mu"], tor.state[q]["momentum_buffer"]), n
        assert rel_max(p, _params(UNIQUE)[int(n[1:])][1]) > 1e-2  # the parameters moved


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("budget", [None, 16 << 10], ids=["whole", "pieces"])
def test_fused_muon_equals_the_chain(ns_dtype, budget):
    """20 steps with an lr scheduler, a momentum and a weight-decay change, fewer
    Newton-Schulz steps from step 15, a parameter without a gradient for a few steps,
    whole and in pieces: the momentum and the counts
    are the chain's bit for bit, the parameters within the update's float32 rounding."""
    a, b = _params(MIXED), _params(MIXED)
    held = set_batch_bytes(budget, "cpu") if budget else None
    try:
        fused = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
        chain = mfx.TransformOptimizer(b, mfx.muon, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, fused=False)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.7) for o in (fused, chain)]
        for step in range(20):
            for o in (fused, chain):
                if step == 10:
                    o.param_groups[0]["momentum"] = 0.9
                    o.param_groups[0]["weight_decay"] = 0.05
                if step == 15:
                    o.param_groups[0]["ns_steps"] = 4  # read as a value by the lowering
            shared_grads([a, b], step, skip=2 if 6 <= step < 9 else None, seed=GRAD_SEED)
            fused.step()
            chain.step()
            for s in scheds:
                s.step()
            g0, c0 = fused.plan.groups[0], chain.plan.groups[0]
            assert g0.path == "fused" and c0.path == "eager", fused.plan
            assert (g0.pieces is not None) == (budget is not None) == (c0.pieces is not None)
    finally:
        set_batch_bytes(held, "cpu")
    sa = _like_the_chain(a, b, fused, chain)
    assert sa[2]["count"] == 17 and sa[0]["count"] == 20


@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_muon_in_cut_batches_equals_the_chain(nesterov):
    """A budget of two matrices: expert stacks cut over several Newton-Schulz batches,
    batches of several parameters, each batch's Nesterov input made when it runs and its
    outputs added in bfloat16: the momentum is the chain's bit for bit, the parameters
    within the update's rounding, over 8 steps."""
    shapes = [(5, 16, 24), (16, 24), (16, 24), (3, 24, 16), (24, 16)]
    a, b = _params(shapes), _params(shapes)
    held = set_batch_bytes(2 * 16 * 24 * 4, "cpu")
    try:
        fused = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, weight_decay=0.1, nesterov=nesterov,
                                       ns_dtype=torch.bfloat16)
        chain = mfx.TransformOptimizer(b, mfx.muon, lr=0.02, weight_decay=0.1, nesterov=nesterov,
                                       ns_dtype=torch.bfloat16, fused=False)
        for step in range(8):
            shared_grads([a, b], step, seed=GRAD_SEED)
            fused.step()
            chain.step()
        assert fused.plan.groups[0].path == "fused" and fused.plan.groups[0].pieces is not None
    finally:
        set_batch_bytes(held, "cpu")
    _like_the_chain(a, b, fused, chain)


def test_the_kept_nesterov_buffer_changes_no_bit_and_holds_one_batch(monkeypatch):
    """On the CPU the Nesterov input is made in a buffer kept between steps: the steps are
    bit for bit those that make it afresh (the path off the CPU), and the buffer holds the
    largest batch (two matrices under this budget, one matrix above it), not the group."""
    from muonfx.optim.step import fused_muon

    shapes = [(5, 16, 24), (16, 24), (16, 24), (48, 40)]
    a, b = _params(shapes), _params(shapes)
    held = set_batch_bytes(2 * 16 * 24 * 4, "cpu")
    try:
        kept = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
        fresh = mfx.TransformOptimizer(b, mfx.muon, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
        for step in range(4):
            shared_grads([a, b], step, seed=GRAD_SEED)
            kept.step()
            with monkeypatch.context() as m:
                m.setattr(fused_muon, "_scratch", lambda memo, like: None)
                fresh.step()
    finally:
        set_batch_bytes(held, "cpu")
    for (n, p), (_, q) in zip(a, b):
        assert torch.equal(p, q), n
    memo = kept.plan.groups[0].memo
    bufs = [v for k, v in memo.items() if isinstance(k, tuple) and k[0] == "muon nesterov"]
    assert len(bufs) == 1 and bufs[0].numel() == 48 * 40, [t.numel() for t in bufs]
    assert not [k for k in fresh.plan.groups[0].memo if isinstance(k, tuple) and k[0] == "muon nesterov"]


def test_fused_muon_state_round_trips_with_the_chain():
    """A checkpoint of the lowered step loads into the chain and the other way round: the
    state keeps the chain's layout."""
    a, b = _params(MIXED), _params(MIXED)
    fused = mfx.TransformOptimizer(a, mfx.muon, lr=0.02, weight_decay=0.1)
    for step in range(3):
        shared_grads([a, b], step, seed=GRAD_SEED)
        fused.step()
    chain = mfx.TransformOptimizer(b, mfx.muon, lr=0.02, weight_decay=0.1, fused=False)
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    chain.load_state_dict(fused.state_dict())
    for step in range(3, 6):
        shared_grads([a, b], step, seed=GRAD_SEED)
        fused.step()
        chain.step()
    for (n, p), (_, q) in zip(a, b):
        assert rel_max(p, q) < CHAIN_TOL, n


@pytest.mark.parametrize("case,why", [
    ({"lr": mfx.schedules.linear(0.02, 0.0, 10)}, "lr is a schedule"),
    ({"mu_dtype": torch.bfloat16}, "mu_dtype is given"),
    ({"dims": {"w0": mfx.MatrixView(rows=0, cols=1)}}, "dims is given"),
])
def test_what_is_not_lowered_runs_the_chain(case, why):
    named = _params(UNIQUE)
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=case.pop("lr", 0.02), **case)
    shared_grads([named], 0, seed=GRAD_SEED)
    opt.step()
    g = opt.plan.groups[0]
    assert g.path == "eager" and g.kernel is None, opt.plan
    with pytest.raises(ValueError, match=why):
        mfx.TransformOptimizer(_params(UNIQUE), mfx.muon, lr=mfx.schedules.linear(0.02, 0.0, 10) if "schedule" in why
                               else 0.02, fused=True, **case).plan


def test_the_plan_names_the_lowering_and_newton_schulz():
    named = _params(MIXED)
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02)
    text = str(opt.plan)
    assert "fused (Muon's elementwise links in foreach passes)" in text, text
    assert "standard, torch products" in text, text  # each matrix's Newton-Schulz route, as for the chain


def test_hybrid_optimizers_lower_both_groups():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = mfx.create_hybrid_optimizer(model)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    paths = {g.index: (g.path, g.why) for g in opt.plan.groups}
    assert all(p == "fused" for p, _ in paths.values()), paths


def test_bad_hyperparameter_changes_nothing():
    """A bad number set between steps raises Muon's own error before anything is written."""
    named = _params(UNIQUE)
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02)
    shared_grads([named], 0, seed=GRAD_SEED)
    opt.step()
    before = [p.detach().clone() for _, p in named]
    mu = [opt.state[p]["momentum.mu"].clone() for _, p in named]
    opt.param_groups[0]["momentum"] = 1.5
    shared_grads([named], 1, seed=GRAD_SEED)
    with pytest.raises(ValueError, match="momentum"):
        opt.step()
    for (_, p), b, m in zip(named, before, mu):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["momentum.mu"], m)


def _lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


@pytest.mark.parametrize("options,lowered", [
    ({}, True), ({"ns_stepsize": 0.7}, True), ({"beta2": 0.95}, False), ({"gradient_accumulation_steps": 2}, False),
])
def test_fsdp_muon_optimizer_on_plain_tensors_is_lowered_without_row_norm_or_accumulation(options, lowered):
    """FSDPMuonOptimizer's matrices run Muon's lowering where their chain is Muon's with a
    constant scale (``ns_stepsize``), within the update's rounding of the chain."""
    import warnings

    warnings.simplefilter("ignore", mfx.MeaningChangedWarning)
    m1, m2 = _lm(), _lm()
    a = mfx.FSDPMuonOptimizer(m1, ns_dtype=torch.float32, **options)
    b = mfx.FSDPMuonOptimizer(m2, ns_dtype=torch.float32, **options)
    for g in b.param_groups:
        g["fused"] = False
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        for m, o in ((m1, a), (m2, b)):
            m(x * (step + 1)).square().mean().backward()
            o.step()
            o.zero_grad()
    muon = next(g for g in a.plan.groups if any(k[-1] == "weight" for k in g.keys))
    assert (muon.path == "fused") == lowered, a.plan
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert rel_max(p, q) < CHAIN_TOL, n


def test_a_tall_matrix_output_comes_back_in_rows_on_the_cpu():
    """Muon's lowering hands the parameter update a tall matrix's Newton-Schulz output
    laid out in rows (one matrix a batch: copied while in the cache), the same values as
    the transposed view the iteration leaves; a batch of several stays as it is."""
    from muonfx.optim.step.fused_muon import _InRows
    from muonfx.transforms.orthogonalize import NSRule

    gen = torch.Generator().manual_seed(0)
    one, many = torch.randn(1, 96, 64, generator=gen), torch.randn(3, 96, 64, generator=gen)
    fn = NSRule(dtype=torch.bfloat16).matrix_fn([one], 1e-7, polar=True)
    rows = _InRows(fn)
    plain = fn(one)
    assert not plain.is_contiguous() and plain.mT.is_contiguous()  # the iteration's transposed view
    got = rows(one)
    assert got.is_contiguous() and got.dtype == plain.dtype and torch.equal(got, plain)
    assert not rows(many).is_contiguous() and torch.equal(rows(many), fn(many))
    assert rows.compute_dtype is fn.compute_dtype and rows.batch_limit == fn.batch_limit


def test_the_step_adds_a_tall_matrixs_output_in_rows(monkeypatch):
    """In the optimizer's step the parameter update of a tall CPU matrix (its own batch)
    reads the output in rows; a wide one's comes as the iteration leaves it."""
    from muonfx.optim.step import fused_muon

    seen = []
    write = fused_muon.FusedMuon.write

    def spy(state, pending, params, keys, vals):
        seen.extend((tuple(o.shape[-2:]), o.is_contiguous()) for o in pending[2])
        return write(state, pending, params, keys, vals)

    monkeypatch.setattr(fused_muon.FusedMuon, "write", staticmethod(spy))
    named = _params([(96, 64), (64, 96)])
    opt = mfx.TransformOptimizer(named, mfx.muon, ns_dtype=torch.bfloat16)
    shared_grads([named], 0, seed=GRAD_SEED)
    opt.step()
    assert opt.plan.groups[0].path == "fused", opt.plan
    assert sorted(seen) == [((64, 96), True), ((96, 64), True)], seen
