"""``muonfx.testing.check_transform``: every public transform passes it, and broken
transforms are caught with the right law named and a minimal example shown.

Kept fast: few hypothesis examples per law, derandomized (the same examples every run).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx import schedules
from muonfx.core import aligned, build, leaves
from muonfx.testing import LAWS, OPT_IN_LAWS, ConformanceError, check_transform, params_and_grads

FAST = dict(max_examples=5, derandomize=True)


from helpers import one_intra_op_thread  # noqa: E402,F401  (autouse: one thread in this module)


# ---------------------------------------------------------------------------
# (a) every public transform, combinator, wrapper, preset and recipe conforms
# ---------------------------------------------------------------------------

ANY, MATRIX = "any", "matrix"

MATRICES_2D_3D = dict(params=params_and_grads(min_ndim=2, max_ndim=3))

# name -> (leaves it takes, builder, extra check_transform options)
PUBLIC: dict[str, tuple[str, Callable[[], mfx.GradientTransformation], dict[str, Any]]] = {
    # core and transforms
    "identity": (ANY, mfx.identity, dict(zero_grad_exact=True)),
    "momentum": (ANY, lambda: mfx.momentum(0.9), dict(zero_grad_exact=True)),
    "momentum_nesterov_bf16_mu": (ANY, lambda: mfx.momentum(0.9, nesterov=True, mu_dtype=torch.bfloat16), {}),
    "nesterov": (ANY, lambda: mfx.nesterov(0.95), dict(zero_grad_exact=True)),
    "newton_schulz": (MATRIX, mfx.newton_schulz, dict(zero_grad_exact=True)),
    "newton_schulz_polar_express_gram": (
        MATRIX, lambda: mfx.newton_schulz(coefficients="polar_express", method="auto"), {}),
    "row_normalize": (MATRIX, lambda: mfx.chain(mfx.newton_schulz(), mfx.row_normalize(0.95)), {}),
    "scale_by_shape": (MATRIX, lambda: mfx.scale_by_shape("spectral"), dict(zero_grad_exact=True)),
    "decoupled_decay": (ANY, lambda: mfx.decoupled_decay(0.1), {}),
    "scale": (ANY, lambda: mfx.scale(-0.5), dict(zero_grad_exact=True)),
    "scale_by_learning_rate": (ANY, lambda: mfx.scale_by_learning_rate(0.1), {}),
    "scale_by_learning_rate_schedule": (
        ANY, lambda: mfx.scale_by_learning_rate(schedules.warmup_cosine_decay(0.0, 1.0, 1, 4)), {}),
    "scale_by_adam": (ANY, mfx.scale_by_adam, dict(zero_grad_exact=True)),
    "clip_by_global_norm": (ANY, lambda: mfx.clip_by_global_norm(0.5), dict(zero_grad_exact=True)),
    # combinators
    "chain": (ANY, lambda: mfx.chain(mfx.momentum(0.9), mfx.decoupled_decay(0.1),
                                     mfx.scale_by_learning_rate(0.1)), {}),
    "named_chain": (ANY, lambda: mfx.named_chain(("adam", mfx.scale_by_adam()),
                                                 ("clip", mfx.clip_by_global_norm(1.0))), {}),
    "masked": (ANY, lambda: mfx.masked(mfx.scale_by_adam(), lambda k, t: t.ndim % 2 == 0), {}),
    "mask_by_ndim": (ANY, lambda: mfx.mask_by_ndim(mfx.muon(), {2, 3, 4}), {}),
    "partition": (ANY, lambda: mfx.partition(
        {"m": mfx.momentum(0.9), "a": mfx.scale_by_adam(), "c": mfx.clip_by_global_norm(1.0)},
        lambda k, t: "mac"[t.ndim % 3]), {}),
    # wrappers
    "apply_if_finite": (ANY, lambda: mfx.apply_if_finite(mfx.adamw()), {}),
    "accumulate_2": (ANY, lambda: mfx.accumulate(mfx.momentum(0.9), 2), {}),
    "inject_hyperparams": (ANY, lambda: mfx.inject_hyperparams(mfx.adamw)(
        lr=schedules.linear(1e-3, 1e-4, 3), weight_decay=0.1), {}),
    # presets
    "muon": (MATRIX, lambda: mfx.muon(weight_decay=0.1), {}),
    "adamw": (ANY, mfx.adamw, {}),
    "muon_adamw": (ANY, lambda: mfx.muon_adamw(weight_decay=0.1), {}),
    # recipes
    "moonlight": (ANY, mfx.moonlight, {}),
    "normuon": (MATRIX, mfx.normuon, {}),
    # bias_corrected_momentum and scale_by_adam(nesterov=True) run inside optax_muon,
    # row_normalize(axis="larger") inside modded_nanogpt_normuon
    "optax_muon": (ANY, lambda: mfx.optax_muon(weight_decay=0.1, adam_weight_decay=0.1), {}),
    "modded_nanogpt_normuon": (MATRIX, lambda: mfx.modded_nanogpt_normuon(weight_decay=0.1), {}),
    "cautious_decay": (ANY, lambda: mfx.cautious_decay(0.1), {}),
    "muon_cautious": (MATRIX, mfx.muon_cautious, {}),
    "momentum_warmup": (ANY, lambda: mfx.scale_by_learning_rate(mfx.momentum_warmup(steps=3)), {}),
    "muon_with_momentum_warmup": (MATRIX, lambda: mfx.muon_with_momentum_warmup(warmup_steps=3), {}),
    # 2-D and 3-D only: see test_blockwise_on_4d_leaves below
    "blockwise": (MATRIX, lambda: mfx.blockwise(mfx.scale_by_shape("match_rms_adamw"), 1), MATRICES_2D_3D),
    # state kept per block (keyed under the parameter's key): the checkpoint law saves it
    "blockwise_stateful": (MATRIX, lambda: mfx.blockwise(mfx.chain(mfx.scale_by_adam(), mfx.momentum(0.9)), 1),
                           MATRICES_2D_3D),
    "split_newton_schulz": (MATRIX, lambda: mfx.split_newton_schulz(1, dim=1), MATRICES_2D_3D),
    "muon_per_head": (MATRIX, lambda: mfx.muon_per_head(1, qkv_pattern=r"^[a-m]"), MATRICES_2D_3D),
    # the catalogue (tests/test_catalogue.py has their parity tests)
    "scale_by_lion": (ANY, mfx.scale_by_lion, dict(zero_grad_exact=True)),
    "scale_by_adopt": (ANY, mfx.scale_by_adopt, dict(zero_grad_exact=True)),
    "scale_by_laprop": (ANY, mfx.scale_by_laprop, dict(zero_grad_exact=True)),
    "cautious": (ANY, lambda: mfx.cautious(mfx.scale_by_adam()), dict(zero_grad_exact=True)),
    "mars_correction": (ANY, lambda: mfx.mars_correction(0.1, 0.9, max_norm=1.0), dict(zero_grad_exact=True)),
    "schedule_free": (ANY, lambda: mfx.schedule_free(mfx.chain(mfx.scale_by_adam(0.0), mfx.scale_by_learning_rate(0.1))),
                      {}),
    "schedule_free_muon": (MATRIX, lambda: mfx.schedule_free(mfx.muon()), MATRICES_2D_3D),
    "lion": (ANY, lambda: mfx.lion(weight_decay=0.1), {}),
    "adopt": (ANY, lambda: mfx.adopt(weight_decay=0.1, decouple=True), {}),
    "laprop": (ANY, lambda: mfx.laprop(weight_decay=0.1), {}),
    "cautious_adamw": (ANY, lambda: mfx.cautious_adamw(weight_decay=0.1), {}),
    "mars_adamw": (ANY, lambda: mfx.mars_adamw(weight_decay=0.1), {}),
    "mars_muon": (MATRIX, lambda: mfx.mars_muon(weight_decay=0.1), MATRICES_2D_3D),
    "schedule_free_adamw": (ANY, lambda: mfx.schedule_free_adamw(weight_decay=0.1, warmup_steps=2), {}),
    "scale_by_dion2": (MATRIX, lambda: mfx.scale_by_dion2(0.5), MATRICES_2D_3D),
    "dion2": (MATRIX, lambda: mfx.dion2(weight_decay=0.1), MATRICES_2D_3D),
    "scale_by_soap": (ANY, lambda: mfx.scale_by_soap(precondition_frequency=1), dict(zero_grad_exact=True)),
    "soap": (ANY, lambda: mfx.soap(precondition_frequency=1, max_precond_dim=3, merge_dims=True), {}),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_transforms_conform(name):
    kind, build_tx, extra = PUBLIC[name]
    if kind == MATRIX and "params" not in extra:
        extra = dict(extra, matrices_only=True)
    tx = build_tx()
    report = check_transform(tx, **FAST, **extra)
    assert report == {law: "ok" for law in LAWS if law != "inject_hyperparams"} | {
        "inject_hyperparams": "skipped: pass factory= and hyperparams= to check it",
        "leafwise": "ok" if mfx.is_leafwise(tx) else "skipped: not declared leafwise",
        "idle_parameter": "ok" if mfx.is_leafwise(tx) else "skipped: not declared leafwise",
        "compiled": "skipped: not requested (it compiles every example: laws=[..., 'compiled'])"}


@pytest.mark.parametrize("factory,hyperparams,kind,static_args", [
    (mfx.adamw, dict(lr=schedules.cosine_decay(1e-3, 4), betas=(0.8, 0.99), weight_decay=0.1), ANY, ()),
    (mfx.momentum, dict(beta=0.8, nesterov=True), ANY, ()),
    (mfx.muon, dict(lr=0.02, momentum=0.9, ns_coefficients="polar_express"), MATRIX, ()),
    (mfx.muon_adamw, dict(lr=0.02, adamw_lr=3e-3, labels=mfx.default_muon_labels), ANY, ("labels",)),
])
def test_inject_hyperparams_law_holds_for_public_factories(factory, hyperparams, kind, static_args):
    report = check_transform(factory=factory, hyperparams=hyperparams, static_args=static_args,
                             matrices_only=kind == MATRIX, **FAST)
    assert {v for law, v in report.items() if law not in OPT_IN_LAWS} == {"ok"}


def test_blockwise_on_4d_leaves():
    """4-D leaves are split on their [out, in*kh*kw] view and put back in place (this
    law check found the reassembly on the wrong dim; fixed in blockwise, now in muonfx/combine.py)."""
    check_transform(mfx.split_newton_schulz(1, dim=1), params=params_and_grads(min_ndim=4, max_ndim=4),
                    laws=["purity", "dtype_preservation"], **FAST)
    u = TensorDict({"w": torch.arange(24.0).reshape(4, 6, 1, 1)}, [])
    for sizes, dim in ((2, 0), (3, 1)):
        tx = mfx.blockwise(mfx.scale(1.0), sizes, dim=dim)
        out, _ = tx.update(u, tx.init(u))
        assert torch.equal(out["w"], u["w"]), (sizes, dim)


# ---------------------------------------------------------------------------
# (b) broken transforms: the right law is named, with a minimal example
# ---------------------------------------------------------------------------


def stateless(update_fn) -> mfx.GradientTransformation:
    return mfx.GradientTransformation(lambda params: mfx.EmptyState(), update_fn)


def mutates_its_input():
    """Scales the incoming updates in place."""

    def update_fn(updates, state, params=None):
        for u in updates.values(include_nested=True, leaves_only=True):
            u.mul_(0.5)
        return updates, state

    return stateless(update_fn)


def lazy_momentum(beta=0.9):
    """Creates its momentum buffer on the first update instead of in init."""

    def init_fn(params):
        return {}

    def update_fn(updates, state, params=None):
        mu = updates.clone() if "mu" not in state else state["mu"].apply(lambda m: beta * m) + updates
        return mu, {"mu": mu}

    return mfx.GradientTransformation(init_fn, update_fn)


def float64_updates():
    """Computes (and returns) its updates in float64."""
    return stateless(lambda updates, state, params=None: (updates.apply(lambda u: 2.0 * u.double()), state))


def normalize_without_eps():
    """u / ||u||: NaN for a zero gradient."""
    return stateless(lambda updates, state, params=None: (
        updates.apply(lambda u: u / torch.linalg.vector_norm(u)), state))


class ScheduledState(NamedTuple):
    count: int
    schedule: Any  # a Python callable: not loadable with weights_only=True


def schedule_in_state():
    """Keeps its lr schedule (a lambda) in the state."""

    def init_fn(params):
        return ScheduledState(0, lambda t: 0.1 / (1 + t))

    def update_fn(updates, state, params=None):
        lr = state.schedule(state.count)
        return updates.apply(lambda u: -lr * u), ScheduledState(state.count + 1, state.schedule)

    return mfx.GradientTransformation(init_fn, update_fn)


class EmaState(NamedTuple):
    mu: TensorDict


def step_count_as_attribute(beta=0.9):
    """Bias-corrected EMA that ignores part of its state: the step count lives as a Python
    attribute on the buffers, not in the state, so a checkpoint silently drops it."""

    def init_fn(params):
        return EmaState(params.apply(torch.zeros_like))

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        mus = aligned(state.mu, keys, "mu")
        t = (getattr(mus[0], "steps", 0) if mus else 0) + 1
        new = [torch.lerp(m, u, 1 - beta) for m, u in zip(mus, us)]
        for m in new:
            m.steps = t
        return build(keys, [m / (1 - beta**t) for m in new]), EmaState(build(keys, new))

    return mfx.GradientTransformation(init_fn, update_fn)


class NormEmaState(NamedTuple):
    stats: TensorDict


def global_norm_ema(beta=0.9):
    """Keeps a global statistic in a TensorDict keyed 'norm_ema', not by parameter."""

    def init_fn(params):
        return NormEmaState(TensorDict({"norm_ema": torch.zeros(())}, []))

    def update_fn(updates, state, params=None):
        norm = mfx.global_norm(updates).float()
        ema = beta * state.stats["norm_ema"] + (1 - beta) * norm
        return (updates.apply(lambda u: (u / (1 + ema)).to(u.dtype)),
                NormEmaState(TensorDict({"norm_ema": ema}, [])))

    return mfx.GradientTransformation(init_fn, update_fn)


def closure_momentum(beta=0.9):
    """Keeps its momentum in a closure instead of the state."""
    hidden: dict = {}

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        out = [beta * hidden.get(k, torch.zeros_like(u)) + u for k, u in zip(keys, us)]
        hidden.update(zip(keys, out))
        return build(keys, out), state

    return stateless(update_fn)


def stacked_global_norm():
    """torch.stack of the leaves' norms: fails on an empty TensorDict."""

    def update_fn(updates, state, params=None):
        _, us = leaves(updates)
        norm = torch.stack([torch.linalg.vector_norm(u.float()) for u in us]).norm()
        return updates.apply(lambda u: (u / (1 + norm)).to(u.dtype)), state

    return stateless(update_fn)


def noisy_sgd(lr: float = 0.1, noise: float = 1e-3) -> mfx.GradientTransformation:
    """SGD with noise seeded at construction: pure, but every factory call differs."""
    seed = int(torch.randint(0, 2**31 - 1, ()))

    class Count(NamedTuple):
        count: int

    def update_fn(updates, state, params=None):
        gen = torch.Generator().manual_seed(seed + state.count)
        out = updates.apply(lambda u: -lr * (u + noise * torch.randn(u.shape, generator=gen).to(u.dtype)))
        return out, Count(state.count + 1)

    return mfx.GradientTransformation(lambda params: Count(0), update_fn)


def jittery_scale():
    """A 1e-6 relative jitter, like a non-deterministic reduction (hidden generator)."""
    gen = torch.Generator().manual_seed(0)

    def update_fn(updates, state, params=None):
        jitter = 1.0 + 2.0**-20 * (1.0 + torch.rand((), generator=gen, dtype=torch.float64).item())
        return updates.apply(lambda u: u * jitter), state

    return stateless(update_fn)


BROKEN = {
    # name: (transform, law that must be named, phrases the message must contain)
    "mutates_its_input": (mutates_its_input, "purity", ["modified its input updates in place"]),
    "closure_momentum": (closure_momentum, "purity", ["calling update twice", "outside its state"]),
    "lazy_momentum": (lazy_momentum, "eager_state", ["after update 1", "dict keys [] vs ['mu']"]),
    "float64_updates": (float64_updates, "dtype_preservation", ["float64", "for an input float32"]),
    "normalize_without_eps": (normalize_without_eps, "zero_gradient", ["NaN", "zero gradient"]),
    "stacked_global_norm": (stacked_global_norm, "masked_identity", ["masked(tx, all False)", "empty"]),
    "schedule_in_state": (schedule_in_state, "state_dict_roundtrip", ["torch.save", "pickle"]),
    "global_norm_ema": (global_norm_ema, "state_dict_roundtrip", ["load_state_dict", "belongs to no parameter"]),
    "step_count_as_attribute": (step_count_as_attribute, "adapter_loop",
                                ["through mfx.TransformOptimizer", "Python attribute on a tensor"]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_transform_is_caught_with_the_right_law(name):
    make, law, phrases = BROKEN[name]
    with pytest.raises(ConformanceError) as info:
        check_transform(make(), max_examples=10, derandomize=True)
    err = info.value
    assert isinstance(err, AssertionError)
    assert err.law == law, str(err)
    msg = str(err)
    if err.adapter:  # an adapter law: reported as the adapter's
        assert law in ("adapter_loop", "state_dict_roundtrip", "idle_parameter")
        assert msg.startswith(f"adapter law {law!r} broken (mfx.TransformOptimizer running your transform)"), msg
    else:
        assert msg.startswith(f"law {law!r} broken"), msg
    assert "expected:" in msg and err.expectation in msg
    for phrase in phrases:
        assert phrase in msg, (phrase, msg)
    # the laws before it passed; the report says so
    order = list(LAWS)
    assert err.report[law] == "FAILED"
    assert all(err.report[earlier] in ("ok", "skipped: pass factory= and hyperparams= to check it",
                                       "skipped: not declared leafwise")
               for earlier in order[:order.index(law)]), err.report
    # the minimal example: hypothesis shrank it to one small leaf, and it is shown and returned
    params, grads = err.example
    keys = [".".join(k) if isinstance(k, tuple) else k for k in params.keys(True, True)]
    assert len(keys) == 1, msg
    leaf = next(iter(params.values(True, True)))
    assert "minimal failing example" in msg
    assert f"{keys[0]}  {str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}" in msg, msg
    assert set(grads.keys(True, True)) == set(params.keys(True, True))


def test_ignoring_part_of_the_state_passes_the_transform_laws():
    """The step-count-as-attribute transform satisfies purity, chain / masked /
    accumulate in the functional loop; the adapter law's run exposes the state it keeps
    elsewhere, and that failure is reported as the adapter's law (not as the transform's
    purity)."""
    report = check_transform(step_count_as_attribute(), laws=[l for l in LAWS if l not in (
        "inject_hyperparams", "state_dict_roundtrip", "adapter_loop", "compiled")], **FAST)
    assert report["purity"] == "ok" and report["adapter_loop"] == "skipped: not requested"
    assert all(v == "ok" for k, v in report.items() if not v.startswith("skipped"))
    with pytest.raises(ConformanceError, match="adapter_loop") as info:
        check_transform(step_count_as_attribute(), laws=["purity", "adapter_loop"], **FAST)
    assert info.value.adapter and info.value.report["purity"] == "ok"


def donating_momentum(beta=0.9):
    """A donation bug: momentum that writes its result into the old state buffer (the
    in-place trick the adapter's write-back, not a transform, may play)."""

    def init_fn(params):
        return EmaState(params.apply(torch.zeros_like))

    def update_fn(updates, state, params=None):
        keys, us = leaves(updates)
        mus = aligned(state.mu, keys, "mu")
        new = [m.lerp_(u, 1 - beta) for m, u in zip(mus, us)]
        return build(keys, new), EmaState(build(keys, new))

    return mfx.GradientTransformation(init_fn, update_fn)


def test_a_donation_bug_breaks_the_purity_law():
    with pytest.raises(ConformanceError) as info:
        check_transform(donating_momentum(), **FAST)
    assert info.value.law == "purity"
    assert "modified its input state in place" in str(info.value)


def test_the_original_error_is_chained():
    with pytest.raises(ConformanceError) as info:
        check_transform(schedule_in_state(), laws=["state_dict_roundtrip"], **FAST)
    assert info.value.__cause__ is not None  # the pickling error itself, with its traceback


def test_inject_hyperparams_law_catches_impure_factories():
    # noisy_sgd is a fine transform, but its factory is not a function of its arguments
    assert check_transform(noisy_sgd(), **FAST)["purity"] == "ok"
    with pytest.raises(ConformanceError) as info:
        check_transform(factory=noisy_sgd, hyperparams=dict(lr=0.1), **FAST)
    assert info.value.law == "inject_hyperparams"
    assert "inject_hyperparams(factory)(**hyperparams) gave other updates than factory(**hyperparams)" in str(info.value)


def test_tolerances_accept_nondeterministic_reductions():
    f32 = params_and_grads(dtypes=(torch.float32,))
    with pytest.raises(ConformanceError) as info:
        check_transform(jittery_scale(), params=f32, **FAST)
    assert info.value.law == "purity" and "calling update twice" in str(info.value)
    report = check_transform(jittery_scale(), params=f32, rtol=1e-5, atol=0.0, **FAST)
    assert report["purity"] == report["chain_identity"] == report["state_dict_roundtrip"] == "ok"


def test_zero_grad_exact():
    # decoupled decay moves the weights even with a zero gradient: finite, not zero
    assert check_transform(mfx.adamw(weight_decay=0.1), laws=["zero_gradient"], **FAST)["zero_gradient"] == "ok"
    with pytest.raises(ConformanceError, match="not zero"):
        check_transform(mfx.adamw(weight_decay=0.1), laws=["zero_gradient"], zero_grad_exact=True, **FAST)


def test_matrix_only_transform_on_general_params_names_the_error():
    with pytest.raises(ConformanceError) as info:
        check_transform(mfx.newton_schulz(), laws=["purity"], matrices_only=False, **FAST)
    msg = str(info.value)
    assert "update raised ValueError" in msg and "matrices_only=True" in msg
    assert isinstance(info.value.__cause__, ValueError)


def test_the_kit_learns_a_matrix_only_domain():
    """``check_transform(mfx.muon())`` with no options: the kit sees muon refuse 0-D/1-D
    leaves by name, checks it on matrices and says so (no purity error about a 0-D leaf)."""
    report = check_transform(mfx.muon(), laws=["purity", "dtype_preservation"], **FAST)
    assert report["purity"] == report["dtype_preservation"] == "ok"
    assert report["domain"].startswith("matrices only (2-D to 4-D leaves): the transform refuses 0-D leaves")
    assert "newton_schulz needs matrices" in report["domain"]
    # a transform that takes every rank: no probe verdict, every rank drawn
    assert "domain" not in check_transform(mfx.scale(2.0), laws=["purity"], **FAST)

    def refuses_everything():
        def update(u, s, p=None):
            raise ValueError("never")
        return mfx.GradientTransformation(lambda p: mfx.EmptyState(), update)

    # refusing matrices too is not a domain: the law reports the error
    with pytest.raises(ConformanceError, match="never") as info:
        check_transform(refuses_everything(), laws=["purity"], **FAST)
    assert "domain" not in info.value.report


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="unknown laws"):
        check_transform(mfx.identity(), laws=["purity", "associativity"])
    with pytest.raises(ValueError, match="needs factory= and hyperparams="):
        check_transform(mfx.identity(), laws=["inject_hyperparams"])
    with pytest.raises(TypeError, match="together"):
        check_transform(factory=mfx.adamw)
    with pytest.raises(TypeError, match="GradientTransformation"):
        check_transform(lambda u: u)
    with pytest.raises(ValueError, match="steps"):
        check_transform(mfx.identity(), steps=0)
    with pytest.raises(TypeError, match=r"\(params, grads\)"):
        from muonfx.testing import param_tensordicts

        check_transform(mfx.identity(), params=param_tensordicts(), laws=["purity"], **FAST)


def test_report_lists_every_law_in_order():
    report = check_transform(mfx.scale(2.0), laws=["dtype_preservation", "purity"], **FAST)
    assert list(report) == list(LAWS)
    assert report["purity"] == report["dtype_preservation"] == "ok"


def test_idle_parameter_law_catches_state_the_adapter_cannot_attribute(monkeypatch):
    """The law fails where the adapter attributes state to parameters by their exact key
    only (as before blockwise's per-block state was attributed to its parameter): a step
    where one parameter has no gradient then loses the others' per-block state."""
    from muonfx import tree

    tx = mfx.blockwise(mfx.scale_by_adam(), 1)
    matrices = params_and_grads(min_ndim=2, max_ndim=2)
    assert check_transform(tx, params=matrices, laws=["idle_parameter"], **FAST)["idle_parameter"] == "ok"
    monkeypatch.setattr(tree, "owner", lambda key, params: key if key in params else None)
    with pytest.raises(ConformanceError) as info:
        check_transform(tx, params=matrices, laws=["idle_parameter"], **FAST)
    assert info.value.law == "idle_parameter"
    # the blocks' state is not the parameter's any more: the step without 'a' loses it
    assert "without a gradient in step 0" in str(info.value) and "b.block0" in str(info.value), str(info.value)
