"""The transforms, one small module per family."""

from .adam import ScaleByAdamState, scale_by_adam
from .adopt import ScaleByAdoptState, scale_by_adopt
from .cautious import cautious
from .clipping import clip_by_global_norm, global_norm
from .decay import cautious_decay, decoupled_decay
from .dion2 import ScaleByDion2State, scale_by_dion2
from .laprop import ScaleByLapropState, scale_by_laprop
from .lion import ScaleByLionState, scale_by_lion
from .mars import MarsCorrectionState, mars_correction
from .momentum import BiasCorrectedMomentumState, MomentumState, bias_corrected_momentum, momentum, nesterov
from .orthogonalize import newton_schulz
from .qk import QKLayout, qk_clip
from .rows import RowNormalizeState, row_normalize
from .schedule_free import ScheduleFreeState, schedule_free
from .soap import ScaleBySoapState, scale_by_soap
from .scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_shape, shape_factor

__all__ = ["ScaleByAdamState", "scale_by_adam", "clip_by_global_norm", "global_norm",
           "decoupled_decay", "cautious_decay", "MomentumState", "momentum", "nesterov", "BiasCorrectedMomentumState",
           "bias_corrected_momentum", "newton_schulz", "QKLayout", "qk_clip", "row_normalize", "RowNormalizeState",
           "ScaleByScheduleState", "scale", "scale_by_learning_rate", "scale_by_shape", "shape_factor",
           "ScaleByAdoptState", "scale_by_adopt", "cautious", "ScaleByLapropState", "scale_by_laprop", "ScaleByLionState",
           "scale_by_lion", "MarsCorrectionState", "mars_correction", "ScheduleFreeState", "schedule_free",
           "ScaleByDion2State", "scale_by_dion2",
           "ScaleBySoapState", "scale_by_soap"]
