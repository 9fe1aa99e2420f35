"""muonfx: optax-style functional optimizer transforms for PyTorch, with Muon as the flagship.

    >>> import muonfx as mfx
    >>> tx = mfx.muon_adamw(lr=0.02, adamw_lr=1e-3)
"""

from . import linalg, schedules, seam
from .base import EmptyState, GradientTransformation, apply_updates, identity, is_leafwise, leafwise
from .combine import MaskedState, PartitionState, chain, mask_by_ndim, masked, named_chain, partition
from .distributed.fsdp import FSDPMuonOptimizer
from .familiar import MeaningChangedWarning, MuonOptimizer, create_hybrid_optimizer
from .optim import TransformOptimizer, lr_multiplier
from .options import MuonOptions
from .presets import adamw, default_muon_labels, muon, muon_adamw
from .recipes import (blockwise, cautious_decay, momentum_warmup, moonlight, muon_cautious, muon_per_head,
                      modded_nanogpt_normuon, muon_with_momentum_warmup, normuon, optax_muon, split_newton_schulz)
from .transforms import (BiasCorrectedMomentumState, MomentumState, RowNormalizeState, bias_corrected_momentum, ScaleByAdamState, ScaleByScheduleState, clip_by_global_norm,
                         decoupled_decay, global_norm, momentum, nesterov, newton_schulz, row_normalize, scale,
                         scale_by_adam, scale_by_learning_rate, scale_by_shape)
from .wrappers import (AccumulateState, ApplyIfFiniteState, InjectHyperparamsState, accumulate,
                       apply_if_finite, inject_hyperparams)

__version__ = "0.1.0"

__all__ = [
    "GradientTransformation", "EmptyState", "identity", "apply_updates", "leafwise", "is_leafwise",
    "chain", "named_chain", "masked", "mask_by_ndim", "partition", "MaskedState", "PartitionState",
    "momentum", "nesterov", "newton_schulz", "row_normalize", "RowNormalizeState", "scale_by_shape", "decoupled_decay", "scale",
    "scale_by_learning_rate", "scale_by_adam", "clip_by_global_norm", "global_norm",
    "MomentumState", "ScaleByAdamState", "ScaleByScheduleState",
    "apply_if_finite", "accumulate", "inject_hyperparams",
    "ApplyIfFiniteState", "AccumulateState", "InjectHyperparamsState",
    "muon", "adamw", "muon_adamw", "default_muon_labels", "MuonOptions",
    "moonlight", "normuon", "cautious_decay", "muon_cautious", "momentum_warmup", "muon_with_momentum_warmup",
    "blockwise", "split_newton_schulz", "muon_per_head",
    "schedules", "linalg", "seam",
    "TransformOptimizer", "lr_multiplier", "MuonOptimizer", "create_hybrid_optimizer", "FSDPMuonOptimizer",
    "MeaningChangedWarning", "optax_muon", "modded_nanogpt_normuon", "bias_corrected_momentum",
    "BiasCorrectedMomentumState",
]
