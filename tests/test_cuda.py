"""muonfx on CUDA, and the backend rule of multi-rank runs.

Tests marked ``cuda`` need a GPU: they run where ``torch.cuda.is_available()`` and are
skipped elsewhere (``tests/conftest.py``), the CPU-only CI included:

* parity of ``TransformOptimizer(..., mfx.muon, ns_dtype=bf16)`` with ``torch.optim.Muon``
  on CUDA matrices (same-shape ones go through the batched Newton-Schulz);
* the extra memory of a Muon step: the model-size terms of the pure update plus a few
  batches of the byte budget (:func:`muonfx.linalg.batch_bytes`), derived below;
* ``opt.compile()`` on CUDA: the same training as eager while lr and weight decay change,
  schedules evaluated inside the compiled step applied step by step, and the conformance
  kit's ``compiled`` law on stateful transforms;
* the symmetric Triton Newton-Schulz kernels (:mod:`muonfx.linalg.triton_ns`) against
  torch's bf16 products, on square, wide, tall and ragged shapes.

The CUDA tolerances come from the same problems measured on the CPU, with the margin stated next to each.
A GPU run can check the measured values against them (the assertion messages print
them).

The backend rule (NCCL only when every rank on the machine has a GPU of its own, else
gloo on the CPU) is tested everywhere, with ``torch.cuda`` monkeypatched.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import muonfx as mfx
from muonfx.linalg import batch_bytes, set_batch_bytes

ROOT = Path(__file__).resolve().parents[1]

cuda = pytest.mark.cuda

# Two layers of a small transformer's matrices: same-shape pairs (q/o, k/v) are batched
# together by muonfx, torch.optim.Muon takes them one by one; tall, wide and square.
SHAPES = {f"l{i}.{n}": s for i in range(2)
          for n, s in (("q", (256, 256)), ("k", (64, 256)), ("v", (64, 256)), ("o", (256, 256)),
                       ("up", (512, 256)), ("down", (256, 512)))}
STEPS = 10
LR, WD, MU = 0.02, 0.1, 0.95

# mfx.muon(ns_dtype=bf16) vs torch.optim.Muon, 10 steps of this problem (max over the
# matrices of max |a - b| / max |b|). On the CPU the NS outputs agree bit for bit: measured
# 6.7e-7 (float32 rounding of the parameter update, as in test_parity). On CUDA, muonfx's
# batched bmm/baddbmm and torch's per-matrix mm/addmm may run cuBLAS kernels that round
# some bf16 products differently. bf16 vs float32 Newton-Schulz on this problem: 4.2e-5 ..
# 1.1e-4 (measured on the CPU). The tolerance allows that much bf16 rounding noise and
# stays 10x below what a wrong hyperparameter costs (measured: momentum 0.9 instead of
# 0.95, 1.1e-3; weight decay left out, 2.0e-2).
CUDA_BF16_PARITY_TOL = 1e-4
# opt.compile() vs eager, bf16 Newton-Schulz: inductor fuses the elementwise work and keeps
# it in float32 where eager rounds to bf16 between ops. Measured on the CPU (inductor C++,
# this test's problem and schedule): 5.4e-5. Tolerance: about 10x that.
CUDA_COMPILE_TOL = 5e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _problem(device, shapes=SHAPES, steps=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same numbers on every machine
    params = {k: torch.randn(s, generator=gen).to(device) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen).to(device) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _train(make_opt, params, grads_seq, between=None):
    named = [(k, torch.nn.Parameter(v.clone())) for k, v in params.items()]
    opt = make_opt(named)
    for step, grads in enumerate(grads_seq):
        if between is not None:
            between(opt, step)
        for k, p in named:
            p.grad = grads[k].clone()
        opt.step()
    return {k: p.detach() for k, p in named}


def _mfx_muon(named, **kw):
    return mfx.TransformOptimizer(named, mfx.muon, lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16, ns_method="standard", momentum=MU,
                                  nesterov=True, adjust_lr="original", **kw)


# ---------------------------------------------------------------------------
# parity with torch.optim.Muon
# ---------------------------------------------------------------------------


@cuda
def test_muon_bf16_matches_torch_optim_muon_on_cuda():
    params, grads = _problem("cuda")
    got = _train(_mfx_muon, params, grads)
    want = _train(lambda named: torch.optim.Muon([p for _, p in named], lr=LR, weight_decay=WD, momentum=MU,
                                                 nesterov=True, adjust_lr_fn="original"), params, grads)
    errs = {k: rel_err(got[k], want[k]) for k in SHAPES}
    for k in SHAPES:
        assert got[k].device.type == "cuda" and got[k].dtype == torch.float32
        assert rel_err(want[k], params[k]) > 1e-3  # the parameters really moved
    assert max(errs.values()) < CUDA_BF16_PARITY_TOL, errs


# ---------------------------------------------------------------------------
# extra step memory
# ---------------------------------------------------------------------------

# The step's extra memory is bounded by the budget B (mfx.linalg.batch_bytes), not by the
# model: a group larger than B whose transform is leafwise (Muon is) runs in pieces of at
# most B bytes, each computed and written before the next (muonfx.optim.step.pieces). Per
# piece, measured on the CPU with the allocator's records (muonfx.memory.AllocatorPeak;
# 40 matrices of 1024x2048, bf16 Newton-Schulz): eagerly 5.25 B (the new momentum, the
# Nesterov input, the Newton-Schulz work space and output, two links of the chain), for
# B = 256 MiB (pieces of 32 and 8 matrices) and B = 32 MiB (10 pieces of 4) alike;
# compiled 1.75 B (the compiler stores in place and frees early). Before the pieces
# the eager step held 3 P plus up to 3 B: with B = 32 MiB and P = 320 MiB, 1.1 GiB against
# the 256 MiB bound below.
# * 64 MiB of slack: allocator rounding and cuBLAS work space.
PIECE_FACTOR = {"eager": 6, "compiled": 3}
MEMORY_SLACK = 64 << 20


@cuda
# the compiled path compiles a graph per budget (about a minute each on a GPU machine's CPU):
# slow, with the other compile tests; the eager path runs in every CUDA run
@pytest.mark.parametrize("path", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("budget", [None, 32 << 20], ids=["default-budget", "32MiB-budget"])
def test_muon_step_extra_memory_is_bounded_by_the_budget(budget, path):
    n, shape = 40, (1024, 2048)  # 40 same-shape matrices, 8 MiB each: P = 320 MiB
    set_batch_bytes(budget, "cuda")
    try:
        B = batch_bytes("cuda")
        gen = torch.Generator().manual_seed(0)
        named = [(f"w{i}", torch.nn.Parameter(torch.randn(*shape, generator=gen).cuda())) for i in range(n)]
        opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02, weight_decay=0.1)  # bf16 NS, CUDA's default
        if path == "compiled":
            opt.compile()
        else:
            opt.param_groups[0]["compile"] = False
        for step in range(4):  # the first steps create the state, cuBLAS's work space, the graphs
            for _, p in named:
                p.grad = torch.randn(shape, device="cuda")
            if step == 3:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            opt.step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    finally:
        set_batch_bytes(None, "cuda")
    P = sum(p.numel() * p.element_size() for _, p in named)
    bound = PIECE_FACTOR[path] * B + MEMORY_SLACK
    mib = 1 << 20
    assert extra <= bound, (f"{path}: extra {extra / mib:.0f} MiB > {PIECE_FACTOR[path]} B + slack "
                            f"= {bound / mib:.0f} MiB (P {P / mib:.0f} MiB, B {B / mib:.0f} MiB; "
                            f"extra / B = {extra / B:.2f})")


# ---------------------------------------------------------------------------
# the compiled path
# ---------------------------------------------------------------------------


@cuda
@pytest.mark.slow  # compiles (opt-in since the default path compiles nothing)
def test_compiled_muon_step_matches_eager_on_cuda():
    torch._dynamo.reset()
    params, grads = _problem("cuda", seed=1, steps=6)

    def schedule(opt, step):  # lr and weight decay change every step, like under a scheduler
        for g in opt.param_groups:
            g["lr"] = LR * (1.0 - 0.1 * step)
            g["weight_decay"] = WD + 0.02 * step

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    eager = _train(_mfx_muon, params, grads, schedule)
    comp = _train(lambda named: _mfx_muon(named).compile(backend=counter), params, grads, schedule)
    assert counter.frame_count >= 1  # the compiled path ran
    errs = {k: rel_err(comp[k], eager[k]) for k in SHAPES}
    for k in SHAPES:
        assert rel_err(eager[k], params[k]) > 1e-3
    assert max(errs.values()) < CUDA_COMPILE_TOL, errs


#: stateful transforms for the compiled law on CUDA (inductor writes Triton there, not the
#: CPU's C++: its own fusions, its own chances to get one wrong)
CUDA_COMPILED_LAW = {
    "accumulate_momentum": lambda: mfx.accumulate(mfx.momentum(0.9), 2),
    "adamw": mfx.adamw,
    "muon_float32_ns": lambda: mfx.muon(weight_decay=0.1, ns_dtype=torch.float32),
}


def on_device(device: str, min_ndim: int = 0):
    """float32 ``(params, grads)`` examples moved to ``device``."""
    from muonfx.testing import params_and_grads

    return params_and_grads(dtypes=(torch.float32,), min_ndim=min_ndim, max_leaves=3).map(
        lambda pg: (pg[0].to(device), pg[1].to(device)))


@cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CUDA_COMPILED_LAW))
def test_the_compiled_law_holds_on_cuda(name):
    """``check_transform(laws=["compiled"])`` with CUDA parameters: the compiled optimizer
    (one graph, then pieces) trains as the eager one within the law's default tolerance
    (on the CPU: below 1e-5 of the step for these, 5e-5 for Muon with float32 NS)."""
    from muonfx.testing import check_transform

    tx = CUDA_COMPILED_LAW[name]()
    report = check_transform(tx, laws=["compiled"], max_examples=2, derandomize=True,
                             params=on_device("cuda", min_ndim=2 if name.startswith("muon") else 0))
    assert report["compiled"] == "ok", report


def _warmup_lambda(step):
    return min(step / 10, 1.0) * 1e-2


@cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear", "warmup_cosine_decay", "join", "own"])
def test_in_graph_schedules_compiled_on_cuda_follow_the_schedule(name):
    """A schedule evaluated inside the compiled step on CUDA (Triton code, where the CPU
    tests see C++): the lr applied at each step is the schedule's. On torch 2.10/2.11 a
    schedule of one's own (``own``: ``min`` of a float) runs eagerly instead
    (schedules.FLOAT_MIN_MAX_MISCOMPILED); muonfx's compile everywhere."""
    sched = {"linear": mfx.schedules.linear(1e-2, 0.0, 20),
             "warmup_cosine_decay": mfx.schedules.warmup_cosine_decay(0.0, 1e-2, 3, 20),
             "join": mfx.schedules.join([mfx.schedules.constant(1e-2), mfx.schedules.linear(1e-2, 0.0, 10)], [5]),
             "own": _warmup_lambda}[name]
    torch._dynamo.reset()
    w = torch.nn.Parameter(torch.zeros(64, 32, device="cuda"))
    opt = mfx.TransformOptimizer([("w", w)], mfx.scale_by_learning_rate(sched)).compile()
    applied = []
    for _ in range(14):
        w.grad = torch.ones_like(w)
        before = w.detach().clone()
        opt.step()
        applied.append((before - w.detach()).mean().item())
    assert applied == pytest.approx([sched(t) for t in range(14)], rel=1e-5, abs=1e-9), applied
    fell_back = opt.plan.groups[0].why == "torch.compile failed on it"
    assert fell_back == (name == "own" and mfx.schedules.FLOAT_MIN_MAX_MISCOMPILED)


# ---------------------------------------------------------------------------
# which process group a multi-rank run gets (runs everywhere)
# ---------------------------------------------------------------------------

# (GPUs on the machine, ranks on it, local rank) -> (backend, device)
RULE = [
    (0, 1, 0, "gloo", "cpu"),
    (0, 2, 1, "gloo", "cpu"),
    (1, 1, 0, "nccl", "cuda:0"),
    (1, 2, 1, "gloo", "cpu"),  # two ranks would share one GPU: an NCCL error
    (2, 2, 1, "nccl", "cuda:1"),
    (2, 3, 2, "gloo", "cpu"),
    (8, 4, 3, "nccl", "cuda:3"),
]


def _fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("shape", [(4, 1024, 1024), (2, 256, 2048), (1, 2048, 5632), (3, 300, 700), (1, 700, 300)])
def test_symmetric_triton_newton_schulz_on_cuda(shape, monkeypatch):
    """The symmetric kernels (asked for: torch's products are the rule) against torch's bf16
    products: the distance to the float64 iteration within 1.5x (+2e-3) of torch's (as on
    the CPU under the interpreter, tests/test_triton_ns.py); their check on first use
    passes, and the route really takes them."""
    from muonfx.linalg import newton_schulz_batched, resolve, triton_ns
    from muonfx.linalg.newton_schulz import _gram, _standard

    sched = resolve("keller", 5)
    g = torch.randn(*shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = g.mT if shape[1] > shape[2] else g
    x = (x / x.norm(dim=(-2, -1), keepdim=True)).double()
    truth = {"standard": _standard(x, sched.steps), "gram": _gram(x, sched.steps, 2)}
    calls = []
    for name in ("standard_sym", "gram_sym"):
        real = getattr(triton_ns, name)
        monkeypatch.setattr(triton_ns, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    monkeypatch.setattr(triton_ns, "_switch", True)  # the kernels, asked for
    monkeypatch.setattr(triton_ns, "_verdicts", {})
    for method in ("standard", "gram"):
        ours = newton_schulz_batched(g, sched, dtype=torch.bfloat16, method=method)
        with monkeypatch.context() as m:
            m.setattr(triton_ns, "available", lambda t: False)
            theirs = newton_schulz_batched(g, sched, dtype=torch.bfloat16, method=method)
        if shape[1] > shape[2]:
            ours, theirs = ours.mT, theirs.mT
        e_ours = ((ours.double() - truth[method]).norm() / truth[method].norm()).item()
        e_torch = ((theirs.double() - truth[method]).norm() / truth[method].norm()).item()
        assert e_ours <= 1.5 * e_torch + 2e-3, (method, e_ours, e_torch)
    # each form: its check on first use, then the batch
    assert calls == ["standard_sym"] * 2 + ["gram_sym"] * 2 and not triton_ns._failed
    assert all(triton_ns.verdicts().values()), triton_ns.verdicts()


@cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_torch_products_are_the_cuda_default_and_the_kernels_are_checked_when_asked(monkeypatch, caplog):
    """By default a CUDA batch takes torch's products (no kernel runs, nothing is timed);
    asked for, the kernels are checked once for the shape against torch's products and
    then used, and their result is that route's, bit for bit."""
    import logging

    from muonfx.linalg import newton_schulz_batched, resolve, triton_ns

    monkeypatch.setattr(triton_ns, "_verdicts", {})
    monkeypatch.setattr(triton_ns, "_switch", None)
    monkeypatch.delenv("MUONFX_TRITON_NS", raising=False)
    sched = resolve("keller", 5)
    g = torch.randn(4, 1024, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    plain = newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    assert triton_ns.verdicts() == {}
    monkeypatch.setattr(triton_ns, "_switch", True)
    with caplog.at_level(logging.INFO, logger="muonfx"):
        kernels = newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    (key, ok), = triton_ns.verdicts().items()
    # (dtype, smaller side, larger side, Gram form, restart): the standard form, the default
    # method (ns_method="standard"), has no restart
    assert key[1:] == (torch.bfloat16, 1024, 2048, False, None) and ok, (key, caplog.records)
    assert torch.equal(kernels, newton_schulz_batched(g, sched, dtype=torch.bfloat16))
    torch.testing.assert_close(kernels, plain, rtol=0, atol=0.05)  # bf16 products, other rounding


@pytest.mark.parametrize("where", ["examples/fsdp_muon.py", "benchmarks/_common.py"])
@pytest.mark.parametrize("gpus,ranks,local,backend,device", RULE)
def test_multi_rank_runs_take_nccl_only_with_a_gpu_per_rank(where, gpus, ranks, local, backend, device, monkeypatch):
    mod = _load(ROOT / where, "_mfx_rule_" + Path(where).stem)
    _fake_gpus(monkeypatch, gpus)
    assert mod.pick_backend(ranks, local) == (backend, torch.device(device))


class _FakeDist:
    """What ``muonfx.cli.runtime.setup`` calls in ``torch.distributed``, recorded."""

    def __init__(self, monkeypatch, world: int, rank: int) -> None:
        import torch.distributed as dist

        self.inits: list[str] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: self.inits.append(backend))
        monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: world)


def _setup_cli(monkeypatch, gpus: int, world: int, rank: int, device: str = "auto"):
    from muonfx.cli import runtime

    _fake_gpus(monkeypatch, gpus)
    fake = _FakeDist(monkeypatch, world, rank)
    set_devices: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_devices.append(torch.device(d)))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda *a: None)  # global state: leave it
    for k, v in dict(WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, RANK=rank, LOCAL_RANK=rank).items():
        monkeypatch.setenv(k, str(v))
    rt = runtime.setup(device, True, torch.get_num_threads(), "auto")
    return rt, fake.inits, set_devices


@pytest.mark.parametrize("gpus", [0, 2])
def test_cli_fsdp_backend_without_gpus_or_with_one_per_rank(gpus, monkeypatch):
    rt, inits, set_devices = _setup_cli(monkeypatch, gpus, world=2, rank=1)
    if gpus:
        assert (rt.backend, rt.device, inits, set_devices) == ("nccl", torch.device("cuda", 1), ["nccl"],
                                                               [torch.device("cuda", 1)])
        assert rt.amp
    else:
        assert (rt.backend, rt.device, inits, set_devices) == ("gloo", torch.device("cpu"), ["gloo"], [])
        assert not rt.amp


def test_cli_fsdp_ranks_sharing_one_gpu_run_gloo_on_the_cpu(monkeypatch):
    rt, inits, set_devices = _setup_cli(monkeypatch, gpus=1, world=2, rank=1)
    assert (rt.backend, rt.device, inits, set_devices) == ("gloo", torch.device("cpu"), ["gloo"], [])
    assert not rt.amp  # bf16 autocast follows the device: CUDA only


def test_cuda_marker_is_registered_and_skips_without_a_gpu(pytestconfig, request):
    assert any(m.startswith("cuda:") for m in pytestconfig.getini("markers"))
    item = next((i for i in request.session.items if i.name == "test_compiled_muon_step_matches_eager_on_cuda"), None)
    if item is None:
        pytest.skip("the cuda-marked test was not collected in this run")
    skips = [m for m in item.iter_markers("skip") if "needs CUDA" in m.kwargs.get("reason", "")]
    assert bool(skips) == (not torch.cuda.is_available())
