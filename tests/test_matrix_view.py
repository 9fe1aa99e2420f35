"""The matrix view (:class:`muonfx.MatrixView`): the default reads 2-D, 3-D expert stacks
and 4-D conv weights as before, bit for bit; ``dims=`` overrides it per parameter, and the
plan, ``describe`` and every matrix transform read the same view."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx.core import default_view
from muonfx.distributed import describe

CONV_T = mfx.MatrixView(rows=(1, 2, 3), cols=0)  # [out, in, kh, kw] read as (in*kh*kw) x out


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lin": torch.randn(8, 32, generator=g), "moe": torch.randn(4, 16, 8, generator=g),
            "conv": torch.randn(8, 3, 2, 2, generator=g)}


def _run(tx, grads: dict[str, torch.Tensor], steps: int = 2) -> TensorDict:
    params = TensorDict({k: torch.ones_like(v) for k, v in grads.items()}, [])
    state = tx.init(params)
    for i in range(steps):
        out, state = tx.update(TensorDict({k: v * (i + 1) for k, v in grads.items()}, []), state, params)
    return out


def test_default_view_reads_2d_3d_and_conv_as_hand_reshaped_matrices_bit_for_bit():
    """Muon on a 2-D matrix, an expert stack and a conv weight gives, bit for bit, Muon on
    the same matrices reshaped by hand: the 2-D one itself, each expert as its own
    parameter, the conv weight as ``[out, in*kh*kw]``."""
    g = _grads()
    got = _run(mfx.muon(weight_decay=0.1), g)
    hand = {"lin": g["lin"], "conv": g["conv"].flatten(1), **{f"e{i}": g["moe"][i] for i in range(4)}}
    ref = _run(mfx.muon(weight_decay=0.1), hand)
    assert torch.equal(got["lin"], ref["lin"])
    assert torch.equal(got["conv"], ref["conv"].reshape(8, 3, 2, 2))
    assert torch.equal(got["moe"], torch.stack([ref[f"e{i}"] for i in range(4)]))


@pytest.mark.parametrize("shape", [(8, 32), (4, 16, 8), (8, 3, 2, 2), (2, 3, 4, 5, 6)])
def test_default_view_through_the_general_path_is_the_fast_path(shape):
    """The default view given explicitly (the override path: permute, reshape, unstack)
    gives the same stacks, shapes and results as the inline default path."""
    from muonfx.transforms._matrix import as_stacks, from_stacks, matrix_shapes

    t = torch.randn(shape)
    view = default_view(len(shape))
    fast, = as_stacks([("w",)], [t], "test")
    slow, = as_stacks([("w",)], [t], "test", [view])
    assert torch.equal(fast, slow) and fast.shape == slow.shape == view.shape(shape)
    assert matrix_shapes([("w",)], [t], "test") == matrix_shapes([("w",)], [t], "test", [view]) == [view.shape(shape)[1:]]
    assert torch.equal(from_stacks([fast * 2], [t])[0], from_stacks([slow * 2], [t], [view])[0])


def test_conv_weight_viewed_transposed_against_a_hand_reshaped_reference():
    """``dims`` reads a conv weight as ``(in*kh*kw) x out``: Muon's update (Newton-Schulz
    and the shape scale of a 12 x 8 matrix) is, bit for bit, Muon's on that matrix made
    by hand, transposed back; the default view gives a different update."""
    g = _grads()
    dims = {"conv": CONV_T}
    got = _run(mfx.muon(dims=dims, weight_decay=0.1), g)
    hand = dict(g, conv=g["conv"].flatten(1).T.contiguous())
    ref = _run(mfx.muon(weight_decay=0.1), hand)
    assert torch.equal(got["conv"], ref["conv"].T.reshape(8, 3, 2, 2))
    assert torch.equal(got["lin"], ref["lin"]) and torch.equal(got["moe"], ref["moe"])
    default = _run(mfx.muon(weight_decay=0.1), g)
    assert not torch.allclose(got["conv"], default["conv"], atol=1e-3)
    # the shape scale reads the override: sqrt(max(1, 12 / 8)) instead of sqrt(max(1, 8 / 12))
    u = TensorDict({"conv": torch.ones(8, 3, 2, 2)}, [])
    assert mfx.scale_by_shape(dims=dims).update(u, None)[0]["conv"][0, 0, 0, 0].item() == pytest.approx(1.5 ** 0.5)
    assert mfx.scale_by_shape().update(u, None)[0]["conv"][0, 0, 0, 0].item() == 1.0


def test_override_by_callable_and_row_normalize_against_hand_reshaped_reference():
    """A callable ``(name, tensor) -> view | None`` (``None``: the default), through
    :func:`muonfx.normuon`, whose per-row statistics read the same view."""
    g = _grads(1)
    pick = lambda name, t: CONV_T if t.ndim == 4 else None  # noqa: E731
    got = _run(mfx.normuon(dims=pick), g, steps=3)
    ref = _run(mfx.normuon(), dict(g, conv=g["conv"].flatten(1).T.contiguous()), steps=3)
    assert torch.equal(got["conv"], ref["conv"].T.reshape(8, 3, 2, 2))
    assert torch.equal(got["moe"], ref["moe"])
    state = mfx.row_normalize(dims=pick).init(TensorDict(g, []))
    assert state.v["conv"].shape == (1, 12)  # one statistic per row of the 12 x 8 view


def test_expert_stack_read_as_one_matrix_by_an_override():
    """``MatrixView(rows=(0, 1), cols=2)`` reads ``[E, m, n]`` as one ``(E*m) x n`` matrix."""
    g = _grads(2)
    got = _run(mfx.newton_schulz(dims={"moe": mfx.MatrixView((0, 1), 2)}), g, steps=1)
    ref = _run(mfx.newton_schulz(), {"moe": g["moe"].reshape(64, 8)}, steps=1)
    assert torch.equal(got["moe"], ref["moe"].reshape(4, 16, 8))


def test_plan_and_describe_show_each_parameters_view():
    """``print(opt.plan)`` and ``describe`` print the view per parameter, the override
    marked as given."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 2), torch.nn.Flatten(), torch.nn.Linear(72, 4))
    tx = mfx.muon_adamw(dims={"0.weight": CONV_T})
    opt = mfx.TransformOptimizer(model.named_parameters(), tx)
    model(torch.randn(2, 3, 4, 4)).sum().backward()
    opt.step()
    text = str(opt.plan)
    assert "12x8 matrix (dims 1*2*3 x 0), given by dims=" in text
    assert "4x72 matrix (dims 0 x 1): " in text
    rows = {r["parameter"]: r["matrix view"] for r in describe(model, dims={"0.weight": CONV_T}).rows}
    assert rows["0.weight"] == "12x8 matrix (dims 1*2*3 x 0)" and rows["2.weight"] == "4x72 matrix (dims 0 x 1)"
    assert describe(model).rows[0]["matrix view"] == "8x12 matrix (dims 0 x 1*2*3)"


@pytest.mark.parametrize("bad, error, words", [
    (mfx.MatrixView(0, 0), ValueError, "'conv' of shape (8, 3, 2, 2)"),
    (mfx.MatrixView(0, 4), ValueError, "'conv'"),
    ((1, 0), TypeError, "'conv'"),
])
def test_a_bad_view_is_refused_naming_the_parameter(bad, error, words):
    g = TensorDict(_grads(), [])
    tx = mfx.newton_schulz(dims={"conv": bad})
    with pytest.raises(error) as e:
        tx.update(g, tx.init(g))
    assert words in str(e.value) and "MatrixView" in str(e.value)
