"""The torch.optim adapter: a thin :class:`TransformOptimizer` shell over per-group
records (:mod:`.groups`), the :class:`~muonfx.optim.executor.Executor` that runs
every step (:mod:`.executor`), and checkpoints (:mod:`.checkpoint`)."""

from .executor import Executor, write_back
from .groups import GroupRecord, lr_multiplier
from .optimizer import TransformOptimizer

__all__ = ["TransformOptimizer", "lr_multiplier", "Executor", "GroupRecord", "write_back"]
