"""Test configuration: CPU-safe oneDNN ISA, hypothesis profiles, and the ``cuda`` marker.

Tests marked ``@pytest.mark.cuda`` (registered in pyproject.toml) need a CUDA GPU: they
run where ``torch.cuda.is_available()`` is True and are skipped, with the reason, elsewhere
(on the CPU-only CI they show up as skipped in the ``-ra`` summary).
"""

import os

# bf16 matmul on CPUs whose VM forbids AMX dies with SIGILL unless oneDNN is capped.
# Must be set before torch is imported; the library itself never depends on it.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
# Newton-Schulz's default dtype follows the CPU (bf16 where it is native): pin float32 so
# every machine runs the same numerics against the float32 references (also in the
# subprocesses of CLI and FSDP tests, which inherit the environment).
# tests/test_precision.py lifts the pin to test the per-device default itself.
os.environ.setdefault("MUONFX_NS_DTYPE", "float32")

import pytest  # noqa: E402
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


def pytest_collection_modifyitems(config, items):
    """Skip ``cuda``-marked tests where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    why = ("needs CUDA: torch.cuda.is_available() is False here "
           f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# The predecessor's README said ``pytest tests/ --cov=muon_fsdp``: name the package
# that exists now (and pytest-cov, when it is not installed) instead of a bare
# "unrecognized arguments".
def pytest_addoption(parser, pluginmanager):
    if not pluginmanager.has_plugin("pytest_cov"):
        parser.addoption("--cov", action="append", nargs="?", const=True, default=[], dest="muonfx_cov",
                         help="needs pytest-cov (pip install pytest-cov); measure with --cov=muonfx")


#: the predecessor's test files (its README ran ``pytest tests/test_optimizer.py -v``) and
#: where their subjects are tested here (docs/migration.md has the same table)
PREDECESSOR_TESTS = {
    "test_optimizer.py": "tests/test_parity.py (the update against torch.optim.Muon and a reference loop), "
                         "tests/test_predecessor.py (MuonOptimizer, FSDPMuonOptimizer, create_hybrid_optimizer as "
                         "muon_fsdp's users call them) and tests/test_optim_integrations.py (schedulers, "
                         "checkpoints, Lightning, Hugging Face)",
}


def pytest_configure(config):
    for arg in config.args:
        path = arg.split("::")[0]
        name = os.path.basename(path)
        if name in PREDECESSOR_TESTS and not os.path.exists(path):
            raise pytest.UsageError(f"{path} was muon_fsdp's test file; its subjects are tested in "
                                    f"{PREDECESSOR_TESTS[name]}; python -m pytest -q runs them all")
    given = getattr(config.option, "muonfx_cov", None) or getattr(config.option, "cov_source", None) or []
    if any(isinstance(v, str) and "muon_fsdp" in v for v in given):
        raise pytest.UsageError("--cov=muon_fsdp: the package is muonfx now; use --cov=muonfx")
    if getattr(config.option, "muonfx_cov", None):
        raise pytest.UsageError("--cov needs pytest-cov, which is not installed: pip install pytest-cov "
                                "(then pytest --cov=muonfx)")


@pytest.fixture(autouse=True)
def _process_wide_ns_settings_restored():
    """A test that pins the Newton-Schulz dtype process-wide (``set_default_ns_dtype``)
    leaves the next test the settings it found."""
    from muonfx.linalg import precision

    before = precision._override
    yield
    precision._override = before
