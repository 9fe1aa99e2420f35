"""Faults, library side: every fault that held in the adversarial pass stays held.

Sections: ``weak`` (predicates and labels, AdamW's per-parameter step, overflowing
gradients), ``held`` (bitwise resume), ``distributed`` (rank-local faults agreed before
the collectives) and the step's own faults (compile failures, copies, steps in pieces).
Bad input refused (load_state_dict, gradients of another shape, dtype or device,
hyperparameters) is in ``tests/test_bad_input.py``; the CLI and FSDP2 cases are in
``tests/test_faults_cli.py``.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import muonfx as mfx
from helpers import backward as _backward, refused, resumed, small_model as _model  # noqa: E402

NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------



def test_labels_as_a_hyperparameter_or_group_key_routes_instead_of_raising():
    """``labels=`` is a function ``(key, tensor)``, not a schedule ``step -> value``: it
    used to be called with the step count (a TypeError from the lambda)."""
    everything_adamw = lambda key, t: "adamw"  # noqa: E731
    model = _model()
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, labels=everything_adamw)
    group_opt = mfx.TransformOptimizer([{"params": list(model.named_parameters()), "labels": everything_adamw}],
                                       mfx.muon_adamw)
    for o in (opt, group_opt):
        _backward(model, 0)
        o.step()
        assert sorted(o.state[model[0].weight]) == ["adamw.adam.count", "adamw.adam.mu", "adamw.adam.nu", "count"]
    assert "labels" not in opt.state_dict()["param_groups"][0]  # a function is not saved


def test_is_schedule_tells_schedules_from_other_callables():
    from muonfx.wrappers import is_schedule

    assert is_schedule(mfx.schedules.linear(1.0, 0.0, 10)) and is_schedule(lambda step: 0.1)
    assert not is_schedule(lambda key, t: "muon") and not is_schedule(0.1) and not is_schedule(torch.ones(1))


# -- AdamW's step counter is per parameter in the adapter, as in torch ------


def _every_other(make, steps=20, start=0, opt=None, params=None):
    """``a`` gets a gradient every step, ``b`` only on even steps (torch.optim.AdamW
    counts ``b``'s steps separately)."""
    if params is None:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(4, 4, generator=gen)), nn.Parameter(torch.randn(4, generator=gen))]
    opt = opt if opt is not None else make(params)
    a, b = params
    for s in range(start, steps):
        gen = torch.Generator().manual_seed(100 + s)
        a.grad = torch.randn(4, 4, generator=gen)
        b.grad = torch.randn(4, generator=gen) if s % 2 == 0 else None
        opt.step()
    return params, opt


def test_adamw_matches_torch_for_a_parameter_that_skips_steps():
    """Before: ``b``'s first step after a skip was 0.744x torch's, and it ended ~5e-3 away."""
    ref, _ = _every_other(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    got, opt = _every_other(lambda ps: mfx.TransformOptimizer(list(zip("ab", ps)), mfx.adamw, lr=1e-2,
                                                               weight_decay=0.1))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=2e-6, rtol=0)
    b_state = opt.state[got[1]]
    assert (b_state["adam.count"], b_state["count"]) == (10, 10)  # torch: state[b]["step"] == 10
    assert opt.state[got[0]]["adam.count"] == 20


@pytest.mark.parametrize("nesterov", [False, True])
def test_bias_corrected_momentum_corrects_each_parameter_at_its_own_count(nesterov):
    """Two parameters at counts 5 and 2 in one update: each gets the correction of its
    own count, as when updated alone."""
    from muonfx.counts import from_values

    gen = torch.Generator().manual_seed(9)
    g = TensorDict({"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}, [])
    mu = TensorDict({"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}, [])
    tx = mfx.bias_corrected_momentum(0.9, nesterov=nesterov)
    state = tx.init(g)._replace(count=from_values([("a",), ("b",)], [5, 2]), mu=mu)
    both, _ = tx.update(g, state)
    for k, t in (("a", 5), ("b", 2)):
        one = TensorDict({k: g[k]}, [])
        alone, _ = tx.update(one, tx.init(one)._replace(count=t, mu=TensorDict({k: mu[k]}, [])))
        assert torch.equal(both[k], alone[k]), k
    assert not torch.equal(both["b"], tx.update(g, state._replace(count=5))[0]["b"])  # the count matters


def test_per_parameter_counters_resume_bitwise_through_torch_save():
    ref, _ = _every_other(lambda ps: mfx.TransformOptimizer(list(zip("ab", ps)), mfx.adamw, lr=1e-2), steps=9)
    half, opt = _every_other(lambda ps: mfx.TransformOptimizer(list(zip("ab", ps)), mfx.adamw, lr=1e-2), steps=5)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert (sd["state"][0]["adam.count"], sd["state"][1]["adam.count"]) == (5, 3)
    params = [nn.Parameter(p.detach().clone()) for p in half]
    new = mfx.TransformOptimizer(list(zip("ab", params)), mfx.adamw, lr=1e-2)
    new.load_state_dict(sd)
    _every_other(None, steps=9, start=5, opt=new, params=params)
    for r, g in zip(ref, params):
        assert torch.equal(r, g)


def test_per_parameter_counters_in_the_compiled_step():
    """Every other step a parameter has no gradient: the compiled optimizer (opt.compile():
    partial steps compiled too, one graph per set of present parameters) gives what the
    eager step gives, with per-parameter counts."""
    torch._dynamo.reset()
    eager, _ = _every_other(lambda ps: mfx.TransformOptimizer(list(zip("ab", ps)), mfx.adamw, lr=1e-2), steps=6)
    comp, opt = _every_other(lambda ps: mfx.TransformOptimizer(list(zip("ab", ps)), mfx.adamw, lr=1e-2)
                             .compile(backend="eager"), steps=6)
    for r, g in zip(eager, comp):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)
    assert opt.state[comp[1]]["adam.count"] == 3


def test_a_parameter_that_never_gets_a_gradient_keeps_its_counters():
    model = _model()
    opt = mfx.create_hybrid_optimizer(model)
    model[1].bias.requires_grad_(False)
    for s in range(3):
        _backward(model, s)
        opt.step()
    frozen = opt.state[model[1].bias]
    moving = opt.state[model[0].bias]
    assert {k: v for k, v in frozen.items() if not torch.is_tensor(v)} == {"count": 0, "adam.count": 0}
    assert moving["adam.count"] == 3


# -- gradients whose float32 sum of squares overflows ------------------------


@pytest.mark.parametrize("scale", [1e19, 1e25, 1e34])
def test_muon_update_of_a_huge_gradient_is_the_update_of_the_scaled_gradient(scale):
    """Muon's update does not depend on the gradient's scale; entries >= ~1e19 used to
    overflow the float32 norm and give a zero update."""
    g = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    tx = mfx.newton_schulz()
    small, _ = tx.update(TensorDict({"w": g}, []), tx.init(TensorDict({"w": g}, [])))
    huge, _ = tx.update(TensorDict({"w": g * scale}, []), tx.init(TensorDict({"w": g}, [])))
    assert huge["w"].abs().max() > 0.1
    torch.testing.assert_close(huge["w"], small["w"], atol=1e-5, rtol=1e-5)


def test_newton_schulz_is_unchanged_bit_for_bit_where_nothing_overflows():
    """The overflow guard changes no bit of a finite-norm input: the result equals the
    iteration started from the plain ``G / max(||G||, eps)`` (the formula before it)."""
    from muonfx.linalg import newton_schulz_batched, resolve
    from muonfx.linalg.newton_schulz import _standard

    g = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))
    g[1] = 0.0  # the eps floor
    sched = resolve("keller", 5)
    plain = _standard(g / torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True).clamp_min(1e-7), sched.steps)
    assert torch.equal(newton_schulz_batched(g, sched), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("huge", [False, True])
def test_the_cpu_skips_the_guard_only_where_it_changes_no_bit(dtype, huge, monkeypatch):
    """On the CPU a batch without an overflowing norm skips the guard's multiply and second
    norm; the branch-free guard (what a traced or CUDA step runs) gives the same bits, for
    plain batches and for a batch with one overflowing matrix."""
    from muonfx.linalg.newton_schulz import _normalized

    g = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(4))
    g[2] = 0.0  # the eps floor
    if huge:  # float16: beyond its own range (65504) for the norm, which is taken in float32
        g[1] *= 1e25 if dtype != torch.float16 else 3000.0
    for tall in (False, True):
        x = g.mT.contiguous() if tall else g
        cpu = _normalized(x, 1.0, 1e-7, dtype, tall)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        branch_free = _normalized(x, 1.0, 1e-7, dtype, tall)
        monkeypatch.undo()
        assert torch.equal(cpu, branch_free), (dtype, huge, tall)
        assert torch.isfinite(cpu).all() and cpu.abs().amax(dim=(-2, -1))[:2].min() > 0


def test_float16_newton_schulz_of_a_matrix_whose_norm_exceeds_float16s_range():
    """A float16 norm overflows at 65504 (entries of ~1000 on a 64 x 128 matrix): it is
    taken in float32, so the result is the one of the matrix 1024 times smaller (a power
    of two: the same float16 mantissas), bit for bit; it used to be NaN."""
    from muonfx.linalg import newton_schulz_batched, resolve

    g = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(2))
    sched = resolve("keller", 5)
    big = newton_schulz_batched(g * 1024, sched, dtype=torch.float16)
    assert torch.isfinite(big).all()
    assert torch.equal(big, newton_schulz_batched(g, sched, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_normalisation_of_huge_and_plain_matrices_is_the_eager_one(dtype):
    """Traced (the executor's compiled step, inductor), the overflow guard computes what
    it does eagerly: for a matrix whose norm overflows (the update of the matrix at a
    sane scale) and for the others, in one batch."""
    from muonfx.linalg import newton_schulz_batched, resolve

    torch._dynamo.reset()
    g = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(3))
    huge = g.clone()
    huge[1] *= 1e25
    sched = resolve("keller", 5)
    run = torch.compile(lambda t: newton_schulz_batched(t, sched, dtype=dtype), fullgraph=True)
    out = run(huge)
    # on the CPU the compiled Newton-Schulz is one operator running the eager code: the same bits
    torch.testing.assert_close(out, newton_schulz_batched(huge, sched, dtype=dtype), rtol=0, atol=0)
    # the huge matrix, scaled by 2**-100, normalises to other roundings than the plain one,
    # which the iteration amplifies: measured 7.2e-7 (float32) and 1.2e-2 (bf16, one bf16
    # step of the largest entries) here; another CPU's kernels round differently: ~5x
    tol = 5e-6 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out, run(g), rtol=0, atol=tol)
    assert out.abs().amax(dim=(-2, -1)).min() > 0.1  # no matrix zeroed


@pytest.mark.parametrize("scale", [1e19, 1e30])
def test_clip_by_global_norm_scales_a_huge_gradient_instead_of_zeroing_it(scale):
    g = TensorDict({"w": torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * scale,
                    "b": torch.randn(16, generator=torch.Generator().manual_seed(1)) * scale}, [])
    out, _ = mfx.clip_by_global_norm(1.0).update(g, None)
    assert math.isclose(mfx.global_norm(out).item(), 1.0, rel_tol=1e-5)
    assert math.isclose(mfx.global_norm(g).item() / scale, mfx.global_norm(g.apply(lambda t: t / scale)).item(),
                        rel_tol=1e-5)
    # direction kept
    torch.testing.assert_close(out["w"] / out["w"].norm(), g["w"] / scale / (g["w"] / scale).norm())


def test_clip_passes_small_gradients_bit_for_bit():
    g = TensorDict({"w": torch.randn(8, 16) * 1e-3}, [])
    out, _ = mfx.clip_by_global_norm(1.0).update(g, None)
    assert torch.equal(out["w"], g["w"]) and out["w"].dtype == torch.float32


def test_a_gradient_holding_inf_still_gives_a_nan_not_a_silent_zero():
    g = TensorDict({"w": torch.ones(4, 4)}, [])
    g["w"][0, 0] = INF
    out, _ = mfx.clip_by_global_norm(1.0).update(g, None)
    assert torch.isnan(out["w"][0, 0])  # inf * (1 / inf): a non-finite step that apply_if_finite skips
    skip = mfx.apply_if_finite(mfx.clip_by_global_norm(1.0))
    out, state = skip.update(g, skip.init(g))
    assert state.notfinite_count == 1 and torch.equal(out["w"], torch.zeros(4, 4))


# ---------------------------------------------------------------------------
# held: keep them held
# ---------------------------------------------------------------------------

SETUPS = {
    "adamw": lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.adamw, lr=1e-2, weight_decay=0.1),
    "muon_adamw": lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.muon_adamw, lr=0.02),
    "hybrid": lambda m: mfx.create_hybrid_optimizer(m),
    "muon_schedule": lambda m: mfx.TransformOptimizer(
        [(n, p) for n, p in m.named_parameters() if p.ndim == 2], mfx.muon,
        lr=mfx.schedules.linear(0.02, 0.0, 10), weight_decay=0.1),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_resume_through_torch_save_weights_only_is_bitwise(setup):
    ref = _model()
    ref_opt = SETUPS[setup](ref)
    for s in range(4):
        _backward(ref, s)
        ref_opt.step()
    a = _model()
    a_opt = SETUPS[setup](a)
    for s in range(2):
        _backward(a, s)
        a_opt.step()
    b = _model(seed=7)
    b_opt = resumed(a, a_opt, b, SETUPS[setup])
    for s in range(2, 4):
        _backward(b, s)
        b_opt.step()
    for p, q in zip(ref.parameters(), b.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------
# distributed: rank-local faults are agreed before the step's collectives
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_rank_local_faults_raise_on_every_rank_before_any_collective():
    """TransformOptimizer(mfx.muon_adamw) on an FSDP2 model, 2 gloo ranks; rank 1 alone:

    * ``ns_steps=0`` or ``ns_method="bogus"`` in its param group: both ranks raise the same
      SettingsDiffer naming the setting and the ranks' values (before, rank 0 waited in the
      all-to-all until gloo's timeout);
    * a gradient for ``0.weight`` replicated where the parameter is a row shard (the same
      shape, another local piece): rank 1 raises the ValueError naming the parameter and
      the shapes, rank 0 RankFailed naming rank 1, within 10 s (measured: a few ms);
    * ``grad=None`` for ``0.weight`` while rank 0 has a gradient (was gloo's "collective
      mismatch" abort): both ranks raise GradientsDiffer with the same message, naming the
      parameter and the ranks.

    Nothing changes on any rank, and the next step runs everywhere. ``grad=None`` for
    ``0.weight`` on every rank is a consistent skip: it does not move, the rest does."""
    from dist_harness import run_world

    import fault_workers as fw

    res = run_world(fw.step_faults, 2, timeout=180)
    kind, msg = res[1]["grad_layout"]["error"]
    assert kind == "ValueError" and "parameter '0.weight': this rank's gradient shard has shape (16, 16)" in msg, msg
    kind, msg = res[0]["grad_layout"]["error"]
    assert kind == "RankFailed" and "step() failed on rank(s) [1]" in msg, res[0]["grad_layout"]
    # a setting on one rank alone is a difference between the ranks: the same error on both
    for fault in ("ns_steps", "ns_method"):
        assert res[0][fault]["error"] == res[1][fault]["error"], fault
        kind, msg = res[0][fault]["error"]
        assert kind == "SettingsDiffer" and f"the ranks disagree on '{fault}' of param group 0" in msg, msg
    for fault in ("ns_steps", "ns_method", "grad_none", "grad_layout"):
        for r in range(2):
            got = res[r][fault]
            assert got["unchanged"] and got["seconds"] < 10 and got["next_step_moved"], (r, fault, got)
    msgs = {res[r]["grad_none"]["error"] for r in range(2)}
    assert len(msgs) == 1, msgs  # the same error on every rank
    kind, msg = msgs.pop()
    assert kind == "GradientsDiffer" and "'0.weight' has a gradient on rank(s) [0] and grad=None on rank(s) [1]" in msg
    for r in range(2):
        moved = res[r]["none_everywhere"]
        assert moved.pop("0.weight") is False and all(moved.values()), moved


@pytest.mark.slow
def test_ranks_that_disagree_raise_the_same_error_naming_the_setting():
    """2 gloo ranks, an FSDP2 model; rank 1 alone has another Newton-Schulz dtype (was a
    gloo abort, "Received data size doesn't match"), another batch budget (an abort),
    another beta2 (a wait until the process group's timeout), lr, ns_steps or ns_method
    (accepted silently, or one rank's error), its parameters in another order (no error
    and two matrices 9 % off), or an extra param group (an abort). Every rank raises the
    same SettingsDiffer naming the setting and the ranks, within seconds; nothing moves,
    and the next step runs everywhere."""
    from dist_harness import run_world

    import fault_workers as fw

    res = run_world(fw.settings_differ, 2, timeout=180)
    want = {"ns_dtype": "the Newton-Schulz dtype on cpu", "budget": "the batch budget on cpu",
            "adamw_betas": "'adamw_betas' of param group 0 (rank(s) [0]: (0.9, 0.95); rank(s) [1]: (0.9, 0.9))",
            "lr": "'lr' of param group 0", "ns_steps": "'ns_steps' of param group 0",
            "ns_method": "'ns_method' of param group 0",
            "order": "the parameter names (in order) of param group 0 (rank(s) [0]: parameter 0: '0.weight'",
            "extra_group": "the number of param groups (rank(s) [0]: 1; rank(s) [1]: 2)"}
    for fault, text in want.items():
        errors = {res[r][fault]["error"] for r in range(2)}
        assert len(errors) == 1 and None not in errors, (fault, errors)  # the same error on every rank
        kind, msg = errors.pop()
        assert kind == "SettingsDiffer" and f"the ranks disagree on {text}" in msg, (fault, msg)
        for r in range(2):
            assert res[r][fault]["unchanged"] and res[r][fault]["seconds"] < 10, (r, fault, res[r][fault])
    assert "MUONFX_NS_DTYPE" in res[0]["ns_dtype"]["error"][1]
    assert res[0]["next_step_moved"] and res[1]["next_step_moved"]


@pytest.mark.slow
def test_ranks_whose_cpus_default_to_different_dtypes_take_float32_by_rule():
    """No Newton-Schulz dtype pinned, rank 0's CPU defaults to bf16 and rank 1's to float32
    (two CPU generations; was a gloo abort at the first step): every rank computes in
    float32, and two steps end bit for bit where a run with float32 pinned everywhere does."""
    from dist_harness import run_world

    import fault_workers as fw

    res = run_world(fw.mixed_cpus, 2, timeout=180)
    for r in range(2):
        assert res[r]["rule_dtype"] == "torch.float32" and res[r]["same"], res[r]


@pytest.mark.slow
def test_the_process_groups_timeout_bounds_the_wait_for_a_late_rank():
    """The step's first collective (the agreement) waits at most the process group's
    timeout the user set (3 s here): rank 1 reaches ``step()`` 6 s late, rank 0 raises
    after about 3 s instead of waiting for it."""
    from dist_harness import run_world

    import fault_workers as fw

    res = run_world(fw.user_timeout, 2, 6.0, timeout=120, collective_timeout=3)
    assert res[0]["error"] is not None and 2.5 < res[0]["seconds"] < 5.5, res[0]


# ---------------------------------------------------------------------------
# the step's own faults: compile failures and tensor lrs said, nothing
# printed, copies that work, resume by rules, steps in pieces that are atomic
# ---------------------------------------------------------------------------


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_failed_compile_says_so_once_and_steps_eagerly(monkeypatch, caplog):
    """opt.compile() where the compiler cannot take the step (here: no compiler at all):
    one WARNING on the muonfx logger naming the group and the error, eager steps after,
    the plan says why."""
    import logging

    from muonfx import logs

    def failing(fn, **kwargs):
        def run(*args):
            raise torch._dynamo.exc.TorchDynamoException("backend failed: no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", failing)
    monkeypatch.setattr(logs, "_said", set())
    model = _mlp()
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw).compile()
    with caplog.at_level(logging.INFO, logger="muonfx"):
        _train(model, opt, 4)
    said = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "no C++ compiler" in said[0].getMessage()
    assert "param group(s) 0" in said[0].getMessage()
    # back to the rule's path without compiling: AdamW's fused kernel
    assert opt.plan.groups[0].path == "fused" and opt.plan.groups[0].why.endswith("torch.compile failed on it")


def test_a_tensor_lr_keeps_opt_compile_on():
    """A tensor lr (what CUDA-graph users pass) reaches the compiled graph as a tensor,
    checked eagerly before the graph runs: the step stays compiled and trains as the
    eager step with the same lrs, a scheduler driving it; a NaN tensor lr is refused and
    changes nothing."""
    torch._dynamo.reset()
    for factory in (mfx.adamw, mfx.muon):
        a, b = _mlp(), _mlp()
        pick = (lambda m: [(n, p) for n, p in m.named_parameters() if p.ndim == 2]) if factory is mfx.muon \
            else (lambda m: list(m.named_parameters()))
        opt = mfx.TransformOptimizer(pick(a), factory, lr=torch.tensor(1e-2)).compile(backend="aot_eager")
        ref = mfx.TransformOptimizer(pick(b), factory, lr=1e-2)
        scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref)]
        for step in range(3):
            for m, o, s in ((a, opt, scheds[0]), (b, ref, scheds[1])):
                _train(m, o, 1, seed=step)
                s.step()
            assert opt.plan.groups[0].path == "compiled", opt.plan
        for (n, p), (_, q) in zip(pick(a), pick(b)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{factory.__name__} {n}: {msg}")
        opt.param_groups[0]["lr"] = torch.tensor(NAN)
        before = [p.detach().clone() for _, p in pick(a)]
        a(torch.randn(4, 8)).sum().backward()
        with pytest.raises(ValueError, match="hyperparameter 'lr' is nan"):
            opt.step()
        assert all(torch.equal(x, p) for x, (_, p) in zip(before, pick(a)))


def test_a_step_prints_nothing_on_stderr(capfd):
    """No step measures anything by default: the first compiled step prints no profiler
    lines (``profiler_start``, ``CPUAllocator.cpp``) on the user's stderr."""
    torch._dynamo.reset()
    model = _mlp()
    opt = mfx.MuonOptimizer(model, lr=0.02).compile()
    _train(model, opt, 2)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "CPUAllocator" not in err and "USDT" not in err, err[-400:]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_works_like_torchs(how):
    """copy.deepcopy(opt) and pickling give an optimizer that steps (as copies of
    torch.optim.AdamW do): its own state, moving on exactly as the original."""
    import pickle

    model = _mlp()
    opt = mfx.MuonOptimizer(model, lr=0.02)
    _train(model, opt, 2)
    twin_model = copy.deepcopy(model)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        twin = pickle.loads(pickle.dumps(opt))
    # the copy holds its own parameters (as torch's copies do): point it at the twin model's
    for g, tg in zip(twin.param_groups, opt.param_groups):
        names = dict(model.named_parameters())
        twin_params = dict(twin_model.named_parameters())
        by_id = {id(p): n for n, p in names.items()}
        g["params"] = [twin_params[by_id[id(p)]] for p in tg["params"]]
    _train(model, opt, 2, seed=7)
    _train(twin_model, twin, 2, seed=7)
    for (n, p), (_, q) in zip(model.named_parameters(), twin_model.named_parameters()):
        assert torch.equal(p, q), n
    assert opt.state_dict()["state"][0]["count"] == twin.state_dict()["state"][0]["count"] == 4


def test_resume_under_the_compiled_path_is_bitwise(monkeypatch):
    """The path of a step comes from rules and settings, not from timing: groups compiled
    when asked (their "compile" setting, saved in the state_dict) resume from a state_dict
    bit for bit, whether they stopped after 2 or 3 steps."""
    torch._dynamo.reset()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"}))
    model = _mlp()
    opt = mfx.MuonOptimizer(model, lr=0.02).compile()
    _train(model, opt, 5)
    assert {g.path for g in opt.plan.groups} == {"compiled"}
    for stop in (2, 3):
        m1 = _mlp()
        o1 = mfx.MuonOptimizer(m1, lr=0.02).compile()
        _train(m1, o1, stop)
        m2 = _mlp(seed=5)
        o2 = resumed(m1, o1, m2, lambda m: mfx.MuonOptimizer(m, lr=0.02))
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            x = torch.randn(4, 8, generator=gen)
            if step < stop:
                continue
            for m, o in ((m2, o2),):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        for (n, p), (_, q) in zip(model.named_parameters(), m2.named_parameters()):
            assert torch.equal(p, q), (stop, n)


def test_a_step_in_pieces_whose_last_piece_would_fail_changes_nothing():
    """A Muon group in pieces (a small batch budget) holding a 1-D parameter in its last
    piece (strict MuonOptimizer: a matrix group that cannot take it): the plan's dry run
    refuses it before the first piece is written; nothing moves."""
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])
    named = list(model.named_parameters())
    named.append(("bias", nn.Parameter(torch.zeros(16))))
    old = mfx.linalg.set_batch_bytes(16 * 16 * 4, "cpu")
    try:
        opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02)
        for _, p in named:
            p.grad = torch.randn_like(p)
        refused(ValueError, "'bias'.*1-D", opt.step, [p for _, p in named], opt.transform_state(0))
    finally:
        mfx.linalg.set_batch_bytes(old, "cpu")
