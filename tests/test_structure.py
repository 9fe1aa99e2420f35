"""The shape of the package: how its modules import each other.

Each check runs in a fresh interpreter (a subprocess), since the test session has
already imported everything.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


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


def test_strategies_do_not_import_the_conformance_check():
    proc = run_python("""
        import sys, muonfx._strategies
        print("muonfx.conformance" in sys.modules, "muonfx.testing" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
