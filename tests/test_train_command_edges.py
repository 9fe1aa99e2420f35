"""``muonfx train`` and ``muonfx bench`` at their edges: every catalogue optimizer trains
next to AdamW (``--optimizer NAME --compare adamw``) and an unknown name is refused with the
valid ones; paths that cannot be used are refused before training, a checkpoint that
cannot be written costs the checkpoint and nothing else, SIGHUP stops a run as SIGTERM does, a damaged corpus cache is rebuilt."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
import torch

from helpers import run_main  # noqa: E402
from test_faults_cli import cache, env  # noqa: F401  (the corpus cache and the environment of the CLI tests)
from muonfx.cli import checkpoint as cli_checkpoint
from muonfx.cli.checkpoint import CheckpointError, content_sha256, load_checkpoint, write_atomically
from muonfx.cli.corpus import load_corpus
from muonfx.cli.interrupt import StepInterrupt
from muonfx.cli.optimizers import optimizer_names
from muonfx.presets import catalogue

FAST = ["--model", "tiny", "--batch-size", "2", "--context", "16", "--threads", "1", "--eval-batches", "1",
        "--device", "cpu", "--no-progress"]
TWO = ["train", "--steps", "2", "--eval-every", "2", *FAST]


@pytest.mark.parametrize("name", catalogue.__all__)
def test_each_catalogue_optimizer_trains_next_to_adamw(name, env, tmp_path):
    assert run_main([*TWO, "--optimizer", name, "--compare", "adamw", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert set(runs) == {name, "adamw"}
    for rec in runs.values():
        assert rec["steps"] == 2 and all(torch.isfinite(torch.tensor(v)) for _, v in rec["val_curve"])
    assert runs[name]["final_val_loss"] != runs["adamw"]["final_val_loss"]  # it stepped, and not as AdamW


def test_every_optimizer_name_is_in_the_help_and_an_unknown_one_lists_them(env, capsys):
    assert set(catalogue.__all__) <= set(optimizer_names())
    with pytest.raises(SystemExit):
        run_main(["train", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert all(n in helptext for n in optimizer_names()), helptext
    assert run_main([*TWO, "--optimizer", "lamb", "--compare", "adamw"]) == 2
    err = capsys.readouterr().err
    assert "unknown optimizer 'lamb'; choose one of: " + ", ".join(optimizer_names()) in err


@pytest.mark.parametrize("option", ["--save", "--resume", "--out", "--cache-dir"])
def test_an_empty_path_is_refused_before_training(option, env, capsys):
    assert run_main([*TWO, option, ""]) == 2
    err = capsys.readouterr().err
    assert f"{option} is empty" in err, err


def test_out_naming_a_file_is_refused_before_training(env, tmp_path, capsys):
    f = tmp_path / "summary"
    f.write_text("mine")
    assert run_main([*TWO, "--out", str(f)]) == 2
    assert f"--out {f} is a file" in capsys.readouterr().err
    assert f.read_text() == "mine"


def test_a_checkpoint_is_written_under_a_fresh_name_and_renamed(tmp_path):
    """The temporary file is created exclusively (a link planted at a predictable name is
    neither followed nor overwritten) and renamed over the target."""
    target = tmp_path / "ck.pt"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "ck.pt.tmp").symlink_to(victim)  # the name the old writer used
    write_atomically(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "ck.pt.tmp", "victim"]


def test_a_full_disk_leaves_no_partial_file_and_the_old_checkpoint(tmp_path):
    target = tmp_path / "ck.pt"
    target.write_bytes(b"old")

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(CheckpointError, match="No space left on device"):
        write_atomically(target, full)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_a_full_disk_at_the_final_save_keeps_the_trained_run_in_the_summary(env, tmp_path, capsys, monkeypatch):
    def full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cli_checkpoint.torch, "save", full)
    out = tmp_path / "run"
    assert run_main([*TWO, "--out", str(out), "--save", str(tmp_path / "ck" / "final.pt")]) == 1
    cap = capsys.readouterr()
    assert "could not save step 2" in cap.out and "No space left on device" in cap.err, cap
    assert "Traceback" not in cap.out + cap.err
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"]["muon_adamw"]
    assert run["steps"] == 2 and "No space left" in run["save_error"]
    assert list((tmp_path / "ck").iterdir()) == []  # no partial file left behind


def test_resume_refuses_another_amp_and_bounds_the_saved_thread_count(env, tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    assert run_main([*TWO, "--steps", "3", "--stop-at", "1", "--out", str(tmp_path / "a"), "--save", str(ck)]) == 0
    capsys.readouterr()
    assert run_main(["train", "--resume", str(ck), "--amp", "bf16", "--out", str(tmp_path / "b")]) == 2
    assert "trained with --amp auto, not bf16" in capsys.readouterr().err
    # a checkpoint that asks for a million threads (hand-edited): the run takes the machine's cores at most
    data = torch.load(ck, weights_only=True)
    data["settings"]["threads"] = 10**6
    data["sha256"] = content_sha256(data)
    torch.save(data, ck)
    assert load_checkpoint(ck)["settings"]["threads"] == 10**6
    assert run_main(["train", "--resume", str(ck), "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / "c")]) == 0
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert 1 <= summary["threads"] <= (os.cpu_count() or 1)


def test_sighup_asks_the_run_to_stop_as_sigterm_does():
    with StepInterrupt() as ctrl:
        os.kill(os.getpid(), signal.SIGHUP)
        assert ctrl.requested and ctrl.signum == signal.SIGHUP
    assert signal.getsignal(signal.SIGHUP) != ctrl._handle  # put back on the way out


def test_a_damaged_corpus_cache_is_rebuilt(tmp_path):
    first = load_corpus(tmp_path)
    (cached,) = tmp_path.glob("corpus-*.pt")
    good = torch.load(cached, weights_only=True)
    for damage in ({**good, "data": good["data"][:100]},  # truncated tokens
                   {**good, "data": good["data"] + 1000},  # tokens outside the vocabulary
                   {**good, "chars": "many"},  # a field of the wrong type
                   [1, 2, 3]):  # not a corpus at all
        torch.save(damage, cached)
        again = load_corpus(tmp_path)
        assert not again.from_cache and again.sha256 == first.sha256 and torch.equal(again.data, first.data)
        assert load_corpus(tmp_path).from_cache  # and the cache is whole again


def test_bench_refuses_a_word_that_is_not_an_option(tmp_path, capsys):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "one.py").write_text('print("ran")\n')
    assert run_main(["bench", "--dir", str(d), "one"]) == 2
    cap = capsys.readouterr()
    assert "unexpected 'one'" in cap.err and "--only NAME" in cap.err and "ran" not in cap.out
