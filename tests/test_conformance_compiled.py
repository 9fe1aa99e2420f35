"""The conformance kit's ``compiled`` law: a transform compiled by inductor inside
``TransformOptimizer`` must train as the eager optimizer does.

Every example compiles (inductor's C++ on the CPU, seconds each), so the checks here draw
few examples. The law must catch the compiler mistakes it exists for: the fused state
write-back that inductor got wrong (one ``torch._foreach_copy_`` of every buffer, now
one ``copy_`` each: ``muonfx.optim.step.writeback.store``) is put back here and the law
must see it.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
import muonfx.optim.step.compiled as compiled_mod
from muonfx import tree
from muonfx.core import GradientTransformation, build, td_items
from muonfx.testing import COMPILED_RTOL, LAWS, OPT_IN_LAWS, ConformanceError, check_transform, params_and_grads

from helpers import one_intra_op_thread  # noqa: F401  (autouse: one thread in this module)

FEW = dict(max_examples=2, derandomize=True, laws=["compiled"])
FLOAT32 = dict(params=params_and_grads(dtypes=(torch.float32,), max_leaves=3))


def test_the_compiled_law_is_checked_only_when_asked_for():
    report = check_transform(mfx.scale(2.0), max_examples=2, derandomize=True)
    assert "compiled" in LAWS and OPT_IN_LAWS == ("compiled",)
    assert report["compiled"] == "skipped: not requested (it compiles every example: laws=[..., 'compiled'])"
    assert report["purity"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("build", [lambda: mfx.accumulate(mfx.momentum(0.9), 2), mfx.adamw],
                         ids=["accumulate_momentum", "adamw"])
def test_stateful_transforms_compiled_by_inductor_conform(build):
    """Every dtype the strategies draw (float32, float64, bf16 parameters), default tolerance."""
    assert check_transform(build(), **FEW)["compiled"] == "ok"


def _foreach_store(old, new):
    """The compiled step's state write-back as it was before: one
    ``torch._foreach_copy_`` of every new buffer into its old one, which inductor
    (2.10 to 2.13) fuses into one loop that writes a buffer before it computes another
    buffer's new value from it."""
    old_leaves, _ = tree.flatten(old)
    new_leaves, spec = tree.flatten(new)
    dst, src, out = [], [], []
    for o, n in zip(old_leaves, new_leaves):
        if isinstance(n, TensorDict) and isinstance(o, TensorDict):
            ks, nv = td_items(n)
            ov = td_items(o)[1]
            kept = []
            for a, b in zip(ov, nv):
                if a is not b and a.shape == b.shape and a.dtype == b.dtype:
                    dst.append(a)
                    src.append(b)
                    kept.append(a)
                else:
                    kept.append(b)
            out.append(build(ks, kept))
        else:
            out.append(n)
    if dst:
        torch._foreach_copy_(dst, src)
    return tree.unflatten(out, spec)


def test_the_law_catches_the_fused_write_back_inductor_got_wrong(monkeypatch):
    """``accumulate(momentum(0.9), 2)`` with the old write-back: the momentum took the
    zeroed sum in the compiled steps. The law fails and names the parameter and step."""
    monkeypatch.setattr(compiled_mod, "store", _foreach_store)
    with pytest.raises(ConformanceError) as info:
        check_transform(mfx.accumulate(mfx.momentum(0.9), 2), **FEW, **FLOAT32)
    err = info.value
    assert err.law == "compiled" and err.report["compiled"] == "FAILED"
    assert "differ between the compiled and the eager optimizer" in err.detail, err.detail
    assert "params[" in err.detail and "step " in err.detail
    assert "minimal failing example" in str(err) and err.example is not None


def noisy_sign(scale: float = 0.1) -> GradientTransformation:
    """Sign descent with a little noise drawn inside update: random numbers, which the
    compiled step draws differently from eager PyTorch."""

    def init_fn(params):
        return ()

    def update_fn(updates, state, params=None):
        return updates.apply(lambda g: -scale * (torch.sign(g) + 0.5 * torch.rand_like(g))), state

    return GradientTransformation(init_fn, update_fn)


def test_random_numbers_inside_update_break_the_law_and_the_error_says_so():
    with pytest.raises(ConformanceError) as info:
        check_transform(noisy_sign(), **FEW, **FLOAT32)
    assert info.value.law == "compiled"
    assert "Random numbers drawn inside update differ under the compiler" in info.value.detail


def test_a_transform_the_compiler_cannot_take_is_reported_as_stepped_eagerly():
    """``apply_if_finite`` chooses on a tensor's value (data-dependent): the adapter steps
    it eagerly, which is correct; the law says nothing was compared."""
    report = check_transform(mfx.apply_if_finite(mfx.momentum(0.9)), **FEW, **FLOAT32)
    assert report["compiled"].startswith("skipped: torch.compile could not take this transform in any of the 2 "
                                         "examples"), report["compiled"]


def _bf16_inside():
    """A float32 transform that computes in bf16 inside: ``3 u + 1`` with bf16 operands
    (eagerly rounded after the product and after the sum, by inductor once at the end)."""
    def init_fn(params):
        return mfx.EmptyState()

    def update_fn(updates, state, params=None):
        return updates.apply(lambda u: (u.bfloat16() * 3.0 + 1.0).to(u.dtype)), state

    return GradientTransformation(init_fn, update_fn)


@pytest.mark.slow
def test_low_precision_inside_a_float32_transform_needs_its_own_tolerance():
    """Elementwise bf16 arithmetic inside a float32 transform differs between two fusions
    by a bf16 rounding (~4e-3 of the step): beyond the default tolerance (a float32
    transform's reorderings stay below 1e-5 of the step), within ``rtol=0.1``. Muon with
    bf16 Newton-Schulz needs no such tolerance on the CPU: its Newton-Schulz is one opaque
    operator in the compiled step, the eager code bit for bit."""
    assert COMPILED_RTOL == 1e-4
    args = dict(max_examples=2, derandomize=True, laws=["compiled"],
                params=params_and_grads(dtypes=(torch.float32,), min_ndim=2, max_ndim=2, min_leaves=2, max_leaves=2))
    assert check_transform(mfx.muon(ns_dtype=torch.float32), **args)["compiled"] == "ok"
    assert check_transform(mfx.muon(ns_dtype=torch.bfloat16), **args)["compiled"] == "ok"
    assert check_transform(_bf16_inside(), rtol=0.1, **args)["compiled"] == "ok"
    with pytest.raises(ConformanceError, match="pass rtol= if the transform computes in a lower precision"):
        check_transform(_bf16_inside(), **args)


def test_the_backend_is_checked_before_anything_runs():
    with pytest.raises(TypeError, match="backend"):
        check_transform(mfx.scale(2.0), laws=["compiled"], backend=3)
    with pytest.raises(TypeError, match="backend"):
        check_transform(mfx.scale(2.0), laws=["compiled"], backend="")


def test_another_backend_is_used_when_given():
    calls = []

    def counting(gm, example_inputs):
        calls.append(1)
        return gm.forward

    assert check_transform(mfx.momentum(0.9), backend=counting, **FEW, **FLOAT32)["compiled"] == "ok"
    assert calls, "the law did not compile with the backend it was given"


@pytest.mark.slow
def test_the_compiled_run_covers_one_graph_and_pieces():
    """A model larger than the batch budget runs a leafwise transform with matrix work
    compiled in pieces, one graph each: the law's compiled run takes that path too (a
    one-byte budget from step ``steps`` on), after whole-graph steps; the budget is
    restored afterwards."""
    from muonfx.optim.step.run import Runner

    kinds = []
    real = Runner._run

    def spy(self, plan, *a, **k):
        kinds.extend("pieces" if g.pieces else "whole" for g in plan.compiled)
        return real(self, plan, *a, **k)

    Runner._run = spy
    try:
        before = mfx.linalg.batch_bytes("cpu")
        two = params_and_grads(dtypes=(torch.float32,), min_leaves=2, max_leaves=2, min_ndim=2, max_ndim=2,
                               nested=False)
        assert check_transform(mfx.muon(ns_dtype=torch.float32), max_examples=1, derandomize=True,
                               laws=["compiled"], params=two)["compiled"] == "ok"
    finally:
        Runner._run = real
    assert "whole" in kinds and "pieces" in kinds, kinds
    assert mfx.linalg.batch_bytes("cpu") == before
