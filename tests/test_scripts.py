"""scripts/gpu-figures.sh: one command per part on a CUDA machine. Without a
GPU, so what is checked is what can go wrong before the GPU is reached: the usage,
that every benchmark and flag it names exists, and how ``all`` spends its one deadline
(with a stand-in ``python3`` that records its calls)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-figures.sh"


@pytest.mark.parametrize("args", [[], ["everything"]])
def test_an_unknown_part_prints_the_usage_and_writes_nothing(args, tmp_path):
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert res.returncode == 2
    assert "usage: scripts/gpu-figures.sh all|tests|ns|muon|llama|rows|adamw|memory|host" in res.stderr
    assert not (tmp_path / "out").exists()


def test_every_benchmark_and_flag_it_names_exists():
    text = SCRIPT.read_text()
    calls = re.findall(r"(?:run|step \d+) python3 (benchmarks/\w+\.py)([^\n]*)", text)
    assert {c[0] for c in calls} == {"benchmarks/newton_schulz.py", "benchmarks/muon_step.py",
                                     "benchmarks/adamw_step.py", "benchmarks/step_memory.py",
                                     "benchmarks/host_cost.py", "benchmarks/first_step.py"}
    for path, args in calls:
        source = (ROOT / path).read_text()
        for flag in re.findall(r"(--[\w-]+)", args):
            assert f'"{flag}"' in source, (path, flag)
        for names in re.findall(r"--variants (\S+)", args):
            for v in names.split(","):
                assert f'"muonfx {v}"' in source, (path, v)
        for name in re.findall(r"--sets (\S+)", args):
            for s in name.split(","):
                assert f'"{s}"' in source or path.endswith("step_memory.py"), (path, s)


STUB = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in
    *moe32*) exec sleep 30 ;;                       # a step that outlasts the deadline
    *gpt2*) echo "| gpt2 | 12 layers | muonfx default | compiled | 9 | 30 | 0.30 |"; echo "USDT: noise" ;;
    *) echo "ran: $*" ;;
esac
"""


def _run_all(tmp_path, budget: int, min_step: int, stub: str = STUB):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(stub)
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "CALLS": str(tmp_path / "calls"),
           "FIGURES_BUDGET_S": str(budget), "FIGURES_MIN_STEP_S": str(min_step)}
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(SCRIPT), "all"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    return res, out, (tmp_path / "calls").read_text().splitlines(), time.monotonic() - t0


def test_all_stops_the_step_that_outlasts_the_deadline_and_skips_the_rest(tmp_path):
    res, out, calls, took = _run_all(tmp_path, budget=4, min_step=1)
    # info, Llama-1B, then MoE (stopped at the deadline); nothing after it starts
    assert [c.split()[:2] for c in calls] == [["-m", "muonfx"], ["benchmarks/muon_step.py", "--device"],
                                              ["benchmarks/muon_step.py", "--device"]]
    assert "--sets llama1b" in calls[1] and "--sets moe32" in calls[2]
    assert took < 30
    assert res.returncode == 1, res.stderr
    log = (out / "all.log").read_text()
    assert "stopped after" in log and "moe32" in log.split("stopped after")[1].splitlines()[0]
    for skipped in ("gpt2", "first_step.py", "pytest", "adamw_step.py", "newton_schulz.py"):
        assert any(line.startswith("skipped, the budget is spent") and skipped in line for line in log.splitlines()), skipped
    summary = (out / "all.summary.txt").read_text().splitlines()
    assert any(line.startswith("stopped after") for line in summary)
    assert sum(line.startswith("skipped, ") for line in summary) == 5


def test_all_runs_every_step_in_order_when_time_allows(tmp_path):
    stub = STUB.replace('*moe32*) exec sleep 30 ;;', '*moe32*) echo "| moe32 | row |" ;;')
    res, out, calls, took = _run_all(tmp_path, budget=60, min_step=1, stub=stub)
    assert took < 30
    assert res.returncode == 0, res.stdout + res.stderr
    # the benchmarks first, in the order of value, then the CUDA tests, AdamW, Newton-Schulz
    order = ["muonfx info", "--sets llama1b", "--sets moe32", "--sets gpt2", "first_step.py --device cuda", "pytest",
             "adamw_step.py --device cuda", "newton_schulz.py --only speed --device cuda"]
    assert len(calls) == len(order)
    for call, want in zip(calls, order):
        assert want in call, (call, want)
    # the GPU-marked tests without the compile sweeps; the Triton-interpreter tests stay in the CPU suite
    assert "tests/test_cuda.py" in calls[5] and "test_triton_ns" not in calls[5] and 'cuda and not slow' in calls[5]
    summary = (out / "all.summary.txt").read_text()
    assert "| gpt2 |" in summary and "| moe32 |" in summary and "skipped" not in summary
    log = (out / "all.log").read_text()
    assert "USDT" not in log
