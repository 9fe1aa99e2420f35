"""The plan's fused lowering: a group built with ``mfx.adamw`` runs torch's fused AdamW
kernel, bit for bit ``torch.optim.AdamW(fused=True)``; what does not match runs the chain."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx

SHAPES = [(24, 16), (16,), (6, 4, 5), ()]


def _pair(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    return ps, qs


def _grads(pairs, step, skip=None):
    gen = torch.Generator().manual_seed(100 + step)
    for i, (p, q) in enumerate(pairs):
        if i == skip:
            p.grad = q.grad = None
            continue
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad, q.grad = g.clone(), g.clone()


#: torch.optim.AdamW's options, each and both
OPTIONS = [{}, {"amsgrad": True}, {"maximize": True}, {"amsgrad": True, "maximize": True}]
_OPTION_IDS = ["plain", "amsgrad", "maximize", "amsgrad+maximize"]


@pytest.mark.parametrize("options", OPTIONS, ids=_OPTION_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("lr", [3e-2, "tensor"])
def test_fused_adamw_is_torch_fused_adamw_bit_for_bit(dtype, lr, options):
    """20 steps with an lr scheduler, a parameter without a gradient for a few steps
    (its own count lags, as torch's ``state[p]["step"]``), bit for bit torch's, with
    torch's ``amsgrad`` and ``maximize`` too (the running maximum is ``adam.nu_max``,
    torch's ``max_exp_avg_sq``)."""
    ps, qs = _pair(dtype)
    lr_ = torch.tensor(3e-2) if lr == "tensor" else lr
    opt = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=lr_, betas=(0.9, 0.95),
                                 weight_decay=0.1, eps=1e-6, **options)
    ref = torch.optim.AdamW(qs, lr=torch.tensor(3e-2) if lr == "tensor" else lr, betas=(0.9, 0.95),
                            weight_decay=0.1, eps=1e-6, fused=True, **options)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (opt, ref)]
    for step in range(20):
        _grads(list(zip(ps, qs)), step, skip=1 if 5 <= step < 8 else None)
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        assert opt.plan.groups[0].path == "fused", opt.plan
        for i, (p, q) in enumerate(zip(ps, qs)):
            assert torch.equal(p, q), f"step {step}, p{i}: {(p.float() - q.float()).abs().max()}"
    sd = opt.state_dict()["state"]
    for i, q in enumerate(qs):
        st = ref.state[q]
        assert torch.equal(sd[i]["adam.mu"], st["exp_avg"]) and torch.equal(sd[i]["adam.nu"], st["exp_avg_sq"])
        assert sd[i]["adam.count"] == int(st["step"].item())
        if options.get("amsgrad"):
            assert torch.equal(sd[i]["adam.nu_max"], st["max_exp_avg_sq"])
        else:
            assert "adam.nu_max" not in sd[i]


# The chain (``"fused": False``) against torch.optim.AdamW(foreach=False), 20 steps, max
# |p - q| / max |q|: float32 rounding of algebraically equal arithmetic (the chain folds
# the bias corrections into one factor). Measured at most 5.6e-7 for every option (AMD
# EPYC, torch 2.13); tolerance ~9x, the AdamW parity tolerance of tests/test_parity.py.
CHAIN_TOL = 5e-6


@pytest.mark.parametrize("options", OPTIONS, ids=_OPTION_IDS)
def test_the_chain_computes_torch_adamw_with_each_option(options):
    ps, qs = _pair()
    opt = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=1e-2, betas=(0.9, 0.95),
                                 weight_decay=0.1, eps=1e-6, fused=False, **options)
    ref = torch.optim.AdamW(qs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6, foreach=False, **options)
    start = [q.detach().clone() for q in qs]
    for step in range(20):
        _grads(list(zip(ps, qs)), step, skip=2 if step in (4, 5) else None)
        opt.step()
        ref.step()
    assert opt.plan.groups[0].path == "eager"
    for i, (p, q, q0) in enumerate(zip(ps, qs, start)):
        err = ((p - q).abs().max() / q.abs().max()).item()
        assert err < CHAIN_TOL, (i, err)
        assert not torch.equal(q, q0)
    sd = opt.state_dict()["state"]
    for i, q in enumerate(qs):
        if options.get("amsgrad"):
            torch.testing.assert_close(sd[i]["adam.nu_max"], ref.state[q]["max_exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_amsgrad_state_round_trips_and_loads_across_settings():
    """``adam.nu_max`` is saved and loaded; a checkpoint made with amsgrad loads into an
    optimizer built without it (and the other way round): the saved hyperparameters and
    their state come together, as in torch. Turning amsgrad on part-way raises, and the
    step changes nothing."""
    ps, qs = _pair()
    named = [(f"p{i}", p) for i, p in enumerate(ps)]
    ams = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2, amsgrad=True)
    for step in range(3):
        _grads(list(zip(ps, qs)), step)
        ams.step()
    sd = ams.state_dict()
    assert all("adam.nu_max" in st for st in sd["state"].values()) and sd["param_groups"][0]["amsgrad"] is True
    for amsgrad in (True, False):
        other = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2, amsgrad=amsgrad)
        other.load_state_dict(sd)
        assert other.param_groups[0]["amsgrad"] is True
        back = other.state_dict()
        for i, st in sd["state"].items():
            assert back["state"][i].keys() == st.keys()
            assert torch.equal(back["state"][i]["adam.nu_max"], st["adam.nu_max"])
    plain = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2)
    plain.step()
    plain_sd = plain.state_dict()
    ams.load_state_dict(plain_sd)
    assert ams.param_groups[0]["amsgrad"] is False and "adam.nu_max" not in ams.state_dict()["state"][0]
    ams.step()
    # turned on part-way: refused by both paths, nothing written
    for fused in (None, False):
        opt = mfx.TransformOptimizer(named, mfx.adamw, lr=1e-2, fused=fused)
        _grads(list(zip(ps, qs)), 0)
        opt.step()
        before = [p.detach().clone() for p in ps], opt.state_dict()
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(ValueError, match="amsgrad=True but the state has no running maximum"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before[0]))
        assert opt.transform_state(0).inner_state["adam"].count == 1


def test_the_fused_step_is_the_chain_within_the_kernels_rounding():
    """The lowering computes what the chain computes transform by transform
    (``"fused": False``): the same state layout, values within float32 rounding (the
    kernel orders the arithmetic differently: measured at most a few ulps)."""
    ps, qs = _pair()
    fused = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=1e-2, weight_decay=0.1)
    chain = mfx.TransformOptimizer([(f"p{i}", q) for i, q in enumerate(qs)], mfx.adamw, lr=1e-2, weight_decay=0.1,
                                   fused=False)
    for step in range(20):
        _grads(list(zip(ps, qs)), step, skip=0 if step == 3 else None)
        fused.step()
        chain.step()
    assert fused.plan.groups[0].path == "fused" and chain.plan.groups[0].path == "eager"
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    a, b = fused.state_dict(), chain.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k, v in a["state"][i].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(v, b["state"][i][k], rtol=1e-5, atol=1e-7)
            else:
                assert v == b["state"][i][k], k


def test_a_checkpoint_moves_between_the_fused_step_and_the_chain():
    """Both paths read and write one state: a checkpoint of the fused step resumes in the
    chain and the other way round."""
    ps, qs = _pair()
    fused = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=1e-2)
    for step in range(3):
        _grads(list(zip(ps, qs)), step)
        fused.step()
    chain = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=1e-2, fused=False)
    chain.load_state_dict(fused.state_dict())
    chain.param_groups[0]["fused"] = False
    _grads(list(zip(ps, qs)), 3)
    chain.step()
    assert chain.transform_state(0).inner_state["adam"].count == 4
    back = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=1e-2)
    back.load_state_dict(chain.state_dict())
    assert back.param_groups[0]["fused"] is False  # saved with the groups, as "compile" is
    back.param_groups[0]["fused"] = None
    _grads(list(zip(ps, qs)), 4)
    back.step()
    assert back.plan.groups[0].path == "fused" and back.transform_state(0).inner_state["adam"].count == 5


def test_what_the_kernel_does_not_compute_runs_the_chain():
    """A chain of one's own (even AdamW's links), a schedule for lr, and a prebuilt
    transform are not lowered: the plan says eager and why."""
    w = [("w", torch.nn.Parameter(torch.randn(4, 4)))]

    def own(lr=1e-3):
        return mfx.chain(mfx.scale_by_adam(), mfx.decoupled_decay(0.01), mfx.scale_by_learning_rate(lr))

    assert mfx.TransformOptimizer(w, own).plan.groups[0].path == "eager"
    sched = mfx.TransformOptimizer(w, mfx.adamw, lr=mfx.schedules.linear(1e-3, 0.0, 10)).plan.groups[0]
    assert sched.path == "eager", sched
    assert mfx.TransformOptimizer(w, mfx.adamw(lr=1e-3)).plan.groups[0].path == "eager"
    hybrid = mfx.create_hybrid_optimizer(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    paths = sorted(g.path for g in hybrid.plan.groups)
    assert paths == ["fused", "fused"], hybrid.plan  # Muon's lowering too (tests/test_fused_muon.py)
    assert "torch._fused_adamw_" in str(hybrid.plan) and "Muon's elementwise links" in str(hybrid.plan)


def test_the_fused_setting_is_checked_and_a_bad_step_changes_nothing():
    w = torch.nn.Parameter(torch.randn(4, 4))
    for bad in ("yes", 1, "false"):
        opt = mfx.TransformOptimizer([("w", w)], mfx.adamw, fused=bad)
        w.grad = torch.ones_like(w)
        with pytest.raises(ValueError, match="'fused'"):
            opt.step()
    opt = mfx.TransformOptimizer([("w", w)], lambda lr=1e-3: mfx.scale(-lr), fused=True)
    with pytest.raises(ValueError, match="no fused kernel"):
        opt.step()
    # an lr the chain refuses is refused before the kernel writes anything, in every group
    a, b = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    opt = mfx.TransformOptimizer([{"params": [("a", a)], "tx": mfx.muon, "lr": 0.02, "ns_dtype": torch.float32},
                                  {"params": [("b", b)], "tx": mfx.adamw, "lr": 1e-3}], mfx.adamw)
    a.grad, b.grad = torch.randn(3, 3), torch.randn(3)
    opt.step()
    before = [a.detach().clone(), b.detach().clone()], opt.state_dict()
    for bad_lr, err in ((-1.0, ValueError), (float("nan"), ValueError)):
        opt.param_groups[1]["lr"] = bad_lr
        with pytest.raises(err, match="lr"):
            opt.step()
        assert torch.equal(a, before[0][0]) and torch.equal(b, before[0][1])
        after = opt.state_dict()["state"]
        for i, st in before[1]["state"].items():
            for k, v in st.items():
                assert (torch.equal(v, after[i][k]) if isinstance(v, torch.Tensor) else v == after[i][k]), (i, k)
    betas = opt.param_groups[1]["betas"]
    opt.param_groups[1]["lr"], opt.param_groups[1]["betas"] = 1e-3, (0.9, 1.5)
    with pytest.raises(ValueError, match="betas"):
        opt.step()
    assert torch.equal(b, before[0][1])
    opt.param_groups[1]["betas"] = betas
    opt.step()


def test_gradients_of_other_strides_than_their_parameters_run_the_chain():
    """torch's fused kernel reads a parameter, its gradient and its moments as flat memory,
    element by element: a gradient laid out otherwise (a contiguous gradient of a
    transposed parameter) runs the chain for that step, torch.optim.AdamW's values. Where
    the layouts agree (both transposed) the kernel runs, bit for bit torch's fused AdamW."""
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    a, b = torch.nn.Parameter(w.clone().t()), torch.nn.Parameter(w.clone().t())
    opt = mfx.TransformOptimizer([("w", a)], mfx.adamw, lr=0.1)
    ref = torch.optim.AdamW([b], lr=0.1, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        g = torch.randn(6, 8, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert opt.plan.groups[0].path == "fused"
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the chain's rounding of torch's arithmetic
    a, b = torch.nn.Parameter(w.clone().t()), torch.nn.Parameter(w.clone().t())
    opt = mfx.TransformOptimizer([("w", a)], mfx.adamw, lr=0.1)
    ref = torch.optim.AdamW([b], lr=0.1, fused=True)
    for _ in range(3):
        g = torch.randn(8, 6, generator=gen).t()  # laid out as the parameter
        a.grad, b.grad = g.clone(), g.clone()
        assert a.grad.stride() == a.stride()
        opt.step()
        ref.step()
    assert torch.equal(a, b)


def test_the_fused_step_issues_torchs_device_ops_and_reads_no_value_back():
    """What a GPU's host waits for, checked on the CPU: a fused AdamW step (two step counts
    in the group, after a step without one gradient) issues the operators torch's fused
    AdamW issues (an op making each count's step number, the kernel) and reads no tensor's value
    back to the host (``aten._local_scalar_dense``, a device sync on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4, generator=gen)) for _ in range(6)]
    opt = mfx.TransformOptimizer(params, mfx.adamw, lr=1e-3, weight_decay=0.01)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = None if step == 1 and i == 2 else torch.randn(8, 4, generator=gen)
        opt.step()
    for p in params:
        p.grad = torch.randn(8, 4, generator=gen)
    with Ops() as ops:
        opt.step()
    assert opt.plan.groups[0].path == "fused", opt.plan
    device_ops = [n for n in ops.seen if not n.startswith("_record_function")]
    assert sorted(device_ops) == ["_fused_adamw_", "full", "full"], ops.seen  # a step number per count
    assert "_local_scalar_dense" not in ops.seen
