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
def test_the_testing_modules_import_first():
    """The conformance kit's modules import in one direction (strategies <- compare <- laws
    <- adapter_laws, compiled_law <- check <- muonfx.testing): any works as the very first
    muonfx import."""
    for first in ("muonfx.testing", "muonfx.testing.strategies", "muonfx.testing.laws",
                  "muonfx.testing.adapter_laws", "muonfx.testing.compiled_law", "muonfx.testing.check"):
        proc = run_python(f"""
            import {first}
            from muonfx.testing import LAWS, ConformanceError, check_transform, params_and_grads
            from muonfx.testing.check import check_transform as c
            assert c is check_transform
            print("ok")
        """)
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", f"import {first} first:\n{proc.stderr}"


def _imports(path: Path) -> set[str]:
    """The muonfx (and torch.distributed) modules a source file imports (absolute names),
    by its syntax tree."""
    import ast

    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = mod.rsplit(".", 1)[0]  # (an __init__'s package is its folder)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
            out.update(n for n in names if n.startswith(("muonfx", "torch.distributed")))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(("muonfx", "torch.distributed")))
    return out


# the layers above the ground floor: core and _compat import none of them
_ABOVE_OPS = ("muonfx.optim", "muonfx.transforms", "muonfx.wrappers", "muonfx.inject", "muonfx.combine",
              "muonfx.presets", "muonfx.tree", "muonfx.counts", "muonfx.hyperparams", "muonfx.schedules", "muonfx.distributed",
              "muonfx.seam", "muonfx.linalg", "muonfx.testing", "muonfx.cli")
_ABOVE_CORE = _ABOVE_OPS + ("muonfx.ops",)
_ABOVE_COMPAT = _ABOVE_CORE + ("muonfx.core",)

# each module (or package) and the muonfx modules it may never import: imports flow one way
_NEVER = {
    "muonfx/_compat": _ABOVE_COMPAT,
    "muonfx/core": _ABOVE_CORE,
    "muonfx/ops.py": _ABOVE_OPS,
    "muonfx/counts.py": ("muonfx.optim", "muonfx.transforms", "muonfx.wrappers", "muonfx.inject", "muonfx.tree",
                         "muonfx.distributed"),
    "muonfx/tree.py": ("muonfx.optim", "muonfx.transforms", "muonfx.wrappers", "muonfx.inject", "muonfx.distributed"),
    "muonfx/linalg": ("muonfx.optim", "muonfx.transforms", "muonfx.wrappers", "muonfx.inject", "muonfx.distributed",
                      "muonfx.tree"),
    "muonfx/transforms": ("muonfx.optim", "muonfx.distributed", "torch.distributed"),
    "muonfx/presets": ("muonfx.optim", "muonfx.distributed", "muonfx.cli", "torch.distributed"),
    "muonfx/distributed": ("muonfx.optim", "muonfx.cli"),
    "muonfx/testing/strategies.py": ("muonfx.testing.laws", "muonfx.testing.check", "muonfx.testing.adapter_laws",
                                     "muonfx.optim"),
    "muonfx/testing/laws.py": ("muonfx.testing.check", "muonfx.testing.adapter_laws", "muonfx.optim"),
    "muonfx/testing/adapter_laws.py": ("muonfx.testing.check",),
    "muonfx/testing/compiled_law.py": ("muonfx.testing.check",),
}


def test_imports_flow_one_way():
    """The bottom modules (_compat, core, ops, counts, tree, linalg) import nothing above them, no
    transform or preset imports the adapter or distributed code, the distributed backend
    imports nothing of the adapter (``optim``), and the conformance kit's modules
    import in one direction (strategies <- compare <- laws <- adapter_laws, compiled_law
    <- check <- muonfx.testing)."""
    bad = []
    for where, never in _NEVER.items():
        path = ROOT / where
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            for imp in _imports(f):
                if any(imp == n or imp.startswith(n + ".") for n in never):
                    bad.append(f"{f.relative_to(ROOT)} imports {imp}")
    assert not bad, bad


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
    import muonfx.distributed, muonfx.optim.fsdp_optimizer, muonfx.optim.muon_optimizer, muonfx.presets
    builtins.__import__ = real_import
    print(repr(seen))
    print(by_dependency, "torch.distributed.tensor" in sys.modules)
"""


def test_import_muonfx_does_not_import_torch_distributed_tensor():
    """``import muonfx`` (and ``muonfx.distributed``, and ``muonfx.optim.fsdp_optimizer``,
    where ``FSDPMuonOptimizer`` lives) imports no DTensor code: the DTensor backend is imported when the adapter
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
