"""A newcomer's first ten minutes: the README's set-up order, what ``muonfx train`` says
about time and speed, the comparison plot's marker, ``muonfx bench``'s progress, and
the benchmark flags the docs advertise.

Training runs are tiny (batch 4, a few steps, one thread) and run in this process.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from muonfx.cli import main
from helpers import default_signals, run_main  # noqa: E402
from muonfx.cli.args import DEFAULTS
from muonfx.cli import bench as cli_bench
from muonfx.cli import train as cli_train
from muonfx.cli.corpus import load_corpus
from muonfx.cli.estimate import RunClock, evaluations_between
from muonfx.cli.progress import format_rate
from muonfx.cli.report import compare_runs, crossings, plain_png, plot_losses
from muonfx.cli.train_cmd import warmup_note

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--batch-size", "4", "--threads", "1", "--eval-batches", "2", "--device", "cpu",
        "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("muonfx-cache")
    load_corpus(d)
    return d



# ---------------------------------------------------------------------------
# README: choose torch first, then the one install command and the one test command
# ---------------------------------------------------------------------------


def _shell_lines(text: str) -> list[str]:
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```(bash|sh|shell)\s*$", line):
            inside = True
        elif inside and line.strip().startswith("```"):
            inside = False
        elif inside and line.strip():
            out.append(line.split("#", 1)[0].strip())
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_torch_choice_comes_before_the_install_command(page):
    lines = _shell_lines((ROOT / page).read_text(encoding="utf-8"))
    cpu = next(i for i, c in enumerate(lines)
               if c.startswith("pip install torch") and "--index-url https://download.pytorch.org/whl/cpu" in c)
    cuda = next(i for i, c in enumerate(lines) if c == "pip install torch")
    install = lines.index('pip install -e ".[dev]"')
    test = lines.index("python -m pytest -q")
    assert max(cpu, cuda) < install < test, lines
    if page == "README.md":
        assert test < lines.index("muonfx train --compare adamw")


def test_ci_runs_exactly_the_readme_test_command():
    readme = _shell_lines((ROOT / "README.md").read_text(encoding="utf-8"))
    ci = [c for c in (ROOT / ".ci" / "run").read_text().splitlines() if c.strip() and not c.startswith("#")]
    assert "python -m pytest -q" in readme and ci[-2:] == ["python -m pytest -q", "python -m pytest -q -m slow"]
    # the README's command leaves the slow tests out, and the pytest configuration says so
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert "addopts = \"-ra -m 'not slow'\"" in pyproject and '"slow: ' in pyproject


def test_readme_states_the_measured_time_of_the_main_job():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    head = text[:text.index("muonfx train --compare adamw")]
    assert re.search(r"about \d+ minutes on a quiet 2-core machine", head), head[-600:]
    assert f"{DEFAULTS['steps']}-step runs" in head
    assert "a few minutes on a laptop CPU" not in text
    # the set-up states measured figures: the environment's size and the tests' time
    assert "a few hundred MB" not in text and "about 300 MB" not in text
    assert re.search(r"a 0\.9 GB environment", head) and re.search(r"to 2\.3 GB, 1\.0 GB of it Triton", head), head
    assert re.search(r"The tests take \d+ min \d+ s of CPU time on a 2-core machine", head), head
    assert "python -m pytest -q -m slow" in head


# ---------------------------------------------------------------------------
# what the run prints: time estimates, labelled token rates, the warm-up note
# ---------------------------------------------------------------------------


def test_format_rate_never_prints_zero_thousands():
    assert format_rate(37.4) == "37 tok/s" and format_rate(0.42) == "0.42 tok/s"
    assert format_rate(6789) == "6.79k tok/s" and format_rate(12345) == "12.3k tok/s"
    assert format_rate(2.5e6) == "2.50M tok/s"
    for r in (0.01, 3.0, 49.0, 99.0, 999.0, 1001.0, 4.9e4):
        assert float(re.match(r"[\d.]+", format_rate(r)).group()) > 0, r   # the old "0.0k tok/s" for 49


def test_evaluations_between_counts_the_final_one_once():
    assert evaluations_between(0, 600, 600, 50) == 12
    assert evaluations_between(0, 7, 7, 3) == 3       # 3, 6 and the end
    assert evaluations_between(0, 6, 6, 3) == 2       # 3 and 6 (= the end)
    assert evaluations_between(3, 6, 10, 3) == 1      # --stop-at 6 of 10: only 6


def test_run_clock_extrapolates_the_measured_steps():
    c = RunClock(steps=100, stop=100, eval_every=50, eval_batches=4)
    c.eval_seconds = 2.0
    c.add_step(10.0, 1.0)                 # the first step (allocations) is not counted
    assert not c.ready()
    for _ in range(3):
        c.add_step(0.5, 0.1)
    assert c.ready()
    line = c.measured(done=4, name="m", then="adamw")
    # 96 steps x 0.6 s + 2 evaluations x 2 s = 61.6 s; adamw: 100 x 0.5 s + 3 x 2 s = 56 s
    assert "~1:02 for this run: 96 steps to go at 0.60 s/step (measured over steps 2-4)" in line
    assert "2 evaluations at 2.0 s" in line and "then adamw ~0:56; ~1:58 in all" in line
    assert not c.ready()                  # said once
    slow = RunClock(steps=10, stop=10, eval_every=5, eval_batches=2, warmup_seconds=5.0)
    slow.add_step(9.0, 1.0)
    slow.add_step(6.0, 0.5)               # one timed step longer than the warm-up budget is enough
    assert slow.ready()
    rough = slow.rough(20.0, "32 x 1024", "m", "cpu")
    # 10 steps x 3 x 20 s + 3 evaluations x 2 batches x 20 s = 720 s
    assert "took 20.0 s on cpu" in rough and "~12:00" in rough


def test_warmup_note():
    assert "--warmup 20 is longer than --steps 5: the learning rate climbs for the whole run" in warmup_note(20, 5)
    assert "--warmup 5 is as long as --steps 5" in warmup_note(5, 5) and warmup_note(4, 5) is None
    # --warmup 1 starts at the peak: it fits any run, and no note recommends the value passed
    assert warmup_note(1, 1) is None and warmup_note(0, 1) is None
    for warmup in range(2, 40):
        for steps in range(1, warmup + 1):
            note = warmup_note(warmup, steps)
            assert note is not None and f"pass --warmup {warmup}," not in note, note


def test_compare_run_prints_estimates_labelled_rates_and_its_real_folder(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MUONFX_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_train, "ROUGH_ESTIMATE_AFTER_S", 0.0)  # as if the first batch were slow
    assert run_main(["train", "--compare", "adamw", "--steps", "6", "--eval-every", "3", *FAST]) == 0
    out = capsys.readouterr().out
    # a rough estimate from the step-0 evaluation's first batch, then a measured one, per run
    assert re.search(r"\[muon_adamw\] rough estimate: one forward pass of a 4 x 128 batch took [\d.]+ s on cpu", out)
    assert re.search(r"\[muon_adamw\] expected: ~\d+:\d\d for this run: \d+ steps to go at [\d.]+ s/step "
                     r"\(measured over steps? [\d-]+\).*; then adamw ~\d+:\d\d; ~\d+:\d\d in all", out), out
    assert re.search(r"\[adamw\] expected: ~\d+:\d\d for this run", out)
    assert out.index("[muon_adamw] expected") < out.index("[muon_adamw] step     6")   # after step 4
    # every rate says what it counts; none is "0.0k"
    assert re.search(r"step     3 \| .* \| [\d.]+k? tok/s training \| ~\d+:\d\d left, then adamw ~\d+:\d\d\n", out), out
    # every evaluation says the time left, at the pace so far; the last one says none is
    assert re.search(r"\[muon_adamw\] step     6 \| .* \| ~0:00 left, then adamw ~\d+:\d\d\n", out), out
    assert re.search(r"\[adamw\] step     6 \| .* \| ~0:00 left\n", out), out
    assert re.search(r"muon_adamw: final val loss .* \(\d+ s of it evaluating\), [\d.]+k? tok/s training "
                     r"\(evaluations excluded\)", out), out
    assert not re.search(r"(?<![\d.])0\.0k", out), out  # a zero rate ("10.0k" is not one)
    assert "note: --warmup 20 is longer than --steps 6" in out
    # the output folder is the one getting-started names
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and re.fullmatch(r"\d{8}-\d{6}-muon_adamw-vs-adamw", runs[0].name), runs
    doc = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert "runs/<date>-<time>-muon_adamw-vs-adamw/" in doc
    from muonfx.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
    assert "runs/<date>-<time>-<optimizer>[-vs-<compare>]" in next(a.help for a in sub._actions if a.dest == "out")
    example = re.search(r"runs/(\d{8}-\d{6}-muon_adamw-vs-adamw)/", doc)
    assert example, "getting-started shows no example folder name"
    s = json.loads((runs[0] / "summary.json").read_text())
    rec = s["runs"]["muon_adamw"]
    assert rec["eval_seconds"] > 0 and rec["tokens_per_s"] > 0


def test_no_warmup_note_when_the_warmup_fits(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MUONFX_CACHE_DIR", str(cache))
    assert run_main(["train", "--steps", "5", "--warmup", "1", *FAST, "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "note: --warmup" not in out and "rough estimate" not in out   # a fast first batch: no rough figure
    assert "(measured over steps 2-4)" in out and "then " not in out       # no --compare: one run


# ---------------------------------------------------------------------------
# the plot marks where the run crosses the baseline's final loss
# ---------------------------------------------------------------------------

RUNS = {"muon": {"val_curve": [[0, 4.0], [50, 2.0], [100, 1.0]], "train_curve": [[1, 4.0], [100, 1.0]],
                 "final_val_loss": 1.0, "steps": 100},
        "adamw": {"val_curve": [[0, 4.0], [50, 3.0], [100, 1.5]], "train_curve": [[1, 4.0], [100, 1.5]],
                  "final_val_loss": 1.5, "steps": 100}}


def test_plot_marks_the_crossing_with_the_step_ratio(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    cmp = compare_runs(RUNS, "adamw")
    assert [(c["name"], c["step"], c["ratio"]) for c in crossings(cmp)] == [("muon", 75.0, 1.33)]
    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(self), real(self, *a, **k))[1])
    assert plot_losses(RUNS, tmp_path / "loss.png", "t", cmp) == ""
    ax = saved[0].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "muon reaches adamw's final val loss at step ~75: 1.33x fewer steps" in legend
    assert [t.get_text() for t in ax.texts] == ["1.33x fewer steps"]
    star = [ln for ln in ax.lines if ln.get_marker() == "*"]
    assert len(star) == 1 and list(star[0].get_xdata()) == [75.0] and list(star[0].get_ydata()) == [1.5]
    # the legend sits below the axes, inside the figure: it covers no curve
    fig = saved[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    box, frame = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert box.y1 <= frame.y0 and box.y0 >= 0 and box.x0 >= 0 and box.x1 <= fig.bbox.x1, (box, frame)
    # no comparison, no marker
    saved.clear()
    plot_losses(RUNS, tmp_path / "plain.png", "t")
    assert not saved[0].axes[0].texts and not [ln for ln in saved[0].axes[0].lines if ln.get_marker() == "*"]


def _png_pixels(path: Path) -> list[bytes]:
    data = path.read_bytes()
    w, h = struct.unpack(">II", data[16:24])
    raw, i = b"", 8
    while i < len(data):
        n = struct.unpack(">I", data[i:i + 4])[0]
        if data[i + 4:i + 8] == b"IDAT":
            raw += data[i + 8:i + 8 + n]
        i += 12 + n
    rows = zlib.decompress(raw)
    return [rows[r * (3 * w + 1) + 1 + 3 * x:r * (3 * w + 1) + 4 + 3 * x] for r in range(h) for x in range(w)]


def test_plain_png_marks_the_crossing_too(tmp_path):
    marks = crossings(compare_runs(RUNS, "adamw"))
    plain_png(RUNS, tmp_path / "a.png")
    plain_png(RUNS, tmp_path / "b.png", marks=marks)
    grey = bytes((128, 128, 128))
    assert _png_pixels(tmp_path / "a.png").count(grey) == 0
    assert _png_pixels(tmp_path / "b.png").count(grey) > 500     # a horizontal and a vertical line


# ---------------------------------------------------------------------------
# muonfx bench: says what runs and that it is still running
# ---------------------------------------------------------------------------


def test_bench_shows_progress_while_a_script_is_silent(tmp_path, monkeypatch, capsys):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "slow_one.py").write_text('"""Slow thing: how fast a sleep is."""\nimport time, sys\n'
                                   'print("setting up", flush=True)\ntime.sleep(2.0)\nprint("| a | b |")\n'
                                   'print("args", sys.argv[1:])\n')
    monkeypatch.setattr(cli_bench, "HEARTBEAT_S", 0.4)
    assert main(["bench", "--dir", str(d), "--", "--layers", "2"]) == 0
    cap = capsys.readouterr()
    assert "1 benchmark(s), one process each: slow_one" in cap.out
    assert "== [1/1] slow_one" in cap.out and "Slow thing: how fast a sleep is." in cap.out
    assert cap.out.index("setting up") < cap.out.index("| a | b |") and "args ['--layers', '2']" in cap.out
    beats = re.findall(r"\[slow_one\] still running, (\d+) s", cap.err)
    assert len(beats) >= 2, cap.err
    assert "== slow_one: ok in" in cap.out


def test_bench_says_how_long_the_rest_takes_and_drops_the_profilers_lines(tmp_path, monkeypatch, capsys):
    measured = dict(cli_bench.MEASURED_S)
    d = tmp_path / "benchmarks"
    d.mkdir()
    for name in ("one", "two"):  # what torch.profiler prints when a step's memory is measured
        (d / f"{name}.py").write_text(
            'import sys\nprint("| table |")\n'
            'print("USDT:2026-11-26 13:02:14 9080:9080 SyncActivityProfilerHandler.cpp:52] profiler_start")\n'
            'print("[W1126 13:06:20.164123577 CPUAllocator.cpp:245] Memory block of unknown size was allocated '
            'before the profiling started, profiler results will not include the deallocation event", '
            'file=sys.stderr)\nprint("| row |")\n')
    monkeypatch.setattr(cli_bench, "MEASURED_S", {"one": 60.0, "two": 120.0})
    assert main(["bench", "--dir", str(d)]) == 0
    out = capsys.readouterr().out
    assert ("expected: ~3:00 for one, two (measured on a 2-core CPU shared with other jobs, default arguments; "
            "a quiet machine takes less)") in out, out
    assert re.search(r"expected: ~0:0\d more for two \(at this machine's pace so far: 0\.0x", out), out
    assert out.count("| table |") == 2 and out.count("| row |") == 2
    assert "USDT" not in out and "CPUAllocator" not in out, out
    # every script of the repository has a measured time
    assert set(measured) == {p.stem for p in (ROOT / "benchmarks").glob("*.py")
                                         if not p.name.startswith("_")}


def test_bench_ctrl_c_stops_the_script_in_one_line(tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "a_slow.py").write_text('import os, time\nprint("started", os.getpid(), flush=True)\ntime.sleep(60)\n')
    (d / "b_next.py").write_text('print("never")\n')
    p = subprocess.Popen([sys.executable, "-m", "muonfx", "bench", "--dir", str(d)], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    child = None
    for line in p.stdout:
        if line.startswith("started"):
            child = int(line.split()[1])
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in out + err, (out, err)
    assert err.strip().splitlines()[-1].startswith("muonfx bench: interrupted during a_slow after "), err
    assert err.strip().endswith("s; not run: b_next"), err
    assert "never" not in out
    with pytest.raises(ProcessLookupError):  # the benchmark did not outlive the command
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


# ---------------------------------------------------------------------------
# the benchmark commands the docs advertise use flags the scripts have
# ---------------------------------------------------------------------------


def _flags_of(script: Path) -> set[str]:
    flags = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def _advertised(texts: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    out = []
    if texts is None:
        texts = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
                 for p in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]}
    for where, text in texts.items():
        for m in re.finditer(r"benchmarks/(\w+)\.py((?:[ \t]+--?[\w-]+(?:[ \t]+[^\s#`|-][^\s#`|]*)?)*)", text):
            for flag in re.findall(r"(?<![\w-])--[\w-]+", m.group(2)):
                out.append((where, m.group(1), flag))
    return out


def test_benchmark_flags_in_the_docs_exist():
    adv = _advertised()
    assert ("benchmarks/adamw_step.py", "adamw_step", "--layers") in adv  # the scan sees the usage lines
    scripts = {p.stem: _flags_of(p) for p in (ROOT / "benchmarks").glob("*.py")}
    missing = [(w, s, f) for w, s, f in adv if s in scripts and f not in scripts[s]]
    assert not missing, f"advertised flags that the scripts do not have: {missing}"
    # a stale usage line (a flag the script no longer has) is caught
    stale = _advertised({"x": "    python benchmarks/adamw_step.py --scale 0.25    # fewer layers"})
    assert stale == [("x", "adamw_step", "--scale")] and "--scale" not in scripts["adamw_step"]


# ---------------------------------------------------------------------------
# numbers and names the docs repeat agree with their source
# ---------------------------------------------------------------------------


def test_the_docs_name_the_dependency_floors_of_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    floors = dict(re.findall(r'"(torch|tensordict)>=([\d.]+)"', pyproject))
    assert set(floors) == {"torch", "tensordict"}, floors
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for name, version in re.findall(r"\b(torch|tensordict)>=([\d.]*\d)", page.read_text(encoding="utf-8")):
            assert version == floors[name], f"{page.name}: {name}>={version}, pyproject.toml: {name}>={floors[name]}"


def test_the_benchmark_list_in_the_docs_is_every_benchmark():
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert cli_bench.MEASURED_S.keys() == set(scripts)
    listed = re.search(r"muonfx bench --list +# (.*)", (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8"))
    assert listed and listed.group(1).split(", ") == scripts, listed
    perf = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert all(f"python benchmarks/{s}.py" in perf for s in scripts)
    assert f"muonfx bench                          # all {['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten'][len(scripts) - 1]}" in perf


def test_gpt2_on_a_cpu_is_said_before_anything_is_built(tmp_path):
    """``--model gpt2`` on a CPU takes minutes a step: the first line says so and names the
    quick choices (it used to come a minute later, as a rough estimate of ~21 h)."""
    p = subprocess.Popen([sys.executable, "-m", "muonfx", "train", "--model", "gpt2", "--device", "cpu",
                          "--no-progress", "--out", str(tmp_path / "o")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()
    finally:
        p.kill()
        p.wait()
    assert first.startswith("note: --model gpt2 on a CPU: minutes a step"), first
    assert "300 steps take hours" in first and "muonfx train --model tiny" in first and "fewer --steps" in first


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_first_example_of_a_page_prints_its_loss(page, capsys):
    """A newcomer who pastes the first example sees that it ran: a loss that goes down."""
    text = (ROOT / page).read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, page, "exec"), {"__name__": "first_example"})
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", capsys.readouterr().out)]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
