"""muonfx: optax-style functional optimizer transforms for PyTorch, with Muon as the flagship.

    >>> import muonfx as mfx
    >>> tx = mfx.muon_adamw(lr=0.02, adamw_lr=1e-3)

The public names below are imported on first use (PEP 562): ``import muonfx`` itself
imports neither torch nor tensordict, so the ``muonfx`` command answers ``--help``
and bad options at once. ``mfx.muon`` (or ``from muonfx import muon``) imports what it
needs, as an eager ``import`` would.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(["EmptyState", "GradientTransformation", "MatrixView", "apply_updates", "identity", "is_leafwise",
                     "leafwise"], ".core"),
    **dict.fromkeys(["MaskedState", "PartitionState", "blockwise", "chain", "mask_by_ndim", "masked", "named_chain",
                     "partition"], ".combine"),
        "FSDPMuonOptimizer": ".optim.fsdp_optimizer",
    **dict.fromkeys(["MuonOptimizer", "create_hybrid_optimizer"], ".optim.muon_optimizer"),
    **dict.fromkeys(["TransformOptimizer", "lr_multiplier"], ".optim"),
    **dict.fromkeys(["MeaningChangedWarning", "MuonOptions"], ".presets.options"),
    **dict.fromkeys(["adamw", "default_muon_labels", "muon", "muon_adamw"], ".presets.standard"),
    **dict.fromkeys(["moonlight", "muon_cautious", "muon_per_head", "modded_nanogpt_normuon",
                     "muon_with_momentum_warmup", "normuon", "optax_muon", "split_newton_schulz"], ".presets.variants"),
    **dict.fromkeys(["adopt", "cautious_adamw", "laprop", "lion", "mars_adamw", "mars_muon", "schedule_free_adamw",
                     "dion2", "soap"], ".presets.catalogue"),
    "momentum_warmup": ".schedules",
    **dict.fromkeys(["QKLogitRecorder", "max_logits"], ".attention"),
    "QKClip": ".optim.qk_clip",
    "NoMuonError": ".optim.routing",
    **dict.fromkeys(["QKLayout", "qk_clip"], ".transforms.qk"),
    **dict.fromkeys(["BiasCorrectedMomentumState", "MomentumState", "RowNormalizeState", "bias_corrected_momentum",
                     "ScaleByAdamState", "ScaleByScheduleState", "cautious_decay", "clip_by_global_norm",
                     "decoupled_decay", "global_norm", "momentum", "nesterov", "newton_schulz", "row_normalize",
                     "scale", "scale_by_adam", "scale_by_learning_rate", "scale_by_shape"], ".transforms"),
    **dict.fromkeys(["MarsCorrectionState", "ScaleByAdoptState", "ScaleByLapropState", "ScaleByLionState", "cautious",
                     "mars_correction", "scale_by_adopt", "scale_by_laprop", "scale_by_lion", "ScheduleFreeState",
                     "schedule_free", "ScaleByDion2State", "scale_by_dion2", "ScaleBySoapState",
                     "scale_by_soap"], ".transforms"),
    **dict.fromkeys(["AccumulateState", "ApplyIfFiniteState", "InjectHyperparamsState", "accumulate",
                     "apply_if_finite", "inject_hyperparams"], ".wrappers"),
}

__all__ = [*_EXPORTS, "schedules", "linalg", "seam"]


def __getattr__(name: str):
    """Import a public name (or a submodule: ``mfx.linalg``, ``mfx.optim``, ...) on first use."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)  # binds muonfx.<name> itself
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from . import linalg, schedules, seam
    from .combine import (MaskedState, PartitionState, blockwise, chain, mask_by_ndim, masked, named_chain,
                          partition)
    from .core import EmptyState, GradientTransformation, MatrixView, apply_updates, identity, is_leafwise, leafwise
    from .optim import TransformOptimizer, lr_multiplier
    from .optim.fsdp_optimizer import FSDPMuonOptimizer
    from .optim.muon_optimizer import MuonOptimizer, create_hybrid_optimizer
    from .presets.catalogue import (adopt, cautious_adamw, dion2, laprop, lion, mars_adamw, mars_muon,
                                    schedule_free_adamw, soap)
    from .presets.options import MeaningChangedWarning, MuonOptions
    from .presets.standard import adamw, default_muon_labels, muon, muon_adamw
    from .presets.variants import (moonlight, muon_cautious, muon_per_head, modded_nanogpt_normuon,
                                   muon_with_momentum_warmup, normuon, optax_muon, split_newton_schulz)
    from .attention import QKLogitRecorder, max_logits
    from .optim.qk_clip import QKClip
    from .optim.routing import NoMuonError
    from .schedules import momentum_warmup
    from .transforms.qk import QKLayout, qk_clip
    from .transforms import (BiasCorrectedMomentumState, MomentumState, RowNormalizeState, ScaleByAdamState,
                             ScaleByScheduleState, bias_corrected_momentum, cautious_decay, clip_by_global_norm,
                             decoupled_decay, global_norm, momentum, nesterov, newton_schulz, row_normalize, scale,
                             scale_by_adam, scale_by_learning_rate, scale_by_shape)
    from .transforms import (MarsCorrectionState, ScaleByAdoptState, ScaleByLapropState, ScaleByLionState,
                             ScaleByDion2State, ScaleBySoapState, ScheduleFreeState, cautious, mars_correction,
                             scale_by_adopt, scale_by_dion2, scale_by_laprop, scale_by_lion, scale_by_soap,
                             schedule_free)
    from .wrappers import (AccumulateState, ApplyIfFiniteState, InjectHyperparamsState, accumulate,
                           apply_if_finite, inject_hyperparams)
