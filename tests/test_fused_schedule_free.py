"""The plan's Schedule-Free AdamW lowering: a group built with ``mfx.schedule_free_adamw``
steps ``z`` in torch's fused AdamW kernel and ``x``, ``y`` in foreach passes, in place on
the group's own state; it equals the chain within its rounding, keeps the chain's state
(checkpoints, ``eval()``/``train()``), and what it does not compute runs the chain."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx
from muonfx.optim.step.fused_schedule_free import FusedScheduleFreeAdamW

from helpers import count_calls, one_rank_dtensor, rel_max, seeded_grads

SHAPES = [(24, 16), (16,), (6, 4, 5), (), (33, 7)]
HP = dict(lr=1e-2, weight_decay=0.1, warmup_steps=5, r=0.5)

# The lowered step against the chain (fused=False), max |a - b| / max |b| over the training
# weights y and the evaluation weights x after 20 steps (a step lr schedule, new betas, weight
# decay, eps and weight_lr_power, a parameter without a gradient for 3 steps). The numbers
# (lr_k, c, counts, weight sum) are the chain's to the bit (asserted); Adam's direction
# comes from torch's fused kernel (lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) against the
# chain's (sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2)), then -lr), the decay is a second
# addition and y is the lerp itself rather than y + (lerp - y). Measured (AMD EPYC, torch
# 2.13 CPU, 5 seeds): float32 4.2e-7, float64 1.1e-15, bfloat16 2.2e-2 (every intermediate of
# the chain rounded to bf16: both are that far from a float64 run, 1-2 %). Tolerances ~5x.
TOL = {torch.float32: 2e-6, torch.float64: 1e-14, torch.bfloat16: 0.1}


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)))
            for i, s in enumerate(SHAPES)]


@pytest.fixture
def kernel_steps(monkeypatch):
    """How many steps the lowered kernel ran (the plan may say "fused" while a step's
    tensors send it to the chain)."""
    return count_calls(monkeypatch, FusedScheduleFreeAdamW, "step")


def _train(fused, dtype=torch.float32, seed=0, start=0, stop=20, named=None, opt=None):
    """Steps ``start`` to ``stop``: a step lr schedule, new betas and weight decay at step
    10, eps and weight_lr_power at 12, parameter 1 without a gradient at steps 5-7; the
    training weights y and the evaluation weights x after them."""
    named = named or _params(dtype, seed)
    opt = opt or mfx.TransformOptimizer(named, mfx.schedule_free_adamw, fused=fused, **HP)
    for step in range(start, stop):
        seeded_grads(named, step, skip=1 if 5 <= step < 8 else None)
        group = opt.param_groups[0]
        group["lr"] = HP["lr"] * 0.8 ** (step // 3)  # as a scheduler sets it
        if step == 10:
            group["betas"], group["weight_decay"] = (0.8, 0.99), 0.05
        if step == 12:
            group["eps"], group["weight_lr_power"] = 1e-6, 1.0
        opt.step()
        assert opt.plan.groups[0].path == ("eager" if fused is False else "fused"), opt.plan
    y = [p.detach().clone() for _, p in named]
    opt.eval()
    x = [p.detach().clone() for _, p in named]
    opt.train()
    return opt, named, y, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_lowered_step_is_the_chain_within_its_rounding(dtype, kernel_steps):
    low, named, y, x = _train(None, dtype)
    assert kernel_steps[0] == 20  # every step ran the kernel, the one with a parameter left out too
    chain, _, y_ref, x_ref = _train(False, dtype)
    for (n, _), a, b in zip(named, y + x, y_ref + x_ref):
        assert rel_max(a, b) <= TOL[dtype], (n, rel_max(a, b))
    assert min(rel_max(a, p.detach()) for a, (_, p) in zip(y, _params(dtype))) > 1e-3  # every parameter moved
    sa, sb = low.state_dict(), chain.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            if isinstance(v, torch.Tensor):
                assert rel_max(v, sb["state"][i][k]) <= TOL[dtype], (i, k)
            else:  # counts, k, the weight sum and the mode: the chain's numbers
                assert v == sb["state"][i][k], (i, k, v, sb["state"][i][k])
    assert sa["state"][1]["0.count"] == 17 and sa["state"][0]["0.count"] == 20


def test_eval_and_train_swap_and_checkpoints_move_between_the_lowering_and_the_chain(kernel_steps, tmp_path):
    """A checkpoint of the lowered step taken in eval mode resumes in the chain, whose
    checkpoint resumes in the lowered step: the same state, the swap included."""
    _, _, y, x = _train(None)
    named = _params()
    opt, *_ = _train(None, named=named, stop=7)
    opt.eval()  # the parameters hold x
    torch.save(opt.state_dict(), tmp_path / "c.pt")
    chain = mfx.TransformOptimizer(named, mfx.schedule_free_adamw, **HP)
    chain.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    chain.param_groups[0]["fused"] = False
    with pytest.raises(RuntimeError, match="opt.train"):  # the chain's error in eval mode
        seeded_grads(named, 7)
        chain.step()
    chain.train()
    _train(False, named=named, opt=chain, start=7, stop=14)
    back = mfx.TransformOptimizer(named, mfx.schedule_free_adamw, **HP)
    back.load_state_dict(chain.state_dict())
    back.param_groups[0]["fused"] = None
    _, _, y_back, x_back = _train(None, named=named, opt=back, start=14, stop=20)
    assert kernel_steps[0] == 20 + 7 + 6
    for (n, _), a, b in zip(named + named, y_back + x_back, y + x):
        assert rel_max(a, b) <= TOL[torch.float32], n


def test_a_step_in_eval_mode_is_refused_and_changes_nothing():
    named = _params()
    opt = mfx.TransformOptimizer(named, mfx.schedule_free_adamw, **HP)
    seeded_grads(named, 0)
    opt.step()
    opt.eval()
    before = [p.detach().clone() for _, p in named], opt.state_dict()
    seeded_grads(named, 1)
    with pytest.raises(RuntimeError, match="opt.train"):
        opt.step()
    assert all(torch.equal(p, b) for (_, p), b in zip(named, before[0]))
    assert opt.state_dict()["state"][0]["k"] == before[1]["state"][0]["k"] == 1


@pytest.mark.parametrize("name,value,match", [
    ("warmup_steps", 2.5, "warmup_steps"), ("betas", (0.9, 1.5), "betas"), ("lr", -1.0, "lr"),
    ("weight_lr_power", float("inf"), "weight_lr_power"),
])
def test_a_bad_number_is_refused_before_the_kernel_writes(name, value, match, kernel_steps):
    named = _params()
    opt = mfx.TransformOptimizer(named, mfx.schedule_free_adamw, **HP)
    seeded_grads(named, 0)
    opt.step()
    before = [p.detach().clone() for _, p in named]
    z = [t.clone() for t in opt.state_dict()["state"][0].values() if isinstance(t, torch.Tensor)]
    opt.param_groups[0][name] = value
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step()
    assert kernel_steps[0] == 1
    assert all(torch.equal(p, b) for (_, p), b in zip(named, before))
    after = [t for t in opt.state_dict()["state"][0].values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, z))


def test_what_is_not_lowered_runs_the_chain(kernel_steps):
    """A schedule or a tensor for a number runs the chain; ``fused=True`` there is refused,
    naming why; gradients of other strides than their parameters run the chain for
    that step, bit for bit."""
    for lr, why in ((mfx.schedules.linear(1e-2, 0.0, 10), "lr is a schedule"), (torch.tensor(1e-2), "lr is Tensor")):
        named = _params()
        opt = mfx.TransformOptimizer(named, mfx.schedule_free_adamw, lr=lr)
        seeded_grads(named, 0)
        opt.step()
        g = opt.plan.groups[0]
        assert g.path == "eager" and g.kernel is None, opt.plan
        with pytest.raises(ValueError, match=why):
            mfx.TransformOptimizer(_params(), mfx.schedule_free_adamw, lr=lr, fused=True).plan
    assert kernel_steps[0] == 0
    a, b = _params(), _params()
    low = mfx.TransformOptimizer(a, mfx.schedule_free_adamw, **HP)
    chain = mfx.TransformOptimizer(b, mfx.schedule_free_adamw, fused=False, **HP)
    for step in range(3):
        seeded_grads(a, step)
        seeded_grads(b, step)
        a[0][1].grad = a[0][1].grad.t().contiguous().t()  # the same values, column-major
        low.step()
        chain.step()
    assert kernel_steps[0] == 0 and low.plan.groups[0].path == "fused"
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(a, b))


def test_the_rule_refuses_dtensor_parameters():
    d, end = one_rank_dtensor((4, 4))
    try:
        assert FusedScheduleFreeAdamW.why_not(dict(lr=1e-3, betas=(0.9, 0.999)), [d]) == "DTensor parameters"
        assert FusedScheduleFreeAdamW.why_not(dict(lr=1e-3, betas=(0.9, 0.999)), [torch.randn(4, 4)]) is None
    finally:
        end()


def test_the_plan_names_the_lowering():
    named = _params()
    opt = mfx.TransformOptimizer(named, mfx.schedule_free_adamw)
    text = str(opt.plan)
    assert f"fused ({FusedScheduleFreeAdamW.name})" in text and "elementwise, in the fused kernel" in text, text
