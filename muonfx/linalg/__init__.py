"""Matrix kernels: Newton-Schulz iterations, their coefficient schedules and compute dtypes."""

from .batching import batch_bytes, plan_batches, set_batch_bytes
from .coefficients import PRESETS, CoefficientSpec, Schedule, resolve
from .newton_schulz import (SPECTRAL_MIN_DIM, NewtonSchulz, auto_method, auto_takes_gram, default_compute_dtype,
                            gram_pays_off, newton_schulz_batched, spectral_pays_off)
from .precision import cpu_ns_choice, ns_dtype_for, set_default_ns_dtype
from .settings import MatrixSettings
from . import symmetric  # the iterations written for any symmetric product (the Triton tiles plug in there)

__all__ = ["PRESETS", "CoefficientSpec", "Schedule", "resolve", "default_compute_dtype",
           "newton_schulz_batched", "NewtonSchulz", "gram_pays_off", "auto_takes_gram",
           "auto_method", "spectral_pays_off", "SPECTRAL_MIN_DIM", "batch_bytes", "set_batch_bytes", "plan_batches",
           "ns_dtype_for", "set_default_ns_dtype", "cpu_ns_choice", "MatrixSettings"]
