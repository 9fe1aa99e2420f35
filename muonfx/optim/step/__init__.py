"""How the adapter runs a step: the plan (:mod:`.plan`), the runner (:mod:`.run`), the
write-back (:mod:`.writeback`), pieces (:mod:`.pieces`), the compiled step
(:mod:`.compiled`), the dry run (:mod:`.dryrun`) and measured tuning (:mod:`.tune`).
Transforms compute; these modules execute."""

from .pieces import PartialStepError
from .plan import GroupPlan, Settings, StepPlan
from .run import Runner
from .writeback import commit, write_back

__all__ = ["StepPlan", "GroupPlan", "Settings", "Runner", "PartialStepError", "commit",
           "write_back"]
