"""The examples run: each is started as its users would start it, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_fsdp_tp_example_trains_on_a_dp_tp_mesh():
    """examples/fsdp_tp_muon.py on 4 spawned gloo ranks (dp 2 x tp 2), 12 steps: the plan is
    printed, the loss goes down, every matrix is orthogonalised once per step in the world."""
    proc = run_example("fsdp_tp_muon.py", "--world", "4", "--tp", "2", "--steps", "12", "--port", "29571")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"examples/fsdp_tp_muon.py exited with {proc.returncode}:\n{out}"
    assert re.search(r"blocks\.0\.q\.weight .*dp:_S\(0, 2\), tp:S\(0\).*64x64 matrix \(dims 0 x 1\)", proc.stdout), out
    losses = [float(m) for m in re.findall(r"^step\s+\d+\s+loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    assert "dp 2 x tp 2: 144 matrices orthogonalised in 12 steps" in proc.stdout, out


def test_examples_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for script in sorted(EXAMPLES.glob("*.py")):
        assert script.name in readme, f"examples/README.md does not list {script.name}"


@pytest.mark.slow
def test_qk_clip_example_bounds_the_logits():
    """examples/qk_clip.py, 40 steps: the largest logit grows past 3 x tau without the clip
    and stays under 2 x tau with it."""
    proc = run_example("qk_clip.py", "--steps", "40", "--tau", "5", "--threads", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"examples/qk_clip.py exited with {proc.returncode}:\n{out}"
    m = re.search(r"^largest logit over the last \d+ steps: no clip ([0-9.]+), tau 5 ([0-9.]+)", proc.stdout, re.M)
    assert m is not None, out
    plain, clipped = float(m.group(1)), float(m.group(2))
    assert plain > 15 and clipped < 10, out
