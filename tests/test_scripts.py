"""scripts/gpu-figures.sh: the one command per part that a session lent a GPU runs. No
GPU here, so what is checked is what can go wrong before the GPU is reached: the usage,
and that every benchmark and flag it names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-figures.sh"


@pytest.mark.parametrize("args", [[], ["everything"]])
def test_an_unknown_part_prints_the_usage_and_writes_nothing(args, tmp_path):
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert res.returncode == 2
    assert "usage: scripts/gpu-figures.sh tests|ns|muon|llama|rows|adamw|memory" in res.stderr
    assert not (tmp_path / "out").exists()


def test_every_benchmark_and_flag_it_names_exists():
    text = SCRIPT.read_text()
    calls = re.findall(r"run python3 (benchmarks/\w+\.py)([^\n]*)", text)
    assert {c[0] for c in calls} == {"benchmarks/newton_schulz.py", "benchmarks/muon_step.py",
                                     "benchmarks/adamw_step.py", "benchmarks/step_memory.py"}
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
