"""Bad input gets a clear ValueError / TypeError that names the offending key (or
hyperparameter), raised before anything is changed: every input (updates, state,
params) is checked to be unchanged after the exception."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from helpers import flatten_state  # noqa: E402
from muonfx import schedules

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------



def snapshot(*objs):
    out = []
    for obj in objs:
        out.append([(p, v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for p, v in flatten_state(obj)])
    return out


def assert_unchanged(snap, *objs):
    now = snapshot(*objs)
    assert len(now) == len(snap)
    for before, after in zip(snap, now):
        assert [p for p, _ in before] == [p for p, _ in after]
        for (path, b), (_, a) in zip(before, after):
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape, path
                if b.layout != torch.strided:
                    a, b = a.to_dense(), b.to_dense()
                assert torch.equal(torch.view_as_real(a) if a.is_complex() else a,
                                   torch.view_as_real(b) if b.is_complex() else b) or (
                    torch.isnan(a).any() and torch.allclose(a, b, equal_nan=True, rtol=0, atol=0)), path
            else:
                assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), path


def make_params():
    return TensorDict(
        {
            "layers": {"0": {"weight": torch.randn(8, 4), "bias": torch.randn(8)}},
            "embed": {"weight": torch.randn(10, 4)},
        },
        [],
    )


def grads_like(params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return params.apply(lambda p: torch.randn(p.shape, generator=gen))


def raises_unchanged(exc, match, fn, *inputs):
    """``fn()`` raises ``exc`` matching ``match`` and leaves ``inputs`` untouched."""
    snap = snapshot(*inputs)
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(snap, *inputs)


OPTIMIZERS = {
    "muon_adamw": lambda: mfx.muon_adamw(),
    "adamw": lambda: mfx.adamw(),
    "momentum": lambda: mfx.momentum(0.9),
    "clip_then_adam": lambda: mfx.chain(mfx.clip_by_global_norm(1.0), mfx.scale_by_adam()),
    "accumulate": lambda: mfx.accumulate(mfx.adamw(), 2),
    "apply_if_finite": lambda: mfx.apply_if_finite(mfx.adamw()),
    "inject": lambda: mfx.inject_hyperparams(mfx.adamw)(lr=1e-3),
}

# ---------------------------------------------------------------------------
# sparse and complex gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_gradient_is_rejected(name):
    params = make_params()
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    grads = grads_like(params)
    grads["embed", "weight"] = torch.randn(10, 4).to_sparse()
    assert grads["embed", "weight"].layout == torch.sparse_coo
    raises_unchanged(TypeError, r"'embed\.weight'.*sparse", lambda: tx.update(grads, state, params),
                     grads, state, params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_complex_gradient_is_rejected(name):
    params = make_params()
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    grads = grads_like(params)
    grads["layers", "0", "weight"] = torch.randn(8, 4, dtype=torch.complex64)
    raises_unchanged(TypeError, r"'layers\.0\.weight' is complex", lambda: tx.update(grads, state, params),
                     grads, state, params)


def test_complex_or_sparse_params_rejected_at_init():
    params = make_params()
    params["layers", "0", "bias"] = torch.randn(8, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"params leaf 'layers\.0\.bias' is complex"):
        mfx.adamw().init(params)
    params = make_params()
    params["embed", "weight"] = params["embed", "weight"].to_sparse()
    with pytest.raises(TypeError, match=r"params leaf 'embed\.weight' has layout"):
        mfx.momentum().init(params)


def test_non_tensordict_input_is_rejected():
    params = make_params()
    tx = mfx.adamw()
    state = tx.init(params)
    with pytest.raises(TypeError, match="TensorDict"):
        tx.update({"w": torch.zeros(2)}, state, params)
    with pytest.raises(TypeError, match="TensorDict"):
        mfx.apply_updates({"w": torch.zeros(2)}, params)


# ---------------------------------------------------------------------------
# key mismatches
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory,what",
    [
        (lambda: mfx.momentum(0.9), "momentum state"),
        (lambda: mfx.scale_by_adam(), "adam state"),
        (lambda: mfx.accumulate(mfx.scale(1.0), 3), "accumulate state"),
    ],
)
def test_updates_vs_state_keys_differ(factory, what):
    params = make_params()
    tx = factory()
    state = tx.init(params)
    grads = grads_like(params)
    del grads["embed", "weight"]
    grads["extra"] = torch.zeros(3)
    raises_unchanged(
        ValueError,
        rf"{what}.*missing keys \['extra'\], extra keys \['embed\.weight'\]",
        lambda: tx.update(grads, state, params), grads, state, params,
    )


def test_updates_vs_state_keys_differ_through_presets():
    params = make_params().exclude(("layers", "0", "bias"))
    grads = grads_like(params).exclude(("embed", "weight"))
    grads["layers", "0", "other"] = torch.randn(8, 4)
    for tx in (mfx.muon(), mfx.adamw(), mfx.muon_adamw(labels=lambda k, t: "muon")):
        state = tx.init(params)
        raises_unchanged(
            ValueError, r"missing keys \['layers\.0\.other'\], extra keys \['embed\.weight'\]",
            lambda: tx.update(grads, state, grads), grads, state, params,
        )


def test_updates_vs_params_key_mismatch():
    params = make_params()
    grads = grads_like(params)
    other = params.exclude(("layers", "0", "bias"))
    other["new"] = torch.zeros(2)
    # apply_updates
    raises_unchanged(
        ValueError, r"missing keys \['new'\], extra keys \['layers\.0\.bias'\]",
        lambda: mfx.apply_updates(other, grads), other, grads,
    )
    # a transform that reads params (decoupled decay)
    tx = mfx.adamw(weight_decay=0.1)
    state = tx.init(params)
    raises_unchanged(
        ValueError, r"params.*missing keys \['layers\.0\.bias'\], extra keys \['new'\]",
        lambda: tx.update(grads, state, other), grads, state, other,
    )
    # partition / masked check params against the updates up front
    for tx in (mfx.muon_adamw(), mfx.mask_by_ndim(mfx.momentum(), 2)):
        state = tx.init(params)
        raises_unchanged(
            ValueError, r"params.*missing keys \['layers\.0\.bias'\], extra keys \['new'\]",
            lambda: tx.update(grads, state, other), grads, state, other,
        )


def test_params_required():
    params = make_params()
    tx = mfx.adamw(weight_decay=0.1)
    state = tx.init(params)
    grads = grads_like(params)
    raises_unchanged(ValueError, "params.*required.*params=", lambda: tx.update(grads, state), grads, state)


# ---------------------------------------------------------------------------
# schedules returning NaN
# ---------------------------------------------------------------------------


def nan_after(k, value=0.1):
    return lambda count: value if int(count) < k else float("nan")


def test_nan_schedule_in_scale_by_learning_rate():
    params = make_params()
    tx = mfx.scale_by_learning_rate(nan_after(2))
    state = tx.init(params)
    grads = grads_like(params)
    for _ in range(2):
        _, state = tx.update(grads, state, params)
    raises_unchanged(ValueError, r"'lr' is nan at step 2", lambda: tx.update(grads, state, params),
                     grads, state, params)
    # a NaN / inf constant lr is refused when the transform is built
    with pytest.raises(ValueError, match="'lr' is nan"):
        mfx.scale_by_learning_rate(float("nan"))
    with pytest.raises(ValueError, match="'lr' is inf"):
        mfx.adamw(lr=float("inf"))


def test_nan_schedule_in_muon_chain_keeps_state():
    params = make_params().exclude(("layers", "0", "bias"))
    tx = mfx.muon(lr=nan_after(1, 0.02))
    state = tx.init(params)
    grads = grads_like(params)
    _, state = tx.update(grads, state, params)
    raises_unchanged(ValueError, r"'lr' is nan at step 1", lambda: tx.update(grads, state, params),
                     grads, state, params)


def test_nan_schedule_through_inject_hyperparams():
    params = make_params()
    tx = mfx.inject_hyperparams(mfx.adamw)(lr=1e-3, weight_decay=nan_after(1, 0.01))
    state = tx.init(params)
    grads = grads_like(params)
    _, state = tx.update(grads, state, params)
    raises_unchanged(ValueError, r"'weight_decay' is nan at step 1", lambda: tx.update(grads, state, params),
                     grads, state, params)
    # a schedule that is NaN from the start fails at init, naming the hyperparameter
    tx = mfx.inject_hyperparams(mfx.muon)(momentum=nan_after(0))
    with pytest.raises(ValueError, match="'momentum' is nan at step 0"):
        tx.init(params)


def test_bad_value_written_into_injected_state():
    params = make_params()
    tx = mfx.inject_hyperparams(mfx.adamw)(lr=1e-3, weight_decay=0.01)
    state = tx.init(params)
    grads = grads_like(params)
    state.hyperparams["lr"] = float("nan")
    raises_unchanged(ValueError, "'lr' is nan", lambda: tx.update(grads, state, params), grads, state, params)
    state.hyperparams["lr"] = 1e-3
    state.hyperparams["weight_decay"] = -1.0
    raises_unchanged(ValueError, "weight_decay must be >= 0", lambda: tx.update(grads, state, params),
                     grads, state, params)
    del state.hyperparams["weight_decay"]
    raises_unchanged(ValueError, r"lacks hyperparameters \['weight_decay'\]",
                     lambda: tx.update(grads, state, params), grads, state, params)


# ---------------------------------------------------------------------------
# matrix transforms on 0-D / 1-D leaves
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory,who",
    [
        (lambda: mfx.newton_schulz(), "newton_schulz"),
        (lambda: mfx.scale_by_shape(), "scale_by_shape"),
        (lambda: mfx.muon(), "newton_schulz"),
    ],
)
@pytest.mark.parametrize("key,shape", [(("layers", "0", "bias"), (8,)), (("scale",), ())])
def test_matrix_transforms_refuse_vectors_and_scalars(factory, who, key, shape):
    params = TensorDict({"w": torch.randn(4, 6)}, [])
    params[key] = torch.randn(shape)
    tx = factory()
    state = tx.init(params)
    grads = grads_like(params)
    dotted = ".".join(key).replace(".", r"\.")
    raises_unchanged(
        ValueError, rf"{who} needs matrices.*'{dotted}'.*{len(shape)}-D.*mask_by_ndim.*partition",
        lambda: tx.update(grads, state, params), grads, state, params,
    )


def test_mask_by_ndim_is_the_way_out():
    params = TensorDict({"w": torch.randn(4, 6), "b": torch.randn(4)}, [])
    tx = mfx.mask_by_ndim(mfx.newton_schulz(), {2, 3, 4})
    out, _ = tx.update(params, tx.init(params), params)
    assert torch.equal(out["b"], params["b"])


# ---------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------


def test_partition_label_without_transform():
    params = make_params()
    tx = mfx.partition({"muon": mfx.muon(), "adamw": mfx.adamw()},
                       lambda key, t: "frozen" if key.startswith("embed") else ("muon" if t.ndim == 2 else "adamw"))
    with pytest.raises(ValueError, match=r"no transform for label 'frozen' for \['embed\.weight'\]"):
        tx.init(params)
    # the same with a labels mapping
    labels = {"layers.0.weight": "muon", "layers.0.bias": "adamw", "embed.weight": "sgd"}
    tx = mfx.partition({"muon": mfx.muon(), "adamw": mfx.adamw()}, labels)
    with pytest.raises(ValueError, match=r"label 'sgd' for \['embed\.weight'\].*known labels"):
        tx.init(params)


def test_partition_label_without_transform_at_update():
    """Labels computed at update time (from the updates when no params are passed)."""
    params = make_params()
    tx = mfx.partition({"a": mfx.scale(1.0), "b": mfx.scale(2.0)},
                       lambda key, t: "a" if t.abs().max() < 1e3 else "z")
    state = tx.init(params)
    grads = grads_like(params)
    grads["layers", "0", "bias"] = torch.full((8,), 1e4)
    raises_unchanged(ValueError, r"label 'z' for \['layers\.0\.bias'\]", lambda: tx.update(grads, state),
                     grads, state)


def test_labels_or_mask_missing_a_key():
    params = make_params()
    tx = mfx.partition({"m": mfx.momentum(), "a": mfx.adamw()}, {"layers.0.weight": "m", "layers.0.bias": "a"})
    with pytest.raises(ValueError, match=r"labels has no entry for keys \['embed\.weight'\]"):
        tx.init(params)
    tx = mfx.masked(mfx.momentum(), {"layers.0.weight": True})
    with pytest.raises(ValueError, match=r"mask has no entry for keys \['embed\.weight', 'layers\.0\.bias'\]"):
        tx.init(params)
    with pytest.raises(TypeError, match="mask must be"):
        mfx.masked(mfx.momentum(), 3).init(params)


def test_partition_and_chain_refuse_non_transforms():
    with pytest.raises(TypeError, match="label 'adamw'"):
        mfx.partition({"muon": mfx.muon(), "adamw": mfx.adamw}, lambda k, t: "muon")
    with pytest.raises(TypeError, match="argument 1"):
        mfx.chain(mfx.momentum(), mfx.scale)


# ---------------------------------------------------------------------------
# Newton-Schulz coefficients
# ---------------------------------------------------------------------------


def test_unknown_ns_preset():
    with pytest.raises(ValueError, match=r"unknown Newton-Schulz coefficients 'kellr'.*keller"):
        mfx.newton_schulz(coefficients="kellr")
    with pytest.raises(ValueError, match="'polarexpress'"):
        mfx.muon(ns_coefficients="polarexpress")
    with pytest.raises(ValueError, match="'nope'"):
        mfx.muon_adamw(ns_coefficients="nope")


@pytest.mark.parametrize(
    "coefficients,exc,match",
    [
        ((3.0, -4.0), ValueError, r"triple.*\[3\.0, -4\.0\]"),
        ((1.0, 2.0, 3.0, 4.0), ValueError, "triple"),
        ((1.0, 2.0, float("nan")), ValueError, "finite"),
        ((1.0, float("inf"), 2.0), ValueError, "finite"),
        ([(1.0, 2.0, 3.0), (1.0, 2.0)], ValueError, r"coefficients\[1\]"),
        ([(1.0, 2.0, 3.0), "abc"], TypeError, r"coefficients\[1\]"),
        ([], ValueError, "empty"),
        (None, TypeError, "preset name"),
        (5, TypeError, "preset name"),
    ],
)
def test_bad_coefficient_triples(coefficients, exc, match):
    with pytest.raises(exc, match=match):
        mfx.newton_schulz(coefficients=coefficients)


def test_bad_ns_steps_and_safety():
    for steps in (0, -1, 100, 2.5, True):
        with pytest.raises(ValueError, match="ns steps"):
            mfx.newton_schulz(steps=steps)
    with pytest.raises(ValueError, match="ns steps"):
        mfx.muon(ns_steps=0)
    with pytest.raises(ValueError, match="safety"):
        mfx.newton_schulz(safety=0.0)


# ---------------------------------------------------------------------------
# bad hyperparameters
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: mfx.decoupled_decay(-0.1), "weight_decay must be >= 0"),
        (lambda: mfx.muon(weight_decay=-0.1), "weight_decay must be >= 0"),
        (lambda: mfx.adamw(weight_decay=-0.01), "weight_decay must be >= 0"),
        (lambda: mfx.muon_adamw(adamw_weight_decay=-1.0), "weight_decay must be >= 0"),
        (lambda: mfx.momentum(1.5), "beta must be in"),
        (lambda: mfx.momentum(-0.1), "beta must be in"),
        (lambda: mfx.momentum(float("nan")), "beta must be in"),
        (lambda: mfx.muon(momentum=1.01), "momentum must be in"),
        (lambda: mfx.scale_by_adam(b1=1.0), "b1 must be in"),
        (lambda: mfx.scale_by_adam(b2=-0.5), "b2 must be in"),
        (lambda: mfx.scale_by_adam(eps=-1e-8), "eps must be >= 0"),
        (lambda: mfx.adamw(betas=(0.9, 1.5)), "betas\\[1\\] must be in"),
        (lambda: mfx.adamw(betas=(1.2, 0.999)), "betas\\[0\\] must be in"),
        (lambda: mfx.accumulate(mfx.adamw(), every_k=0), "every_k must be an int >= 1, got 0"),
        (lambda: mfx.accumulate(mfx.adamw(), every_k=2.0), "every_k must be an int"),
        (lambda: mfx.clip_by_global_norm(0.0), "max_norm must be > 0"),
        (lambda: mfx.clip_by_global_norm(-1.0), "max_norm must be > 0"),
        (lambda: mfx.clip_by_global_norm(float("nan")), "max_norm must be > 0"),
        (lambda: mfx.apply_if_finite(mfx.adamw(), max_consecutive_errors=-1), "max_consecutive_errors"),
        (lambda: mfx.scale_by_shape("keller"), "unknown scale_by_shape mode 'keller'"),
        (lambda: mfx.muon(adjust_lr="rms"), "unknown scale_by_shape mode 'rms'"),
        (lambda: mfx.mask_by_ndim(mfx.momentum(), -1), "ndim must be non-negative"),
        (lambda: mfx.schedules.cosine_decay(1.0, 0), "decay_steps must be > 0"),
        (lambda: mfx.schedules.linear(1.0, 0.0, -5), "transition_steps must be >= 0"),
        (lambda: mfx.schedules.warmup_cosine_decay(0.0, 1.0, 10, 10), "must exceed warmup_steps"),
        (lambda: mfx.schedules.join([schedules.constant(1.0)], [5]), "len\\(boundaries\\)"),
        (lambda: mfx.schedules.join([schedules.constant(1.0)] * 3, [5, 2]), "increasing"),
        (lambda: mfx.inject_hyperparams(mfx.adamw, static_args=("nope",))(), r"static_args \['nope'\]"),
    ],
)
def test_bad_hyperparameters(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_named_chain_duplicate_names():
    with pytest.raises(ValueError, match=r"duplicate names \['lr'\]"):
        mfx.named_chain(("lr", mfx.scale(1.0)), ("momentum", mfx.momentum()), ("lr", mfx.scale(2.0)))
    with pytest.raises(TypeError, match="named_chain takes"):
        mfx.named_chain(("a", mfx.scale))


def test_named_chain_and_chain_state_mismatch():
    params = make_params()
    grads = grads_like(params)
    tx = mfx.named_chain(("momentum", mfx.momentum()), ("lr", mfx.scale_by_learning_rate(0.1)))
    state = tx.init(params)
    bad = {"momentum": state["momentum"], "lr_typo": state["lr"]}
    raises_unchanged(ValueError, "lr_typo", lambda: tx.update(grads, bad, params), grads, bad)
    tx = mfx.chain(mfx.momentum(), mfx.scale(1.0))
    state = tx.init(params)
    raises_unchanged(ValueError, "state has 1 entries for 2 transforms",
                     lambda: tx.update(grads, state[:1], params), grads, state)
