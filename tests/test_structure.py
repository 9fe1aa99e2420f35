"""The shape of the package: how its modules import each other.

Each check runs in a fresh interpreter (a subprocess), since the test process has
already imported everything.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_conformance_imports_first():
    """``muonfx.conformance`` and ``muonfx.testing`` import in one direction (no cycle):
    either works as the very first muonfx import."""
    for first in ("muonfx.conformance", "muonfx.testing", "muonfx._strategies"):
        proc = run_python(f"""
            import {first}
            from muonfx.testing import LAWS, ConformanceError, check_transform, params_and_grads
            from muonfx.conformance import check_transform as c
            assert c is check_transform
            print("ok")
        """)
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", f"import {first} first:\n{proc.stderr}"


@pytest.mark.slow
def test_strategies_do_not_import_the_conformance_check():
    proc = run_python("""
        import sys, muonfx._strategies
        print("muonfx.conformance" in sys.modules, "muonfx.testing" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


# Who imports ``torch.distributed.tensor`` while ``import muonfx`` runs: every
# ``import``/``from ... import`` statement executed by a muonfx module is recorded
# (tensordict itself pulls the package in through torch._dynamo on recent torch, so
# ``sys.modules`` alone cannot tell muonfx's own imports apart).
_WHO_IMPORTS_DTENSOR = """
    import builtins, importlib.util, sys
    real_import = builtins.__import__
    seen = []

    def spy(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        if importer.split(".")[0] == "muonfx":
            full = importlib.util.resolve_name("." * level + name, (globals or {}).get("__package__")) if level else name
            targets = [full] + [f"{full}.{f}" for f in (fromlist or ()) if isinstance(f, str)]
            if any(t == "torch.distributed.tensor" or t.startswith("torch.distributed.tensor.") for t in targets):
                seen.append(f"{importer}: {full} {tuple(fromlist or ())}")
        return real_import(name, globals, locals, fromlist, level)

    import tensordict  # the dependency's own imports, before the spy is on
    by_dependency = "torch.distributed.tensor" in sys.modules
    builtins.__import__ = spy
    import muonfx
    import muonfx.distributed, muonfx.distributed.fsdp, muonfx.familiar, muonfx.recipes
    builtins.__import__ = real_import
    print(repr(seen))
    print(by_dependency, "torch.distributed.tensor" in sys.modules)
"""


def test_import_muonfx_does_not_import_torch_distributed_tensor():
    """``import muonfx`` (and ``muonfx.distributed``, which ``FSDPMuonOptimizer`` lives
    under) imports no DTensor code: the DTensor backend is imported when the adapter
    first sees a DTensor parameter."""
    proc = run_python(_WHO_IMPORTS_DTENSOR)
    assert proc.returncode == 0, proc.stderr
    seen, flags = proc.stdout.strip().splitlines()
    assert seen == "[]", f"muonfx modules imported torch.distributed.tensor at import time: {seen}"
    by_dependency, loaded = flags.split()
    if by_dependency == "False":  # where tensordict does not pull it in, nothing may
        assert loaded == "False"


def test_the_dtensor_backend_still_loads_on_demand():
    proc = run_python("""
        import sys, muonfx.distributed as d
        b = d.install()
        assert d.BACKEND is b and type(b).__name__ == "DTensorBackend"
        assert "muonfx.distributed.backend" in sys.modules
        d.uninstall()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
