"""Leafwise declarations (``mfx.leafwise``): who is declared, that the declaration is
true (a split of the tree computes what the whole tree computes), and the conformance
law that checks it.

A wrong declaration would let the adapter run a transform in pieces and silently
change what it computes, so the table below says, for every public transform,
combinator, wrapper, preset and recipe, whether it is declared, and why not where it
is not. Kept fast: tiny trees, a few hypothesis examples, derandomized.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx
from muonfx import schedules
from muonfx.core import Key, build
from muonfx.testing.compare import tree_diff as _tree_diff
from muonfx.optim.groups import lr_multiplier
from muonfx.tree import merge, restrict
from muonfx.testing import ConformanceError, check_transform, params_and_grads

FAST = dict(max_examples=5, derandomize=True)


from helpers import one_intra_op_thread  # noqa: E402,F401  (autouse: one thread in this module)


# ---------------------------------------------------------------------------
# who is declared
# ---------------------------------------------------------------------------

clip = lambda: mfx.clip_by_global_norm(1.0)  # noqa: E731  the one global transform
mom = lambda: mfx.momentum(0.9)  # noqa: E731

# name -> (builder, declared leafwise?)
DECLARED: dict[str, tuple[Callable[[], mfx.GradientTransformation], bool]] = {
    # transforms
    "identity": (mfx.identity, True),
    "momentum": (mom, True),
    "nesterov": (mfx.nesterov, True),
    "bias_corrected_momentum": (mfx.bias_corrected_momentum, True),
    "newton_schulz": (mfx.newton_schulz, True),
    "row_normalize": (mfx.row_normalize, True),
    "scale": (lambda: mfx.scale(2.0), True),
    "scale_by_learning_rate": (lambda: mfx.scale_by_learning_rate(0.1), True),
    "scale_by_learning_rate_schedule": (lambda: mfx.scale_by_learning_rate(schedules.linear(1.0, 0.0, 3)), True),
    "scale_by_shape": (mfx.scale_by_shape, True),
    "decoupled_decay": (lambda: mfx.decoupled_decay(0.1), True),
    "decoupled_decay_mask": (lambda: mfx.decoupled_decay(0.1, mask=lambda k, t: t.ndim >= 2), True),
    "scale_by_adam": (mfx.scale_by_adam, True),
    "clip_by_global_norm": (clip, False),  # one norm over every leaf
    # combinators
    "chain": (lambda: mfx.chain(mom(), mfx.scale(-0.1)), True),
    "chain_empty": (mfx.chain, True),
    "chain_with_clip": (lambda: mfx.chain(clip(), mom()), False),
    "named_chain": (lambda: mfx.named_chain(("m", mom()), ("lr", mfx.scale(-0.1))), True),
    "named_chain_with_clip": (lambda: mfx.named_chain(("m", mom()), ("clip", clip())), False),
    "masked": (lambda: mfx.masked(mom(), lambda k, t: t.ndim == 2), True),
    "masked_clip": (lambda: mfx.masked(clip(), lambda k, t: t.ndim == 2), False),
    "mask_by_ndim": (lambda: mfx.mask_by_ndim(mfx.newton_schulz(), {2, 3}), True),
    "mask_by_ndim_clip": (lambda: mfx.mask_by_ndim(clip(), 2), False),
    "partition": (lambda: mfx.partition({"a": mom(), "b": mfx.scale_by_adam()}, lambda k, t: "a"), True),
    "partition_with_clip": (lambda: mfx.partition({"a": mom(), "b": clip()}, lambda k, t: "a"), False),
    # wrappers
    "accumulate": (lambda: mfx.accumulate(mom(), 2), True),
    "accumulate_clip": (lambda: mfx.accumulate(clip(), 2), False),
    "inject_hyperparams": (lambda: mfx.inject_hyperparams(mfx.adamw)(lr=schedules.linear(1e-3, 0.0, 5)), True),
    "inject_hyperparams_clip": (lambda: mfx.inject_hyperparams(mfx.clip_by_global_norm)(max_norm=1.0), False),
    "apply_if_finite": (lambda: mfx.apply_if_finite(mom()), False),  # one finite check over every leaf
    "lr_multiplier": (lambda: lr_multiplier(mfx.muon())(lr=0.5), True),
    "lr_multiplier_clip": (lambda: lr_multiplier(clip())(lr=0.5), False),
    # presets
    "muon": (mfx.muon, True),
    "adamw": (mfx.adamw, True),
    "muon_adamw": (mfx.muon_adamw, True),
    # recipes
    "moonlight": (mfx.moonlight, True),
    "moonlight_eps_before_bias_correction": (lambda: mfx.moonlight(adamw_eps_before_bias_correction=True), True),
    "normuon": (mfx.normuon, True),
    "cautious_decay": (lambda: mfx.cautious_decay(0.1), True),
    "cautious_decay_mask": (lambda: mfx.cautious_decay(0.1, mask=lambda k, t: t.ndim >= 2), True),
    "muon_cautious": (mfx.muon_cautious, True),
    "muon_with_momentum_warmup": (mfx.muon_with_momentum_warmup, True),
    "blockwise": (lambda: mfx.blockwise(mom(), 2), True),
    "blockwise_clip": (lambda: mfx.blockwise(clip(), 2), False),
    "split_newton_schulz": (lambda: mfx.split_newton_schulz(2), True),
    "muon_per_head": (lambda: mfx.muon_per_head(2), True),
    "optax_muon": (mfx.optax_muon, True),
    "modded_nanogpt_normuon": (mfx.modded_nanogpt_normuon, True),
    "fsdp_muon": (lambda: mfx.presets.fsdp_muon(gradient_accumulation_steps=2), True),
    # the catalogue
    "scale_by_lion": (mfx.scale_by_lion, True),
    "scale_by_adopt": (mfx.scale_by_adopt, True),
    "scale_by_laprop": (mfx.scale_by_laprop, True),
    "cautious": (lambda: mfx.cautious(mfx.scale_by_adam()), True),
    "mars_correction": (lambda: mfx.mars_correction(0.1, 0.9, max_norm=1.0), True),
    "schedule_free": (lambda: mfx.schedule_free(mfx.scale_by_learning_rate(0.1)), False),
    "scale_by_dion2": (lambda: mfx.scale_by_dion2(0.5, ns_dtype=torch.float32), True),
    "scale_by_soap": (lambda: mfx.scale_by_soap(precondition_frequency=1), True),
}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_declared_leafwise_or_not(name):
    build_tx, expected = DECLARED[name]
    tx = build_tx()
    assert mfx.is_leafwise(tx) is expected
    assert isinstance(tx, mfx.GradientTransformation)


# ---------------------------------------------------------------------------
# the presets: a split of the tree computes what the whole tree computes
# ---------------------------------------------------------------------------


def _tree() -> TensorDict:
    """A small model-like tree: an embedding, a 2-D and a 3-D (expert stack) matrix, a
    conv weight, two 1-D params and a head."""
    g = torch.Generator().manual_seed(0)
    shapes = {("embed", "weight"): (10, 8), ("layers", "0", "w"): (8, 8), ("layers", "0", "b"): (8,),
              ("layers", "1", "experts"): (3, 8, 6), ("layers", "1", "norm"): (8,),
              ("conv",): (4, 2, 3, 3), ("head", "weight"): (5, 8)}
    return build(list(shapes), [torch.randn(s, generator=g) for s in shapes.values()])


def _keys(td: TensorDict) -> list[Key]:
    return [k if isinstance(k, tuple) else (k,) for k in td.keys(include_nested=True, leaves_only=True)]


def _sub(td: TensorDict, ks: list[Key]) -> TensorDict:
    return build(ks, [td.get(k) for k in ks])


PRESETS: dict[str, tuple[Callable[[], mfx.GradientTransformation], bool]] = {
    # name -> (builder, matrices only)
    "muon": (lambda: mfx.muon(weight_decay=0.1, ns_dtype=torch.float32), True),
    "adamw": (lambda: mfx.adamw(weight_decay=0.1), False),
    "muon_adamw": (lambda: mfx.muon_adamw(weight_decay=0.1, ns_dtype=torch.float32), False),
    "normuon": (lambda: mfx.normuon(weight_decay=0.1, ns_dtype=torch.float32), True),
    "lion": (lambda: mfx.lion(weight_decay=0.1), False),
    "adopt": (lambda: mfx.adopt(weight_decay=0.1), False),
    "laprop": (lambda: mfx.laprop(weight_decay=0.1), False),
    "cautious_adamw": (lambda: mfx.cautious_adamw(weight_decay=0.1), False),
    "mars_adamw": (lambda: mfx.mars_adamw(weight_decay=0.1), False),
    "mars_muon": (lambda: mfx.mars_muon(weight_decay=0.1, ns_dtype=torch.float32), True),
    "dion2": (lambda: mfx.dion2(ns_dtype=torch.float32), True),
    "soap": (lambda: mfx.soap(precondition_frequency=2), False),
}


def _split_vs_whole(tx: mfx.GradientTransformation, params: TensorDict, steps: int = 3) -> float:
    """The largest difference between the updates of ``tx`` on the whole tree and of
    ``tx`` run as the adapter runs a leafwise group in pieces: each piece updated with its
    share of the state (restrict) and merged back (merge); ``inf`` if the merged state
    differs from the whole tree's by more than 1e-6 (or in a scalar). Two splittings:
    halves, and one leaf at a time."""
    keys = _keys(params)
    splits = [[keys[: len(keys) // 2], keys[len(keys) // 2:]], [[k] for k in keys]]
    gen = torch.Generator().manual_seed(1)
    grads = [params.apply(lambda t: torch.randn(t.shape, generator=gen)) for _ in range(steps)]
    worst = 0.0
    for pieces in splits:
        whole = split = tx.init(params)
        for g in grads:
            out, whole = tx.update(g, whole, params)
            merged = split
            for ks in pieces:
                o, s = tx.update(_sub(g, ks), restrict(split, set(ks)), _sub(params, ks))
                worst = max([worst] + [(o.get(k) - out.get(k)).abs().max().item() for k in ks])
                merged = merge(merged, s)
            split = merged
            if _tree_diff(split, whole, "state", "close", 0.0, 1e-6) is not None:  # scalars included
                return float("inf")
    return worst


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_split_equals_whole(name):
    build_tx, matrices_only = PRESETS[name]
    tx = build_tx()
    assert mfx.is_leafwise(tx)
    params = _tree()
    if matrices_only:
        params = _sub(params, [k for k in _keys(params) if params.get(k).ndim >= 2])
    assert _split_vs_whole(tx, params) <= 1e-6


def test_split_vs_whole_sees_a_global_transform():
    """The check above is not vacuous: a global clip in front of AdamW splits differently."""
    assert _split_vs_whole(mfx.chain(mfx.clip_by_global_norm(1.0), mfx.adamw()), _tree()) > 1e-3


def test_blockwise_state_splits_with_its_leaf():
    """blockwise keeps its blocks' state under the leaf's key (``(*key, "block<i>")``):
    restrict keeps it with the leaf, so a stateful inner transform splits too."""
    tx = mfx.blockwise(mfx.momentum(0.9), 2)
    params = TensorDict({"a": torch.randn(4, 3), "b": torch.randn(4, 3)}, [])
    state = tx.init(params)
    sub = restrict(state, {("a",)})
    assert sorted(sub.mu.keys(True, True)) == [("a", "block0"), ("a", "block1")]
    assert check_transform(mfx.blockwise(mfx.momentum(0.9), 1), laws=["leafwise"],
                           params=params_and_grads(min_ndim=2, max_ndim=3), **FAST)["leafwise"] == "ok"


# ---------------------------------------------------------------------------
# inject_hyperparams decides on its initial values and holds to it
# ---------------------------------------------------------------------------


def _clipped_above(threshold: float = 0.0, lr: float = 0.1) -> mfx.GradientTransformation:
    """Plain scaling, or scaling followed by a global clip when ``threshold > 0``."""
    scaled = mfx.scale(-lr)
    return mfx.chain(mfx.clip_by_global_norm(threshold), scaled) if threshold > 0 else scaled


def test_inject_hyperparams_refuses_a_declaration_that_changes():
    tx = mfx.inject_hyperparams(_clipped_above)(threshold=0.0)
    assert mfx.is_leafwise(tx)
    g = TensorDict({"w": torch.ones(3)}, [])
    state = tx.init(g)
    _, state = tx.update(g, state)
    state.hyperparams["threshold"] = 1.0  # the factory now builds a global transform
    with pytest.raises(ValueError, match=r"leafwise .*static_args"):
        tx.update(g, state)
    # built from a clipping start, it is not declared, and a later value changes nothing
    tx = mfx.inject_hyperparams(_clipped_above)(threshold=1.0)
    assert not mfx.is_leafwise(tx)
    state = tx.init(g)
    state.hyperparams["threshold"] = 0.0
    tx.update(g, state)


def test_inject_hyperparams_with_refused_initial_values_declares_nothing():
    tx = mfx.inject_hyperparams(mfx.muon)(momentum=lambda step: float("nan"))
    assert not mfx.is_leafwise(tx)
    with pytest.raises(ValueError, match="'momentum' is nan at step 0"):
        tx.init(TensorDict({"w": torch.ones(2, 2)}, []))


# ---------------------------------------------------------------------------
# the conformance law
# ---------------------------------------------------------------------------

# at least two leaves, every gradient entry >= 10 in size: clipping to 1.0 always triggers
BIG_GRADS = params_and_grads(min_leaves=2, dtypes=(torch.float32,)).map(
    lambda pg: (pg[0], pg[1].apply(lambda t: t.sign() * 10.0 + t + (t == 0) * 10.0)))


def test_the_law_catches_a_false_declaration():
    with pytest.raises(ConformanceError) as info:
        check_transform(mfx.leafwise(mfx.clip_by_global_norm(1.0)), params=BIG_GRADS, **FAST)
    err = info.value
    assert err.law == "leafwise", str(err)
    assert err.report["leafwise"] == "FAILED"
    assert all(v == "ok" or v.startswith("skipped") for k, v in err.report.items() if k != "leafwise")
    msg = str(err)
    assert msg.startswith("law 'leafwise' broken") and "declared leafwise" in msg
    assert "alone tx gave other updates than on the whole tree" in msg
    params, _ = err.example
    assert len(list(params.keys(True, True))) >= 2


def test_the_law_catches_state_that_depends_on_other_leaves():
    """A counter of leaves kept in the state: the updates are leafwise, the state is not."""

    def counts_leaves():
        def update(u, s, p=None):
            return u, s + len(list(u.keys(True, True)))
        return mfx.leafwise(mfx.GradientTransformation(lambda p: 0, update))

    with pytest.raises(ConformanceError) as info:
        check_transform(counts_leaves(), laws=["leafwise"], **FAST)
    assert info.value.law == "leafwise"
    assert "another state than on the whole tree" in str(info.value)


def test_honest_declarations_pass_and_undeclared_are_skipped():
    def sign_descent(lr):
        return mfx.leafwise(mfx.GradientTransformation(
            lambda p: mfx.EmptyState(), lambda u, s, p=None: (u.apply(lambda t: -lr * torch.sign(t)), s)))

    for tx in (sign_descent(0.1), mfx.adamw(), mfx.accumulate(mfx.momentum(0.9), 2)):
        assert check_transform(tx, laws=["leafwise"], params=BIG_GRADS, **FAST)["leafwise"] == "ok"
    # not declared: skipped, also when asked for by name
    report = check_transform(mfx.clip_by_global_norm(1.0), laws=["leafwise"], params=BIG_GRADS, **FAST)
    assert report["leafwise"] == "skipped: not declared leafwise"
    assert check_transform(mfx.scale(2.0), laws=["purity"], **FAST)["leafwise"] == "skipped: not requested"
