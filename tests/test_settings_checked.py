"""Settings and saved values that would mean something other than what they say are
refused by name, before anything changes: the ``"compile"`` and ``"fused"`` entries of a
param group (set by hand or loaded), hand-edited step counts, numbers too large for
float32, a Nesterov flag that is not a bool; a group added after ``opt.compile()`` is
compiled as the others."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx


def _opt():
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = mfx.TransformOptimizer([("w", w)], mfx.adamw, lr=1e-3)
    w.grad = torch.ones_like(w)
    return w, opt


@pytest.mark.parametrize("key", ["compile", "fused"])
@pytest.mark.parametrize("bad", ["false", "yes", 1, 0.0])
def test_a_group_setting_other_than_none_true_false_is_refused(key, bad):
    w, opt = _opt()
    opt.param_groups[0][key] = bad
    before = w.detach().clone()
    with pytest.raises(ValueError, match=f"'{key}' is {bad!r}"):
        opt.step()
    assert torch.equal(w, before)
    good = _opt()[1]
    good.step()
    sd = good.state_dict()
    sd["param_groups"][0][key] = bad
    with pytest.raises(ValueError, match=f"saved '{key}' is {bad!r}"):
        good.load_state_dict(sd)


@pytest.mark.parametrize("bad", [-3, True, "5", 1e30, 2.5, float("nan")])
def test_a_hand_edited_count_is_refused_at_load(bad):
    w, opt = _opt()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["adam.count"] = bad
    before = opt.state_dict()
    with pytest.raises(ValueError, match="adam.count"):
        opt.load_state_dict(sd)
    assert opt.state_dict()["state"][0]["adam.count"] == before["state"][0]["adam.count"] == 1


def test_a_whole_float_count_loads_as_an_int():
    w, opt = _opt()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["adam.count"] = torch.tensor(1.0)  # as torch.optim stores its steps
    opt.load_state_dict(sd)
    assert opt.state_dict()["state"][0]["adam.count"] == 1


@pytest.mark.parametrize("name", ["lr", "weight_decay"])
def test_a_number_beyond_float32_is_refused(name):
    w, opt = _opt()
    opt.param_groups[0][name] = 1e39
    with pytest.raises(ValueError, match=f"'{name}' is 1e\\+39.*float32"):
        opt.step()
    with pytest.raises(ValueError, match="float32"):
        mfx.adamw(lr=1e39)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_nesterov_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="'nesterov'"):
        mfx.muon(nesterov=bad)


def test_a_group_added_after_compile_is_compiled(monkeypatch):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    a, b = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    opt = mfx.TransformOptimizer([("a", a)], mfx.adamw).compile()
    opt.add_param_group({"params": [("b", b)]})
    assert [g["compile"] for g in opt.param_groups] == [True, True]
    a.grad, b.grad = torch.ones(3, 3), torch.ones(3)
    opt.step()
    assert [g.path for g in opt.plan.groups] == ["compiled", "compiled"]
