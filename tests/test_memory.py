"""Optimizer state memory: Muon keeps one buffer per matrix (optionally bf16), AdamW two;
a step's extra working memory, measured op by op, is bounded by the largest group."""


import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.tree import tensors as tree_tensors
from muonfx.memory import FreshMemory
from helpers import sweep  # noqa: E402


def _params():
    gen = torch.Generator().manual_seed(0)
    return TensorDict({"a": torch.randn(16, 32, generator=gen), "b": torch.randn(3, 8, 8, generator=gen),
                       "c": torch.randn(4, 2, 3, 3, generator=gen)}, [])


def _state_bytes(state):
    return sum(t.numel() * t.element_size() for t in tree_tensors(state))


def test_muon_state_is_one_buffer_per_matrix():
    p = _params()
    param_bytes = sum(t.numel() * t.element_size() for t in p.values())
    state = mfx.muon().init(p)
    assert len(list(tree_tensors(state))) == 3
    assert _state_bytes(state) == param_bytes
    half = mfx.muon(mu_dtype=torch.bfloat16).init(p)
    assert _state_bytes(half) == param_bytes // 2
    assert all(t.dtype == torch.bfloat16 for t in tree_tensors(half))


def test_adamw_state_is_two_buffers_per_parameter():
    p = _params()
    param_bytes = sum(t.numel() * t.element_size() for t in p.values())
    state = mfx.adamw().init(p)
    assert _state_bytes(state) == 2 * param_bytes


def test_bf16_momentum_tracks_float32_momentum():
    p = _params()
    g = p.apply(lambda t: torch.randn_like(t))
    full, half = mfx.muon(ns_dtype=torch.float32), mfx.muon(ns_dtype=torch.float32, mu_dtype=torch.bfloat16)
    sf, sh = full.init(p), half.init(p)
    for _ in range(3):
        uf, sf = full.update(g, sf, p)
        uh, sh = half.update(g, sh, p)
    for k in ("a", "b", "c"):
        rel = ((uf[k] - uh[k]).norm() / uf[k].norm()).item()
        assert rel < 0.05, (k, rel)  # bf16 storage of the EMA only



# ---------------------------------------------------------------------------
# a step's extra working memory, measured
# ---------------------------------------------------------------------------


def test_fresh_memory_counts_allocations_and_frees():
    x = torch.randn(1000)
    with FreshMemory() as m:
        y = x * 2           # 4000 bytes
        x.mul_(2)           # in place: nothing new
        z = y + 1           # 8000 live
        del y               # 4000 live
        w = z[:10]          # a view: nothing new
        del z, w            # 0 live
        v = x.sqrt()        # 4000 again, peak stays 8000
    assert m.peak == 8000 and m.live == 4000
    del v


def _step_peak(factory, shapes, **kw):
    gen = torch.Generator().manual_seed(0)
    named = [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in shapes.items()]
    opt = mfx.TransformOptimizer(named, factory, lr=0.01, **kw)
    for step in range(3):  # the first step allocates the state; measure a later one
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 2:
            with FreshMemory() as m:
                opt.step()
        else:
            opt.step()
    return m.peak, sum(p.numel() * p.element_size() for _, p in named)


def _distinct_shapes(n):
    """n matrices of different shapes (one per same-shape group), the largest 96x128."""
    return {f"w{i}": (96 - i, 128 - 2 * i) for i in range(n)}


def _same_shapes(n):
    return {f"w{i}": (64, 96) for i in range(n)}


def test_adamw_eager_step_holds_the_new_state_and_two_links_of_the_chain():
    """The eager step computes the pure update before it writes anything (so a
    raising step changes nothing): new mu and nu (2 P) and two consecutive links of the
    chain (2 P) are alive at the peak. ``opt.compile()`` fuses these away."""
    shapes = _distinct_shapes(12) | {"b": (96,)}
    peak, model = _step_peak(mfx.adamw, shapes, fused=False)  # the chain, transform by transform
    assert 3.5 * model <= peak <= 4 * model + 256, peak / model


def test_adamw_fused_step_allocates_nothing_per_parameter():
    """AdamW's default path, torch's fused kernel on the state's own buffers, writes in
    place: no tensor of a parameter's size is allocated during the step."""
    shapes = _distinct_shapes(12) | {"b": (96,)}
    peak, model = _step_peak(mfx.adamw, shapes)
    assert peak <= 4096, peak


#: the bound of the step's extra memory in budgets, by path and Newton-Schulz dtype: the
#: measured figures of the docstring below with a margin
MUON_PIECE_BOUND = {("chain", torch.float32): 7, ("chain", torch.bfloat16): 4.75,
                    ("lowered", torch.float32): 5, ("lowered", torch.bfloat16): 2.75}


@pytest.mark.parametrize("path", ["lowered", "chain"])
@pytest.mark.parametrize("ns_dtype", sweep([torch.float32, torch.bfloat16], keep={"bfloat16"},
                                           ids=["float32", "bfloat16"]))
def test_muon_step_memory_is_a_few_budgets_whatever_the_model(ns_dtype, path):
    """32 same-shape matrices, budget B = 4 of them (one knob,
    muonfx.linalg.set_batch_bytes): the group is larger than B, so it runs in pieces of
    at most B bytes, each written before the next, and the step's extra memory is a few
    B whatever the number of matrices. Measured (64 x 96 matrices: Newton-Schulz's
    batched products): the chain 6.3 B (float32) and 4.2 B (bf16), for 32 and for 64
    matrices alike; the plan's Muon lowering (the default path; ``fused=False`` runs the
    chain), which keeps no second momentum buffer, makes each batch's Nesterov input
    when the batch runs and keeps the outputs in their compute dtype until the piece
    writes: 4.3 B and 2.2 B. Without the budget (all 32 matrices in one batch and one
    piece) the same multiples of the model's bytes P."""
    mat = 64 * 96 * 4
    budget = 4 * mat
    kw = {"ns_dtype": ns_dtype, "fused": None if path == "lowered" else False}
    try:
        mfx.linalg.set_batch_bytes(budget, "cpu")
        peak, model = _step_peak(mfx.muon, _same_shapes(32), **kw)
        twice, _ = _step_peak(mfx.muon, _same_shapes(64), **kw)
        mfx.linalg.set_batch_bytes(1 << 40, "cpu")
        unbounded, _ = _step_peak(mfx.muon, _same_shapes(32), **kw)
    finally:
        mfx.linalg.set_batch_bytes(None, "cpu")
    assert peak <= MUON_PIECE_BOUND[path, ns_dtype] * budget, peak / budget
    assert twice <= peak + 4096, (twice, peak)  # twice the model, the same peak
    assert unbounded >= 2 * model  # the whole model in one batch: the budget is what bounds it
    # 32 matrices of other shapes, all within the CPU's budget: one piece, whole
    peak, model = _step_peak(mfx.muon, _distinct_shapes(32), **kw)
    assert model <= mfx.linalg.batch_bytes("cpu")
    assert peak <= 3 * model + 5 * mfx.linalg.batch_bytes("cpu")


# ---------------------------------------------------------------------------
# the allocator's own records: the path that runs, compiled included
# ---------------------------------------------------------------------------


def test_allocator_peak_counts_allocations_and_frees():
    from muonfx.memory import AllocatorPeak

    x = torch.randn(1000)
    with AllocatorPeak() as m:
        y = x * 2           # 4000 bytes
        z = y + 1           # 8000 live
        del y
        v = x.sqrt()        # 8000 again: the peak stays
        del z, v
    # the scalars 2 and 1 become tiny tensors of their own
    assert 8000 <= m.peak < 8100, m.peak


def test_allocator_peak_agrees_with_the_op_by_op_count_on_an_eager_step():
    from muonfx.memory import AllocatorPeak

    gen = torch.Generator().manual_seed(0)
    named = [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in _distinct_shapes(6).items()]
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.01, ns_dtype=torch.float32)
    peaks = []
    for counter in (None, FreshMemory(), AllocatorPeak()):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        if counter is None:
            opt.step()  # creates the state
            continue
        with counter:
            opt.step()
        peaks.append(counter.peak)
    fresh, allocator = peaks
    # the same eager step: the allocator also sees the few-byte scalars the dispatcher hides
    assert fresh <= allocator <= fresh * 1.01 + 4096, (fresh, allocator)


@pytest.mark.slow
def test_the_compiled_muon_step_matches_eager_and_holds_about_what_the_eager_one_holds():
    """Inductor's compiled step (Newton-Schulz in bf16, Gram form, stacks cut over two
    batches, tall and wide matrices; the cast back to float32 fused into the parameter
    update) trains like the eager step, and the allocator's records show what it holds:
    about a model's bytes, as the eager step (Muon's lowering)."""
    from muonfx.memory import step_memory

    torch._dynamo.reset()
    shapes = {"wide": (4, 24, 64), "tall": (4, 64, 24), "sq": (32, 32)}
    gen = torch.Generator().manual_seed(0)
    init = {k: torch.randn(*s, generator=gen) * 0.1 for k, s in shapes.items()}
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    pair = []
    for _ in range(2):
        named = [(k, torch.nn.Parameter(v.clone())) for k, v in init.items()]
        pair.append((named, mfx.TransformOptimizer(named, mfx.muon, **kw)))
    (e_named, eager), (c_named, comp) = pair
    eager.param_groups[0]["compile"] = False
    comp.compile()
    try:
        mfx.linalg.set_batch_bytes(2 * 24 * 64 * 4, "cpu")  # each stack of 4 in two batches
        for step in range(4):
            g = {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}
            for named in (e_named, c_named):
                for k, p in named:
                    p.grad = g[k].clone()
            if step == 3:
                mem_e = step_memory(eager.step, torch.device("cpu"))
                mem_c = step_memory(comp.step, torch.device("cpu"))
            else:
                eager.step()
                comp.step()
    finally:
        mfx.linalg.set_batch_bytes(None, "cpu")
    for (n, a), (_, b) in zip(e_named, c_named):
        moved = (a - init[n]).norm()
        # the same ops, fused: a float32 rounding apart before the bf16 cast, which flips
        # a few bf16 inputs of Newton-Schulz; bf16's own scale (test_precision's 3e-2 bound)
        assert (a - b).norm() <= 3e-2 * moved, (n, ((a - b).norm() / moved).item())
    model = sum(v.numel() * 4 for v in init.values())
    # both run in pieces here (the group is larger than the budget); the compiled pieces
    # store in place and free early: 1.06-1.2 P. The eager step is Muon's lowering, which
    # makes each batch's Nesterov input when it runs (in a buffer kept between steps on
    # the CPU) and keeps the outputs in bf16: 0.85 P (2.05 P before it did)
    assert 0 < mem_c <= 1.5 * model and 0 < mem_e <= 1.5 * model, (mem_c / model, mem_e / model)


# ---------------------------------------------------------------------------
# Newton-Schulz lets go of its normalised input
# ---------------------------------------------------------------------------


def _ns_peak(g: torch.Tensor) -> float:
    """Peak fresh bytes of one standard bf16 Newton-Schulz call on the bf16 batch ``g``,
    in units of ``g``'s bytes."""
    ns = mfx.linalg.NewtonSchulz(mfx.linalg.resolve("keller", 5), dtype=torch.bfloat16, method="standard")
    with FreshMemory() as m:
        ns(g)
    return m.peak / (g.numel() * g.element_size())


def _raise_in_a_compiled_step() -> None:
    """A compiled muonfx step that raises (a NaN lr in its second group, after two good
    steps): measured, from then on in this process CPython no longer frees a temporary
    argument inside the function it was passed to (torch 2.13, Python 3.11)."""
    gen = torch.Generator().manual_seed(0)
    named = [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in
             {"w": (12, 8), "v": (8, 8), "b": (8,)}.items()]
    groups = [{"params": [p for _, p in named[:2]], "param_names": ["w", "v"], "tx": mfx.muon},
              {"params": [named[2][1]], "param_names": ["b"], "tx": mfx.adamw}]
    opt = mfx.TransformOptimizer(groups, mfx.adamw, lr=1e-2)
    opt.compile(backend="aot_eager")
    for _ in range(2):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError):
        opt.step()


@pytest.mark.slow
def test_newton_schulz_frees_its_normalised_input_with_the_first_iterate():
    """A wide bf16 batch G (its ``m x m`` products are G/4 each): the normalised copy
    (G), then two iterates at a time (2 G) and two ``m x m`` products: 2.5 G. Were the
    normalised input kept to the end, three batches would be alive from the second step
    on: 3.5 G. The batch is handed over in a list, so this holds also after a compiled
    step raised in the process (where passing it as a temporary no longer frees it)."""
    g = torch.randn(4, 16, 64).to(torch.bfloat16)
    assert _ns_peak(g) <= 2.6, _ns_peak(g)
    _raise_in_a_compiled_step()
    assert _ns_peak(g) <= 2.6, _ns_peak(g)


@pytest.mark.parametrize("ns_dtype, bound", [(torch.bfloat16, 3.9), (torch.float32, 5.2)])
def test_an_expert_stack_piece_holds_under_four_budgets_in_bf16(ns_dtype, bound):
    """Four expert stacks (8 x 64 x 128, 1:2, the Gram form in bf16), the budget one
    stack: each stack is a piece and one Newton-Schulz batch, which goes to Newton-Schulz
    as it is (no copy made by the seam). Measured: bf16 3.75 B (4.25 B while the seam cast
    single batches itself: that copy outlived Newton-Schulz's own), float32 5.0 B."""
    stack = 8 * 64 * 128 * 4
    try:
        mfx.linalg.set_batch_bytes(stack, "cpu")
        peak, _ = _step_peak(mfx.muon, {f"e{i}": (8, 64, 128) for i in range(4)}, ns_dtype=ns_dtype)
    finally:
        mfx.linalg.set_batch_bytes(None, "cpu")
    assert peak <= bound * stack, peak / stack


@pytest.mark.slow
def test_the_step_memory_benchmark_prints_each_path():
    """``benchmarks/step_memory.py`` on a small set: a row per path, pieces below whole."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_memory.py"
    out = subprocess.run([sys.executable, str(script), "--sets", "moe", "--layers", "1", "--budget-mib", "4",
                          "--paths", "whole,eager"], capture_output=True, text=True, timeout=300, check=True).stdout
    mib = {path: int(n) for path, n in re.findall(r"^\|\s*moe\s*\|[^|]*\|\s*(whole|eager)\s*\|\s*(\d+) MiB", out, re.M)}
    assert set(mib) == {"whole", "eager"} and mib["eager"] < mib["whole"], out


# ---------------------------------------------------------------------------
# docs/api.md's table of state per parameter element, measured
# ---------------------------------------------------------------------------

#: the "parameter" column of the table: the shapes measured and the preset's options
_TABLE_PARAMS = {
    "any": ([(16, 32), (32,)], {}),
    "a matrix": ([(16, 32), (8, 8)], {}),
    "a square matrix": ([(16, 16)], {}),
    "an `m x 2m` matrix": ([(16, 32)], {}),
    "an `m x 4m` matrix": ([(8, 32)], {}),
    "an `m x 4m` matrix, `4m > max_precond_dim` (one-sided)": ([(8, 32)], {"max_precond_dim": 16}),
    "a vector (`precondition_1d=False`, the default)": ([(32,)], {}),
}


def _state_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    section = text.split("#### State memory per parameter element", 1)[1].split("\n\n|", 1)[1]
    rows = []
    for line in ("|" + section).split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[1], float(cells[3]), float(cells[4])))
    return rows


def test_the_documented_state_per_element_is_what_each_optimizer_holds():
    from muonfx.memory import state_bytes, state_per_element

    rows = _state_table()
    from muonfx.presets import catalogue
    assert {"adamw", "muon", *catalogue.__all__} <= {r[0] for r in rows}
    for name, param, copies, nbytes in rows:
        shapes, kw = _TABLE_PARAMS[param]
        params = [(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
        opt = mfx.TransformOptimizer(params, getattr(mfx, name), **kw)
        measured = state_per_element(opt)
        assert (measured, measured / 4) == (nbytes, copies), (name, param, measured)
        assert state_bytes(opt) == nbytes * sum(p.numel() for _, p in params)
