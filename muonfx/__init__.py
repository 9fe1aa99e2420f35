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
    **dict.fromkeys(["EmptyState", "GradientTransformation", "apply_updates", "identity", "is_leafwise", "leafwise"],
                    ".core"),
    **dict.fromkeys(["MaskedState", "PartitionState", "chain", "mask_by_ndim", "masked", "named_chain", "partition"],
                    ".combine"),
    "FSDPMuonOptimizer": ".distributed.fsdp",
    **dict.fromkeys(["MeaningChangedWarning", "MuonOptimizer", "create_hybrid_optimizer"], ".familiar"),
    **dict.fromkeys(["TransformOptimizer", "lr_multiplier"], ".optim"),
    "MuonOptions": ".options",
    **dict.fromkeys(["adamw", "default_muon_labels", "muon", "muon_adamw"], ".presets"),
    **dict.fromkeys(["blockwise", "cautious_decay", "momentum_warmup", "moonlight", "muon_cautious", "muon_per_head",
                     "modded_nanogpt_normuon", "muon_with_momentum_warmup", "normuon", "optax_muon",
                     "split_newton_schulz"], ".recipes"),
    **dict.fromkeys(["BiasCorrectedMomentumState", "MomentumState", "RowNormalizeState", "bias_corrected_momentum",
                     "ScaleByAdamState", "ScaleByScheduleState", "clip_by_global_norm", "decoupled_decay",
                     "global_norm", "momentum", "nesterov", "newton_schulz", "row_normalize", "scale",
                     "scale_by_adam", "scale_by_learning_rate", "scale_by_shape"], ".transforms"),
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
    from .core import EmptyState, GradientTransformation, apply_updates, identity, is_leafwise, leafwise
    from .combine import MaskedState, PartitionState, chain, mask_by_ndim, masked, named_chain, partition
    from .distributed.fsdp import FSDPMuonOptimizer
    from .familiar import MeaningChangedWarning, MuonOptimizer, create_hybrid_optimizer
    from .optim import TransformOptimizer, lr_multiplier
    from .options import MuonOptions
    from .presets import adamw, default_muon_labels, muon, muon_adamw
    from .recipes import (blockwise, cautious_decay, momentum_warmup, moonlight, muon_cautious, muon_per_head,
                          modded_nanogpt_normuon, muon_with_momentum_warmup, normuon, optax_muon,
                          split_newton_schulz)
    from .transforms import (BiasCorrectedMomentumState, MomentumState, RowNormalizeState, ScaleByAdamState,
                             ScaleByScheduleState, bias_corrected_momentum, clip_by_global_norm, decoupled_decay,
                             global_norm, momentum, nesterov, newton_schulz, row_normalize, scale, scale_by_adam,
                             scale_by_learning_rate, scale_by_shape)
    from .wrappers import (AccumulateState, ApplyIfFiniteState, InjectHyperparamsState, accumulate,
                           apply_if_finite, inject_hyperparams)
