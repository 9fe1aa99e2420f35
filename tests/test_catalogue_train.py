"""scripts/catalogue_train.py: the per-optimizer ``--lr`` options and the ``--sweep``
table, with the runs of ``muonfx train`` replaced by recorded results (the script's own
subprocesses take minutes; what is checked here is what it does with their results)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("catalogue_train", ROOT / "scripts" / "catalogue_train.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its folders in front
    spec.loader.exec_module(mod)
    return mod


def _record(final: float, steps: int = 100) -> dict:
    curve = [[0, 5.0], [steps // 2, (5.0 + final) / 2], [steps, final]]
    return {"final_val_loss": final, "val_curve": curve, "steps": steps, "seconds": 12.0, "eval_seconds": 2.0}


def test_lr_options_are_read_per_optimizer_and_bad_ones_name_themselves(script):
    assert script.parse_lrs(["lion=3e-4", "soap=0.03"], ["adamw", "lion", "soap"]) == {"lion": 3e-4, "soap": 0.03}
    for bad in ("lion", "lion=fast", "lion=-1", "lion=0"):
        with pytest.raises(SystemExit, match=f"--lr '{bad}': expected NAME=VALUE with a positive VALUE"):
            script.parse_lrs([bad], ["adamw", "lion"])
    with pytest.raises(SystemExit, match="'soap' is not among the optimizers run"):
        script.parse_lrs(["soap=1e-3"], ["adamw", "lion"])


def test_a_run_at_a_given_lr_has_a_folder_of_its_own(script, tmp_path):
    assert script.run_dir(tmp_path, "lion", 1, None) == tmp_path / "lion-s1"
    assert script.run_dir(tmp_path, "lion", 1, 3e-4) == tmp_path / "lion-lr0.0003-s1"


def test_the_sweep_runs_each_presets_lr_times_each_factor_and_marks_the_best(script, monkeypatch, tmp_path,
                                                                            capsys):
    from muonfx.cli.optimizers import preset_lr

    calls = []
    best = {"lion": 3.0, "muon": 0.5}  # the factor at which each one's loss is lowest

    def fake_run(name, seed, args, out, lr=None):
        calls.append((name, seed, lr))
        if name == "adamw":
            return _record(2.5)
        factor = lr / preset_lr(name)
        return _record(2.0 + abs(factor - best[name]))

    monkeypatch.setattr(script, "run", fake_run)
    script.main(["--sweep", "0.5,1,3", "--names", "lion,muon", "--seeds", "4,5", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    lion, muon = preset_lr("lion"), preset_lr("muon")  # the presets' own: 1e-4, 0.02
    assert calls == [("adamw", 4, None)] + [("lion", 4, lion * f) for f in (0.5, 1, 3)] + \
        [("muon", 4, muon * f) for f in (0.5, 1, 3)]  # the first seed only
    assert f"{lion * 3:g}: 2.000 *" in text and f"{muon * 0.5:g}: 2.000 *" in text
    assert text.count(" * |") == 2  # one best per row
    assert f"the best: --lr lion={lion * 3:g} --lr muon={muon * 0.5:g}" in text


def test_the_table_runs_each_optimizer_at_its_given_lr(script, monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run(name, seed, args, out, lr=None):
        calls.append((name, seed, lr))
        return _record(2.5 if name == "adamw" else 2.3)

    monkeypatch.setattr(script, "run", fake_run)
    script.main(["--names", "lion,soap", "--seeds", "0", "--lr", "lion=0.001", "--out", str(tmp_path)])
    assert calls == [("adamw", 0, None), ("lion", 0, 0.001), ("soap", 0, None)]
    assert "lr: lion 0.001; the others at their defaults" in capsys.readouterr().out


def test_muonfx_train_defaults_the_elementwise_catalogue_to_the_swept_lr():
    """``--lr`` not given: the elementwise catalogue presets train at the sweep's best
    (MAIN_JOB_LR, docs/evidence.md), not at their references' defaults; the Muon ones and
    AdamW at theirs. Every elementwise preset has a swept lr."""
    import argparse

    from muonfx.cli.args import fill_lr
    from muonfx.cli.optimizers import MAIN_JOB_LR, MUON_LR, default_lr, preset_lr
    from muonfx.presets import catalogue

    assert set(MAIN_JOB_LR) == set(catalogue.ELEMENTWISE)
    for name, lr in MAIN_JOB_LR.items():
        args = fill_lr(argparse.Namespace(lr=None, optimizer=name, adamw_lr=3e-3))
        assert args.lr == lr == default_lr(name, 3e-3) and lr > preset_lr(name), name
    assert fill_lr(argparse.Namespace(lr=None, optimizer="dion2", adamw_lr=3e-3)).lr == MUON_LR
    assert fill_lr(argparse.Namespace(lr=0.5, optimizer="soap", adamw_lr=3e-3)).lr == 0.5  # given: kept
