"""The ``muonfx`` command line: train, info, bench, examples/train_gpt.py.

Most checks start the command the way users do, in a subprocess (``python -m muonfx``,
``torchrun -m muonfx``); they share one corpus cache, built once. Training runs are
tiny (batch 4, a few steps, one thread) so the file stays well under a minute and a
half on two cores. The runs compared with each other (resume; one process vs two FSDP
ranks) name ``--device cpu``: with ``--device auto`` a machine with a GPU would train the
one-process run on it with bf16 autocast, while two ranks that would share that GPU run
gloo on the CPU; the curves would not match.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonfx
from muonfx.cli import main
from helpers import run_main  # noqa: E402
from muonfx.cli import info as cli_info
from muonfx.cli.corpus import load_corpus
from muonfx.cli.model import GPT, MODELS, GPTConfig
from muonfx.cli.optimizers import build_optimizer, describe, optimizer_names
from muonfx.cli.report import plain_png, plot_losses, steps_to_reach

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--model", "tiny", "--batch-size", "4", "--threads", "1", "--eval-batches", "2", "--device", "cpu"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("muonfx-cache")
    load_corpus(d)  # build once; every subprocess below reads it
    return d


@pytest.fixture
def env(cache, monkeypatch) -> dict:
    monkeypatch.setenv("MUONFX_CACHE_DIR", str(cache))  # for in-process main() calls too
    e = dict(os.environ)
    e.update(MUONFX_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1",
             # bf16 matmul on CPUs whose VM forbids AMX dies with SIGILL unless oneDNN is capped
             ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def muonfx_cmd(env, *args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muonfx", *args], env=env, cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}"
    return out


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# ---------------------------------------------------------------------------
# info, bench, packaging
# ---------------------------------------------------------------------------


def test_info_prints_versions_devices_backends(env):
    import tensordict

    out = ok(muonfx_cmd(env, "info"))
    assert f"muonfx      {muonfx.__version__}" in out
    assert torch.__version__ in out and tensordict.__version__ in out
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in out
    assert "distributed gloo yes" in out and "nccl" in out and "mpi" in out
    assert "bf16 matmul (CPU)" in out
    assert "cpu " in out and "cuda" in out
    # the default Newton-Schulz dtype and the method rule that goes with it
    choice = muonfx.linalg.cpu_ns_choice().dtype
    assert f"ns dtype    CPU {str(choice).replace('torch.', '')}" in out
    assert "ns method   standard (torch.optim.Muon's iteration; the default); ns_method='auto' takes " in out, out
    auto = ("the Gram iteration on rectangular m x n matrices (bf16" if choice == torch.bfloat16 else
            f"float32 at bf16's accuracy: the spectral form (eigh of X X^T) on matrices whose smaller side is at "
            f"least {muonfx.linalg.SPECTRAL_MIN_DIM}")
    assert auto in out, out


def test_info_into_a_pipe_that_closes_early_ends_quietly(env):
    """``muonfx info | head -1``: no BrokenPipeError traceback; status 141 (128 + SIGPIPE)."""
    proc = subprocess.run(f"{shlex.quote(sys.executable)} -m muonfx info --no-bf16-check | head -1; "
                          "echo status ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash", env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("muonfx      ") and len(proc.stdout.splitlines()) == 1, proc.stdout
    assert proc.stderr.strip() == "status 141", proc.stderr


# What answers without torch: --help, --version and the options' own errors. tensordict
# (which imports torch._dynamo: seconds) is not needed by ``info``.
_IMPORTS = """
import sys
from muonfx.cli import main
for argv in ({cases}):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    print(code, "torch" in sys.modules, "tensordict" in sys.modules)
"""


@pytest.mark.parametrize("cases, want", [
    ('["train", "--help"], ["--version"], ["train", "--steps", "0"], ["train", "--warmup", "-1"], '
     '["train", "--stop-at", "9", "--steps", "5"], ["train", "--model", "huge"]',
     ["0 False False", "0 False False", "2 False False", "2 False False", "2 False False", "2 False False"]),
    ('["info", "--no-bf16-check"],', ["0 True False"]),
])
def test_help_and_bad_options_import_no_torch(cases, want, env):
    proc = subprocess.run([sys.executable, "-c", _IMPORTS.format(cases=cases)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line[:1].isdigit()] == want, proc.stdout + proc.stderr


def test_the_package_imports_its_names_on_first_use():
    """``import muonfx`` is cheap (PEP 562); every public name and submodule still resolves."""
    proc = subprocess.run([sys.executable, "-c", "import sys, muonfx; print('torch' in sys.modules); "
                           "import muonfx as m; [getattr(m, n) for n in m.__all__]; print(m.optim.__name__, "
                           "m.testing.__name__, sorted(set(m.__all__) - set(dir(m))))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False", "muonfx.optim muonfx.testing []"], proc.stdout
    with pytest.raises(AttributeError, match="module 'muonfx' has no attribute 'no_such_name'"):
        muonfx.no_such_name
    from muonfx import muon, presets

    assert muon is presets.muon


def test_bf16_check_explains_the_sigill_workaround(monkeypatch):
    def fake_probe(env):  # a CPU whose VM forbids AMX: only the capped ISA works
        return (True, "works") if env.get("ONEDNN_MAX_CPU_ISA") else (False, "the process died with SIGILL")

    monkeypatch.setattr(cli_info, "_probe", fake_probe)
    monkeypatch.setattr(cli_info, "_speed_probe", lambda env: None)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    text = "\n".join(cli_info.bf16_matmul_check())
    assert "SIGILL" in text and "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in text and "export" in text
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    text = "\n".join(cli_info.bf16_matmul_check())
    assert "works" in text and "SIGILL" in text and "keep ONEDNN_MAX_CPU_ISA" in text


def test_bf16_check_advises_the_faster_newton_schulz_dtype(monkeypatch):
    monkeypatch.setattr(cli_info, "_probe", lambda env: (True, "works"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    monkeypatch.setattr(cli_info, "_speed_probe", lambda env: (190.0, 430.0))  # AVX-512 bf16
    from muonfx.linalg import precision

    native = precision.CpuChoice(torch.bfloat16, "native bf16 matmul (avx512_bf16)")
    emulated = precision.CpuChoice(torch.float32, "bf16 would be emulated")
    monkeypatch.setattr(precision, "_cpu", native)
    text = "\n".join(cli_info.bf16_matmul_check())
    assert "float32 190 GFLOP/s, bf16 430 GFLOP/s" in text and "default (CPU): bf16 (native" in text
    assert "bf16 is the faster one here" in text and "MUONFX_NS_DTYPE" not in text
    monkeypatch.setattr(cli_info, "_speed_probe", lambda env: (153.0, 69.0))   # bf16 emulated
    monkeypatch.setattr(precision, "_cpu", emulated)
    text = "\n".join(cli_info.bf16_matmul_check())
    assert "default (CPU): float32" in text and "float32 is the faster one here" in text
    # the rule and the measurement disagree (a busy machine): say how to override
    monkeypatch.setattr(precision, "_cpu", native)
    text = "\n".join(cli_info.bf16_matmul_check())
    assert "but float32 measured faster" in text and "MUONFX_NS_DTYPE=float32" in text
    # the real probe returns two positive rates
    rates = cli_info._speed_probe(dict(os.environ))
    assert rates is not None and all(r > 0 for r in rates)


def test_bench_lists_and_reports_a_missing_directory(tmp_path, capsys):
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert main(["bench", "--dir", str(tmp_path / "nowhere")]) == 1
    assert "no benchmarks/ directory" in capsys.readouterr().err
    assert main(["bench", "--only", "no_such_bench", "--list"]) == 2
    assert "unknown benchmark no_such_bench" in capsys.readouterr().err


def test_console_script_and_dev_extra_are_declared():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["muonfx"] == "muonfx.cli:main"
    dev = " ".join(project["optional-dependencies"]["dev"])
    assert "matplotlib" in dev and "tqdm" in dev and "pytest" in dev


# ---------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------


def test_unknown_optimizer_is_one_clear_line(env):
    proc = muonfx_cmd(env, "train", "--optimizer", "sgd", "--steps", "1")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "unknown optimizer 'sgd'" in err and all(n in err for n in optimizer_names())


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--fsdp"], "torchrun --nproc_per_node=2 -m muonfx train --fsdp"),
    (["--resume", "/no/such/ckpt.pt"], "no such file"),
    (["--compare", "adamw", "--save", "x.pt"], "does not combine"),
    (["--compare", "adamw", "--optimizer", "adamw"], "is the same as"),
    (["--batch-size", "four"], "invalid int value"),
    (["--stop-at", "9", "--steps", "5"], "--stop-at must be between 1 and --steps"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, env, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    try:
        code = main(["train", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def test_train_runs_and_writes_its_summary(env, tmp_path):
    out = tmp_path / "run"
    text = ok(muonfx_cmd(env, "train", "--steps", "5", "--model", "tiny", "--batch-size", "4", "--threads", "1",
                         "--eval-batches", "2", "--out", str(out)))
    s = summary(out)
    run = s["runs"]["muon_adamw"]
    assert [st for st, _ in run["train_curve"]] == [1, 2, 3, 4, 5]
    assert [st for st, _ in run["val_curve"]] == [0, 5]
    assert math.isfinite(run["final_val_loss"]) and run["final_val_loss"] < run["val_curve"][0][1]
    assert {g["tx"]: g["tensors"] for g in run["param_groups"]} == {"muon": 16, "adamw": 12}
    assert s["corpus"]["files"] > 50 and s["corpus"]["chars"] > 10 ** 6 and len(s["corpus"]["sha256"]) == 64
    assert s["versions"]["torch"] == torch.__version__ and s["settings"]["steps"] == 5
    assert "final val loss" in text and "summary.json" in text


def test_compare_writes_a_png_and_a_json(env, tmp_path):
    out = tmp_path / "cmp"
    text = ok(muonfx_cmd(env, "train", "--compare", "adamw", "--steps", "5", *FAST, "--no-progress", "--out", str(out)))
    assert (out / "loss.png").read_bytes()[:8] == PNG
    s = summary(out)
    assert set(s["runs"]) == {"muon_adamw", "adamw"}
    cmp = s["comparison"]
    assert cmp["baseline"] == "adamw" and cmp["target_val_loss"] == s["runs"]["adamw"]["final_val_loss"]
    assert set(cmp["steps_to_reach"]) == {"muon_adamw", "adamw"}
    assert s["runs"]["adamw"]["param_groups"] == [
        {"tx": "adamw", "lr": 1e-2, "tensors": 28, "params": s["runs"]["adamw"]["params"]}]
    assert "adamw's final val loss" in text



@pytest.fixture(scope="module")
def six_steps(cache, tmp_path_factory):
    """A 6-step run saved at the end (in this process): the reference for resume and FSDP."""
    d = tmp_path_factory.mktemp("six")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MUONFX_CACHE_DIR", str(cache))
        assert run_main(["train", "--steps", "6", "--eval-every", "3", *FAST, "--no-progress",
                         "--out", str(d / "out"), "--save", str(d / "full.pt")]) == 0
    return d


def test_save_then_resume_continues_exactly(env, tmp_path, six_steps, capsys):
    half, resumed = tmp_path / "half.pt", tmp_path / "resumed.pt"
    assert run_main(["train", "--steps", "6", "--eval-every", "3", *FAST, "--no-progress", "--stop-at", "3",
                     "--save", str(half), "--out", str(tmp_path / "a")]) == 0
    # the checkpoint's settings are the defaults of the resumed run
    assert run_main(["train", "--resume", str(half), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--save", str(resumed), "--out", str(tmp_path / "b")]) == 0
    assert "resumed at step 3 of 6" in capsys.readouterr().out
    full_run, res_run = summary(six_steps / "out")["runs"]["muon_adamw"], summary(tmp_path / "b")["runs"]["muon_adamw"]
    assert res_run["train_curve"] == full_run["train_curve"]
    assert res_run["val_curve"] == full_run["val_curve"]
    a = torch.load(six_steps / "full.pt", weights_only=True)
    b = torch.load(resumed, weights_only=True)
    assert a["step"] == b["step"] == 6
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for name, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][name][k])), (name, k)
    # a resumed run may not change what shaped the checkpoint
    assert main(["train", "--resume", str(half), "--lr", "0.5"]) == 2
    assert "trained with --lr 0.02, not 0.5" in capsys.readouterr().err


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process(env, tmp_path, six_steps):
    out = tmp_path / "fsdp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "muonfx", "train",
         "--fsdp", "--steps", "6", "--stop-at", "3", "--eval-every", "3", *FAST, "--no-progress", "--out", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    text = ok(proc)
    assert "x2 ranks (FSDP2, gloo)" in text
    s = summary(out)
    assert s["fsdp"] == {"world": 2, "backend": "gloo"}
    got = s["runs"]["muon_adamw"]["train_curve"]
    want = summary(six_steps / "out")["runs"]["muon_adamw"]["train_curve"][:3]
    # each rank takes half of the same global batch: the same run up to reduction order
    assert [st for st, _ in got] == [1, 2, 3]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, rel=1e-4)


def test_train_gpt_example_maps_epochs_to_steps(env, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    corpus = load_corpus(env["MUONFX_CACHE_DIR"])
    steps = math.ceil(0.001 * corpus.split / (4 * 128))
    assert train_gpt.epochs_to_steps(0.001, corpus.split, 4, 128) == steps
    assert train_gpt.epochs_to_steps(3, corpus.split, 32, 1024) == math.ceil(3 * corpus.split / (32 * 1024))
    out = tmp_path / "tg"
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            code = train_gpt.main(["--model", "tiny", "--epochs", "0.001", "--batch-size", "4", "--threads", "1",
                                   "--eval-batches", "1", "--no-progress", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    printed = capsys.readouterr().out
    exact = 0.001 * corpus.split / (4 * 128)
    assert f"= {exact:.2f} steps, rounded up -> --steps {steps}" in printed, printed  # says how it rounds
    s = summary(out)
    assert s["runs"]["muon_adamw"]["steps"] == steps and s["command"].startswith("train_gpt.py --model tiny")


# ---------------------------------------------------------------------------
# in-process pieces: corpus, model routing, optimizers, report
# ---------------------------------------------------------------------------


def test_corpus_is_deterministic(cache, tmp_path):
    a = load_corpus(tmp_path, use_cache=False)
    b = load_corpus(tmp_path, use_cache=False)
    c = load_corpus(cache)
    assert c.from_cache and not a.from_cache
    assert a.sha256 == b.sha256 == c.sha256
    assert a.vocab == c.vocab and torch.equal(a.data, c.data)
    assert (a.files, a.chars) == (c.files, c.chars) and len(a.data) == a.chars
    assert a.decode(a.data[:20]) == a.decode(c.data[:20])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_labels_route_embeddings_head_norms_to_adamw(name):
    with torch.device("meta"):
        model = GPT(MODELS[name])
    for n, p in model.named_parameters():
        hidden = p.ndim == 2 and (".attn." in n or ".mlp." in n)
        assert muonfx.default_muon_labels(n, p) == ("muon" if hidden else "adamw"), n


def test_every_preset_builds_an_optimizer():
    model = GPT(GPTConfig(layers=1, d=16, heads=2, context=8, vocab=12))
    assert {"adamw", "muon", "muon_adamw"} <= set(optimizer_names())
    for name in optimizer_names():
        groups = describe(build_optimizer(name, model, None, 3e-3, 0.01))
        assert sum(g["tensors"] for g in groups) == len(list(model.parameters())), name
    muon_groups = describe(build_optimizer("muon", model, None, 3e-3, 0.01))
    assert [(g["tx"], g["tensors"], g["lr"]) for g in muon_groups] == [("muon", 7, 0.02), ("adamw", 3, 3e-3)]


def test_report_helpers(tmp_path, monkeypatch):
    assert steps_to_reach([[0, 5.0], [10, 3.0], [20, 2.0]], 2.5) == {"step": 20, "interpolated": 15.0}
    assert steps_to_reach([[0, 5.0]], 1.0) is None
    runs = {"a": {"val_curve": [[0, 5.0], [10, 3.0]], "train_curve": [[1, 4.0]], "final_val_loss": 3.0},
            "b": {"val_curve": [[0, 5.0], [10, 4.0]], "train_curve": [], "final_val_loss": 4.0}}
    plain_png(runs, tmp_path / "plain.png")
    data = (tmp_path / "plain.png").read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were missing
    note = plot_losses(runs, tmp_path / "fallback.png", "t")
    assert "pip install matplotlib" in note and (tmp_path / "fallback.png").read_bytes()[:8] == PNG


def test_ns_method_reaches_the_muon_groups_and_is_a_run_setting():
    """``--ns-method`` sets the Muon presets' ns_method (every group that has one); a resumed
    run must share it; a checkpoint from before the option resumes with ``"auto"``, the
    default then."""
    from muonfx.cli.args import RUN_KEYS, check_settings, resolve

    model = GPT(GPTConfig(layers=1, d=16, heads=2, context=8, vocab=12))
    for name, method in (("muon_adamw", "gram"), ("muon", "auto")):
        opt = build_optimizer(name, model, None, 3e-3, 0.01, method)
        methods = [g["ns_method"] for g in opt.param_groups if "ns_method" in g]
        assert methods and set(methods) == {method}, (name, methods)
    assert all(g.get("ns_method", "standard") == "standard"
               for g in build_optimizer("muon_adamw", model, None, 3e-3, 0.01).param_groups)
    assert "ns_method" in RUN_KEYS
    assert "'ns_method' must be one of standard, gram, auto" in check_settings({"ns_method": "fast"})
    old = resolve(argparse.Namespace(**{k: None for k in ("optimizer", "model", "lr", "context", "ns_method")}),
                  {"optimizer": "muon_adamw"})
    assert old.ns_method == "auto"
    new = resolve(argparse.Namespace(**{k: None for k in ("optimizer", "model", "lr", "context", "ns_method")}))
    assert new.ns_method == "standard"
