"""The examples run: each is started as its users would start it, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

_LOSS = re.compile(r"^step\s+\d+ \| loss (?P<loss>[0-9.]+|nan|inf)", re.M)
_FINAL = re.compile(r"^final loss (?P<loss>[0-9.]+|nan|inf)", re.M)


def run_example(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # bf16 matmul on CPUs whose VM forbids AMX dies with SIGILL unless oneDNN is capped.
    env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_mixed_adamw_trains():
    proc = run_example("mixed_adamw.py", "--steps", "20", "--device", "cpu")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"examples/mixed_adamw.py exited with {proc.returncode}:\n{out}"

    losses = [float(m.group("loss")) for m in _LOSS.finditer(proc.stdout)]
    final = _FINAL.search(proc.stdout)
    assert len(losses) >= 2 and final is not None, f"no loss lines in the output:\n{out}"
    first, last = losses[0], float(final.group("loss"))
    assert last == losses[-1]  # the final line repeats the last step's loss
    assert last < first, f"loss did not go down in 20 steps: first {first}, final {last}\n{out}"

    # the param-group split is printed: Muon got the hidden matrices, AdamW the rest
    assert re.search(r"^\s+muon\b.*\b8 tensors\b", proc.stdout, re.M), out
    assert re.search(r"^\s+adamw\b", proc.stdout, re.M), out
    assert "tok_emb.weight" in proc.stdout and "lm_head.weight" in proc.stdout


def test_examples_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for script in sorted(EXAMPLES.glob("*.py")):
        assert script.name in readme, f"examples/README.md does not list {script.name}"
