"""Checkpointing the torch.optim adapter: exact resume, the state_dict format,
refusal of mismatched state dicts, and torch.distributed.checkpoint's helpers.

* model + optimizer + lr scheduler saved after 5 steps and loaded (``weights_only=True``)
  into *fresh* objects continue bit for bit like an uninterrupted 10-step run, for
  ``TransformOptimizer(..., mfx.muon_adamw)`` and for ``mfx.create_hybrid_optimizer``;
* ``state_dict()`` is torch's ``{"state": {int: {str: tensor | number}}, "param_groups": [...]}``
  with readable names (``"momentum.mu"``, ``"adam.nu"``);
* a state dict of another transform or another model is refused with a ``ValueError``
  that says what does not match, and the optimizer and parameters are left untouched;
* ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` round-trip on one process,
  and ``get_state_dict`` / ``set_state_dict`` with full and CPU-offloaded state dicts;
* the step torch.distributed.checkpoint uses to initialise state (zero grads, lr 0)
  changes no parameter, weight decay included.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
import math

import pytest
import torch
from torch import nn

import muonfx as mfx
from helpers import resumed  # noqa: E402

VOCAB, DIM, SEQ, BATCH = 24, 16, 6, 4


class TinyLM(nn.Module):
    """Transformer-ish: embedding, two hidden Linear layers, LayerNorm, output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(self.norm(h))


def make_model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: the batch of step ``step`` depends on nothing else."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return x, y


def train(model: nn.Module, opt: torch.optim.Optimizer, sched, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        sched.step()


def muon_adamw_opt(model: nn.Module) -> mfx.TransformOptimizer:
    return mfx.TransformOptimizer(
        model.named_parameters(), mfx.muon_adamw, lr=0.02, momentum=0.9, weight_decay=0.01,
        adamw_lr=3e-3, adamw_weight_decay=0.05,
    )


def hybrid_opt(model: nn.Module) -> mfx.TransformOptimizer:
    return mfx.create_hybrid_optimizer(model, muon_lr=0.02, adamw_lr=3e-3, muon_weight_decay=0.01)


def blockwise_opt(model: nn.Module) -> mfx.TransformOptimizer:
    """State kept per block (``(*key, "block<i>")``): Adam's moments and its counter
    inside :func:`muonfx.blockwise`, momentum outside it."""
    per_block = mfx.blockwise(mfx.chain(mfx.scale_by_adam(), mfx.newton_schulz()), 8)
    tx = mfx.chain(mfx.partition({"blocks": mfx.chain(mfx.momentum(0.9), per_block), "rest": mfx.scale_by_adam()},
                                 lambda key, t: "blocks" if t.ndim == 2 and t.shape[0] % 8 == 0 else "rest"),
                   mfx.scale_by_learning_rate(0.02))
    return mfx.TransformOptimizer(model.named_parameters(), tx)


BUILDERS = {"muon_adamw": muon_adamw_opt, "hybrid": hybrid_opt, "blockwise": blockwise_opt}
N, M = 5, 5


def cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=N + M, eta_min=1e-4)


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def snapshot(opt: torch.optim.Optimizer) -> dict:
    """A deep copy of ``opt.state_dict()`` (tensors cloned)."""
    sd = opt.state_dict()
    return {
        "state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


def assert_same_state_dict(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            if torch.is_tensor(v):
                assert torch.is_tensor(w) and v.dtype == w.dtype and torch.equal(v, w), (i, k)
            else:
                assert v == w and type(v) is type(w), (i, k, v, w)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


# ---------------------------------------------------------------------------
# exact resume
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_exact_resume_bitwise(kind, tmp_path):
    build = BUILDERS[kind]

    # uninterrupted reference run
    ref = make_model(0)
    ref_opt = build(ref)
    ref_sched = cosine(ref_opt)
    train(ref, ref_opt, ref_sched, range(N + M))

    # first half, then save everything to disk
    model = make_model(0)
    opt = build(model)
    sched = cosine(opt)
    train(model, opt, sched, range(N))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    del model, opt, sched

    # fresh objects (different init, different lr) + load with weights_only=True
    ckpt = torch.load(path, weights_only=True)
    model2 = make_model(123)
    opt2 = build(model2)
    for g in opt2.param_groups:
        g["lr"] = 0.5  # overwritten by the checkpoint
    sched2 = cosine(opt2)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert sched2.last_epoch == N
    train(model2, opt2, sched2, range(N, N + M))

    assert_params_equal(params_of(model2), params_of(ref))
    assert_same_state_dict(opt2.state_dict(), ref_opt.state_dict())
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    # and the run really moved: the cosine schedule reached its end
    assert math.isclose(opt2.param_groups[0]["lr"], 1e-4, rel_tol=1e-9)


def test_resume_then_save_again_is_stable():
    """state_dict -> load -> state_dict is the identity (what a second resume would save)."""
    model = make_model(0)
    opt = hybrid_opt(model)
    sched = cosine(opt)
    train(model, opt, sched, range(3))
    sd = roundtrip(opt.state_dict())
    opt2 = hybrid_opt(make_model(1))
    opt2.load_state_dict(sd)
    assert_same_state_dict(opt2.state_dict(), snapshot(opt))


# ---------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------


def test_blockwise_state_is_saved_under_its_parameter():
    """Every block's entries (and the counter of the transform inside ``blockwise``) are in
    the parameter's own entry, named by the block; a checkpoint that lacks one is refused
    by name."""
    model = make_model(0)
    opt = blockwise_opt(model)
    sched = cosine(opt)
    train(model, opt, sched, range(2))
    sd = opt.state_dict()
    fc1 = list(dict(model.named_parameters())).index("fc1.weight")  # 32 x 16: four blocks of 8 rows
    names = sorted(sd["state"][fc1])
    blocks = [n for n in names if re.fullmatch(r"block\d", n.rsplit(".", 1)[-1])]
    assert len(blocks) == 8 and {n.rsplit(".", 1)[1] for n in blocks} == {f"block{i}" for i in range(4)}, names
    assert all(sd["state"][fc1][n].shape == (8, 16) for n in blocks)
    counters = [n for n in names if n.endswith("count") and sd["state"][fc1][n] == 2]
    assert counters, names  # the inner Adam's step counter, not only the adapter's
    broken = snapshot(opt)
    del broken["state"][fc1][blocks[0]]
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"fc1\.weight.*" + blocks[0].replace(".", r"\.")):
        opt.load_state_dict(broken)
    assert_same_state_dict(opt.state_dict(), before)


def test_state_dict_format_hybrid():
    model = make_model(0)
    opt = hybrid_opt(model)
    train(model, opt, cosine(opt), range(2))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    n_params = sum(1 for _ in model.parameters())
    assert sorted(sd["state"]) == list(range(n_params))
    for i, entry in sd["state"].items():
        assert isinstance(i, int)
        for k, v in entry.items():
            assert isinstance(k, str)
            assert torch.is_tensor(v) or isinstance(v, (int, float, bool)), (i, k, type(v))

    muon_group, adamw_group = sd["param_groups"]
    assert muon_group["param_names"] == ["fc1.weight", "fc2.weight"]
    assert "embed.weight" in adamw_group["param_names"] and "head.weight" in adamw_group["param_names"]
    for pid, name in zip(muon_group["params"], muon_group["param_names"]):
        entry = sd["state"][pid]
        assert set(entry) == {"momentum.mu", "count"}
        assert entry["count"] == 2
        assert entry["momentum.mu"].shape == dict(model.named_parameters())[name].shape
    for pid, name in zip(adamw_group["params"], adamw_group["param_names"]):
        entry = sd["state"][pid]
        assert {"adam.mu", "adam.nu"} <= set(entry)
        assert entry["adam.mu"].shape == dict(model.named_parameters())[name].shape
    assert muon_group["lr"] == pytest.approx(cosine_lr(0.02, 2)) and adamw_group["betas"] == (0.9, 0.95)

    loaded = roundtrip(sd)  # weights_only=True reads it
    assert_same_state_dict(loaded, sd)


def cosine_lr(base: float, t: int, eta_min: float = 1e-4, T: int = N + M) -> float:
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / T)) / 2


def test_state_dict_is_a_view_of_the_live_state():
    """opt.state[p] holds the same per-parameter entries as state_dict()."""
    model = make_model(0)
    opt = hybrid_opt(model)
    train(model, opt, cosine(opt), range(2))
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        assert opt.state[p].keys() == sd["state"][i].keys()
        for k, v in opt.state[p].items():
            if torch.is_tensor(v):
                assert torch.equal(v, sd["state"][i][k])


def test_state_dict_with_bf16_ns_dtype_loads_weights_only():
    """A torch.dtype hyperparameter (ns_dtype) is saved by its name and survives
    weights_only loading; a state dict holding the dtype itself (earlier releases) loads too."""
    model = make_model(0)
    opt = mfx.create_hybrid_optimizer(model, ns_dtype=torch.bfloat16)
    train(model, opt, cosine(opt), range(1))
    sd = roundtrip(opt.state_dict())
    assert sd["param_groups"][0]["ns_dtype"] == "torch.bfloat16"
    assert opt.param_groups[0]["ns_dtype"] is torch.bfloat16  # the live group keeps the dtype
    for saved in (sd, {**sd, "param_groups": [{**sd["param_groups"][0], "ns_dtype": torch.bfloat16},
                                              *sd["param_groups"][1:]]}):
        opt2 = mfx.create_hybrid_optimizer(make_model(1), ns_dtype=torch.float32)
        opt2.load_state_dict(saved)
        assert opt2.param_groups[0]["ns_dtype"] is torch.bfloat16
        assert_same_state_dict(opt2.state_dict(), opt.state_dict())


@pytest.mark.parametrize("option", ["full_state_dict", "cpu_offload"])
def test_full_and_offloaded_state_dicts_with_a_dtype_hyperparameter(option):
    """torch's ``get_state_dict`` with ``full_state_dict=True`` or ``cpu_offload=True``
    takes only tensors, numbers, strings and None: a dtype hyperparameter (ns_dtype) goes
    through as its name, and ``set_state_dict`` restores the dtype and the state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(**{option: True})
    model = make_model(0)
    opt = mfx.create_hybrid_optimizer(model, ns_dtype=torch.float32)
    train(model, opt, cosine(opt), range(2))
    msd, osd = get_state_dict(model, opt, options=options)
    assert osd["param_groups"][0]["ns_dtype"] == "torch.float32"
    fresh = make_model(1)
    fresh_opt = mfx.create_hybrid_optimizer(fresh, ns_dtype=torch.bfloat16)
    cosine(fresh_opt)  # built before the load, as in training (it adds "initial_lr" to the groups)
    set_state_dict(fresh, fresh_opt, model_state_dict=roundtrip(msd), optim_state_dict=roundtrip(osd),
                   options=options)
    assert fresh_opt.param_groups[0]["ns_dtype"] is torch.float32

    def tuples(sd):  # torch's full state dict hands tuples (betas) back as lists
        return {**sd, "param_groups": [{k: tuple(v) if isinstance(v, list) and k != "param_names" else v
                                        for k, v in g.items()} for g in sd["param_groups"]]}

    assert_same_state_dict(tuples(fresh_opt.state_dict()), tuples(opt.state_dict()))
    assert_params_equal(params_of(fresh), params_of(model))


# ---------------------------------------------------------------------------
# mismatches: ValueError, nothing changes
# ---------------------------------------------------------------------------


class Matrices(nn.Module):
    def __init__(self, a: int = 8, b: int = 12, c: int = 4, extra: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(a, b, bias=False)
        self.l2 = nn.Linear(b, c, bias=False)
        if extra:
            self.l3 = nn.Linear(c, c, bias=False)


def _stepped(model: nn.Module, tx, **hp) -> mfx.TransformOptimizer:
    opt = mfx.TransformOptimizer(model.named_parameters(), tx, **hp)
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt


def _expect_refusal(target_opt, target_model, sd, *needles):
    before = snapshot(target_opt)
    params_before = params_of(target_model)
    live_before = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in target_opt.state[p].items()}
                   for p in target_model.parameters()}
    with pytest.raises(ValueError) as err:
        target_opt.load_state_dict(roundtrip(sd))
    msg = str(err.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert_same_state_dict(target_opt.state_dict(), before)
    assert_params_equal(params_of(target_model), params_before)
    for p in target_model.parameters():
        now = target_opt.state[p]
        assert now.keys() == live_before[id(p)].keys()
        for k, v in now.items():
            assert torch.equal(v, live_before[id(p)][k]) if torch.is_tensor(v) else v == live_before[id(p)][k]
    # and it still steps like an untouched optimizer would
    return msg


def test_load_other_chain_raises_and_changes_nothing():
    src_model = Matrices()
    adam_sd = _stepped(src_model, mfx.adamw, lr=1e-3).state_dict()
    model = Matrices()
    opt = _stepped(model, mfx.muon, lr=0.02, weight_decay=0.1)
    msg = _expect_refusal(opt, model, adam_sd, "l1.weight", "momentum.mu", "adam.mu")
    assert "missing" in msg and "unexpected" in msg

    # and the other way round
    muon_sd = opt.state_dict()
    model2 = Matrices()
    opt2 = _stepped(model2, mfx.adamw, lr=1e-3)
    _expect_refusal(opt2, model2, muon_sd, "adam.mu", "momentum.mu")


def test_load_other_shapes_raises_and_changes_nothing():
    src_sd = _stepped(Matrices(8, 10, 4), mfx.muon, lr=0.02).state_dict()  # l1 is 10x8, l2 4x10
    model = Matrices(8, 12, 4)
    opt = _stepped(model, mfx.muon, lr=0.02)
    _expect_refusal(opt, model, src_sd, "shape", "(10, 8)", "(12, 8)")


def test_load_other_param_count_raises_and_changes_nothing():
    src_sd = _stepped(Matrices(extra=True), mfx.muon, lr=0.02).state_dict()
    model = Matrices()
    opt = _stepped(model, mfx.muon, lr=0.02)
    _expect_refusal(opt, model, src_sd, "3 parameters", "2")


def test_load_other_names_raises_and_changes_nothing():
    class Renamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 12, bias=False)
            self.b = nn.Linear(12, 4, bias=False)

    src_sd = _stepped(Renamed(), mfx.muon, lr=0.02).state_dict()
    model = Matrices()
    opt = _stepped(model, mfx.muon, lr=0.02)
    _expect_refusal(opt, model, src_sd, "names differ", "a.weight", "l1.weight")


def test_load_other_group_count_raises_and_changes_nothing():
    src_model = make_model(0)
    src_sd = hybrid_opt(src_model).state_dict()  # 2 groups
    model = make_model(0)
    opt = muon_adamw_opt(model)  # 1 group
    train(model, opt, cosine(opt), range(1))
    _expect_refusal(opt, model, src_sd, "2 param groups", "1")


def test_load_bad_second_group_changes_first_group_neither():
    """The check covers every group before anything is written."""
    model = make_model(0)
    opt = hybrid_opt(model)
    train(model, opt, cosine(opt), range(2))
    other = make_model(0)
    other_opt = hybrid_opt(other)
    train(other, other_opt, cosine(other_opt), range(4))
    sd = other_opt.state_dict()
    # break only the AdamW group's state of one parameter
    pid = sd["param_groups"][1]["params"][0]
    sd["state"][pid]["adam.mu"] = torch.zeros(3, 3)
    _expect_refusal(opt, model, sd, "adam.mu", "shape", "(3, 3)")


# ---------------------------------------------------------------------------
# torch.distributed.checkpoint helpers
# ---------------------------------------------------------------------------


def test_dcp_get_set_optimizer_state_dict_roundtrip():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # The non-distributed path of these helpers needs no process group.
    model = make_model(0)
    opt = hybrid_opt(model)
    sched = cosine(opt)
    train(model, opt, sched, range(3))
    saved = get_optimizer_state_dict(model, opt)
    # keyed by fully qualified parameter names
    assert "fc1.weight" in saved["state"] and "momentum.mu" in saved["state"]["fc1.weight"]
    assert "adam.nu" in saved["state"]["embed.weight"]
    expected = snapshot(opt)
    expected_params = params_of(model)
    saved = roundtrip(saved)

    # keep training (state and params move), then restore the optimizer from `saved`
    train(model, opt, sched, range(3, 5))
    model.load_state_dict(expected_params)
    set_optimizer_state_dict(model, opt, saved)
    assert_same_state_dict(opt.state_dict(), expected)

    # continuing from the restored state equals continuing from the original
    ref = make_model(0)
    ref_opt = hybrid_opt(ref)
    ref_sched = cosine(ref_opt)
    train(ref, ref_opt, ref_sched, range(5))
    sched2 = cosine(opt)
    sched2.load_state_dict(ref_sched.state_dict())
    for g, rg in zip(opt.param_groups, ref_opt.param_groups):
        g["lr"] = rg["lr"]
    model.load_state_dict(params_of(ref))
    set_optimizer_state_dict(model, opt, get_optimizer_state_dict(ref, ref_opt))
    train(model, opt, sched2, range(5, 7))
    train(ref, ref_opt, ref_sched, range(5, 7))
    assert_params_equal(params_of(model), params_of(ref))

    # into a fresh model/optimizer
    fresh = make_model(5)
    fresh_opt = hybrid_opt(fresh)
    set_optimizer_state_dict(fresh, fresh_opt, roundtrip(get_optimizer_state_dict(ref, ref_opt)))
    assert_same_state_dict(fresh_opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("tx,hp", [
    (mfx.muon, dict(lr=0.02, weight_decay=0.1)),
    (mfx.adamw, dict(lr=1e-3, weight_decay=0.1)),
])
def test_zero_grad_zero_lr_step_changes_nothing(tx, hp):
    """What get_optimizer_state_dict does to initialise state: lr 0, zero grads, step()."""
    torch.manual_seed(0)
    model = Matrices()
    opt = mfx.TransformOptimizer(model.named_parameters(), tx, **hp)
    before = params_of(model)
    assert_zero_lr_zero_grad_step_changes_nothing(model, opt)
    # after real steps too (non-zero momentum / moments, decay > 0)
    for g in opt.param_groups:
        g["lr"] = hp["lr"]
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    moved = params_of(model)
    assert any(not torch.equal(moved[n], before[n]) for n in before)
    assert_zero_lr_zero_grad_step_changes_nothing(model, opt)


def assert_zero_lr_zero_grad_step_changes_nothing(model, opt):
    """DCP's state initialisation: every group's lr 0, zero grads, one step."""
    before = params_of(model)
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert_params_equal(params_of(model), before)


def test_zero_grad_zero_lr_step_hybrid_changes_nothing():
    model = make_model(0)
    opt = mfx.create_hybrid_optimizer(model, muon_weight_decay=0.1, adamw_weight_decay=0.1)
    assert_zero_lr_zero_grad_step_changes_nothing(model, opt)


def test_nested_inject_hyperparams_state_round_trips():
    """A pre-built inject_hyperparams transform inside the adapter's own wrapper: the flat
    names would collide ("count" twice), so they are spelled out in full, and still load."""
    torch.manual_seed(0)
    make = lambda: mfx.inject_hyperparams(mfx.adamw)(lr=mfx.schedules.linear(1e-2, 0.0, 10))  # noqa: E731
    model = torch.nn.Linear(3, 3)
    opt = mfx.TransformOptimizer(model.named_parameters(), make())
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    names = set(sd["state"][0])
    assert {"count", "inner_state.count", "inner_state.inner_state.adam.mu"} <= names
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other = mfx.TransformOptimizer(torch.nn.Linear(3, 3).named_parameters(), make())
    other.load_state_dict(torch.load(buf, weights_only=True))
    again = other.state_dict()["state"][0]
    assert again["inner_state.count"] == 2
    assert torch.equal(again["inner_state.inner_state.adam.nu"], sd["state"][0]["inner_state.inner_state.adam.nu"])


# ---------------------------------------------------------------------------
# checkpoints of the previous release still load
# ---------------------------------------------------------------------------

_OLD = Path(__file__).parent / "data" / "checkpoints_a901c07.pt"


def _old_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


_OLD_MAKERS = {
    "muon_adamw": lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.muon_adamw, lr=0.02, ns_dtype=torch.float32),
    "adamw": lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.adamw, lr=1e-2),
    "prebuilt_chain": lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.chain(
        mfx.momentum(0.9), mfx.apply_if_finite(mfx.scale_by_adam()), mfx.scale(-0.01))),
    "hybrid": lambda m: mfx.create_hybrid_optimizer(m, ns_dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(_OLD_MAKERS))
def test_checkpoints_of_the_previous_release_load_and_resume(name):
    """``tests/data/checkpoints_a901c07.pt`` was written by muonfx at commit a901c07 (before
    the executor) with ``tests/data/make_checkpoints.py``: 3 steps of each optimizer. It
    loads with ``weights_only=True`` into today's optimizer, which then saves the same
    keys and values, and resumes exactly like an optimizer that ran those 3 steps today."""
    saved = torch.load(_OLD, weights_only=True)[name]
    m = _old_model()
    m.load_state_dict(saved["model"])
    opt = _OLD_MAKERS[name](m)
    opt.load_state_dict(saved["optim"])
    again = opt.state_dict()
    for pid, entries in saved["optim"]["state"].items():
        assert sorted(again["state"][pid]) == sorted(entries), pid
        for k, v in entries.items():
            w = again["state"][pid][k]
            assert (torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v), (pid, k)
    # today's run of the same 3 steps, then one more step on both
    ref_m = _old_model()
    ref = _OLD_MAKERS[name](ref_m)
    for i in range(4):
        if i < 3:
            torch.manual_seed(10 + i)
            ref_m.zero_grad()
            ref_m(torch.randn(5, 8)).pow(2).sum().backward()
            ref.step()
            continue
        for model, o in ((ref_m, ref), (m, opt)):
            torch.manual_seed(99)
            model.zero_grad()
            model(torch.randn(5, 8)).pow(2).sum().backward()
            o.step()
    # the old code folded the lr into p += -lr * u (one rounding fewer): float tolerance
    for a, b in zip(m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::muonfx.MeaningChangedWarning")  # the renamed floor, on purpose
def test_checkpoints_with_the_old_epsilon_names_load_into_the_renamed_options():
    """0.1 renamed moonlight's ``eps``/``ns_eps`` to ``adamw_eps``/``eps`` and normuon's
    ``eps``/``ns_eps`` to ``row_eps``/``eps``; fsdp_muon's row ``eps`` is ``row_eps``."""
    from muonfx.optim.checkpoint import renamed_eps

    assert renamed_eps({"eps": 1e-8, "ns_eps": 1e-6, "lr": 1.0}, {"eps", "adamw_eps", "lr"}) == {
        "lr": 1.0, "eps": 1e-6, "adamw_eps": 1e-8}
    assert renamed_eps({"eps": 1e-10, "ns_eps": 1e-6}, {"eps", "row_eps"}) == {"eps": 1e-6, "row_eps": 1e-10}
    assert renamed_eps({"eps": 1e-10}, {"eps", "row_eps"}) == {"row_eps": 1e-10}
    new = {"eps": 1e-7, "adamw_eps": 1e-8}
    assert renamed_eps(new, {"eps", "adamw_eps"}) is new  # today's checkpoints pass through
    # end to end: an old moonlight group loads with Adam's epsilon where it belongs
    model = torch.nn.Linear(4, 4)
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.moonlight)
    sd = opt.state_dict()
    group = dict(sd["param_groups"][0])
    group.pop("adamw_eps")
    group["eps"], group["ns_eps"] = 3e-8, 2e-7
    sd["param_groups"] = [group]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["adamw_eps"] == 3e-8 and opt.param_groups[0]["eps"] == 2e-7


@pytest.mark.slow
def test_a_model_of_2_24_elements_resumes_bit_for_bit_with_every_default():
    """MuonOptimizer with every default on a model of 2^24 matrix elements (and biases): its
    Muon group runs Muon's lowering in pieces (larger than the CPU's batch budget; nothing
    is compiled unless asked), its AdamW group (the biases) in torch's fused kernel. Stopped
    after two steps and resumed from ``torch.save`` / ``torch.load(weights_only=True)``
    into a new model and optimizer, the next two steps end bit for bit where the
    uninterrupted run does: no timing decides any path."""
    layers = 16  # 16 x (64 x 16384) = 2^24 matrix elements, plus the biases

    def model(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(16384 if i % 2 == 0 else 64, 64 if i % 2 == 0 else 16384)
                               for i in range(layers)])

    def grads(m, step):
        gen = torch.Generator().manual_seed(100 + step)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen)

    whole = model()
    opt = mfx.MuonOptimizer(whole)
    assert sum(p.numel() for p in whole.parameters()) >= 1 << 24
    for step in range(4):
        grads(whole, step)
        opt.step()
    g = opt.plan.groups[0]
    assert g.path == "fused" and g.pieces is not None, opt.plan
    assert opt.plan.groups[1].path == "fused"  # the biases' AdamW group

    first = model()
    o1 = mfx.MuonOptimizer(first)
    for step in range(2):
        grads(first, step)
        o1.step()
    again = model(seed=3)
    o2 = resumed(first, o1, again, mfx.MuonOptimizer)
    for step in range(2, 4):
        grads(again, step)
        o2.step()
    assert o2.plan.groups[0].path == "fused" and o2.plan.groups[1].path == "fused"
    for (n, a), (_, b) in zip(whole.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], o2.state_dict()["state"]
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]) if isinstance(v, torch.Tensor) else v == sb[i][k], (i, k)
