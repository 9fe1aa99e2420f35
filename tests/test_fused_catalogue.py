"""The plan's lowerings of the catalogue's elementwise presets (Lion, ADOPT, LaProp,
C-AdamW, MARS-AdamW): foreach passes on the group's own state, the chain run link by link
(``"fused": False``) as the reference; what does not match runs the chain."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx
from muonfx.linalg import set_batch_bytes
from muonfx.optim.step.fused_adam_family import FusedAdopt, FusedCautiousAdamW, FusedLaProp, FusedLion, FusedMarsAdamW
from helpers import one_rank_dtensor, rel_max, shared_grads

SHAPES = [(24, 16), (16,), (6, 4, 5), (), (40, 8)]

#: preset, options, the kernel; every option the lowering reads a second way
CASES = {
    "lion": (mfx.lion, {"lr": 1e-3, "weight_decay": 0.1}, FusedLion),
    "adopt": (mfx.adopt, {"lr": 1e-2}, FusedAdopt),
    "adopt_l2": (mfx.adopt, {"lr": 1e-2, "weight_decay": 0.1}, FusedAdopt),
    "adopt_decoupled": (mfx.adopt, {"lr": 1e-2, "weight_decay": 0.1, "decouple": True}, FusedAdopt),
    "laprop": (mfx.laprop, {"lr": 1e-3, "weight_decay": 0.1}, FusedLaProp),
    "cautious_adamw": (mfx.cautious_adamw, {"weight_decay": 0.1}, FusedCautiousAdamW),
    "mars_adamw": (mfx.mars_adamw, {"weight_decay": 0.1, "gamma": 0.5}, FusedMarsAdamW),  # the clip acts
    "mars_adamw_unclipped": (mfx.mars_adamw, {"max_norm": None}, FusedMarsAdamW),
}

# The lowered step against the chain, 20 steps under an lr scheduler with a parameter
# without a gradient for three steps, max |p_lowered - p_chain| / max |p_chain|. What
# differs is rounding: the parameter update is torch.optim's W (1 - lr wd) - lr d against
# the chain's W + (-lr (d + wd W)); the moments a fused kernel writes are its arithmetic
# (MARS's and LaProp's torch._fused_adamw_, ADOPT's momentum torch._fused_sgd_), the
# others the chain's bit for bit (asserted).
# Measured (AMD EPYC, torch 2.13, over two sets of gradients): float32 at most 1.2e-6 (Lion);
# bfloat16 2.9e-3 (a bf16 ulp of the largest parameter), up to 2.6e-2 with ADOPT's
# decoupled decay (torch's form rounds the bf16 parameter twice a step, the chain's once).
# Tolerances ~4x and ~3x.
TOL = {torch.float32: 5e-6, torch.bfloat16: 8e-2}
# the moments from a fused kernel against the chain's (measured): float32 at most 3.1e-7;
# bfloat16 3.1e-2 (LaProp's momentum: the kernel rounds once in float32, the chain's ops
# each to bfloat16)
KERNEL_STATE_TOL = {torch.float32: 3e-6, torch.bfloat16: 0.15}
# ADOPT's moments with its L2 decay (g + wd W reads the parameters, which round otherwise;
# the momentum is divided by sqrt(v)): float32 at most 2.5e-5, on the 0-D parameter;
# bfloat16 3.9e-3 (measured)
L2_STATE_TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2}
#: the state entries each case's kernels write (prefixes), compared within KERNEL_STATE_TOL
KERNEL_STATE = {"adopt": ("adopt.mu",), "adopt_decoupled": ("adopt.mu",), "laprop": ("laprop.",),
                "mars_adamw": ("adam.",), "mars_adamw_unclipped": ("adam.",)}


#: a share of zeros in every gradient (C-AdamW's mask meets u g = 0)
ZEROS = 0.1


def _named(dtype=torch.float32, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)))
            for i, s in enumerate(shapes)]


def _side_by_side(name, a, b, steps, skip=lambda step: None):
    """The lowered optimizer of ``CASES[name]`` on ``a`` and the chain on ``b``, after
    ``steps`` steps on the same gradients (none at place ``skip(step)``)."""
    preset, options, _ = CASES[name]
    fused = mfx.TransformOptimizer(a, preset, **options)
    chain = mfx.TransformOptimizer(b, preset, **options, fused=False)
    for step in range(steps):
        shared_grads([a, b], step, skip=skip(step), zeros=ZEROS)
        fused.step()
        chain.step()
    return fused, chain


def _compare(name, a, b, fused, chain, dtype, exact=True):
    """The parameters within the tolerance, the counts equal, the moments bit for bit
    where the chain's ops write them (those of a fused kernel within its rounding, see
    KERNEL_STATE; ADOPT with its L2 decay: within the parameters' rounding; every moment
    within KERNEL_STATE_TOL where not ``exact``)."""
    for (n, p), (_, q) in zip(a, b):
        assert rel_max(p, q) < TOL[dtype], (n, rel_max(p, q))
    sa, sb = fused.state_dict()["state"], chain.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k, v in sa[i].items():
            if not isinstance(v, torch.Tensor):
                assert v == sb[i][k], (i, k)
            elif k.startswith(KERNEL_STATE.get(name, ())) or not exact and name != "adopt_l2":
                assert rel_max(v, sb[i][k]) < KERNEL_STATE_TOL[dtype], (i, k, rel_max(v, sb[i][k]))
            elif name == "adopt_l2":  # its gradient g + wd W reads the parameters, which round otherwise
                assert rel_max(v, sb[i][k]) < L2_STATE_TOL[dtype], (i, k, rel_max(v, sb[i][k]))
            else:
                assert torch.equal(v, sb[i][k]), (i, k, rel_max(v, sb[i][k]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_lowered_step_is_the_chain(name, dtype):
    """20 steps with an lr scheduler and a parameter without a gradient for three steps
    (its own count lags): the lowered step is the chain's (see TOL)."""
    preset, options, kernel = CASES[name]
    a, b = _named(dtype), _named(dtype)
    fused = mfx.TransformOptimizer(a, preset, **options)
    chain = mfx.TransformOptimizer(b, preset, **options, fused=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (fused, chain)]
    for step in range(20):
        shared_grads([a, b], step, skip=1 if 5 <= step < 8 else None, zeros=ZEROS)
        fused.step()
        chain.step()
        for s in scheds:
            s.step()
        g0, c0 = fused.plan.groups[0], chain.plan.groups[0]
        assert g0.path == "fused" and g0.kernel is kernel and c0.path == "eager", fused.plan
    _compare(name, a, b, fused, chain, dtype)
    assert fused.state_dict()["state"][1]["count"] == 17 and fused.state_dict()["state"][0]["count"] == 20
    assert rel_max(a[0][1], _named(dtype)[0][1]) > 1e-3  # the parameters moved


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_the_lowered_step_is_the_chain_on_cuda(name):
    """On a GPU (temporaries from the allocator, numbers as Python numbers, CUDA's fused
    kernels): 20 steps with a parameter sitting three out, the lowered step within the
    CPU's float32 tolerances of the chain on the same GPU (the moments too: CUDA's foreach
    and pointwise kernels need not round alike)."""
    preset, options, kernel = CASES[name]
    a, b = ([(n, torch.nn.Parameter(p.detach().cuda())) for n, p in _named()] for _ in range(2))
    fused, chain = _side_by_side(name, a, b, 20, skip=lambda step: 1 if 5 <= step < 8 else None)
    g = fused.plan.groups[0]
    assert g.path == "fused" and g.kernel is kernel and chain.plan.groups[0].path == "eager", fused.plan
    assert "flat" not in g.memo  # no kept temporaries off the CPU
    _compare(name, a, b, fused, chain, torch.float32, exact=False)


@pytest.mark.parametrize("name", ["lion", "adopt_l2", "laprop", "cautious_adamw", "mars_adamw"])
def test_in_runs_and_with_mixed_dtypes(name):
    """A group over the batch budget steps in runs of at most the budget (its
    temporaries kept from step to step in buffers of at most the largest run, the state
    not split into pieces); a group of float32 and bfloat16 parameters takes its numbers
    as Python numbers: both the chain's, as above."""
    shapes = [(64, 32), (32,), (48, 40), (), (16, 8, 4)]
    a, b = _named(shapes=shapes), _named(shapes=shapes)
    for named in (a, b):
        named[1][1].data = named[1][1].data.bfloat16()
    held = set_batch_bytes(8 << 10, "cpu")
    try:
        fused, chain = _side_by_side(name, a, b, 12, skip=lambda step: 3 if step == 4 else None)
    finally:
        set_batch_bytes(held, "cpu")
    g = fused.plan.groups[0]
    assert g.path == "fused" and g.pieces is None and chain.plan.groups[0].pieces is not None, fused.plan
    runs = g.memo[("runs", g.keys)]
    assert len(runs) >= 3 and sorted(j for run in runs for j in run) == list(range(len(shapes)))
    largest = max(max(sum(a[j][1].numel() for j in run), 8 << 10 >> 2) for run in runs)
    flats = g.memo["flat"]
    assert flats and all(buf.numel() <= largest + 32 * len(shapes) for buf in flats.values())
    kept = {k: buf.data_ptr() for k, buf in flats.items()}
    shared_grads([a, b], 12, zeros=ZEROS)
    fused.step()
    chain.step()
    assert {k: buf.data_ptr() for k, buf in fused.plan.groups[0].memo["flat"].items()} == kept  # reused
    for (n, p), (_, q) in zip(a, b):
        assert rel_max(p, q) < TOL[p.dtype], (n, rel_max(p, q))


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_moves_between_the_lowered_step_and_the_chain(name):
    """Both paths read and write one state layout: a checkpoint of the lowered step resumes
    in the chain and the other way round, and both go on as one optimizer would."""
    preset, options, _ = CASES[name]
    a, b = _named(), _named()
    fused = mfx.TransformOptimizer(a, preset, **options)
    for step in range(3):
        shared_grads([a, b], step, zeros=ZEROS)
        fused.step()
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    chain = mfx.TransformOptimizer(b, preset, **options, fused=False)
    chain.load_state_dict(fused.state_dict())
    chain.param_groups[0]["fused"] = False  # (the saved groups carry the setting)
    for step in range(3, 6):
        shared_grads([a, b], step, zeros=ZEROS)
        fused.step()
        chain.step()
    assert fused.plan.groups[0].path == "fused" and chain.plan.groups[0].path == "eager"
    _compare(name, a, b, fused, chain, torch.float32)
    fused.load_state_dict(chain.state_dict())  # into an optimizer that has stepped (its plan's memo)
    fused.param_groups[0]["fused"] = None
    for (_, p), (_, q) in zip(a, b):
        p.data.copy_(q.data)
    for step in range(6, 8):
        shared_grads([a, b], step, zeros=ZEROS)
        fused.step()
        chain.step()
    assert fused.plan.groups[0].path == "fused"
    _compare(name, a, b, fused, chain, torch.float32)


@pytest.mark.parametrize("name,kernel_name", [
    ("lion", "Lion's links in foreach passes"),
    ("adopt", "ADOPT's links in foreach passes and torch._fused_sgd_"), ("laprop", "LaProp's moments in torch._fused_adamw_, then foreach passes"),
    ("cautious_adamw", "C-AdamW's links in foreach passes"),
    ("mars_adamw", "MARS's correction in foreach passes, then torch._fused_adamw_"),
])
def test_the_plan_names_the_lowering(name, kernel_name):
    opt = mfx.TransformOptimizer(_named(), getattr(mfx, name))
    text = str(opt.plan)
    assert f"fused ({kernel_name})" in text and "elementwise" in text, text


@pytest.mark.parametrize("name", ["lion", "adopt", "laprop", "cautious_adamw", "mars_adamw"])
@pytest.mark.parametrize("case,why", [
    ({"lr": mfx.schedules.linear(1e-3, 0.0, 10)}, "lr is a schedule"),
    ({"lr": torch.tensor(1e-3)}, "lr is Tensor"),
    ({"weight_decay": mfx.schedules.constant(0.01)}, "weight_decay is a schedule"),
    ({"fused": False}, "fused=False"),
])
def test_what_is_not_lowered_runs_the_chain(name, case, why):
    """A schedule or a tensor for a number, or ``"fused": False``: the chain, and the plan
    says why; ``"fused": True`` then raises, naming the reason."""
    named = _named()
    opt = mfx.TransformOptimizer(named, getattr(mfx, name), **case)
    before = [p.detach().clone() for _, p in named]
    shared_grads([named], 0, zeros=ZEROS)
    opt.step()
    shared_grads([named], 1, zeros=ZEROS)
    opt.step()
    g = opt.plan.groups[0]
    assert g.path == "eager" and g.kernel is None, opt.plan
    assert any(not torch.equal(p, q) for (_, p), q in zip(named, before))
    if "fused" not in case:
        with pytest.raises(ValueError, match=why):
            mfx.TransformOptimizer(_named(), getattr(mfx, name), **case, fused=True).plan


def test_a_step_the_kernel_does_not_take_runs_the_chain():
    """The rule of each step (``ready``): gradients or state buffers of another dtype or
    shape than their parameter, a state of another chain, are refused with the reason."""
    named = _named()
    opt = mfx.TransformOptimizer(named, mfx.laprop)
    shared_grads([named], 0, zeros=ZEROS)
    opt.step()
    state, keys = opt.transform_state(0), opt.plan.groups[0].keys
    params = [p for _, p in named]
    grads = [p.grad for p in params]
    assert FusedLaProp.ready(state, params, grads, keys) is None
    assert "gradients differ" in FusedLaProp.ready(state, params, [g.bfloat16() for g in grads], keys)
    assert "gradients differ" in FusedLaProp.ready(state, params, [g.reshape(-1) for g in grads], keys)
    inner = state.inner_state["laprop"]
    other = state._replace(inner_state={**state.inner_state, "laprop": inner._replace(
        mu=inner.mu.apply(lambda t: t.double()))})
    assert "the state differs" in FusedLaProp.ready(other, params, grads, keys)
    assert "the state is not" in FusedAdopt.ready(state, params, grads, keys)
    assert "the state is not" in FusedMarsAdamW.ready(state, params, grads, keys)


@pytest.mark.parametrize("name", ["lion", "adopt", "laprop", "cautious_adamw", "mars_adamw"])
def test_a_bad_hyperparameter_changes_nothing(name):
    """A bad number set between steps raises the chain's error before anything is written."""
    named = _named()
    opt = mfx.TransformOptimizer(named, getattr(mfx, name))
    shared_grads([named], 0, zeros=ZEROS)
    opt.step()
    before = [p.detach().clone() for _, p in named], opt.state_dict()["state"]
    for key, bad in (("betas", (0.9, 1.5)), ("lr", -1.0), ("eps", float("nan")), ("weight_decay", -0.1)):
        if key not in opt.param_groups[0]:  # Lion has no eps
            continue
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = bad
        shared_grads([named], 1, zeros=ZEROS)
        with pytest.raises(ValueError, match=key):
            opt.step()
        opt.param_groups[0][key] = good
        assert all(torch.equal(p, q) for (_, p), q in zip(named, before[0]))
        after = opt.state_dict()["state"]
        for i, st in before[1].items():
            for k, v in st.items():
                assert torch.equal(v, after[i][k]) if isinstance(v, torch.Tensor) else v == after[i][k], (key, k)
    opt.step()
    assert opt.plan.groups[0].path == "fused" and not torch.equal(named[0][1], before[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "mixed"])
def test_mars_hands_the_chains_corrected_gradient_to_the_fused_kernel(dtype, mixed, monkeypatch):
    """The gradient the lowered MARS-AdamW gives torch's fused AdamW kernel is
    ``mars_correction``'s output bit for bit, clipped or not (the norms stacked where the
    group has one dtype, one by one where it has several)."""
    from tensordict import TensorDict

    seen = {}
    kernel = torch._fused_adamw_

    def spy(params, grads, *args, **kwargs):
        seen.update({id(p): g.clone() for p, g in zip(params, grads)})
        return kernel(params, grads, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    named = _named(dtype)
    if mixed:
        named[1][1].data = named[1][1].data.float() if dtype != torch.float32 else named[1][1].data.bfloat16()
    opt = mfx.TransformOptimizer(named, mfx.mars_adamw, gamma=0.5, betas=(0.9, 0.99))
    tx = mfx.mars_correction(0.5, 0.9, 1.0)
    state = tx.init(TensorDict({n: p.detach() for n, p in named}, []))
    gen = torch.Generator().manual_seed(5)
    clipped = 0
    for _ in range(4):
        gs = {n: torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in named}
        for n, p in named:
            p.grad = gs[n].clone()
        seen.clear()
        opt.step()
        out, state = tx.update(TensorDict(gs, []), state)
        assert opt.plan.groups[0].path == "fused"
        for n, p in named:
            assert torch.equal(seen[id(p)], out[n]), n
        clipped += sum(out[n].float().norm().item() > 0.999 for n, _ in named)
    assert clipped > 0  # the clip acted


@pytest.mark.parametrize("name", list(CASES))
def test_the_path_without_a_scratch_computes_the_same(name, monkeypatch):
    """Off the CPU the lowering takes its temporaries from the allocator (out-of-place
    foreach ops) and its numbers as Python numbers: the same bits as on the CPU's path
    (checked here on the CPU, with the scratch and the 0-D numbers turned off)."""
    from muonfx.optim.step import fused_foreach

    preset, options, _ = CASES[name]
    a, b = _named(), _named()
    cpu = mfx.TransformOptimizer(a, preset, **options)
    for step in range(6):
        shared_grads([a, b], step, skip=2 if step == 3 else None, zeros=ZEROS)
        cpu.step()
    monkeypatch.setattr(fused_foreach, "_scratch", lambda memo, like, n: [None] * n)
    monkeypatch.setattr(fused_foreach._Ops, "num", lambda self, s, inplace=False: s)
    other = mfx.TransformOptimizer(b, preset, **options)
    for step in range(6):
        shared_grads([a, b], step, skip=2 if step == 3 else None, zeros=ZEROS)
        other.step()
        assert other.plan.groups[0].path == "fused" and "flat" not in other.plan.groups[0].memo
    for (n, p), (_, q) in zip(a, b):
        assert torch.equal(p, q), n
    sa, sb = cpu.state_dict()["state"], other.state_dict()["state"]
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]) if isinstance(v, torch.Tensor) else v == sb[i][k], (i, k)


@pytest.mark.parametrize("name", ["lion", "adopt_decoupled", "laprop", "cautious_adamw", "mars_adamw"])
def test_a_large_parameter_steps_alone_on_the_cpu(name):
    """A parameter of at least ``ALONE_BYTES`` runs its passes alone (its tensors in the
    cache), the others together: the chain's step, as above."""
    from muonfx.optim.step.fused_foreach import ALONE_BYTES

    shapes = [(16, 8), (ALONE_BYTES // 4 // 256 + 1, 256), (32,), ()]
    a, b = _named(shapes=shapes), _named(shapes=shapes)
    fused, chain = _side_by_side(name, a, b, 5, skip=lambda step: 2 if step == 1 else None)
    g = fused.plan.groups[0]
    assert g.path == "fused" and sorted(g.memo[("runs", g.keys)]) == [[0, 2, 3], [1]], g.memo.get(("runs", g.keys))
    _compare(name, a, b, fused, chain, torch.float32)


@pytest.mark.parametrize("name", ["lion", "adopt_l2", "adopt_decoupled", "laprop"])
def test_dtensor_parameters_step_as_their_local_shards(name):
    """Lion's, ADOPT's and LaProp's lowerings are elementwise: DTensor parameters (one gloo rank,
    sharded on dim 0, a 0-D one replicated) step as their local shards, bit for bit the
    lowered step on plain tensors; the state stays DTensors. C-AdamW's and MARS's sum over
    whole parameters: their groups of DTensors run the chain."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    d, end = one_rank_dtensor((4, 4))
    try:
        mesh = d.device_mesh
        preset, options, kernel = CASES[name]
        a = _named()
        b = [(n, torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)] if p.ndim else [Replicate()])))
             for n, p in _named()]
        plain, sharded = mfx.TransformOptimizer(a, preset, **options), mfx.TransformOptimizer(b, preset, **options)
        for step in range(6):
            shared_grads([a], step, skip=2 if step == 3 else None, zeros=ZEROS)
            for (_, p), (_, q) in zip(a, b):
                q.grad = None if p.grad is None else distribute_tensor(p.grad.clone(), mesh, q.placements)
            plain.step()
            sharded.step()
        g = sharded.plan.groups[0]
        assert g.path == "fused" and g.kernel is kernel, sharded.plan
        for (n, p), (_, q) in zip(a, b):
            assert torch.equal(p, q.full_tensor()), n
        sa, sb = plain.state_dict()["state"], sharded.state_dict()["state"]
        for i in sa:
            for k, v in sa[i].items():
                if isinstance(v, torch.Tensor):
                    assert type(sb[i][k]).__name__ == "DTensor" and torch.equal(v, sb[i][k].full_tensor()), (i, k)
                else:
                    assert v == sb[i][k], (i, k)
        for other in (FusedCautiousAdamW, FusedMarsAdamW):
            assert other.why_not({"lr": 1e-3}, [d]).startswith("DTensor parameters"), other
        assert FusedLaProp.why_not({"lr": 1e-3}, [d]) is None
    finally:
        end()


def test_the_catalogue_benchmark_times_the_lowering_and_the_chain_on_dtensors():
    """``benchmarks/catalogue_step.py``'s muonfx contenders (``--chain``, ``--dtensor``), in
    this process on two steps: the lowering where asked for, the chain with ``"fused":
    False``, on plain tensors and on one-rank DTensors (the world ended after)."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch.distributed as dist

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("catalogue_step", bench / "catalogue_step.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        got = {c: mod.child("laprop", c, "tiny", 2) for c in
               ("muonfx", "muonfx chain", "muonfx DTensor", "muonfx DTensor chain")}
    finally:
        sys.path.remove(str(bench))
    assert {c: r["paths"] for c, r in got.items()} == {
        "muonfx": ["fused"], "muonfx chain": ["eager"], "muonfx DTensor": ["fused"], "muonfx DTensor chain": ["eager"]}
    assert all(r["steady"] > 0 and r["params"] == got["muonfx"]["params"] for r in got.values())
    assert not dist.is_initialized()
