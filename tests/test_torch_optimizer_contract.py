"""torch.optim's optimizer contract, as PyTorch's own optimizer tests state it, kept by
every optimizer class muonfx ships.

A training loop written for ``torch.optim`` relies on more than ``step()``: state dicts
that load between optimizers built from ``named_parameters()`` and from
``parameters()``, hooks that run in torch's order, torch's error types for malformed
hyperparameters, steps without gradients that change nothing, and lr schedulers whose
values the next step reads (and that resume from a checkpoint). Each test below states
one such rule and runs it over ``TransformOptimizer`` (with ``mfx.adamw`` and with
``mfx.muon``), ``MuonOptimizer``, ``create_hybrid_optimizer``'s result and
``FSDPMuonOptimizer`` on a plain model, and over ``torch.optim.AdamW`` itself: the
reference shows that each rule is torch's.
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import muonfx as mfx


class Net(nn.Module):
    """Matrices, biases and a norm; no embedding or head, so that every class splits the
    parameters the same way with names and without."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.l2 = nn.Linear(8, 4)


def _model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _params(model: nn.Module, named: bool) -> list:
    return list(model.named_parameters()) if named else list(model.parameters())


F32 = dict(ns_dtype=torch.float32)


def _tx_adamw(model, named=True, lr=1e-2, betas=(0.9, 0.95)):
    return mfx.TransformOptimizer(_params(model, named), mfx.adamw, lr=lr, betas=betas)


def _tx_muon(model, named=True, lr=0.02, betas=(0.9, 0.95)):
    items = _params(model, named)
    ndim = lambda x: (x[1] if named else x).ndim  # noqa: E731
    return mfx.TransformOptimizer([{"params": [x for x in items if ndim(x) >= 2]},
                                   {"params": [x for x in items if ndim(x) < 2], "tx": mfx.adamw, "lr": 1e-2,
                                    "betas": betas}], mfx.muon, lr=lr, **F32)


def _muon_optimizer(model, named=True, lr=0.02, betas=(0.9, 0.95)):
    return mfx.MuonOptimizer(_params(model, named), lr=lr, adamw_betas=betas, **F32)


def _hybrid(model, named=True, lr=0.02, betas=(0.9, 0.95)):
    return mfx.create_hybrid_optimizer(model, muon_lr=lr, adamw_betas=betas, **F32)


def _fsdp(model, named=True, lr=0.02, betas=(0.9, 0.95)):
    return mfx.FSDPMuonOptimizer(model, lr=lr, adamw_betas=betas, **F32)


def _torch_adamw(model, named=True, lr=1e-2, betas=(0.9, 0.95)):
    return torch.optim.AdamW(_params(model, named), lr=lr, betas=betas)


#: name -> (builder(model, named, lr=, betas=), whether it can be built without names, muonfx's)
CASES: dict[str, tuple[Callable[..., torch.optim.Optimizer], bool, bool]] = {
    "TransformOptimizer(adamw)": (_tx_adamw, True, True),
    "TransformOptimizer(muon)": (_tx_muon, True, True),
    "MuonOptimizer": (_muon_optimizer, True, True),
    "create_hybrid_optimizer": (_hybrid, False, True),
    "FSDPMuonOptimizer": (_fsdp, False, True),
    "torch.optim.AdamW (the reference)": (_torch_adamw, True, False),
}
OURS = [name for name, (_, _, ours) in CASES.items() if ours]
BOTH_FORMS = [name for name, (_, unnamed, _) in CASES.items() if unnamed]


def _build(name: str, model: nn.Module, named: bool = True, **kw: Any) -> torch.optim.Optimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mfx.MeaningChangedWarning)
        return CASES[name][0](model, named, **kw)


def _grads(model: nn.Module, step: int, zero: bool = False, skip: tuple[str, ...] = ()) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for n, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen)
        p.grad = None if n in skip else torch.zeros_like(p) if zero else g


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, sched: Any = None) -> None:
    for step in steps:
        _grads(model, step)
        opt.step()
        if sched is not None:
            sched.step()


def _trained(case: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and ``case``'s optimizer over it, after ``steps`` steps."""
    model = _model()
    opt = _build(case, model)
    _train(model, opt, range(steps))
    return model, opt


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _saved(sd: dict) -> dict:
    """``sd`` through ``torch.save`` and ``torch.load(weights_only=True)``: what a resumed run reads."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    sd = opt.state_dict()
    flat = [(i, k, v.clone() if isinstance(v, torch.Tensor) else v) for i, st in sd["state"].items()
            for k, v in st.items()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return [p.detach().clone() for p in model.parameters()], flat, repr(groups)


def _unchanged(model: nn.Module, opt: torch.optim.Optimizer, before: tuple) -> None:
    params, flat, groups = _snapshot(model, opt)
    assert all(torch.equal(p, q) for p, q in zip(params, before[0])), "a parameter changed"
    assert len(flat) == len(before[1])
    for (i, k, v), (j, l, w) in zip(flat, before[1]):
        assert (i, k) == (j, l)
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)
    assert groups == before[2]


# -- named and unnamed optimizers load each other's state dicts -------------------------

@pytest.mark.parametrize("case", BOTH_FORMS)
def test_a_state_dict_loads_between_named_and_unnamed_optimizers_both_ways(case):
    """Saved from ``named_parameters()``, loaded by an optimizer of ``parameters()``: it
    takes the saved names. Saved without names, loaded by a named one: it keeps its own.
    Training then goes on exactly as in the optimizer that saved."""
    for saver_named in (True, False):
        src_model = _model()
        src = _build(case, src_model, named=saver_named)
        _train(src_model, src, range(2))
        sd = _saved(src.state_dict())
        assert ("param_names" in sd["param_groups"][0]) is saver_named
        dst_model = copy.deepcopy(src_model)
        dst = _build(case, dst_model, named=not saver_named)
        dst.load_state_dict(sd)
        if saver_named:  # an optimizer without names takes the saved ones
            assert [g["param_names"] for g in dst.param_groups] == [g["param_names"] for g in sd["param_groups"]]
        else:  # one with names keeps its own
            assert [g["param_names"] for g in dst.param_groups] == [
                [n for n, p in dst_model.named_parameters() for q in g["params"] if p is q] for g in dst.param_groups]
        _train(src_model, src, range(2, 4))
        _train(dst_model, dst, range(2, 4))
        assert _same_params(src_model, dst_model), (case, saver_named)


@pytest.mark.parametrize("case", [c for c in CASES if c not in BOTH_FORMS])
def test_an_optimizer_given_the_model_loads_a_state_dict_saved_without_names(case):
    """Classes that take the model always know the names; a state dict without them (an
    unnamed optimizer's, torch's format) loads, and they keep their own."""
    src_model = _model()
    src = _build(case, src_model)
    _train(src_model, src, range(2))
    sd = src.state_dict()
    names = [list(g["param_names"]) for g in sd["param_groups"]]
    for g in sd["param_groups"]:
        del g["param_names"]
    dst_model = copy.deepcopy(src_model)
    dst = _build(case, dst_model)
    dst.load_state_dict(_saved(sd))
    assert [g["param_names"] for g in dst.param_groups] == names
    _train(src_model, src, range(2, 4))
    _train(dst_model, dst, range(2, 4))
    assert _same_params(src_model, dst_model)


def test_muon_optimizer_writes_no_names_it_was_not_given():
    w, b = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2))
    unnamed = mfx.MuonOptimizer([w, b], **F32)
    assert [len(g["params"]) for g in unnamed.param_groups] == [1, 1]
    assert not any("param_names" in g for g in unnamed.param_groups)
    named = mfx.MuonOptimizer([("name0", w), ("name1", b)], **F32)
    named.load_state_dict(unnamed.state_dict())
    assert [g["param_names"] for g in named.param_groups] == [["name0"], ["name1"]]


def test_fsdp_muon_optimizer_names_parameters_only_where_the_model_knows_them():
    model = _model()
    by_model = mfx.FSDPMuonOptimizer(model, list(model.parameters()), **F32)
    assert [g["param_names"] for g in by_model.param_groups] == [
        ["l1.weight", "l2.weight"], ["l1.bias", "norm.weight", "norm.bias", "l2.bias"]]
    stranger = nn.Parameter(torch.randn(3))
    mixed = mfx.FSDPMuonOptimizer(model, list(model.parameters()) + [stranger], **F32)
    assert not any("param_names" in g for g in mixed.param_groups)
    assert any(p is stranger for g in mixed.param_groups for p in g["params"])


# -- hooks run in torch's order ----------------------------------------------------------

def _hook_events(opt: torch.optim.Optimizer, model: nn.Module) -> tuple[list[str], dict, float]:
    """Every kind of optimizer hook registered, one step (with a closure), one
    ``state_dict()`` and one ``load_state_dict()``: the order they ran in, the state dict
    the post-hook returned, and the lr the load pre-hook wrote."""
    ev: list[str] = []

    def sd_post(o, sd):
        ev.append("state_dict post")
        return {**sd, "saved_by": "a hook"}

    def load_pre(o, sd):
        ev.append("load_state_dict pre")
        sd = {**sd, "param_groups": [{**g, "lr": 0.125} for g in sd["param_groups"]]}
        sd.pop("saved_by")
        return sd

    handles = [register_optimizer_step_pre_hook(lambda o, a, k: ev.append("global step pre")),
               register_optimizer_step_post_hook(lambda o, a, k: ev.append("global step post"))]
    try:
        opt.register_step_pre_hook(lambda o, a, k: ev.append("step pre"))
        opt.register_step_post_hook(lambda o, a, k: ev.append("step post"))
        opt.register_state_dict_pre_hook(lambda o: ev.append("state_dict pre"))
        opt.register_state_dict_pre_hook(lambda o: ev.append("state_dict pre, prepended"), prepend=True)
        opt.register_state_dict_post_hook(sd_post)
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(lambda o: ev.append("load_state_dict post"))
        _grads(model, 0)
        loss = opt.step(lambda: ev.append("closure") or 1.5)
        ev.append(f"step returned {loss}")
        sd = opt.state_dict()
        opt.load_state_dict(sd)
    finally:
        for h in handles:
            h.remove()
    return ev, sd, opt.param_groups[0]["lr"]


@pytest.mark.parametrize("case", OURS)
def test_hooks_run_in_torchs_order_and_their_results_count(case):
    want, want_sd, want_lr = _hook_events(_torch_adamw(_model()), _model())
    model = _model()
    got, got_sd, got_lr = _hook_events(_build(case, model), model)
    assert got == want, got
    assert got_sd["saved_by"] == want_sd["saved_by"] == "a hook"  # a state_dict post-hook's result is returned
    assert got_lr == want_lr == 0.125  # a load pre-hook's result is loaded


# -- torch's error types, and nothing changed ----------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_a_tensor_lr_of_more_than_one_element_is_a_value_error(case):
    with pytest.raises(ValueError, match="lr"):
        _build(case, _model(), lr=torch.tensor([1e-2, 1e-2]))


@pytest.mark.parametrize("case", list(CASES))
def test_betas_mixing_a_number_and_a_tensor_are_a_value_error(case):
    for betas in ((torch.tensor(0.9), 0.999), (0.9, torch.tensor(0.999))):
        with pytest.raises(ValueError, match="betas"):
            _build(case, _model(), betas=betas)
    _build(case, _model(), betas=(torch.tensor(0.9), torch.tensor(0.999)))  # two tensors: as torch


@pytest.mark.parametrize("case", OURS)
def test_the_same_values_written_into_param_groups_are_refused_by_the_step(case):
    """Where torch reads them only when the optimizer is built, muonfx reads the groups
    at every step: the same error types, and a refused step changes nothing."""
    model, opt = _trained(case, 1)
    _grads(model, 1)
    before = _snapshot(model, opt)
    adamw_group = next(g for g in opt.param_groups if "betas" in g)
    for key, bad, group in (("lr", torch.tensor([1e-2, 1e-2]), opt.param_groups[0]),
                            ("betas", (torch.tensor(0.9), 0.999), adamw_group)):
        good = group[key]
        group[key] = bad
        with pytest.raises(ValueError, match=key):
            opt.step()
        group[key] = good
        _unchanged(model, opt, before)


@pytest.mark.parametrize("case", BOTH_FORMS)
def test_params_given_as_a_tensor_or_a_group_of_a_set_are_a_type_error(case):
    """A set has no order, so neither has a state dict built on it."""
    w = nn.Parameter(torch.randn(4, 4))
    for bad in (w, [{"params": {w}}]):
        with pytest.raises(TypeError):
            _build_from(case, bad)


def _build_from(case: str, params: Any) -> torch.optim.Optimizer:
    """``case``'s class built from ``params`` as given (not from a model)."""
    if case == "TransformOptimizer(adamw)":
        return mfx.TransformOptimizer(params, mfx.adamw)
    if case == "TransformOptimizer(muon)":
        return mfx.TransformOptimizer(params, mfx.muon)
    if case == "MuonOptimizer":
        return mfx.MuonOptimizer(params)
    return torch.optim.AdamW(params)


@pytest.mark.parametrize("case", list(CASES))
def test_a_parameter_in_two_groups_is_a_value_error_and_changes_nothing(case):
    model = _model()
    opt = _build(case, model)
    groups = len(opt.param_groups)
    taken = opt.param_groups[0]["params"][0]
    extra = {"params": [taken]}
    if "param_names" in opt.param_groups[0]:
        extra = {"params": [("again", taken)]}
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group(extra)
    assert len(opt.param_groups) == groups
    if CASES[case][2]:
        assert len(opt.records) == groups


@pytest.mark.parametrize("case", list(CASES))
def test_a_state_dict_of_another_layout_is_a_value_error_and_changes_nothing(case):
    model, opt = _trained(case, 1)
    sd = opt.state_dict()
    before = _snapshot(model, opt)
    with pytest.raises(ValueError):
        opt.load_state_dict({**sd, "param_groups": sd["param_groups"] * 2})
    with pytest.raises(ValueError):
        opt.load_state_dict({**sd, "param_groups": [{**g, "params": g["params"][:-1]} for g in sd["param_groups"]]})
    _unchanged(model, opt, before)


# -- steps without gradients --------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_a_step_without_gradients_changes_nothing(case):
    model, opt = _trained(case, 2)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # set_to_none, torch's default
    before = _snapshot(model, opt)
    assert opt.step() is None
    _unchanged(model, opt, before)


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_without_gradients_keep_their_values_and_state(case):
    model, opt = _trained(case, 2)
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    skip = ("l1.weight", "norm.bias")
    state_before = {i: copy.deepcopy(st) for i, st in opt.state_dict()["state"].items()}
    _grads(model, 2, skip=skip)
    opt.step()
    after = opt.state_dict()["state"]
    for n, p in model.named_parameters():
        if n in skip:
            assert torch.equal(p, kept[n]), n
            i = index[id(p)]
            for k, v in state_before[i].items():
                assert torch.equal(v, after[i][k]) if isinstance(v, torch.Tensor) else v == after[i][k], (n, k)
        else:
            assert not torch.equal(p, kept[n]), n


@pytest.mark.parametrize("case", list(CASES))
def test_zero_gradients_without_weight_decay_leave_the_parameters_as_they_are(case):
    model = _model()
    opt = _build(case, model)
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    kept = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        _grads(model, step, zero=True)
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# -- lr schedulers ------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_a_scheduler_drives_every_group_as_hand_edits_do(case):
    """StepLR's halving and the same lr written by hand give the same parameters, bit for
    bit; a scheduler at lr 0 holds every parameter where it is."""
    a_model, b_model = _model(), _model()
    a, b = _build(case, a_model), _build(case, b_model)
    sched = torch.optim.lr_scheduler.StepLR(a, step_size=1, gamma=0.5)
    base = [g["lr"] for g in b.param_groups]
    for step in range(4):
        for g, lr in zip(b.param_groups, base):
            g["lr"] = lr * 0.5**step
        _grads(a_model, step)
        _grads(b_model, step)
        a.step()
        b.step()
        sched.step()
    assert [g["lr"] for g in a.param_groups] == [lr * 0.5**4 for lr in base]
    assert _same_params(a_model, b_model)
    torch.optim.lr_scheduler.LambdaLR(a, lambda epoch: 0.0)
    kept = [p.detach().clone() for p in a_model.parameters()]
    _train(a_model, a, range(4, 6))
    assert all(torch.equal(p, q) for p, q in zip(a_model.parameters(), kept))


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_resumes_from_the_optimizers_and_the_schedulers_state_dicts(case):
    model = _model()
    opt = _build(case, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, range(3), sched)
    opt_sd, sched_sd = _saved(opt.state_dict()), _saved(sched.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = _build(case, resumed_model)
    resumed_sched = torch.optim.lr_scheduler.StepLR(resumed, step_size=2, gamma=0.5)
    resumed.load_state_dict(opt_sd)  # after the scheduler is made, as torch's docs say
    resumed_sched.load_state_dict(sched_sd)
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in opt.param_groups]
    assert [g["initial_lr"] for g in resumed.param_groups] == [g["initial_lr"] for g in opt.param_groups]
    _train(model, opt, range(3, 6), sched)
    _train(resumed_model, resumed, range(3, 6), resumed_sched)
    assert _same_params(model, resumed_model)


# -- torch.optim.Muon's arguments ---------------------------------------------------------

def test_muon_optimizer_takes_every_argument_of_torch_optim_muon():
    """By keyword, with torch's defaults (torch.optim.Muon's signature read from the
    installed torch); by position past ``lr`` a TypeError gives torch's reading as keywords."""
    import inspect

    sig = inspect.signature(torch.optim.Muon).parameters
    given = {n: p.default for n, p in sig.items() if n != "params"}
    assert {"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
            "adjust_lr_fn"} <= set(given)
    w = nn.Parameter(torch.randn(8, 6))
    opt = mfx.MuonOptimizer([w], **given)
    group = opt.param_groups[0]
    assert group["adjust_lr"] == "original" and "adjust_lr_fn" not in group
    assert all(group[n] == v for n, v in given.items() if n != "adjust_lr_fn")
    assert mfx.MuonOptimizer([w], adjust_lr_fn="match_rms_adamw").param_groups[0]["adjust_lr"] == "match_rms_adamw"
    with pytest.raises(TypeError, match=r"torch.optim.Muon took weight_decay, momentum next.*"
                                        r"weight_decay=0.1, momentum=0.95 \(torch.optim.Muon's order\)"):
        mfx.MuonOptimizer([w], 1e-3, 0.1, 0.95)
    with pytest.raises(ValueError, match="adjust_lr_fn='spectral'.*are adjust_lr's"):
        mfx.MuonOptimizer([w], adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match="disagree"):
        mfx.MuonOptimizer([w], adjust_lr_fn="original", adjust_lr="match_rms_adamw")
