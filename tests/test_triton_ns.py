"""The symmetric Triton Newton-Schulz (muonfx.linalg.triton_ns), run by Triton's interpreter
on the CPU (small shapes); tests/test_cuda.py runs it for real on a GPU. The kernels are
off by default (torch's products are the rule); they run where asked for and where their
check against torch's products passed for the shape.

Triton is a dev dependency on Linux x86_64 (pyproject's ``dev`` extra), so CI runs these.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton; a dev dependency on Linux x86_64)")

from muonfx.linalg import newton_schulz_batched, resolve, triton_ns  # noqa: E402
from muonfx.linalg.newton_schulz import _gram, _standard  # noqa: E402
from helpers import sweep  # noqa: E402

STEPS = resolve("keller", 5).steps
# square, wide, tall (the NS transposes it), sizes that are not multiples of the 16/32
# tiles, batches of one
SHAPES = [(2, 32, 32), (1, 20, 70), (3, 45, 17), (1, 33, 33), (2, 16, 48)]


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter, the kernels asked for, no check made yet."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MUONFX_TRITON_NS", raising=False)
    monkeypatch.setattr(triton_ns, "_failed", False)
    monkeypatch.setattr(triton_ns, "_verdicts", {})
    monkeypatch.setattr(triton_ns, "_switch", True)
    yield


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _unit(shape, seed, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if x.shape[-2] > x.shape[-1]:
        x = x.mT.contiguous()
    return (x / x.norm(dim=(-2, -1), keepdim=True)).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_sym_product_is_the_full_product_and_exactly_symmetric(interpreter, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    got = triton_ns.sym_product(x)
    assert torch.equal(got, got.mT)
    torch.testing.assert_close(got, torch.bmm(x, x.mT), rtol=1e-5, atol=1e-5)
    # the epilogue: alpha * X Y^T + beta * C0, Y a second symmetric-result factor
    a = got / got.norm()
    want = 0.7 * a + (-1.3) * torch.bmm(a, a)
    torch.testing.assert_close(triton_ns.sym_product(a, a, alpha=-1.3, beta=0.7, c0=a), want, rtol=1e-5, atol=1e-6)
    # strided (transposed) inputs are read through their strides
    xt = x.mT.contiguous().mT
    torch.testing.assert_close(triton_ns.sym_product(xt), torch.bmm(x, x.mT), rtol=1e-5, atol=1e-5)


def test_sym_product_launches_sub_batches_below_32_bit_offsets(interpreter, monkeypatch):
    """The kernel's offsets are 32-bit: a batch spanning more elements is launched in
    sub-batches (here the limit is lowered to two 20 x 40 matrices), with the same result."""
    x = torch.randn(5, 20, 40, generator=torch.Generator().manual_seed(3))
    whole = triton_ns.sym_product(x)
    a = whole / whole.norm()
    whole_epilogue = triton_ns.sym_product(a, a, alpha=-1.3, beta=0.7, c0=a)
    launches = []
    launch = triton_ns._launch
    monkeypatch.setattr(triton_ns, "_launch", lambda x, *rest: (launches.append(x.shape[0]), launch(x, *rest)))
    monkeypatch.setattr(triton_ns, "_MAX_OFFSET", 20 * 40 + 20 * 40 - 1)  # the last entry of the second 20 x 40
    assert torch.equal(triton_ns.sym_product(x), whole)
    assert launches == [2, 2, 1]
    launches.clear()
    assert torch.equal(triton_ns.sym_product(a, a, alpha=-1.3, beta=0.7, c0=a), whole_epilogue)
    assert launches == [4, 1]  # 20 x 20 factors: four fit


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_sym_product_rounds_once_like_bmm(interpreter, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    got, ref = triton_ns.sym_product(x), torch.bmm(x, x.mT)
    assert got.dtype == torch.bfloat16
    exact = torch.bmm(x.double(), x.double().mT)
    # both are float32 accumulations rounded once to bf16: within one bf16 ulp of the exact
    ulp = exact.abs().clamp_min(exact.abs().max() * 2 ** -8) * 2 ** -7
    assert ((got.double() - exact).abs() <= ulp).all()
    assert ((ref.double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("tile", triton_ns.GPU_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_the_gpu_tiles_compute_the_product_on_ragged_shapes(interpreter, tile):
    """The tile sizes a GPU autotunes over (128 x 64, 128 x 32, 64 x 64), run by the
    interpreter on shapes that are not multiples of them: partial tiles on both sides of
    the diagonal, a partial last step over k, two tiles per side (three programs) and
    one, a batch of two, and the epilogue; exactly symmetric, rounded once as bmm."""
    block, block_k = tile[:2]
    for shape in ((1, 150, 100), (2, 130, 64), (1, 64, 200)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).bfloat16()
        c0 = torch.bmm(x, x.mT)
        out = torch.empty_like(c0)
        triton_ns._launch(x, x, -1.3, 0.7, c0, out, tile=(block, block_k))
        assert torch.equal(out, out.mT)
        exact = -1.3 * torch.bmm(x.double(), x.double().mT) + 0.7 * c0.double()
        ulp = exact.abs().clamp_min(exact.abs().max() * 2 ** -8) * 2 ** -7
        assert ((out.double() - exact).abs() <= ulp).all(), (shape, tile)


@pytest.mark.parametrize("shape", sweep(SHAPES, keep={"shape1"}, ids=[f"shape{i}" for i in range(len(SHAPES))]))
def test_the_iterations_compute_the_same_function(interpreter, shape):
    """float32: the symmetric standard iteration equals torch's to float32 rounding; bf16
    (standard and Gram with restarts, as routed): the distance to the float64 iteration is
    within 1.5x (+2e-3) of torch's bf16 path. Measured: standard 1.3e-2..1.6e-2 for both,
    Gram 3.1e-2..3.8e-2 against torch's 2.6e-2..3.5e-2."""
    x32 = _unit(shape, 3, torch.float32)
    truth_std = _standard(x32.double(), STEPS)
    truth_gram = _gram(x32.double(), STEPS, 2)
    torch.testing.assert_close(triton_ns.standard_sym(x32, STEPS), _standard(x32, STEPS), rtol=0, atol=2e-5)
    # float32 Gram without restarts amplifies the rounding of each product; under the
    # interpreter (numpy products) it ends 1e-4..5e-4 from the float64 iteration, against
    # 1e-6..1e-5 for torch's products. The library routes only 16-bit work here (below:
    # bf16 Gram within 1.5x of torch's).
    truth_gram1 = _gram(x32.double(), STEPS, None)
    assert _rel(triton_ns.gram_sym(x32, STEPS, None), truth_gram1) < 1e-3
    xb = x32.bfloat16()
    e_ours, e_torch = _rel(triton_ns.standard_sym(xb, STEPS), truth_std), _rel(_standard(xb, STEPS), truth_std)
    assert e_ours <= 1.5 * e_torch + 2e-3, (e_ours, e_torch)
    e_ours, e_torch = _rel(triton_ns.gram_sym(xb, STEPS, 2), truth_gram), _rel(_gram(xb, STEPS, 2), truth_gram)
    assert e_ours <= 1.5 * e_torch + 2e-3, (e_ours, e_torch)


def test_a_batch_handed_over_in_a_list_is_taken_out(interpreter):
    """Eagerly the caller hands the normalised batch over in a list, so the iteration
    holds the only reference (and frees it with its first iterate): the list is emptied
    and the result is the one of the batch passed directly."""
    xb = _unit((2, 16, 40), 8, torch.bfloat16)
    for fn, args in ((triton_ns.standard_sym, (STEPS,)), (triton_ns.gram_sym, (STEPS, 2)),
                     (lambda x, *a: triton_ns.orthogonalize(x, STEPS, 2, True), ())):
        box = [xb.clone()]
        got = fn(box, *args)
        assert box == [] and torch.equal(got, fn(xb.clone(), *args))


def test_newton_schulz_routes_16_bit_work_to_the_kernels_when_asked(interpreter, monkeypatch):
    calls = []
    real_std, real_gram = triton_ns.standard_sym, triton_ns.gram_sym
    monkeypatch.setattr(triton_ns, "standard_sym", lambda *a: calls.append("standard") or real_std(*a))
    monkeypatch.setattr(triton_ns, "gram_sym", lambda *a: calls.append("gram") or real_gram(*a))
    sched = resolve("keller", 5)
    square = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(4))
    wide = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(5))
    out = newton_schulz_batched(square, sched, dtype=torch.bfloat16)
    assert calls == ["standard"] * 2 and out.dtype == torch.float32  # its check, then the batch
    newton_schulz_batched(wide, sched, dtype=torch.bfloat16, method="auto")  # Gram pays off at n = 4m
    assert calls == ["standard"] * 2 + ["gram"] * 2
    newton_schulz_batched(square, sched, dtype=torch.float32)  # float32: torch's products
    assert calls == ["standard"] * 2 + ["gram"] * 2


def test_a_failing_launch_falls_back_once_with_a_warning(interpreter, monkeypatch, caplog):
    def broken(*_):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(triton_ns, "standard_sym", broken)
    sched = resolve("keller", 5)
    g = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(6))
    with caplog.at_level(logging.WARNING, logger="muonfx"):
        got = newton_schulz_batched(g, sched, dtype=torch.bfloat16)
        again = newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET")
    want = newton_schulz_batched(g, sched, dtype=torch.bfloat16)  # the torch path
    assert torch.equal(got, want) and torch.equal(again, want)
    warned = [r for r in caplog.records if "symmetric Triton" in r.getMessage()]
    assert len(warned) == 1 and "no kernel for this GPU" in warned[0].getMessage()


def test_not_available_without_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_ns.available(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_ns.available(torch.zeros(1))


@pytest.mark.slow
def test_inside_torch_compile_the_kernels_are_one_operator(interpreter, monkeypatch):
    """The compiled step calls ``torch.ops.muonfx.symmetric_newton_schulz`` (opaque to
    inductor) for a shape whose check passed (an eager call made it), torch's products
    before."""
    import torch._dynamo

    calls = []
    real = triton_ns.standard_sym
    monkeypatch.setattr(triton_ns, "standard_sym", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_ns, "available", lambda t: True)  # as on CUDA
    sched = resolve("keller", 5)
    g = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(8))
    # the operator itself, eagerly: the symmetric iteration
    flat = [c for abc in sched.steps for c in abc]
    x = g / g.norm(dim=(-2, -1), keepdim=True)
    op_out = torch.ops.muonfx.symmetric_newton_schulz(x.bfloat16(), flat, 0, False)
    assert torch.equal(op_out, real(x.bfloat16(), sched.steps))
    calls.clear()

    def step(t):
        return newton_schulz_batched(t, sched, dtype=torch.bfloat16, method="standard")

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    before = compiled(g)                                # nothing checked yet: torch's products
    assert calls == []
    eager = step(g)                                     # an eager call checks the shape (and runs) ...
    assert calls == [1, 1] and triton_ns.verdicts() == {("cpu", torch.bfloat16, 24, 24, False, None): True}
    after = compiled(g)                                 # ... and the graph (re)built takes the operator
    assert calls == [1, 1, 1]
    assert torch.equal(after, eager)
    torch.testing.assert_close(before, eager, rtol=0, atol=0.05)  # bf16 products, different rounding
    # a tall batch reaches the operator as a transposed (non-contiguous) view; the
    # operator's output is contiguous, as its fake promises (opcheck tests the pair)
    tall = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(9))
    assert triton_ns.verify(16, 40, torch.bfloat16, "cpu", None, False)
    torch.testing.assert_close(compiled(tall), step(tall), rtol=0, atol=0)
    view = (tall / tall.norm(dim=(-2, -1), keepdim=True)).bfloat16().mT
    torch.library.opcheck(torch.ops.muonfx.symmetric_newton_schulz.default, (view, flat, 0, False))
    torch.library.opcheck(torch.ops.muonfx.symmetric_newton_schulz.default, (view, flat, 3, True))
    torch._dynamo.reset()


def _spy(monkeypatch) -> list:
    calls = []
    for name in ("standard_sym", "gram_sym"):
        real = getattr(triton_ns, name)
        monkeypatch.setattr(triton_ns, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    return calls


def test_the_kernels_are_off_by_default(monkeypatch):
    """torch's products are the rule (measured slower on an H100 on six of seven shapes):
    without set_enabled(True) or MUONFX_TRITON_NS=1 no kernel runs, whatever the device."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MUONFX_TRITON_NS", raising=False)
    monkeypatch.setattr(triton_ns, "_switch", None)
    calls = _spy(monkeypatch)
    g = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(10))
    newton_schulz_batched(g, resolve("keller", 5), dtype=torch.bfloat16)
    assert calls == [] and not triton_ns.requested()
    assert not triton_ns.takes(g, torch.bfloat16, 3, False)


def test_the_first_use_of_a_shape_checks_the_kernels_against_torch(interpreter, monkeypatch, caplog):
    """The first batch of a shape checks the kernels on a seeded random batch of that
    shape against torch's products (no timing); a shape that passes takes the kernels
    from then on, one whose kernels differ beyond bf16 rounding keeps torch's products,
    with one warning; the verdicts are per shape and form, and both orientations share
    them."""
    calls = _spy(monkeypatch)
    sched = resolve("keller", 5)
    square = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(10))
    wide = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(11))
    newton_schulz_batched(square, sched, dtype=torch.bfloat16)
    assert triton_ns.verdicts() == {("cpu", torch.bfloat16, 24, 24, False, None): True}
    assert calls == ["standard_sym", "standard_sym"]  # the check, then the batch itself
    calls.clear()
    newton_schulz_batched(square, sched, dtype=torch.bfloat16)
    assert calls == ["standard_sym"]  # checked once
    # a kernel that computes something else for the wide shape: refused, with a warning
    real = triton_ns.gram_sym
    monkeypatch.setattr(triton_ns, "gram_sym", lambda x, *a: real(x, *a) * 1.5)  # (the spy records it)
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="muonfx"):
        got = newton_schulz_batched(wide, sched, dtype=torch.bfloat16, method="auto")
        again = newton_schulz_batched(wide.mT, sched, dtype=torch.bfloat16, method="auto")
    assert triton_ns.verdicts()[("cpu", torch.bfloat16, 16, 64, True, 3)] is False
    assert calls == ["gram_sym"]  # the check only: then torch's products
    warned = [r.getMessage() for r in caplog.records if "differs from torch's products" in r.getMessage()]
    assert len(warned) == 1 and "16 x 64" in warned[0], warned
    monkeypatch.setattr(triton_ns, "_switch", False)
    assert torch.equal(got, newton_schulz_batched(wide, sched, dtype=torch.bfloat16, method="auto"))
    assert torch.equal(again, newton_schulz_batched(wide.mT, sched, dtype=torch.bfloat16, method="auto"))


def test_set_enabled_and_the_environment_switch_the_kernels(interpreter, monkeypatch):
    calls = _spy(monkeypatch)
    sched = resolve("keller", 5)
    g = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(12))
    triton_ns._verdicts[("cpu", torch.bfloat16, 24, 24, False, None)] = True  # as if checked
    triton_ns.set_enabled(False)
    newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    assert calls == []
    triton_ns.set_enabled(True)
    newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    assert calls == ["standard_sym"]
    triton_ns.set_enabled(None)
    for value, used in (("1", True), ("on", True), ("0", False), ("off", False), ("auto", False), ("", False)):
        calls.clear()
        monkeypatch.setenv("MUONFX_TRITON_NS", value)
        newton_schulz_batched(g, sched, dtype=torch.bfloat16)
        assert calls == (["standard_sym"] if used else []), value
    triton_ns.set_enabled(False)  # overrides the environment
    monkeypatch.setenv("MUONFX_TRITON_NS", "1")
    calls.clear()
    newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    assert calls == []
    triton_ns.set_enabled(None)
    monkeypatch.setenv("MUONFX_TRITON_NS", "sometimes")
    with pytest.raises(ValueError, match="MUONFX_TRITON_NS='sometimes'"):
        newton_schulz_batched(g, sched, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="enabled must be True, False or None"):
        triton_ns.set_enabled("yes")
    assert triton_ns._switch is None


def test_inside_torch_compile_only_checked_shapes_take_the_kernels(interpreter, monkeypatch):
    """A graph cannot check the kernels: inside ``torch.compile`` a shape not checked yet
    keeps torch's products; once checked (eagerly; an optimizer's plan checks its shapes
    before its graph is traced), the graph built after it takes the operator."""
    import torch._dynamo

    monkeypatch.setattr(triton_ns, "available", lambda t: True)  # as on CUDA
    calls = _spy(monkeypatch)
    sched = resolve("keller", 5)
    g = torch.randn(2, 24, 24, generator=torch.Generator().manual_seed(13))

    def step(t):
        return newton_schulz_batched(t, sched, dtype=torch.bfloat16, method="standard")

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(g)
    assert calls == [] and triton_ns.verdicts() == {}
    assert triton_ns.verify(24, 24, torch.bfloat16, "cpu", None, False)
    torch._dynamo.reset()
    calls.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(g)
    assert calls == ["standard_sym"]
    torch._dynamo.reset()


def test_an_optimizer_checks_its_shapes_when_its_plan_is_built(interpreter, monkeypatch):
    """With the kernels asked for, a compiled optimizer's plan checks every matrix shape
    of its compiled groups before the graph is traced (the settings it captured say the
    kernels are asked for), so the graph takes them for shapes that pass."""
    import muonfx as mfx

    monkeypatch.setattr(triton_ns, "runs_on", lambda d: True)
    w = torch.nn.Parameter(torch.randn(24, 24))
    opt = mfx.TransformOptimizer([("w", w)], mfx.muon, ns_dtype=torch.bfloat16, ns_method="standard", compile=True)
    assert opt.plan.settings.triton and opt.plan.groups[0].path == "compiled"
    assert triton_ns.verdicts() == {("cpu", torch.bfloat16, 24, 24, False, None): True}
    assert "triton" in str(opt.plan)
