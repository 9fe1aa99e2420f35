"""Test configuration: CPU-safe oneDNN ISA and hypothesis profiles."""

import os

# bf16 matmul on CPUs whose VM forbids AMX dies with SIGILL unless oneDNN is capped.
# Must be set before torch is imported; the library itself never depends on it.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
