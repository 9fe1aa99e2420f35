"""The plan's SOAP lowering: a group built with ``mfx.soap`` keeps each basis's Gram matrix
``Q^T Q`` between steps and takes the first moment's round trip through the original
space (``Q^T (Q mu)`` per dimension) as one product; it equals the chain within that
product's rounding, writes the chain's state in place, and what it does not compute runs
the chain."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx
from muonfx.linalg import set_batch_bytes
from muonfx.optim.step.fused_soap import FusedSoap

from helpers import count_calls, one_rank_dtensor, rel_max, seeded_grads

# a 2-D matrix each way, a bias, a 3-D and a 4-D leaf, a wide matrix
SHAPES = [(12, 5), (5,), (2, 3, 4), (16, 8), (4, 2, 3, 2), (9, 30)]
CASES = {
    # bases refreshed every 5 steps, weight decay
    "two_sided": dict(lr=1e-2, betas=(0.9, 0.95), precondition_frequency=5, weight_decay=0.1),
    # one-sided (a side over max_precond_dim), merged dims, a preconditioned 1-D leaf, normalize_grads
    "merged": dict(lr=1e-2, precondition_frequency=4, max_precond_dim=7, merge_dims=True, precondition_1d=True,
                   normalize_grads=True),
}
# The lowered step against the chain (fused=False) after 20 steps (a step lr schedule, a new
# weight decay, a parameter without a gradient for 2 steps, so that counts differ across the
# refreshes): the factors, the bases and the second moment are the chain's bit for bit
# (asserted); the first moment differs by the rounding of G mu against Q^T (Q mu) (the
# bases are orthogonal to float32 rounding), and the parameters by what it moves. Measured
# max |a - b| / max |b| (AMD EPYC, torch 2.13 CPU, 5 seeds): parameters 1.4e-7 (float32),
# 3.2e-16 (float64); first moment 7.6e-7, 1.5e-15. Tolerances ~7x.
PARAM_TOL = {torch.float32: 1e-6, torch.float64: 2e-15}
MU_TOL = {torch.float32: 5e-6, torch.float64: 1e-14}


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for i, s in enumerate(SHAPES)]


@pytest.fixture
def kernel_writes(monkeypatch):
    """How many pieces the lowered step wrote (the plan may say "fused" while a step's
    tensors send it to the chain)."""
    return count_calls(monkeypatch, FusedSoap, "write")


def _train(fused, hp, dtype=torch.float32, seed=0, start=0, stop=20, named=None, opt=None):
    named = named or _params(dtype, seed)
    opt = opt or mfx.TransformOptimizer(named, mfx.soap, fused=fused, **hp)
    for step in range(start, stop):
        seeded_grads(named, step, skip=3 if 5 <= step < 7 else None)
        opt.param_groups[0]["lr"] = hp["lr"] * 0.7 ** (step // 4)  # a step schedule, as a scheduler sets it
        if step == 9:
            opt.param_groups[0]["weight_decay"] = 0.05
        opt.step()
    return opt, named


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_the_lowered_step_is_the_chain_within_the_round_trips_rounding(case, dtype, kernel_writes):
    low, a = _train(None, CASES[case], dtype)
    assert low.plan.groups[0].path == "fused" and kernel_writes[0] == 20, low.plan
    chain, b = _train(False, CASES[case], dtype)
    assert chain.plan.groups[0].path == "eager"
    for (n, p), (_, q), (_, s) in zip(a, b, _params(dtype)):
        assert rel_max(p, q) <= PARAM_TOL[dtype], (n, rel_max(p, q))
        assert rel_max(p, s) > 1e-3, n  # it moved
    sa, sb = low.state_dict()["state"], chain.state_dict()["state"]
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k, v in sa[i].items():
            if ".mu" in k:
                assert rel_max(v, sb[i][k]) <= MU_TOL[dtype], (i, k, rel_max(v, sb[i][k]))
            elif isinstance(v, torch.Tensor):  # the factors, the bases, the second moment
                assert torch.equal(v, sb[i][k]), (i, k)
            else:
                assert v == sb[i][k], (i, k)
    assert sa[3]["soap.count"] == 18 and sa[0]["soap.count"] == 20


def test_in_pieces_it_computes_what_it_computes_whole(kernel_writes):
    held = set_batch_bytes(1 << 10, "cpu")
    try:
        low, a = _train(None, CASES["two_sided"])
        pieces = low.plan.groups[0].pieces
    finally:
        set_batch_bytes(held, "cpu")
    # every piece of the 18 steps with every parameter present written by the kernel (and those of the 2 others)
    assert pieces is not None and len(pieces) > 2 and kernel_writes[0] > 18 * len(pieces), low.plan
    whole, b = _train(None, CASES["two_sided"])
    assert whole.plan.groups[0].pieces is None
    for (n, p), (_, q) in zip(a, b):
        assert torch.equal(p, q), n


def test_the_gram_matrices_follow_the_bases_and_checkpoints_move_to_the_chain_and_back(kernel_writes):
    """The kept ``Q^T Q`` are those of the state's current bases (computed again after a
    refresh writes the bases in place, and for a loaded state), one per basis; a checkpoint
    of the lowered step resumes in the chain and back."""
    hp = CASES["two_sided"]
    whole, ref = _train(None, hp)
    named = _params()
    low, _ = _train(None, hp, named=named, stop=6)  # the last step (count 5) refreshed the bases in place
    grams = low.plan.groups[0].memo["soap_grams"]
    bases = low.transform_state(0).inner_state["soap"].bases
    keys = bases.keys(include_nested=True, leaves_only=True)
    assert set(grams) == set(keys)  # one Gram matrix per basis: d^2 elements each
    stale = {k for k in keys if grams[k][1] != bases.get(k)._version}
    assert stale == {k for k in keys if k[0] != "p3"}  # refreshed (p3 sat the step out: not yet)
    _train(None, hp, named=named, opt=low, start=6, stop=9)  # p3 refreshes at step 7 (its count 5)
    for k in keys:
        q = bases.get(k)
        assert grams[k][0] is q and grams[k][1] == q._version and torch.equal(grams[k][2], q.T @ q), k
    chain = mfx.TransformOptimizer(named, mfx.soap, fused=False, **hp)
    chain.load_state_dict(low.state_dict())
    chain.param_groups[0]["fused"] = False
    _train(False, hp, named=named, opt=chain, start=9, stop=13)
    back = mfx.TransformOptimizer(named, mfx.soap, **hp)
    back.load_state_dict(chain.state_dict())
    back.param_groups[0]["fused"] = None
    _train(None, hp, named=named, opt=back, start=13, stop=20)
    assert back.plan.groups[0].path == "fused"
    for (n, p), (_, q) in zip(named, ref):
        assert rel_max(p, q) <= PARAM_TOL[torch.float32], n


def test_a_thin_matrix_keeps_the_round_trip_and_is_the_chain_bit_for_bit():
    """A Gram matrix costs ``d^3`` once per refresh and saves ``d * numel`` at each other
    step: the long side of a thin matrix (``d^2 > (frequency - 1) * numel``) keeps the
    chain's round trip, so that parameter's step is the chain's bit for bit, while the
    square one takes the Gram matrices."""
    hp = dict(lr=1e-2, precondition_frequency=3)

    def named():
        gen = torch.Generator().manual_seed(0)
        return [("thin", torch.nn.Parameter(torch.randn(40, 2, generator=gen))),
                ("square", torch.nn.Parameter(torch.randn(6, 6, generator=gen)))]

    a, b = named(), named()
    low, chain = mfx.TransformOptimizer(a, mfx.soap, **hp), mfx.TransformOptimizer(b, mfx.soap, fused=False, **hp)
    for step in range(8):
        seeded_grads(a, step)
        seeded_grads(b, step)
        low.step()
        chain.step()
    assert {k[0] for k in low.plan.groups[0].memo["soap_grams"]} == {"square"}  # 40^2 > 2 * 80, 6^2 <= 2 * 36
    assert torch.equal(a[0][1], b[0][1]) and not torch.equal(a[1][1], b[1][1])
    assert rel_max(a[1][1], b[1][1]) <= PARAM_TOL[torch.float32]


def test_a_bad_number_is_refused_before_anything_is_written(kernel_writes):
    named = _params()
    opt = mfx.TransformOptimizer(named, mfx.soap, **CASES["two_sided"])
    seeded_grads(named, 0)
    opt.step()
    seeded_grads(named, 1)
    opt.step()
    before = [p.detach().clone() for _, p in named], opt.state_dict()["state"]
    for name, value, match in (("precondition_frequency", 0, "precondition_frequency"), ("betas", (0.9, 1.5), "betas"),
                               ("lr", float("nan"), "lr"), ("shampoo_beta", float("inf"), "shampoo_beta")):
        good = opt.param_groups[0][name]
        opt.param_groups[0][name] = value
        seeded_grads(named, 2)
        with pytest.raises((ValueError, TypeError), match=match):
            opt.step()
        opt.param_groups[0][name] = good
        assert all(torch.equal(p, b) for (_, p), b in zip(named, before[0])), name
        after = opt.state_dict()["state"]
        for i, st in before[1].items():
            for k, v in st.items():
                assert torch.equal(v, after[i][k]) if isinstance(v, torch.Tensor) else v == after[i][k], (name, k)
    assert kernel_writes[0] == 2


def test_what_is_not_lowered_runs_the_chain():
    for lr, why in ((mfx.schedules.linear(1e-2, 0.0, 10), "lr is a schedule"), (torch.tensor(1e-2), "lr is Tensor")):
        named = _params()
        opt = mfx.TransformOptimizer(named, mfx.soap, lr=lr)
        seeded_grads(named, 0)
        opt.step()
        assert opt.plan.groups[0].path == "eager" and opt.plan.groups[0].kernel is None, opt.plan
        with pytest.raises(ValueError, match=why):
            mfx.TransformOptimizer(_params(), mfx.soap, lr=lr, fused=True).plan
    assert FusedSoap.why_not({"lr": 1e-3, "merge_dims": 1}, [torch.zeros(2)]) == "merge_dims is not a bool"
    assert FusedSoap.why_not({"lr": 1e-3, "betas": (0.9, 0.95), "merge_dims": True}, [torch.zeros(2)]) is None


def test_the_rule_refuses_dtensor_parameters():
    d, end = one_rank_dtensor((4, 4))
    try:
        assert FusedSoap.why_not({"lr": 1e-3}, [d]) == "DTensor parameters (the seam's exchange)"
    finally:
        end()


def test_the_plan_names_the_lowering():
    text = str(mfx.TransformOptimizer(_params(), mfx.soap).plan)
    assert f"fused ({FusedSoap.name})" in text, text
