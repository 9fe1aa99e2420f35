"""The transforms, one small module per family."""

from .adam import ScaleByAdamState, scale_by_adam
from .clipping import clip_by_global_norm, global_norm
from .decay import cautious_decay, decoupled_decay
from .momentum import BiasCorrectedMomentumState, MomentumState, bias_corrected_momentum, momentum, nesterov
from .orthogonalize import newton_schulz
from .qk import QKLayout, qk_clip
from .rows import RowNormalizeState, row_normalize
from .scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_shape, shape_factor

__all__ = ["ScaleByAdamState", "scale_by_adam", "clip_by_global_norm", "global_norm",
           "decoupled_decay", "cautious_decay", "MomentumState", "momentum", "nesterov", "BiasCorrectedMomentumState",
           "bias_corrected_momentum", "newton_schulz", "QKLayout", "qk_clip", "row_normalize", "RowNormalizeState",
           "ScaleByScheduleState", "scale", "scale_by_learning_rate", "scale_by_shape", "shape_factor"]
