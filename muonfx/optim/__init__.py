"""The torch.optim adapter: a thin :class:`TransformOptimizer` shell over per-group
records (:mod:`.groups`), the step plan and runner that execute every step
(:mod:`.step`), checkpoints (:mod:`.checkpoint`, entries named by
:mod:`.checkpoint_names`), and the predecessor's optimizer classes
(:mod:`.muon_optimizer`)."""

from .groups import GroupRecord, lr_multiplier
from .optimizer import TransformOptimizer
from .step import PartialStepError, StepPlan, write_back

__all__ = ["TransformOptimizer", "lr_multiplier", "GroupRecord", "StepPlan", "PartialStepError", "write_back"]
