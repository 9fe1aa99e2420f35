"""Bad input is refused: a clear ValueError / TypeError that names the offending key,
parameter or hyperparameter, raised before anything is changed (every input: updates,
state, params, param groups, is checked to be unchanged after the exception).

Sections: the functional transforms and the adapter (first), then ``wrong 1``
(load_state_dict validates everything first), ``wrong 2`` (the functional API refuses
gradients of another shape, dtype or device), ``wrong 3`` (one hyperparameter validation
for the functional presets and the adapter), raw torch errors that named nothing, and
saved states that do not match. The CLI and FSDP2 cases are in
``tests/test_faults_cli.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import muonfx as mfx
from helpers import backward as _backward, refused, small_model as _model  # noqa: E402
import catalogue  # noqa: E402
from muonfx import schedules

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------



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


#: the transforms the sparse and complex refusals run over (tests/catalogue.py)
OPTIMIZERS = {name: e.build for name, e in catalogue.select(catalogue.LAYOUTS).items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_gradient_is_rejected(name):
    params = make_params()
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    grads = grads_like(params)
    grads["embed", "weight"] = torch.randn(10, 4).to_sparse()
    assert grads["embed", "weight"].layout == torch.sparse_coo
    refused(TypeError, r"'embed\.weight'.*sparse", lambda: tx.update(grads, state, params),
              grads, state, params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_complex_gradient_is_rejected(name):
    params = make_params()
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    grads = grads_like(params)
    grads["layers", "0", "weight"] = torch.randn(8, 4, dtype=torch.complex64)
    refused(TypeError, r"'layers\.0\.weight' is complex", lambda: tx.update(grads, state, params),
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
    refused(
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
        refused(
            ValueError, r"missing keys \['layers\.0\.other'\], extra keys \['embed\.weight'\]",
            lambda: tx.update(grads, state, grads), grads, state, params,
        )


def test_updates_vs_params_key_mismatch():
    params = make_params()
    grads = grads_like(params)
    other = params.exclude(("layers", "0", "bias"))
    other["new"] = torch.zeros(2)
    # apply_updates
    refused(
        ValueError, r"missing keys \['new'\], extra keys \['layers\.0\.bias'\]",
        lambda: mfx.apply_updates(other, grads), other, grads,
    )
    # a transform that reads params (decoupled decay)
    tx = mfx.adamw(weight_decay=0.1)
    state = tx.init(params)
    refused(
        ValueError, r"params.*missing keys \['layers\.0\.bias'\], extra keys \['new'\]",
        lambda: tx.update(grads, state, other), grads, state, other,
    )
    # partition / masked check params against the updates up front
    for tx in (mfx.muon_adamw(), mfx.mask_by_ndim(mfx.momentum(), 2)):
        state = tx.init(params)
        refused(
            ValueError, r"params.*missing keys \['layers\.0\.bias'\], extra keys \['new'\]",
            lambda: tx.update(grads, state, other), grads, state, other,
        )


def test_params_required():
    params = make_params()
    tx = mfx.adamw(weight_decay=0.1)
    state = tx.init(params)
    grads = grads_like(params)
    refused(ValueError, "params.*required.*params=", lambda: tx.update(grads, state), grads, state)


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
    refused(ValueError, r"'lr' is nan at step 2", lambda: tx.update(grads, state, params),
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
    refused(ValueError, r"'lr' is nan at step 1", lambda: tx.update(grads, state, params),
              grads, state, params)


def test_nan_schedule_through_inject_hyperparams():
    params = make_params()
    tx = mfx.inject_hyperparams(mfx.adamw)(lr=1e-3, weight_decay=nan_after(1, 0.01))
    state = tx.init(params)
    grads = grads_like(params)
    _, state = tx.update(grads, state, params)
    refused(ValueError, r"'weight_decay' is nan at step 1", lambda: tx.update(grads, state, params),
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
    refused(ValueError, "'lr' is nan", lambda: tx.update(grads, state, params), grads, state, params)
    state.hyperparams["lr"] = 1e-3
    state.hyperparams["weight_decay"] = -1.0
    refused(ValueError, "weight_decay must be >= 0", lambda: tx.update(grads, state, params),
              grads, state, params)
    del state.hyperparams["weight_decay"]
    refused(ValueError, r"lacks hyperparameters \['weight_decay'\]",
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
    refused(
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
    refused(ValueError, r"label 'z' for \['layers\.0\.bias'\]", lambda: tx.update(grads, state),
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
    refused(ValueError, "lr_typo", lambda: tx.update(grads, bad, params), grads, bad)
    tx = mfx.chain(mfx.momentum(), mfx.scale(1.0))
    state = tx.init(params)
    refused(ValueError, "state has 1 entries for 2 transforms",
              lambda: tx.update(grads, state[:1], params), grads, state)


# ===========================================================================
# refused whole, checked with helpers.refused
# ===========================================================================

NAN, INF = float("nan"), float("inf")


def _params():
    gen = torch.Generator().manual_seed(0)
    return TensorDict({"w": torch.randn(4, 4, generator=gen), "b": torch.randn(4, generator=gen)}, [])


def _grads(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return params.apply(lambda p: torch.randn(p.shape, generator=gen))


def _opt_snapshot(opt):
    """Parameters, functional states and param groups (hyperparameters) of an adapter."""
    return ([p for g in opt.param_groups for p in g["params"]], [r.state for r in opt.records],
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


# ---------------------------------------------------------------------------
# wrong 1: load_state_dict validates everything first, then applies
# ---------------------------------------------------------------------------

BAD_SAVED = [  # (factory, group key, saved value, message)
    (mfx.muon_adamw, "lr", "abc", r"param group 0: saved 'lr' is 'abc'"),
    (mfx.muon_adamw, "momentum", "abc", r"param group 0: saved 'momentum' is 'abc'"),
    (mfx.muon_adamw, "lr", NAN, r"param group 0: saved 'lr' is nan"),
    (mfx.muon_adamw, "weight_decay", -1.0, r"param group 0: saved hyperparameter 'weight_decay' is -1.0"),
    (mfx.muon_adamw, "momentum", 1.5, r"param group 0: saved hyperparameter 'momentum' is 1.5"),
    (mfx.muon_adamw, "adamw_eps", -1e-8, r"param group 0: saved hyperparameter 'adamw_eps'"),
    (mfx.muon_adamw, "adamw_betas", (0.9, 1.0), r"param group 0: saved hyperparameter 'adamw_betas\[1\]'"),
    (mfx.muon_adamw, "adjust_lr", "bogus", r"param group 0: .*scale_by_shape mode 'bogus'"),
    (mfx.muon_adamw, "ns_dtype", torch.int32, r"param group 0: .*ns_dtype must be a floating-point"),
    (mfx.adamw, "betas", (0.9,), r"param group 0: saved 'betas' is \(0.9,\); expected 2 numbers"),
    (mfx.adamw, "eps", INF, r"param group 0: saved 'eps' is inf"),
    (mfx.adamw, "lr", -1e-3, r"param group 0: saved hyperparameter 'lr' is -0.001"),
]


def _trained(factory, steps=2, **hp):
    model = _model()
    opt = mfx.TransformOptimizer(model.named_parameters(), factory, **hp)
    for s in range(steps):
        _backward(model, s)
        opt.step()
    return model, opt


@pytest.mark.parametrize("factory,key,value,match", BAD_SAVED, ids=[f"{k}={v!r}" for _, k, v, _ in BAD_SAVED])
def test_load_state_dict_refuses_a_bad_group_whole(factory, key, value, match):
    model, opt = _trained(factory)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][key] = value
    refused(ValueError, match, lambda: opt.load_state_dict(sd), *_opt_snapshot(opt))
    _backward(model, 5)
    opt.step()  # the optimizer still works: nothing was half-applied


def test_load_state_dict_checks_every_group_before_changing_any():
    """Group 1 is bad: group 0's good (and different) values must not be applied either."""
    model = _model()
    opt = mfx.TransformOptimizer([{"params": list(model[0].named_parameters(prefix="a"))},
                                  {"params": list(model[1].named_parameters(prefix="b"))}], mfx.adamw, lr=1e-2)
    _backward(model, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    sd["param_groups"][0]["weight_decay"] = 0.2
    sd["param_groups"][1]["weight_decay"] = NAN
    refused(ValueError, r"param group 1: saved 'weight_decay' is nan", lambda: opt.load_state_dict(sd),
            *_opt_snapshot(opt))
    assert opt.param_groups[0]["lr"] == 1e-2


# ---------------------------------------------------------------------------
# wrong 2: the functional API refuses other shapes, dtypes and devices
# ---------------------------------------------------------------------------

#: the transforms the shape, dtype and device refusals run over (tests/catalogue.py)
FUNCTIONAL = {name: e.build for name, e in catalogue.select(catalogue.REFUSES).items()}


@pytest.mark.parametrize("name", list(FUNCTIONAL))
@pytest.mark.parametrize("shape", [(4, 1), (1, 4), (4,), (2, 4, 4)])
def test_a_gradient_of_another_shape_is_refused(name, shape):
    """A (4, 1) gradient for a (4, 4) parameter used to broadcast through every transform."""
    params = _params()
    tx = FUNCTIONAL[name]()
    state = tx.init(params)
    grads = _grads(params)
    grads["w"] = torch.ones(shape)
    refused(ValueError, rf"updates leaf 'w' has shape {re_shape(shape)}, but .* has \(4, 4\)",
            lambda: tx.update(grads, state, params), grads, state, params)


def re_shape(shape) -> str:
    return "\\(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + "\\)"


def test_apply_updates_does_not_broadcast():
    params = TensorDict({"v": torch.ones(4), "w": torch.ones(4, 4)}, [])
    updates = TensorDict({"v": torch.ones(4, 4), "w": torch.ones(4, 4)}, [])
    refused(ValueError, r"updates leaf 'v' has shape \(4, 4\), but params has \(4,\)",
            lambda: mfx.apply_updates(params, updates), params, updates)
    updates = TensorDict({"v": torch.ones(4), "w": torch.ones(1, 4)}, [])
    refused(ValueError, r"updates leaf 'w' has shape \(1, 4\)", lambda: mfx.apply_updates(params, updates),
            params, updates)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("name", ["momentum", "adamw", "muon_masked_2", "muon_adamw_default"])
def test_integer_and_bool_gradients_are_refused(name, dtype):
    params = _params()
    tx = FUNCTIONAL[name]()
    state = tx.init(params)
    grads = _grads(params)
    grads["w"] = torch.ones(4, 4, dtype=dtype)
    refused(TypeError, rf"updates leaf 'w' has dtype {dtype}; gradients and updates must be floating point",
            lambda: tx.update(grads, state, params), grads, state, params)


def test_integer_and_complex_updates_are_refused_by_apply_updates():
    params = _params()
    for bad, match in ((torch.ones(4, 4, dtype=torch.int64), "has dtype torch.int64"),
                       (torch.ones(4, 4, dtype=torch.complex64), "is complex")):
        updates = _grads(params)
        updates["w"] = bad
        refused(TypeError, rf"updates leaf 'w' {match}", lambda: mfx.apply_updates(params, updates), params, updates)


@pytest.mark.parametrize("name", ["momentum", "adamw", "muon_masked_2", "muon_adamw_default"])
def test_meta_gradients_are_refused(name):
    params = _params()
    tx = FUNCTIONAL[name]()
    state = tx.init(params)
    grads = _grads(params)
    grads["w"] = torch.ones(4, 4, device="meta")
    refused(ValueError, r"updates leaf .w. is on meta \(it holds no data\), but .* is on cpu there",
            lambda: tx.update(grads, state, params),
            grads, state, params)


def test_updates_on_another_device_are_refused():
    """Params on ``meta`` (deferred initialisation) and updates on the CPU: the device
    check names the key (on a GPU machine the same holds for cuda vs cpu)."""
    params = TensorDict({"w": torch.ones(4, 4, device="meta")}, [])
    updates = TensorDict({"w": torch.ones(4, 4)}, [])
    with pytest.raises(ValueError, match=r"updates leaf 'w' is on cpu, but params is on meta"):
        mfx.apply_updates(params, updates)
    tx = mfx.decoupled_decay(0.1)
    with pytest.raises(ValueError, match=r"updates leaf 'w' is on cpu, but params \(needed by decoupled_decay\) "
                                         r"is on meta"):
        tx.update(updates, tx.init(params), params)


# ---------------------------------------------------------------------------
# wrong 3: one hyperparameter validation for the functional presets and the adapter
# ---------------------------------------------------------------------------

BAD_HYPERPARAMS = [  # (factory, kwargs, exception, message naming the hyperparameter)
    (mfx.muon, {"weight_decay": NAN}, ValueError, r"'weight_decay' is nan.*; weight_decay must be >= 0"),
    (mfx.muon, {"weight_decay": INF}, ValueError, r"'weight_decay' is inf"),
    (mfx.muon, {"weight_decay": -0.1}, ValueError, r"'weight_decay' is -0.1"),
    (mfx.muon, {"eps": NAN}, ValueError, r"'eps' is nan"),
    (mfx.muon, {"eps": -1e-7}, ValueError, r"'eps' is -1e-07"),
    (mfx.muon, {"lr": -0.02}, ValueError, r"'lr' is -0.02.*; lr must be >= 0"),
    (mfx.muon, {"lr": INF}, ValueError, r"'lr' is inf"),
    (mfx.muon, {"momentum": 1.5}, ValueError, r"'momentum' is 1.5.*; momentum must be in \[0, 1\]"),
    (mfx.muon, {"momentum": NAN}, ValueError, r"'momentum' is nan"),
    (mfx.muon, {"lr": "abc"}, TypeError, r"'lr' is 'abc' \(a str\)"),
    (mfx.muon, {"lr": None}, TypeError, r"'lr' is None"),
    (mfx.muon, {"lr": torch.ones(2)}, ValueError, r"'lr' is a tensor of shape \(2,\).*must have one element"),
    (mfx.muon, {"ns_dtype": torch.int32}, TypeError, r"ns_dtype must be a floating-point torch dtype"),
    (mfx.muon, {"mu_dtype": torch.int64}, TypeError, r"mu_dtype must be a floating-point torch dtype"),
    (mfx.adamw, {"weight_decay": NAN}, ValueError, r"'weight_decay' is nan"),
    (mfx.adamw, {"eps": NAN}, ValueError, r"'eps' is nan"),
    (mfx.adamw, {"eps": -1e-8}, ValueError, r"'eps' is -1e-08"),
    (mfx.adamw, {"lr": -1e-3}, ValueError, r"'lr' is -0.001"),
    (mfx.adamw, {"betas": (1.0, 0.999)}, ValueError, r"'betas\[0\]' is 1.0.*; betas\[0\] must be in \[0, 1\)"),
    (mfx.adamw, {"betas": (0.9, NAN)}, ValueError, r"'betas\[1\]' is nan"),
    (mfx.adamw, {"betas": (0.9,)}, TypeError, r"'betas' must be a pair"),
    (mfx.adamw, {"betas": (torch.tensor(0.9), 0.999)}, ValueError, r"'betas' mixes tensors and numbers"),
    (mfx.muon_adamw, {"adamw_eps": NAN}, ValueError, r"'adamw_eps' is nan"),
    (mfx.muon_adamw, {"adamw_lr": -1.0}, ValueError, r"'adamw_lr' is -1.0"),
    (mfx.muon_adamw, {"adamw_weight_decay": INF}, ValueError, r"'adamw_weight_decay' is inf"),
    (mfx.muon_adamw, {"adamw_betas": (0.9, -0.1)}, ValueError, r"'adamw_betas\[1\]' is -0.1"),
]
_IDS = [f"{f.__name__}-{next(iter(kw))}={next(iter(kw.values()))!r}" for f, kw, _, _ in BAD_HYPERPARAMS]


@pytest.mark.parametrize("factory,kwargs,exc,match", BAD_HYPERPARAMS, ids=_IDS)
def test_functional_presets_refuse_bad_hyperparameters(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


@pytest.mark.parametrize("factory,kwargs,exc,match", BAD_HYPERPARAMS, ids=_IDS)
def test_the_adapter_refuses_the_same_values_with_the_same_message(factory, kwargs, exc, match):
    """At construction, and as a hand edit of ``param_groups`` between steps (the step
    raises and changes nothing)."""
    model = _model()
    named = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 or factory is not mfx.muon]
    with pytest.raises(exc, match=match):
        mfx.TransformOptimizer(named, factory, **kwargs)
    opt = mfx.TransformOptimizer(named, factory)
    _backward(model, 0)
    opt.step()
    _backward(model, 1)
    name, value = next(iter(kwargs.items()))
    opt.param_groups[0][name] = value
    refused(exc, match, opt.step, *_opt_snapshot(opt))


BAD_SCHEDULES = [  # a schedule's value, found bad at the step that uses it
    (lambda step: None, TypeError, r"'lr' is None \(a NoneType\) at step 1 \(returned by the schedule"),
    (lambda step: "0.1", TypeError, r"'lr' is '0.1' \(a str\) at step 1"),
    (lambda step: torch.full((2,), 0.1), ValueError, r"'lr' is a tensor of shape \(2,\) .* at step 1"),
    (lambda step: NAN if step else 0.1, ValueError, r"'lr' is nan at step 1"),
    (lambda step: -0.1 if step else 0.1, ValueError, r"'lr' is -0.1 at step 1 .*; lr must be >= 0"),
]


@pytest.mark.parametrize("sched,exc,match", BAD_SCHEDULES)
def test_a_bad_schedule_value_is_refused_where_it_is_used(sched, exc, match):
    def lr(step):  # good at step 0, bad from step 1 on
        return 0.1 if step == 0 else sched(step)

    params = _params()
    tx = mfx.adamw(lr=lr)
    state = tx.init(params)
    _, state = tx.update(_grads(params), state, params)
    grads = _grads(params, 2)
    refused(exc, match, lambda: tx.update(grads, state, params), grads, state, params)
    # the adapter: the schedule as a hyperparameter, evaluated at the group's step count
    model = _model()
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw, lr=lr)
    _backward(model, 0)
    opt.step()
    _backward(model, 1)
    refused(exc, match, opt.step, *_opt_snapshot(opt))


def test_a_schedule_as_momentum_is_checked_by_the_momentum_rule():
    tx = mfx.inject_hyperparams(mfx.muon)(lr=0.02, momentum=lambda step: 1.0 + 0.1 * step)
    params = TensorDict({"w": torch.ones(4, 4)}, [])
    state = tx.init(params)
    _, state = tx.update(_grads(params), state, params)
    grads = _grads(params, 2)
    refused(ValueError, r"'momentum' is 1.1 at step 1 .*momentum must be in \[0, 1\]",
            lambda: tx.update(grads, state, params), grads, state, params)


# ---------------------------------------------------------------------------
# weak today: raw torch errors that named nothing
# ---------------------------------------------------------------------------


def test_newton_schulz_refuses_an_integer_dtype():
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch dtype .* got torch.int32"):
        mfx.newton_schulz(dtype=torch.int32)
    with pytest.raises(TypeError, match=r"ns_dtype must be a floating-point torch dtype"):
        mfx.MuonOptions(ns_dtype=torch.int32)


@pytest.mark.parametrize("predicate,what", [
    (lambda key, t: t > 0, r"a tensor of shape \(4, 4\)"),
    (lambda key, t: None, r"None \(a NoneType\)"),
    (lambda key, t: "yes", r"'yes' \(a str\)"),
])
def test_masked_refuses_a_predicate_that_does_not_return_a_bool(predicate, what):
    params = TensorDict({"w": torch.randn(4, 4)}, [])
    tx = mfx.masked(mfx.scale(2.0), predicate)
    with pytest.raises(TypeError, match=rf"mask: the value for leaf 'w' is {what}, not a bool"):
        tx.init(params)
    good = mfx.masked(mfx.scale(2.0), lambda key, t: True)
    state = good.init(params)
    with pytest.raises(TypeError, match=rf"the value for leaf 'w' is {what}"):
        tx.update(params, state, params)


def test_a_one_element_tensor_from_a_predicate_is_a_bool():
    params = TensorDict({"w": torch.ones(4, 4), "b": -torch.ones(4)}, [])
    tx = mfx.masked(mfx.scale(2.0), lambda key, t: t.sum() > 0)
    out, _ = tx.update(params, tx.init(params), params)
    assert out["w"].eq(2).all() and out["b"].eq(-1).all()


# -- saved states that do not match ------------------------------------------


def test_load_state_dict_mismatches_are_clear_and_change_nothing():
    model, opt = _trained(mfx.adamw)
    _, other = _trained(mfx.muon_adamw)
    refused(ValueError, r"optimizer state for parameter '0.weight' does not match",
            lambda: opt.load_state_dict(other.state_dict()), *_opt_snapshot(opt))
    small = nn.Linear(4, 8)
    small_opt = mfx.TransformOptimizer(small.named_parameters(), mfx.adamw)
    refused(ValueError, r"param group 0: state_dict has 2 parameters, this optimizer has 4",
            lambda: opt.load_state_dict(small_opt.state_dict()), *_opt_snapshot(opt))
    refused(ValueError, r"must have 'state' and 'param_groups'", lambda: opt.load_state_dict({"state": {}}),
            *_opt_snapshot(opt))


def test_sparse_gradients_are_refused_naming_the_parameter():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = mfx.TransformOptimizer([("emb.weight", emb.weight)], mfx.muon)
    emb(torch.tensor([1, 2])).sum().backward()
    refused(ValueError, r"parameter 'emb.weight' has a sparse gradient", opt.step, *_opt_snapshot(opt))
    params = TensorDict({"w": torch.randn(10, 4)}, [])
    tx = mfx.adamw()
    state = tx.init(params)
    grads = TensorDict({"w": torch.randn(10, 4).to_sparse()}, [])
    refused(TypeError, r"updates leaf 'w' has layout torch.sparse_coo", lambda: tx.update(grads, state, params),
            state, params)
