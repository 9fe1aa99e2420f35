"""Matrix kernels: Newton-Schulz iterations and their coefficient schedules."""

from .batching import batch_bytes, plan_batches, set_batch_bytes
from .coefficients import PRESETS, CoefficientSpec, Schedule, resolve
from .newton_schulz import default_compute_dtype, newton_schulz_batched

__all__ = ["PRESETS", "CoefficientSpec", "Schedule", "resolve", "default_compute_dtype",
           "newton_schulz_batched", "batch_bytes", "set_batch_bytes", "plan_batches"]
