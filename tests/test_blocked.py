"""Symmetric products by block rows (muonfx.linalg.blocked, the CPU): the same products and
the same iterations as the plain batched ones, to rounding; the rule that picks them; and
the opaque operator the compiled step sees."""

from __future__ import annotations

import pytest
import torch

from muonfx.linalg import NewtonSchulz, blocked, resolve
from muonfx.linalg.newton_schulz import _gram, _normalized, _standard
from helpers import sweep  # noqa: E402

SCHEDULE = resolve("keller", 5)


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m, k", [(6, 9), (17, 5), (32, 32), (1, 4)])
def test_block_product_is_the_full_product(blocks, m, k):
    gen = torch.Generator().manual_seed(m * k + blocks)
    x = torch.randn(3, m, k, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(blocked.block_product(x, blocks=blocks), x @ x.mT, rtol=0, atol=1e-12)
    s = x @ x.mT  # symmetric; s s^T = s s, and alpha s s + beta s
    got = blocked.block_product(s, s, alpha=-0.5, beta=2.0, c0=s, blocks=blocks)
    torch.testing.assert_close(got, -0.5 * s @ s + 2.0 * s, rtol=0, atol=1e-10)


def test_block_product_mirrors_the_blocks_above_the_diagonal():
    """The upper blocks are copies of the lower ones, bit for bit (float32, 3 blocks)."""
    x = torch.randn(2, 30, 50)
    out = blocked.block_product(x, blocks=3)
    for r0, r1 in ((0, 10), (10, 20)):
        assert torch.equal(out[:, r0:r1, r1:], out[:, r1:, r0:r1].mT)


@pytest.mark.parametrize("gram", [False, True], ids=["standard", "gram"])
@pytest.mark.parametrize("shape", sweep([(1, 40, 64), (3, 33, 33), (2, 21, 70)], keep={"odd"},
                                        ids=["one", "square", "odd"]))
def test_the_blocked_iterations_are_the_plain_ones(gram, shape):
    """The same function: in float64 equal to rounding; in float32 and bf16 about as far
    from the float64 iteration as the plain products are: within 4x plus the dtype's floor
    (measured up to 3.9x, float32 Gram on a square matrix, where the Gram form is at its
    most sensitive; bf16 restarts the Gram form every 3 steps, as the plain one does)."""
    gen = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(*shape, generator=gen)
    x64 = _normalized(g.double(), SCHEDULE, 1e-7, torch.float64, False)
    for dtype, floor in ((torch.float64, 1e-11), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        restart = 3 if dtype == torch.bfloat16 else None
        truth = _gram(x64, SCHEDULE.steps, restart) if gram else _standard(x64, SCHEDULE.steps)
        x = _normalized(g.to(dtype), SCHEDULE, 1e-7, dtype, False)
        plain = _gram(x, SCHEDULE.steps, restart) if gram else _standard(x, SCHEDULE.steps)

        def err(t):
            return ((t.double() - truth).norm() / truth.norm()).item()

        for blocks in (2, 3):
            got = blocked.orthogonalize(x, SCHEDULE.steps, restart, gram, blocks)
            assert got.dtype == dtype and got.shape == x.shape
            assert err(got) <= 4 * err(plain) + floor, (dtype, blocks, err(got), err(plain))


def test_the_iteration_takes_over_a_batch_handed_in_a_list():
    x = _normalized(torch.randn(2, 8, 12), SCHEDULE, 1e-7, torch.float32, False)
    box = [x.clone()]
    out = blocked.orthogonalize(box, SCHEDULE.steps, None, False, 2)
    assert box == [] and torch.equal(out, blocked.orthogonalize(x, SCHEDULE.steps, None, False, 2))


def test_block_count_rule():
    assert [blocked.block_count(m) for m in (64, 511, 512, 4096)] == [1, 1, 4, 4]
    assert [blocked.block_count(m, dtype=torch.bfloat16) for m in (512, 639, 640, 2048)] == [1, 1, 3, 3]
    assert blocked.block_count(1024, dtype=torch.float64) == 4
    assert blocked.block_count(4096, "cuda") == 1 and blocked.block_count(4096, "meta") == 1


@pytest.mark.slow
def test_newton_schulz_takes_the_blocks_on_large_cpu_matrices():
    """float32 asked for, 512 x 600 (standard form): the blocked iteration, bit for bit what
    blocked.orthogonalize computes, and within float32 rounding of the plain one; a tall
    batch too (its transpose is the one iterated)."""
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(2, 512, 600, generator=gen)
    ns = NewtonSchulz(SCHEDULE, dtype=torch.float32, method="standard")
    x = _normalized(g, SCHEDULE, 1e-7, torch.float32, False)
    want = blocked.orthogonalize(x, SCHEDULE.steps, None, False, blocked.block_count(512))
    assert torch.equal(ns(g), want)
    plain = _standard(x, SCHEDULE.steps)
    assert ((ns(g) - plain).norm() / plain.norm()).item() < 1e-5
    # a tall batch iterates on its transpose (a strided view: another rounding of the products)
    torch.testing.assert_close(ns(g.mT.contiguous()), want.mT, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_compiled_iteration_is_one_opaque_operator():
    """Inside torch.compile the blocked iteration is torch.ops.muonfx.blocked_newton_schulz
    (one graph node whatever the batch and block count), with a fake that matches."""
    x = _normalized(torch.randn(3, 24, 40), SCHEDULE, 1e-7, torch.float32, False)
    torch.library.opcheck(torch.ops.muonfx.blocked_newton_schulz.default,
                          (x, [c for abc in SCHEDULE.steps for c in abc], 3, True, 2))

    def run(t):
        return blocked.orthogonalize([t * 1.0], SCHEDULE.steps, None, True, 3)

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(run, backend=backend, fullgraph=True)(x)
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    op = torch.ops.muonfx.blocked_newton_schulz
    assert sum(t in (op, op.default) for t in targets) == 1, targets
    assert torch.ops.aten.mm.default not in targets and torch.mm not in targets
    torch.testing.assert_close(got, run(x), rtol=0, atol=0)
    inductor = torch.compile(run, fullgraph=True)(x)  # the real backend (C++ on the CPU)
    torch.testing.assert_close(inductor, run(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_the_spectral_form_takes_the_block_rows_for_its_two_symmetric_products():
    """float32 spectral form on 512 x 600 (as "auto" computes it where float32 is the
    default): R = X X^T and V diag(h) V^T by block rows, to float32 rounding of the plain
    products; inside torch.compile each is torch.ops.muonfx.block_product."""
    from muonfx.linalg.newton_schulz import _spectral

    gen = torch.Generator().manual_seed(13)
    g = torch.randn(2, 512, 600, generator=gen)
    x = _normalized(g, SCHEDULE, 1e-7, torch.float32, False)
    got = NewtonSchulz(SCHEDULE, dtype=torch.float32, method="spectral")(g)
    assert torch.equal(got, _spectral(x, SCHEDULE.steps, blocked.block_count(512)))
    plain = _spectral(x, SCHEDULE.steps, 1)
    assert ((got - plain).norm() / plain.norm()).item() < 1e-5
    y = torch.randn(3, 7, 5, dtype=torch.float64)
    torch.library.opcheck(torch.ops.muonfx.block_product.default, (y, y, 2))

    small = _normalized(torch.randn(2, 24, 40, generator=gen), SCHEDULE, 1e-7, torch.float32, False)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda t: _spectral([t * 1.0], SCHEDULE.steps, 3), backend=backend, fullgraph=True)(small)
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    op = torch.ops.muonfx.block_product
    assert sum(t in (op, op.default) for t in targets) == 2, targets
    torch.testing.assert_close(out, _spectral(small, SCHEDULE.steps, 3), rtol=0, atol=0)


@pytest.mark.slow
def test_the_benchmark_tables_of_the_spectral_form_and_the_block_rows(monkeypatch):
    """``benchmarks/newton_schulz.py``'s spectral and blocks tables, on small shapes: a row
    per size, the rule's choice in its column, ratios that parse."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("newton_schulz")
    try:
        spectral = bench.spectral(1, sides=(8, 16), ratios=(1, 2))
        rows = [r for r in spectral.splitlines() if r.startswith("|") and "x" in r.split("|")[1]]
        assert len(rows) == 4 and all(r.split("|")[6].strip() == "no" for r in rows), spectral
        assert all(float(r.split("|")[5]) > 0 for r in rows)
        table = bench.blocks(1, shapes=((2, 16, 24), (1, 12, 12)))
        rows = [r for r in table.splitlines() if r.startswith("|") and r.split("|")[1].strip() in ("bfloat16", "float32")]
        assert len(rows) == 4 and all(r.split("|")[-2].strip() == "1" for r in rows), table
        assert all(float(c) > 0 for r in rows for c in r.split("|")[5:8])
    finally:
        sys.modules.pop("newton_schulz", None)


def test_newton_schulz_takes_the_blocks_in_bf16_from_640_only():
    """bf16 (the native-bf16 CPU default): the Gram form at 640 x 1280 runs on three block
    rows, bit for bit what blocked.orthogonalize computes; at 512 x 1024, where they gain
    nothing, the plain products."""
    gen = torch.Generator().manual_seed(15)
    ns = NewtonSchulz(SCHEDULE, dtype=torch.bfloat16)
    for m, blocks in ((640, 3), (512, 1)):
        g = torch.randn(1, m, 2 * m, generator=gen)
        assert blocked.block_count(m, dtype=torch.bfloat16) == blocks
        x = _normalized(g, SCHEDULE, 1e-7, torch.bfloat16, False)
        want = (blocked.orthogonalize(x, SCHEDULE.steps, 3, True, blocks) if blocks > 1
                else _gram(x, SCHEDULE.steps, 3))
        assert torch.equal(ns(g), want.float()), m
