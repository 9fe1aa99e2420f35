"""Faults of the command line, the checkpoint file / distributed faults: each case refused whole
or resumed exactly.

* Ctrl-C (a real SIGINT) at several moments, one of them inside ``opt.step()``, then
  ``--resume``: bitwise the uninterrupted run, as ``--stop-at`` then ``--resume`` is.
* ``--fsdp`` Ctrl-C: every rank stops after the same step and the checkpoint is written.
* a checkpoint with one flipped byte, hand-made checkpoints (missing entries, wrong
  types, settings that are not numbers, state that does not fit the model): one line,
  exit 2, before anything is trained.
* ``--lr/--adamw-lr/--weight-decay/--grad-clip nan/inf``: one line, exit 2.

What already held and stays covered elsewhere: a ``kill -9`` of one rank does not hang
the others (``test_fsdp.py::test_harness_reraises_a_rank_error_and_does_not_wait_for_the_others``),
DCP resharding 2->3->2 (``test_fsdp.py::test_checkpoint_across_world_sizes``),
``--stop-at`` then ``--resume`` (``test_cli.py::test_save_then_resume_continues_exactly``).
Training runs are the tiny model, batch 4, 6 steps, one thread.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from muonfx.cli import main
from helpers import default_signals, run_main  # noqa: E402
from muonfx.cli.checkpoint import FORMAT, content_sha256, load_checkpoint
from muonfx.cli.corpus import load_corpus

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).resolve().parent / "interrupt_driver.py"
FAST = ["--model", "tiny", "--batch-size", "4", "--threads", "1", "--eval-batches", "2", "--device", "cpu",
        "--no-progress"]
SIX = ["train", "--steps", "6", "--eval-every", "3", *FAST]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("muonfx-cache")
    load_corpus(d)
    return d


@pytest.fixture
def env(cache, monkeypatch) -> dict:
    monkeypatch.setenv("MUONFX_CACHE_DIR", str(cache))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    e = dict(os.environ)
    e.update(MUONFX_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    return e



@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory) -> dict:
    """An uninterrupted 6-step run (saved at the end) and a checkpoint at step 3."""
    d = tmp_path_factory.mktemp("ref")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MUONFX_CACHE_DIR", str(cache))
        assert run_main([*SIX, "--out", str(d / "out"), "--save", str(d / "full.pt")]) == 0
        assert run_main([*SIX, "--stop-at", "3", "--out", str(d / "o3"), "--save", str(d / "half.pt")]) == 0
    return {"full": torch.load(d / "full.pt", weights_only=True), "half": d / "half.pt"}


def assert_same_run(a: dict, b: dict) -> None:
    """Bitwise: parameters, optimizer state, scheduler, data position, loss history."""
    assert a["step"] == b["step"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for name, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][name][k])), (name, k)
    assert torch.equal(a["data_rng"], b["data_rng"])
    assert a["scheduler"] == b["scheduler"]
    assert a["history"] == b["history"]


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------
# Ctrl-C then --resume: exact
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("where, call", [
    ("step", 4),   # inside the 4th opt.step(), as Newton-Schulz starts (momentum already computed)
    pytest.param("batch", 4, marks=pytest.mark.slow),  # right after step 2's batch is drawn (calls 1-2: the
                   # step-0 evaluation's batches): the data generator moved, the step is not done
    pytest.param("eval", 2, marks=pytest.mark.slow),   # inside the step-3 evaluation
])
def test_ctrl_c_then_resume_is_bitwise_the_uninterrupted_run(where, call, env, tmp_path, reference, capsys):
    ck, end = tmp_path / "ck.pt", tmp_path / "end.pt"
    proc = subprocess.run([sys.executable, str(DRIVER), where, str(call), "--", *SIX, "--out", str(tmp_path / "a"),
                           "--save", str(ck)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=default_signals)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    stopped = load_checkpoint(ck)["step"]
    assert 1 <= stopped < 6
    assert f"interrupted after step {stopped}; continue exactly with: muonfx train --resume {ck}" in out
    assert run_main(["train", "--resume", str(ck), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "b"), "--save", str(end)]) == 0
    assert f"resumed at step {stopped} of 6" in capsys.readouterr().out
    assert_same_run(reference["full"], torch.load(end, weights_only=True))


def test_ctrl_c_at_an_unknown_moment_then_resume_is_exact(env, tmp_path, reference):
    """A SIGINT from outside, as soon as training starts."""
    ck, end = tmp_path / "ck.pt", tmp_path / "end.pt"
    p = subprocess.Popen([sys.executable, "-m", "muonfx", *SIX, "--out", str(tmp_path / "a"), "--save", str(ck)],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=default_signals)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "step     0 | val" in line:
            p.send_signal(signal.SIGINT)
            break
    lines.append(p.communicate(timeout=600)[0])
    out = "".join(lines)
    assert p.returncode == 130, out
    resumes_exactly_or_saved_nothing(out, ck, end, tmp_path, reference)


def resumes_exactly_or_saved_nothing(out: str, ck: Path, end: Path, tmp_path: Path, reference: dict) -> None:
    """A signal at an unknown moment: inside step 1's forward or backward pass nothing
    was completed (nothing saved, and said); later, the last completed step was saved
    and resumes bit for bit."""
    if not ck.exists():
        assert "interrupted before step 1 completed; nothing is saved" in out, out
        return
    stopped = load_checkpoint(ck)["step"]
    assert 1 <= stopped < 6 and f"saved step {stopped}" in out, out
    assert f"interrupted after step {stopped}; continue exactly with: muonfx train --resume {ck}" in out
    assert run_main(["train", "--resume", str(ck), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "b"), "--save", str(end)]) == 0
    assert_same_run(reference["full"], torch.load(end, weights_only=True))


def test_ctrl_c_without_save_says_what_is_lost(env, tmp_path):
    proc = subprocess.run([sys.executable, str(DRIVER), "step", "2", "--", *SIX, "--out", str(tmp_path / "a")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=default_signals)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130, out
    assert "interrupted after step 2; steps 1-2 are lost (pass --save PATH to keep them on Ctrl-C)" in out


@pytest.mark.slow
def test_fsdp_ctrl_c_saves_the_same_step_on_every_rank(env, tmp_path):
    """torchrun, 2 gloo ranks; SIGINT to the whole process group (what a terminal's Ctrl-C
    does; torchrun then forwards a second SIGINT to the ranks). The ranks agree on the
    step, write the checkpoint together, and the checkpoint resumes in one process."""
    ck = tmp_path / "ck.pt"
    p = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "muonfx", *SIX,
         "--fsdp", "--out", str(tmp_path / "a"), "--save", str(ck)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=default_signals)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "step     0 | val" in line:
                os.killpg(p.pid, signal.SIGINT)
                break
        lines.append(p.communicate(timeout=150)[0])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = "".join(lines)
    assert p.returncode != 0, out
    stopped = load_checkpoint(ck)["step"]  # checksum and layout verified
    assert 1 <= stopped < 6, out
    assert out.count(f"saved step {stopped} to {ck}") == 1, out  # rank 0 writes, after all ranks agreed
    assert f"interrupted after step {stopped}; continue exactly with" in out
    assert run_main(["train", "--resume", str(ck), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "b")]) == 0


# ---------------------------------------------------------------------------
# the checkpoint file: checksum and layout
# ---------------------------------------------------------------------------


def _record_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each zip record's (data start, size) in a torch.save file."""
    raw = path.read_bytes()
    out = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            off = info.header_offset
            n, m = struct.unpack("<HH", raw[off + 26:off + 30])
            out[info.filename] = (off + 30 + n + m, info.file_size)
    return out


def flipped(src: Path, dst: Path, pos: int) -> Path:
    raw = bytearray(src.read_bytes())
    raw[pos] ^= 0x01
    dst.write_bytes(bytes(raw))
    return dst


def test_a_flipped_byte_is_refused_in_one_line(reference, tmp_path, env, capsys):
    half = reference["half"]
    records = _record_offsets(half)
    tensors = {k: v for k, v in records.items() if "/data/" in k and v[1] > 0}
    big = max(tensors, key=lambda k: tensors[k][1])
    start, size = tensors[big]
    # torch.load itself does not notice a flipped bit in tensor data: the file loads
    # with one changed value
    torch.load(flipped(half, tmp_path / "probe.pt", start + size // 2), weights_only=True)
    positions = [start, start + size // 2, start + size - 1]
    for k, (s, n) in tensors.items():
        positions.append(s + n // 2)  # every tensor, scalars and RNG states included
    checksum_errors = 0
    for pos in positions:
        bad = flipped(half, tmp_path / "bad.pt", pos)
        err = one_line_error(capsys, run_main(["train", "--resume", str(bad), "--out", str(tmp_path / "o")]))
        assert err.startswith(f"muonfx train: error: --resume {bad}: "), err
        checksum_errors += "checksum mismatch" in err
    assert checksum_errors == len(positions)  # every flip in tensor data is caught by the checksum
    # a flip in the pickle: refused in one line, unless it changed nothing that loads
    # (a pickle memo index, a storage's device name that map_location overrides)
    pkl_start, pkl_size = next(v for k, v in records.items() if k.endswith("data.pkl"))
    want = content_sha256(torch.load(half, weights_only=True))
    refused = 0
    for pos in range(pkl_start, pkl_start + pkl_size, max(1, pkl_size // 12)):
        bad = flipped(half, tmp_path / "bad.pt", pos)
        try:
            same = content_sha256(torch.load(bad, map_location="cpu", weights_only=True)) == want
        except Exception:
            same = False
        if same:
            continue
        refused += 1
        err = one_line_error(capsys, run_main(["train", "--resume", str(bad), "--out", str(tmp_path / "o")]))
        assert err.startswith(f"muonfx train: error: --resume {bad}: "), err
    assert refused >= 6
    assert not (tmp_path / "o").exists()  # nothing ran


def resigned(ckpt: dict, path: Path, **changes) -> Path:
    """``ckpt`` with ``changes`` (None deletes), saved with a valid checksum: a hand-made file."""
    c = dict(ckpt)
    for k, v in changes.items():
        if v is None:
            c.pop(k)
        else:
            c[k] = v
    if "sha256" not in changes:
        c["sha256"] = content_sha256(c)
    torch.save(c, path)
    return path


@pytest.mark.parametrize("change, message", [
    (dict(settings=None), "the checkpoint has no 'settings' entry"),
    (dict(step=None, history=None), "the checkpoint has no 'step', 'history' entry"),
    (dict(step="3"), "the checkpoint's 'step' entry is a str, expected int"),
    (dict(step=0), "the checkpoint's step is 0"),
    (dict(data_rng=[1, 2]), "the checkpoint's 'data_rng' entry is a list, expected Tensor"),
    (dict(history={"train": []}), "the checkpoint's history has no 'val' list"),
    (dict(format="muonfx-train/1"), "format 'muonfx-train/1', this muonfx reads 'muonfx-train/2'"),
    (dict(format="something"), "not a muonfx train checkpoint"),
    (dict(sha256=None), "the checkpoint has no 'sha256' entry"),
])
def test_hand_made_checkpoints_are_one_line_errors(change, message, reference, tmp_path, env, capsys):
    ckpt = torch.load(reference["half"], weights_only=True)
    bad = resigned(ckpt, tmp_path / "bad.pt", **change)
    err = one_line_error(capsys, run_main(["train", "--resume", str(bad), "--out", str(tmp_path / "o")]))
    assert message in err, err


@pytest.mark.parametrize("key, value, message", [
    ("lr", "abc", "the checkpoint's setting 'lr' must be a number, got 'abc'"),
    ("lr", float("nan"), "the checkpoint's setting 'lr' must be a finite number, got nan"),
    ("batch_size", 4.5, "the checkpoint's setting 'batch_size' must be an integer, got 4.5"),
    ("model", "huge", "the checkpoint's setting 'model' names no model: 'huge'"),
    ("optimizer", 3, "the checkpoint's setting 'optimizer' must be a name, got 3"),
])
def test_hand_made_settings_are_one_line_errors(key, value, message, reference, tmp_path, env, capsys):
    ckpt = torch.load(reference["half"], weights_only=True)
    bad = resigned(ckpt, tmp_path / "bad.pt", settings={**ckpt["settings"], key: value})
    err = one_line_error(capsys, run_main(["train", "--resume", str(bad), "--out", str(tmp_path / "o")]))
    assert message in err, err


def test_state_that_does_not_fit_the_model_is_one_line(reference, tmp_path, env, capsys):
    ckpt = torch.load(reference["half"], weights_only=True)
    name = next(iter(ckpt["model"]))
    model = {k: v for k, v in ckpt["model"].items() if k != name}
    bad = resigned(ckpt, tmp_path / "bad.pt", model=model)
    err = one_line_error(capsys, run_main(["train", "--resume", str(bad), "--threads", "1", "--device", "cpu",
                                           "--no-progress", "--out", str(tmp_path / "o")]))
    assert f"its model state does not fit this run's model: missing ['{name}']" in err, err
    assert not (tmp_path / "o").exists()
    shape = {**ckpt["model"], name: ckpt["model"][name][:1]}
    bad = resigned(ckpt, tmp_path / "bad.pt", model=shape)
    err = one_line_error(capsys, run_main(["train", "--resume", str(bad), "--threads", "1", "--device", "cpu",
                                           "--no-progress", "--out", str(tmp_path / "o")]))
    assert "its state does not fit this run" in err and name in err, err


def test_saved_checkpoint_verifies(reference):
    ckpt = load_checkpoint(reference["half"])
    assert ckpt["format"] == FORMAT and ckpt["sha256"] == content_sha256(ckpt) and ckpt["step"] == 3


# ---------------------------------------------------------------------------
# options that are not finite numbers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--lr", "--adamw-lr", "--weight-decay", "--grad-clip"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_one_line_errors(flag, value, env, tmp_path, capsys):
    err = one_line_error(capsys, main(["train", f"{flag}={value}", "--steps", "2", "--out", str(tmp_path / "o")]))
    assert f"{flag} must be a finite number, got {float(value)}" in err, err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------
# distributed: a rank-local error does not strand the other ranks
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_local_error_raises_on_every_rank_at_once():
    """Rank 1 alone has a bad lr ("abc") and stays alive 4 s after its error. Without the
    agreement rank 0 waited in the all-to-all until rank 1 went away (4 s here; with a rank
    that never goes away, until gloo's 30-minute default). A setting on one rank alone is a
    difference between the ranks: both raise the same SettingsDiffer naming it and each
    rank's value, within milliseconds."""
    from dist_harness import run_world

    import fault_workers as fw

    hold = 4.0
    res = run_world(fw.rank_local_error, 2, 1, hold, timeout=120)
    assert res[0]["error"] == res[1]["error"], res
    kind, msg = res[1]["error"]
    assert kind == "SettingsDiffer" and "disagree on 'lr' of param group 0" in msg, res[1]
    assert "rank(s) [1]: 'abc'" in msg and "rank(s) [0]: 0.02" in msg, msg
    assert res[0]["seconds"] < hold / 4, res[0]
    assert res[0]["unchanged"] and res[1]["unchanged"]


@pytest.mark.slow
def test_row_normalize_on_shards_with_fewer_rows_than_ranks():
    """NorMuon's row statistics on DTensors: a 1-row and a 2-row matrix (fewer rows than
    ranks: empty shards), a tall one, 2 experts over W ranks, a conv weight, a column
    shard; 3 updates vs the whole tensors. The statistics go through seam.sum_over: two
    reductions per update for all leaves (the column shard's row sums, then every
    matrix's two norms), and no collective of DTensor's own (which it made twice per
    matrix before, and which failed on some torch versions for empty row shards).
    Measured max abs error: 2.4e-7 (the column-sharded row sums' reduction order)."""
    from dist_harness import run_world

    import fault_workers as fw

    W = 3  # 1 and 2 rows over 3 ranks (W=2 with the 1-row matrix: the same code path)
    res = run_world(fw.row_normalize_on_shards, W, timeout=180)
    for r in range(W):
        assert res[r]["reductions"] == [2, 2, 2], res[r]
        assert res[r]["all_reduces"] == [0, 0, 0], res[r]
    for step in res[0]["errors"]:
        assert max(step.values()) < 1e-6, step
    assert max(res[0]["v_errors"].values()) < 1e-6


@pytest.mark.slow
def test_row_normalize_larger_axis_on_shards():
    """``axis="larger"`` (modded-nanogpt's NorMuon: per-column statistics of wide
    matrices, taken as the rows of their transpose) on the same DTensors: the same
    result as on whole tensors, through the seam's reductions only. Measured: 2 reductions
    per update, no DTensor collective, max abs error 2.4e-7."""
    from dist_harness import run_world

    import fault_workers as fw

    W = 3
    res = run_world(fw.row_normalize_on_shards, W, 3, "larger", timeout=180)
    for r in range(W):
        assert res[r]["all_reduces"] == [0, 0, 0], res[r]
        assert res[r]["reductions"] == [2, 2, 2], res[r]
    for step in res[0]["errors"]:
        assert max(step.values()) < 1e-6, step
    assert max(res[0]["v_errors"].values()) < 1e-6


# ---------------------------------------------------------------------------
# preemption: SIGTERM stops at a step boundary, as Ctrl-C does
# ---------------------------------------------------------------------------


def _signal_after_first_eval(cmd: list[str], env: dict, sig: int, group: bool = False, timeout: int = 150) -> tuple[int, str]:
    """Start ``cmd``, send ``sig`` once the step-0 evaluation is printed (to the process, or
    to its whole group), return (exit status, output)."""
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, preexec_fn=default_signals)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "step     0 | val" in line:
                (os.killpg if group else os.kill)(p.pid, sig)
                break
        lines.append(p.communicate(timeout=timeout)[0])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, "".join(lines)


def test_sigterm_saves_the_last_completed_step_and_resumes_exactly(env, tmp_path, reference):
    """What SLURM or Kubernetes send to stop a job, at an unknown moment: the run saves
    its last completed step, says how to go on, exits 143; --resume then continues bit
    for bit."""
    ck, end = tmp_path / "ck.pt", tmp_path / "end.pt"
    code, out = _signal_after_first_eval([sys.executable, "-m", "muonfx", *SIX, "--out", str(tmp_path / "a"),
                                          "--save", str(ck)], env, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, out
    assert "SIGTERM: stopping at the last completed step (a step in its forward or backward pass is abandoned, " \
           "one inside opt.step() finishes first), then saving to" in out and "Traceback" not in out, out
    assert "muonfx train: terminated (SIGTERM)" in out
    resumes_exactly_or_saved_nothing(out, ck, end, tmp_path, reference)


def _signal_in_a_pass(where: str, call: int, argv: list[str], env: dict, sig: int) -> tuple[int, str]:
    """``muonfx <argv>`` paused inside the ``where`` pass (forward or backward) of training
    step ``call`` (tests/interrupt_driver.py); ``sig`` sent from here once it says so."""
    p = subprocess.Popen([sys.executable, str(DRIVER), where, str(call), "--", *argv], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=default_signals)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if f"driver: paused in the {where} pass of step {call}" in line:
                os.kill(p.pid, sig)
                break
        lines.append(p.communicate(timeout=600)[0])  # bounds a hang only
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, "".join(lines)


@pytest.mark.parametrize("where, sig", [("forward", signal.SIGTERM), ("backward", signal.SIGHUP)],
                         ids=["forward-SIGTERM", "backward-SIGHUP"])
def test_a_signal_in_the_forward_or_backward_pass_abandons_the_step_and_saves_the_last_one(
        where, sig, env, tmp_path, reference):
    """A preemption signal inside step 4's forward (backward) pass: step 4 is dropped at
    once, not finished; the checkpoint is step 3's, bit for bit what ``--stop-at 3``
    saves (parameters, optimizer state, scheduler, data generator, loss history), and the
    resumed run ends bit for bit where the uninterrupted one ends."""
    ck, end = tmp_path / "ck.pt", tmp_path / "end.pt"
    code, out = _signal_in_a_pass(where, 4, [*SIX, "--out", str(tmp_path / "a"), "--save", str(ck)], env, sig)
    assert code == 128 + sig, out
    name = signal.Signals(sig).name
    assert f"{name}: stopping at the last completed step" in out and "Traceback" not in out, out
    assert f"step 4 abandoned after its {where} pass: the parameters and optimizer state are those of step 3" in out
    assert f"saved step 3 to {ck}" in out and "saved step 4" not in out, out
    assert f"interrupted after step 3; continue exactly with: muonfx train --resume {ck}" in out
    assert f"muonfx train: terminated ({name})" in out
    assert_same_run(torch.load(reference["half"], weights_only=True), load_checkpoint(ck))
    assert run_main(["train", "--resume", str(ck), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "b"), "--save", str(end)]) == 0
    assert_same_run(reference["full"], torch.load(end, weights_only=True))


@pytest.mark.slow  # the default run has the same moment with SIGINT (test_ctrl_c_then_resume_...[step-4])
def test_a_sigterm_inside_opt_step_is_waited_for(env, tmp_path, reference):
    """A SIGTERM inside the 4th ``opt.step()`` (as Newton-Schulz starts): that step is
    finished, then saved; the resume is bit for bit."""
    ck, end = tmp_path / "ck.pt", tmp_path / "end.pt"
    proc = subprocess.run([sys.executable, str(DRIVER), "step", "4", "TERM", "--", *SIX, "--out", str(tmp_path / "a"),
                           "--save", str(ck)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          preexec_fn=default_signals)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "step 4 abandoned" not in out and load_checkpoint(ck)["step"] == 4, out
    assert run_main(["train", "--resume", str(ck), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "b"), "--save", str(end)]) == 0
    assert_same_run(reference["full"], torch.load(end, weights_only=True))


def test_a_signal_before_the_first_step_completes_saves_nothing(env, tmp_path):
    ck = tmp_path / "ck.pt"
    code, out = _signal_in_a_pass("forward", 1, [*SIX, "--out", str(tmp_path / "a"), "--save", str(ck)], env,
                                  signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, out
    assert "interrupted before step 1 completed; nothing is saved" in out and "Traceback" not in out, out
    assert not ck.exists()


@pytest.mark.slow
def test_fsdp_sigterm_to_torchrun_saves_the_same_step_on_every_rank(env, tmp_path, reference):
    """SIGTERM to torchrun alone (a scheduler stopping the job): torchrun passes it to the
    ranks, which agree on the step, write one checkpoint and stop; it resumes in one
    process to the uninterrupted run's numbers (FSDP2's reductions: within 1e-6)."""
    ck, end = tmp_path / "ck.pt", tmp_path / "end.pt"
    code, out = _signal_after_first_eval(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "muonfx", *SIX,
         "--fsdp", "--out", str(tmp_path / "a"), "--save", str(ck)], env, signal.SIGTERM)
    assert code != 0, out
    stopped = load_checkpoint(ck)["step"]
    assert 1 <= stopped < 6, out
    assert out.count(f"saved step {stopped} to {ck}") == 1, out
    assert "SIGTERM: finishing the current step on all ranks" in out, out
    assert run_main(["train", "--resume", str(ck), "--threads", "1", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "b"), "--save", str(end)]) == 0
    got, want = torch.load(end, weights_only=True), reference["full"]
    assert got["step"] == want["step"] == 6
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------------------
# resume: the thread count that decides the sums' rounding travels with the checkpoint
# ---------------------------------------------------------------------------


def test_resume_reuses_the_checkpoints_thread_count_and_stays_exact(env, cache, tmp_path, capsys, monkeypatch):
    """The checkpoint's count (all of this machine's cores), where the automatic count
    (``--threads 0``, load based) would pick another (made so here), so a resume that did
    not reuse it would round differently (1 against 2 threads: 7.5e-4 apart). A count above
    the machine's cores is taken down to them, with a note."""
    from muonfx.cli import runtime

    monkeypatch.setenv("MUONFX_CACHE_DIR", str(cache))
    k = os.cpu_count() or 1
    monkeypatch.setattr(runtime, "auto_threads", lambda: max(1, k - 1))
    i = SIX.index("--threads")
    run = SIX[:i] + SIX[i + 2:]
    assert run_main([*run, "--threads", str(k), "--out", str(tmp_path / "f"), "--save", str(tmp_path / "full.pt")]) == 0
    assert run_main([*run, "--threads", str(k), "--stop-at", "3", "--out", str(tmp_path / "h"),
                     "--save", str(tmp_path / "half.pt")]) == 0
    assert load_checkpoint(tmp_path / "half.pt")["settings"]["threads"] == k
    capsys.readouterr()
    assert run_main(["train", "--resume", str(tmp_path / "half.pt"), "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "r"), "--save", str(tmp_path / "end.pt")]) == 0
    assert "note: the checkpoint was trained with" not in capsys.readouterr().out
    assert_same_run(torch.load(tmp_path / "full.pt", weights_only=True),
                    torch.load(tmp_path / "end.pt", weights_only=True))
    # a count given on the command line wins, and the run says what that costs
    assert run_main(["train", "--resume", str(tmp_path / "half.pt"), "--threads", "1", "--device", "cpu",
                     "--no-progress", "--out", str(tmp_path / "r1")]) == 0
    assert (f"note: the checkpoint was trained with {k} CPU thread{'s' if k != 1 else ''}, this run uses 1 "
            "(--threads): the results differ from an uninterrupted run by rounding") in capsys.readouterr().out
    # more threads than cores (a larger machine's checkpoint): this machine's cores, said once
    data = torch.load(tmp_path / "half.pt", weights_only=True)
    data["settings"]["threads"] = k + 1
    data["sha256"] = content_sha256(data)
    torch.save(data, tmp_path / "more.pt")
    assert run_main(["train", "--resume", str(tmp_path / "more.pt"), "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "r2")]) == 0
    assert f"trained with {k + 1} CPU threads, this run uses {k}" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# found before the first step, not after the last one
# ---------------------------------------------------------------------------


def test_an_unwritable_save_path_is_refused_before_training(env, tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    for save, message in [
        (tmp_path / "a-file" / "ck.pt", f"{tmp_path / 'a-file'} is a file, not a folder"),
        (tmp_path / "a-file" / "sub" / "ck.pt", f"{tmp_path / 'a-file'} is a file, not a folder"),
        (tmp_path, "is a folder; give a file path, e.g. "),
    ]:
        err = one_line_error(capsys, run_main([*SIX, "--out", str(tmp_path / "o"), "--save", str(save)]))
        assert err.startswith(f"muonfx train: error: --save {save}") and message in err, err
        assert not (tmp_path / "o").exists()  # nothing ran
    if os.geteuid() != 0:  # root writes into read-only folders: this part needs an ordinary user
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        err = one_line_error(capsys, run_main([*SIX, "--out", str(tmp_path / "o"), "--save", str(ro / "ck.pt")]))
        assert "cannot write there (Permission denied)" in err, err
    # a folder that does not exist yet is made, as the save would make it
    assert run_main([*SIX, "--steps", "1", "--eval-every", "1", "--out", str(tmp_path / "o1"),
                     "--save", str(tmp_path / "new" / "deeper" / "ck.pt")]) == 0
    assert load_checkpoint(tmp_path / "new" / "deeper" / "ck.pt")["step"] == 1
    assert [p.name for p in (tmp_path / "new" / "deeper").iterdir()] == ["ck.pt"]  # no probe left behind


@pytest.mark.parametrize("stop_at", [1, 3])
def test_resume_with_a_stop_at_not_after_the_checkpoint_is_an_error(stop_at, reference, tmp_path, env, capsys):
    err = one_line_error(capsys, run_main(["train", "--resume", str(reference["half"]), "--stop-at", str(stop_at),
                                           "--out", str(tmp_path / "o")]))
    assert (f"--resume: the checkpoint is at step 3, --stop-at {stop_at} leaves nothing to train; pass a --stop-at "
            "after step 3, or drop it") in err, err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------
# MUONFX_NS_DTYPE: a value no optimizer takes is said once, in one line
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["garbage", "float64"])
def test_an_invalid_ns_dtype_variable_is_one_line_in_info_and_train(value, env, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MUONFX_NS_DTYPE", value)
    allowed = "use one of float32, bfloat16, float16 or auto"
    assert main(["info", "--no-bf16-check"]) == 2
    cap = capsys.readouterr()
    assert "overrides" not in cap.out, cap.out
    assert f"MUONFX_NS_DTYPE='{value}' is invalid" in cap.out
    assert cap.err.strip() == (f"muonfx info: error: the environment variable MUONFX_NS_DTYPE: unknown "
                               f"Newton-Schulz dtype '{value}'; {allowed}")
    err = one_line_error(capsys, run_main([*SIX, "--out", str(tmp_path / "o")]))
    assert "MUONFX_NS_DTYPE" in err and allowed in err, err
    assert not (tmp_path / "o").exists()
    monkeypatch.setenv("MUONFX_NS_DTYPE", "bf16")  # a valid one still says it overrides the default
    assert main(["info", "--no-bf16-check"]) == 0
    assert "MUONFX_NS_DTYPE=bf16 overrides it" in capsys.readouterr().out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's ranks through /proc (Linux)")
def test_fsdp_kill_9_of_a_rank_leaves_the_checkpoint_whole_and_the_resume_exact(env, tmp_path):
    """``kill -9`` of one rank (an out-of-memory kill, a lost node) while a resumed FSDP2
    run trains toward a new checkpoint: no rank waits for the dead one, the checkpoint the
    run started from is untouched and no partial new one is left; resumed again, the run
    ends bit for bit where an uninterrupted FSDP2 run ends (the same ranks, the same
    reduction order)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "muonfx",
           "train", "--steps", "12", "--eval-every", "3", *FAST, "--fsdp"]
    full, ck, lost, end = (tmp_path / n for n in ("full.pt", "ck.pt", "lost.pt", "end.pt"))
    for out, extra in (("a", ["--save", str(full)]), ("b", ["--stop-at", "3", "--save", str(ck)])):
        proc = subprocess.run([*run, *extra, "--out", str(tmp_path / out)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    before = ck.read_bytes()
    p = subprocess.Popen([*run, "--resume", str(ck), "--save", str(lost), "--out", str(tmp_path / "killed")],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    lines, killed = [], None
    try:
        for line in p.stdout:
            lines.append(line)
            if "resumed at step 3 of 12" in line:
                ranks = _children(p.pid)
                assert len(ranks) == 2, (ranks, "".join(lines))
                killed = ranks[-1]
                os.kill(killed, signal.SIGKILL)
                break
        lines.append(p.communicate(timeout=120)[0])  # the other rank does not wait for the dead one
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = "".join(lines)
    assert killed is not None and p.returncode != 0, out
    assert ck.read_bytes() == before and load_checkpoint(ck)["step"] == 3
    assert not lost.exists() or load_checkpoint(lost)["step"] > 3, out  # never a partial file
    proc = subprocess.run([*run, "--resume", str(ck), "--save", str(end), "--out", str(tmp_path / "again")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_same_run(torch.load(full, weights_only=True), torch.load(end, weights_only=True))
