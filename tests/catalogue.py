"""The one catalogue of public transforms, combinators, wrappers and presets that the shared
laws run over.

Each entry is one configuration of a public builder: how to build it, which leaves it
takes (``ANY`` or ``MATRIX``: 2-D and more), and which shared laws run over it (``laws``):

=================  ==========================================================================
``CONFORMANCE``    ``check_transform``'s laws (``test_conformance.py``; also compiled in
                   ``test_compile.py``); ``check`` holds extra ``check_transform`` options
``PURITY``         ``update`` mutates nothing and is deterministic (``test_laws.py``)
``ELEMENTWISE``    runs on any leaf, elementwise or a global reduction: sharding, chaining and
                   masking laws (``test_laws.py``)
``ZERO``           a zero gradient gives a zero update (``test_laws.py``)
``EMPTY``          leaves with a zero-sized side pass through (``test_laws.py``)
``DECLARED``       declared leafwise or not, as ``leafwise`` says (``test_leafwise.py``)
``SPLIT``          a split of the tree computes what the whole tree computes (``test_leafwise.py``)
``STATEFUL``       state of several kinds: compiled by inductor, trains as eager (``test_compile.py``)
``ADAPTER``        the adapter's step equals the functional loop, alone and in random chains
                   (``test_step_plan.py``)
``REFUSES``        a gradient of another shape, dtype or device is refused (``test_bad_input.py``)
``LAYOUTS``        sparse and complex gradients are refused (``test_bad_input.py``)
=================  ==========================================================================

A new public transform or preset is one line here (``DEFAULT`` laws: conformance, purity,
and its leafwise declaration)::

    "my_transform": Entry(lambda: mfx.my_transform(0.1), leafwise=True),

``test_catalogue.py`` fails when a public builder of ``muonfx.__all__`` has no entry
(an entry's ``covers`` names the builders it exercises besides the one its name names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import muonfx as mfx
from muonfx import schedules
from muonfx.optim.groups import lr_multiplier
from muonfx.testing import params_and_grads

ANY, MATRIX = "any", "matrix"
CONFORMANCE, PURITY, ELEMENTWISE, ZERO, EMPTY = "conformance", "purity", "elementwise", "zero", "empty"
DECLARED, SPLIT, STATEFUL, ADAPTER = "declared", "split", "stateful", "adapter"
REFUSES, LAYOUTS = "refuses", "layouts"
DEFAULT = frozenset({CONFORMANCE, PURITY, DECLARED})

MATRIX_DIMS = {2, 3, 4}
MATRICES_2D_3D = dict(params=params_and_grads(min_ndim=2, max_ndim=3))


@dataclass(frozen=True)
class Entry:
    """One configuration of a public builder (module doc)."""

    build: Callable[[], mfx.GradientTransformation]
    kind: str = ANY
    laws: frozenset = DEFAULT
    leafwise: bool | None = None  # what is_leafwise says (the DECLARED law)
    check: dict[str, Any] = field(default_factory=dict)
    covers: tuple[str, ...] = ()


def E(build: Callable[[], mfx.GradientTransformation], kind: str = ANY, *laws: str, leafwise: bool | None = None,
      check: dict[str, Any] | None = None, covers: tuple[str, ...] = ()) -> Entry:
    """An entry in one line: ``E(build, kind, *laws)`` (no laws: ``DEFAULT``)."""
    return Entry(build, kind, frozenset(laws) or DEFAULT, leafwise, dict(check or {}), covers)


ZGE = dict(zero_grad_exact=True)
clip = lambda: mfx.clip_by_global_norm(1.0)  # noqa: E731  the one global transform
mom = lambda: mfx.momentum(0.9)  # noqa: E731

CATALOGUE: dict[str, Entry] = {
    # core and transforms
    "identity": E(mfx.identity, ANY, CONFORMANCE, PURITY, DECLARED, leafwise=True, check=ZGE),
    "leafwise": E(lambda: mfx.leafwise(mfx.chain(mom(), mfx.scale(-0.1))), ANY, DECLARED, leafwise=True),
    "momentum": E(mom, ANY, LAYOUTS, REFUSES, ADAPTER, CONFORMANCE, PURITY, ELEMENTWISE, ZERO, DECLARED, leafwise=True, check=ZGE),
    "momentum_nesterov": E(lambda: mfx.momentum(0.9, nesterov=True), ANY, PURITY),
    "momentum_mu_bf16": E(lambda: mfx.momentum(0.9, mu_dtype=torch.bfloat16), ANY, PURITY),
    "momentum_nesterov_bf16_mu": E(lambda: mfx.momentum(0.9, nesterov=True, mu_dtype=torch.bfloat16), ANY,
                                   CONFORMANCE, STATEFUL),
    "nesterov": E(lambda: mfx.nesterov(0.95), ANY, CONFORMANCE, PURITY, DECLARED, leafwise=True, check=ZGE),
    "nesterov_0.8": E(lambda: mfx.nesterov(0.8), ANY, ELEMENTWISE),
    "nesterov_0.9": E(lambda: mfx.nesterov(0.9), ANY, ZERO),
    "momentum_nesterov_0.8": E(lambda: mfx.momentum(0.8, nesterov=True), ANY, ADAPTER),
    "bias_corrected_momentum": E(mfx.bias_corrected_momentum, ANY, DECLARED, leafwise=True),
    "newton_schulz": E(mfx.newton_schulz, MATRIX, CONFORMANCE, PURITY, ZERO, EMPTY, DECLARED, leafwise=True,
                       check=ZGE),
    "newton_schulz_polar_express": E(lambda: mfx.newton_schulz(coefficients="polar_express"), MATRIX, PURITY),
    "newton_schulz_polar_express_gram": E(lambda: mfx.newton_schulz(coefficients="polar_express", method="auto"),
                                          MATRIX, CONFORMANCE),
    "newton_schulz_transposed_conv": E(lambda: mfx.newton_schulz(dims=lambda k, t: mfx.MatrixView(
        tuple(range(1, t.ndim)), 0) if t.ndim == 4 else None), MATRIX, CONFORMANCE),
    "newton_schulz_float32": E(lambda: mfx.newton_schulz(dtype=torch.float32), MATRIX, ADAPTER),
    "ns_float32_masked_2_3": E(lambda: mfx.mask_by_ndim(mfx.newton_schulz(dtype=torch.float32), {2, 3}), ANY,
                               ADAPTER),
    "ns_masked": E(lambda: mfx.mask_by_ndim(mfx.newton_schulz(), MATRIX_DIMS), ANY, PURITY, ELEMENTWISE),
    "row_normalize": E(lambda: mfx.chain(mfx.newton_schulz(), mfx.row_normalize(0.95)), MATRIX, CONFORMANCE),
    "row_normalize_alone": E(mfx.row_normalize, MATRIX, ADAPTER, DECLARED, leafwise=True),
    "scale_by_shape": E(lambda: mfx.scale_by_shape("spectral"), MATRIX, CONFORMANCE, PURITY, EMPTY, check=ZGE),
    "scale_by_shape_default": E(mfx.scale_by_shape, MATRIX, DECLARED, leafwise=True),
    "scale_by_shape_original": E(lambda: mfx.scale_by_shape("original"), MATRIX, ADAPTER, PURITY, EMPTY),
    "scale_by_shape_rms": E(lambda: mfx.scale_by_shape("match_rms_adamw"), MATRIX, PURITY),
    "decoupled_decay": E(lambda: mfx.decoupled_decay(0.1), ANY, REFUSES, ADAPTER, CONFORMANCE, PURITY, ELEMENTWISE, DECLARED,
                         leafwise=True),
    "decoupled_decay_mask": E(lambda: mfx.decoupled_decay(0.1, mask=lambda k, t: t.ndim >= 2), ANY, PURITY,
                              DECLARED, leafwise=True),
    "scale": E(lambda: mfx.scale(-0.5), ANY, ADAPTER, CONFORMANCE, check=ZGE),
    "scale_0.5": E(lambda: mfx.scale(0.5), ANY, PURITY),
    "scale_-2": E(lambda: mfx.scale(-2.0), ANY, ELEMENTWISE),
    "scale_2": E(lambda: mfx.scale(2.0), ANY, DECLARED, leafwise=True),
    "scale_by_learning_rate": E(lambda: mfx.scale_by_learning_rate(0.1), ANY, ADAPTER, CONFORMANCE, PURITY, DECLARED,
                                leafwise=True),
    "scale_by_learning_rate_schedule": E(lambda: mfx.scale_by_learning_rate(
        schedules.warmup_cosine_decay(0.0, 1.0, 1, 4)), ANY, CONFORMANCE, PURITY),
    "scale_by_learning_rate_linear": E(lambda: mfx.scale_by_learning_rate(schedules.linear(1.0, 0.0, 3)), ANY,
                                       DECLARED, leafwise=True),
    "scheduled_lr": E(lambda: mfx.scale_by_learning_rate(schedules.linear(0.1, 0.01, 5)), ANY, ADAPTER),
    "lr_schedule": E(lambda: mfx.scale_by_learning_rate(schedules.linear(1.0, 0.25, 2)), ANY, ELEMENTWISE),
    "scale_by_adam": E(mfx.scale_by_adam, ANY, ADAPTER, CONFORMANCE, PURITY, ELEMENTWISE, ZERO, DECLARED, STATEFUL,
                       leafwise=True, check=ZGE),
    "scale_by_adam_mu_f32": E(lambda: mfx.scale_by_adam(mu_dtype=torch.float32), ANY, PURITY),
    "scale_by_adam_amsgrad": E(lambda: mfx.scale_by_adam(amsgrad=True, maximize=True), ANY, CONFORMANCE, PURITY,
                               check=ZGE),
    "scale_by_adam_amsgrad_mu_f32": E(lambda: mfx.scale_by_adam(mu_dtype=torch.float32, amsgrad=True), ANY, PURITY),
    # its statistics arrive as an extra argument of the step: its own laws are muonfx.testing.check_qk_clip
    "qk_clip": E(lambda: mfx.qk_clip(100.0, 0.5, {}), ANY, DECLARED, leafwise=True),
    "adamw_amsgrad_maximize": E(lambda: mfx.adamw(weight_decay=0.0, amsgrad=True, maximize=True), ANY, EMPTY),
    "clip_by_global_norm": E(lambda: mfx.clip_by_global_norm(0.5), ANY, CONFORMANCE, PURITY, ELEMENTWISE, EMPTY,
                             check=ZGE, covers=("global_norm",)),
    "clip_by_global_norm_1": E(clip, ANY, ADAPTER, ZERO, DECLARED, leafwise=False),  # one norm over every leaf
    # combinators
    "chain": E(lambda: mfx.chain(mfx.momentum(0.9), mfx.decoupled_decay(0.1), mfx.scale_by_learning_rate(0.1)),
               ANY, CONFORMANCE, PURITY, DECLARED, leafwise=True),
    "chain_clip_adam": E(lambda: mfx.chain(mfx.clip_by_global_norm(1.0), mfx.scale_by_adam()), ANY, LAYOUTS),
    "chain_empty": E(mfx.chain, ANY, DECLARED, leafwise=True),
    "chain_with_clip": E(lambda: mfx.chain(clip(), mom()), ANY, DECLARED, leafwise=False),
    "named_chain": E(lambda: mfx.named_chain(("adam", mfx.scale_by_adam()), ("clip", mfx.clip_by_global_norm(1.0))),
                     ANY, CONFORMANCE, PURITY),
    "named_chain_leafwise": E(lambda: mfx.named_chain(("m", mom()), ("lr", mfx.scale(-0.1))), ANY, DECLARED,
                              leafwise=True),
    "named_chain_with_clip": E(lambda: mfx.named_chain(("m", mom()), ("clip", clip())), ANY, DECLARED,
                               leafwise=False),
    "masked": E(lambda: mfx.masked(mfx.scale_by_adam(), lambda k, t: t.ndim % 2 == 0), ANY, CONFORMANCE, PURITY),
    "masked_momentum": E(lambda: mfx.masked(mom(), lambda k, t: t.ndim == 2), ANY, DECLARED, leafwise=True),
    "masked_clip": E(lambda: mfx.masked(clip(), lambda k, t: t.ndim == 2), ANY, DECLARED, leafwise=False),
    "mask_by_ndim": E(lambda: mfx.mask_by_ndim(mfx.muon(), MATRIX_DIMS), ANY, CONFORMANCE),
    "mask_by_ndim_2_3": E(lambda: mfx.mask_by_ndim(mfx.newton_schulz(), {2, 3}), ANY, DECLARED, leafwise=True),
    "mask_by_ndim_clip": E(lambda: mfx.mask_by_ndim(clip(), 2), ANY, DECLARED, leafwise=False),
    "partition": E(lambda: mfx.partition({"m": mfx.momentum(0.9), "a": mfx.scale_by_adam(),
                                          "c": mfx.clip_by_global_norm(1.0)}, lambda k, t: "mac"[t.ndim % 3]),
                   ANY, CONFORMANCE, PURITY, EMPTY, STATEFUL),
    "partition_leafwise": E(lambda: mfx.partition({"a": mom(), "b": mfx.scale_by_adam()}, lambda k, t: "a"), ANY,
                            DECLARED, leafwise=True),
    "partition_with_clip": E(lambda: mfx.partition({"a": mom(), "b": clip()}, lambda k, t: "a"), ANY, DECLARED,
                             leafwise=False),
    "blockwise": E(lambda: mfx.blockwise(mfx.scale_by_shape("match_rms_adamw"), 1), MATRIX, CONFORMANCE,
                   check=MATRICES_2D_3D),  # 2-D and 3-D only: see test_blockwise_on_4d_leaves
    # state kept per block (keyed under the parameter's key): the checkpoint law saves it
    "blockwise_stateful": E(lambda: mfx.blockwise(mfx.chain(mfx.scale_by_adam(), mfx.momentum(0.9)), 1), MATRIX,
                            CONFORMANCE, STATEFUL, check=MATRICES_2D_3D),
    "blockwise_momentum": E(lambda: mfx.blockwise(mom(), 2), MATRIX, DECLARED, leafwise=True),
    "blockwise_clip": E(lambda: mfx.blockwise(clip(), 2), MATRIX, DECLARED, leafwise=False),
    # wrappers
    "apply_if_finite": E(lambda: mfx.apply_if_finite(mfx.adamw()), ANY, CONFORMANCE, LAYOUTS),
    "apply_if_finite_adam": E(lambda: mfx.apply_if_finite(mfx.scale_by_adam()), ANY, ADAPTER),
    "apply_if_finite_momentum": E(lambda: mfx.apply_if_finite(mom()), ANY, PURITY, DECLARED,
                                  leafwise=False),  # one finite check over every leaf
    # inner updates are all inf: step 0 takes the skip branch, step 1 (2 > 1 consecutive) lets it through
    "apply_if_finite_skip": E(lambda: mfx.apply_if_finite(mfx.chain(mfx.momentum(0.9), mfx.scale(math.inf)),
                                                          max_consecutive_errors=1), ANY, PURITY),
    "accumulate_1": E(lambda: mfx.accumulate(mfx.scale_by_adam(), 1), ANY, PURITY),
    "accumulate_2": E(lambda: mfx.accumulate(mfx.momentum(0.9), 2), ANY, ADAPTER, CONFORMANCE, PURITY, EMPTY, DECLARED,
                      STATEFUL, leafwise=True, covers=("accumulate",)),
    "accumulate_adamw": E(lambda: mfx.accumulate(mfx.adamw(), 2), ANY, REFUSES, LAYOUTS),
    "accumulate_clip": E(lambda: mfx.accumulate(clip(), 2), ANY, DECLARED, leafwise=False),
    "inject_hyperparams": E(lambda: mfx.inject_hyperparams(mfx.adamw)(lr=schedules.linear(1e-3, 1e-4, 3),
                                                                      weight_decay=0.1),
                            ANY, CONFORMANCE, PURITY, DECLARED, STATEFUL, leafwise=True),
    "inject_adamw_constant": E(lambda: mfx.inject_hyperparams(mfx.adamw)(lr=1e-3), ANY, LAYOUTS),
    "inject_momentum": E(lambda: mfx.inject_hyperparams(mfx.momentum)(beta=0.9), ANY, PURITY),
    "inject_muon": E(lambda: mfx.inject_hyperparams(mfx.muon)(lr=0.02, momentum=0.9), MATRIX, PURITY),
    "inject_hyperparams_clip": E(lambda: mfx.inject_hyperparams(mfx.clip_by_global_norm)(max_norm=1.0), ANY,
                                 DECLARED, leafwise=False),
    "lr_multiplier": E(lambda: lr_multiplier(mfx.muon())(lr=0.5), MATRIX, DECLARED, leafwise=True),
    "lr_multiplier_clip": E(lambda: lr_multiplier(clip())(lr=0.5), ANY, DECLARED, leafwise=False),
    # presets
    "muon": E(lambda: mfx.muon(weight_decay=0.1), MATRIX, CONFORMANCE, PURITY, EMPTY, DECLARED, leafwise=True),
    "muon_no_decay": E(mfx.muon, MATRIX, ZERO),
    "muon_float32": E(lambda: mfx.muon(weight_decay=0.1, ns_dtype=torch.float32), MATRIX, SPLIT),
    "muon_float32_no_decay": E(lambda: mfx.muon(ns_dtype=torch.float32), MATRIX, ADAPTER),
    "muon_masked_2": E(lambda: mfx.mask_by_ndim(mfx.muon(), 2), ANY, REFUSES),
    "muon_masked": E(lambda: mfx.mask_by_ndim(mfx.muon(), MATRIX_DIMS), ANY, PURITY),
    "muon_polar_express": E(lambda: mfx.muon(ns_coefficients="polar_express", adjust_lr="spectral"), MATRIX, ZERO),
    "muon_polar_express_rms": E(lambda: mfx.muon(ns_coefficients="polar_express", adjust_lr="match_rms_adamw",
                                                 nesterov=False), MATRIX, PURITY),
    "adamw": E(mfx.adamw, ANY, LAYOUTS, REFUSES, CONFORMANCE, PURITY, EMPTY, DECLARED, STATEFUL, leafwise=True),
    "adamw_no_decay": E(lambda: mfx.adamw(weight_decay=0.0), ANY, ZERO),
    "adamw_decay": E(lambda: mfx.adamw(weight_decay=0.1), ANY, ADAPTER, SPLIT),
    "muon_adamw": E(lambda: mfx.muon_adamw(weight_decay=0.1), ANY, CONFORMANCE, PURITY, EMPTY, DECLARED, STATEFUL,
                    leafwise=True),
    "muon_adamw_default": E(mfx.muon_adamw, ANY, REFUSES, LAYOUTS),
    "muon_adamw_no_decay": E(lambda: mfx.muon_adamw(adamw_weight_decay=0.0), ANY, ZERO),
    "muon_adamw_float32": E(lambda: mfx.muon_adamw(weight_decay=0.1, ns_dtype=torch.float32), ANY, ADAPTER, SPLIT),
    "moonlight": E(mfx.moonlight, ANY, CONFORMANCE, DECLARED, leafwise=True),
    "moonlight_eps_before_bias_correction": E(lambda: mfx.moonlight(adamw_eps_before_bias_correction=True), ANY,
                                              DECLARED, leafwise=True),
    "normuon": E(mfx.normuon, MATRIX, CONFORMANCE, DECLARED, STATEFUL, leafwise=True),
    "normuon_float32": E(lambda: mfx.normuon(weight_decay=0.1, ns_dtype=torch.float32), MATRIX, SPLIT),
    # bias_corrected_momentum and scale_by_adam(nesterov=True) run inside optax_muon,
    # row_normalize(axis="larger") inside modded_nanogpt_normuon
    "optax_muon": E(lambda: mfx.optax_muon(weight_decay=0.1, adam_weight_decay=0.1), ANY, CONFORMANCE, DECLARED,
                    leafwise=True),
    "modded_nanogpt_normuon": E(lambda: mfx.modded_nanogpt_normuon(weight_decay=0.1), MATRIX, CONFORMANCE,
                                DECLARED, STATEFUL, leafwise=True),
    "cautious_decay": E(lambda: mfx.cautious_decay(0.1), ANY, REFUSES, CONFORMANCE, DECLARED, leafwise=True),
    "cautious_decay_mask": E(lambda: mfx.cautious_decay(0.1, mask=lambda k, t: t.ndim >= 2), ANY, DECLARED,
                             leafwise=True),
    "muon_cautious": E(mfx.muon_cautious, MATRIX, CONFORMANCE, DECLARED, leafwise=True),
    "momentum_warmup": E(lambda: mfx.scale_by_learning_rate(mfx.momentum_warmup(steps=3)), ANY, CONFORMANCE),
    "muon_with_momentum_warmup": E(lambda: mfx.muon_with_momentum_warmup(warmup_steps=3), MATRIX, CONFORMANCE,
                                   DECLARED, leafwise=True),
    "split_newton_schulz": E(lambda: mfx.split_newton_schulz(1, dim=1), MATRIX, CONFORMANCE, check=MATRICES_2D_3D),
    "split_newton_schulz_2": E(lambda: mfx.split_newton_schulz(2), MATRIX, DECLARED, leafwise=True),
    "muon_per_head": E(lambda: mfx.muon_per_head(1, qkv_pattern=r"^[a-m]"), MATRIX, CONFORMANCE,
                       check=MATRICES_2D_3D),
    "muon_per_head_2": E(lambda: mfx.muon_per_head(2), MATRIX, DECLARED, leafwise=True),
    "fsdp_muon": E(lambda: mfx.presets.fsdp_muon(gradient_accumulation_steps=2), MATRIX, DECLARED, leafwise=True),
    # the catalogue of optimizers after Muon (tests/test_optimizer_catalogue.py has their parity tests)
    "scale_by_lion": E(mfx.scale_by_lion, ANY, CONFORMANCE, PURITY, ELEMENTWISE, DECLARED, leafwise=True, check=ZGE),
    "scale_by_adopt": E(mfx.scale_by_adopt, ANY, CONFORMANCE, PURITY, ELEMENTWISE, DECLARED, leafwise=True,
                        check=ZGE),
    "scale_by_laprop": E(mfx.scale_by_laprop, ANY, CONFORMANCE, PURITY, ELEMENTWISE, DECLARED, leafwise=True,
                         check=ZGE),
    "cautious": E(lambda: mfx.cautious(mfx.scale_by_adam()), ANY, CONFORMANCE, PURITY, ELEMENTWISE, DECLARED,
                  leafwise=True, check=ZGE),
    "mars_correction": E(lambda: mfx.mars_correction(0.1, 0.9, max_norm=1.0), ANY, CONFORMANCE, PURITY, ELEMENTWISE,
                         DECLARED, leafwise=True, check=ZGE),
    "schedule_free": E(lambda: mfx.schedule_free(mfx.chain(mfx.scale_by_adam(0.0), mfx.scale_by_learning_rate(0.1))),
                       ANY, CONFORMANCE),
    "schedule_free_lr": E(lambda: mfx.schedule_free(mfx.scale_by_learning_rate(0.1)), ANY, DECLARED, leafwise=False),
    "schedule_free_muon": E(lambda: mfx.schedule_free(mfx.muon()), MATRIX, CONFORMANCE, check=MATRICES_2D_3D),
    "scale_by_dion2": E(lambda: mfx.scale_by_dion2(0.5), MATRIX, CONFORMANCE, check=MATRICES_2D_3D),
    "scale_by_dion2_float32": E(lambda: mfx.scale_by_dion2(0.5, ns_dtype=torch.float32), MATRIX, DECLARED,
                                leafwise=True),
    "scale_by_soap": E(lambda: mfx.scale_by_soap(precondition_frequency=1), ANY, CONFORMANCE, PURITY, DECLARED,
                       leafwise=True, check=ZGE),
    "lion": E(lambda: mfx.lion(weight_decay=0.1), ANY, CONFORMANCE, SPLIT, ADAPTER),
    "lion_defaults": E(mfx.lion, ANY, ZERO, REFUSES),
    "adopt": E(lambda: mfx.adopt(weight_decay=0.1, decouple=True), ANY, CONFORMANCE),
    "adopt_decay": E(lambda: mfx.adopt(weight_decay=0.1), ANY, SPLIT, ADAPTER),
    "adopt_defaults": E(mfx.adopt, ANY, ZERO, REFUSES),
    "laprop": E(lambda: mfx.laprop(weight_decay=0.1), ANY, CONFORMANCE, SPLIT, ADAPTER),
    "laprop_defaults": E(mfx.laprop, ANY, ZERO, REFUSES),
    "cautious_adamw": E(lambda: mfx.cautious_adamw(weight_decay=0.1), ANY, CONFORMANCE, SPLIT, ADAPTER),
    "cautious_adamw_defaults": E(mfx.cautious_adamw, ANY, ZERO, REFUSES),
    "mars_adamw": E(lambda: mfx.mars_adamw(weight_decay=0.1), ANY, CONFORMANCE, SPLIT, ADAPTER),
    "mars_adamw_defaults": E(mfx.mars_adamw, ANY, ZERO, REFUSES),
    "mars_muon": E(lambda: mfx.mars_muon(weight_decay=0.1), MATRIX, CONFORMANCE, check=MATRICES_2D_3D),
    "mars_muon_float32": E(lambda: mfx.mars_muon(weight_decay=0.1, ns_dtype=torch.float32), MATRIX, SPLIT),
    "schedule_free_adamw": E(lambda: mfx.schedule_free_adamw(weight_decay=0.1, warmup_steps=2), ANY, CONFORMANCE),
    "schedule_free_adamw_decay": E(lambda: mfx.schedule_free_adamw(weight_decay=0.1), ANY, ADAPTER),
    "schedule_free_adamw_defaults": E(mfx.schedule_free_adamw, ANY, ZERO, REFUSES),
    "dion2": E(lambda: mfx.dion2(weight_decay=0.1), MATRIX, CONFORMANCE, check=MATRICES_2D_3D),
    "dion2_float32": E(lambda: mfx.dion2(ns_dtype=torch.float32), MATRIX, SPLIT, ADAPTER),
    "soap": E(lambda: mfx.soap(precondition_frequency=1, max_precond_dim=3, merge_dims=True), ANY, CONFORMANCE),
    "soap_frequency_2": E(lambda: mfx.soap(precondition_frequency=2), ANY, SPLIT, ADAPTER),
    "soap_defaults": E(mfx.soap, ANY, REFUSES),
}


def select(law: str) -> dict[str, Entry]:
    """The entries a law runs over, by name."""
    return {name: e for name, e in CATALOGUE.items() if law in e.laws}


def covered() -> set[str]:
    """Every public builder some entry exercises: the entries' names and their ``covers``."""
    return set(CATALOGUE) | {c for e in CATALOGUE.values() for c in e.covers}
