"""The predecessor's users move over in one line.

Every ``python`` block of the predecessor ``muon_fsdp``'s README and FAQ (copied
verbatim into ``tests/data/muon_fsdp/``) runs here as written, with only its import
line changed: ``from muon_fsdp import`` -> ``from muonfx import``
(``from examples.mixed_adamw import create_hybrid_optimizer`` needs no change:
``examples/mixed_adamw.py`` re-exports it). A snippet that uses names it does not
define (``model``, ``dataloader``, ``loss_fn``, ...; the documents leave them to the
reader or define them in an earlier block) gets them from a short prelude, listed per
block below. The FSDP snippets run on two gloo ranks. A block is skipped only for a
reason that has nothing to do with the optimizer (NCCL, a GPU, an interactive
debugger, pseudo-code), written next to it; every block is either run or skipped with
its reason, so a new block cannot go untested.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import muonfx as mfx
from dist_harness import run_world

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "tests" / "data" / "muon_fsdp"


def blocks(doc: str) -> list[str]:
    text = (DOCS / doc).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def swap_import(code: str) -> str:
    """The one change a user makes: the package name in the import line."""
    return re.sub(r"^(\s*)from muon_fsdp import", r"\1from muonfx import", code, flags=re.M)


#: what every prelude starts from: the imports and objects the documents assume
COMMON = """
import torch
import torch.nn as nn
from muonfx import MuonOptimizer, FSDPMuonOptimizer
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
input, target = torch.randn(8, 16), torch.randn(8, 16)
loss_fn = nn.functional.mse_loss
dataloader = [(input, target)]
"""

LOSS = "loss = loss_fn(model(input), target)\n"

#: (document, block index) -> prelude added after COMMON (what the block assumes)
PRELUDE = {
    ("README.md", 0): "dataloader = [(torch.randn(4, 512), torch.randn(4, 512))]\n",
    ("README.md", 2): "",
    ("README.md", 3): "params = model.parameters()\n",
    ("README.md", 4): "",
    ("FAQ.md", 0): "",
    ("FAQ.md", 1): "vocab_size, d_model = 16, 8\n",
    ("FAQ.md", 2): "",
    ("FAQ.md", 3): "",
    ("FAQ.md", 4): "",
    ("FAQ.md", 5): "",
    ("FAQ.md", 6): "",
    ("FAQ.md", 7): LOSS + "loss.backward()\n",
    ("FAQ.md", 8): "",
    ("FAQ.md", 9): "",
    ("FAQ.md", 10): "optimizer = MuonOptimizer(model.parameters(), weight_decay=0.02)\n" + LOSS,
    ("FAQ.md", 11): "from torch.cuda.amp import autocast\n",
    ("FAQ.md", 12): "",
    ("FAQ.md", 13): "",
    ("FAQ.md", 14): "def load_model():\n    return model\n",
    ("FAQ.md", 17): "dataset = torch.utils.data.TensorDataset(input, target)\n",
    ("FAQ.md", 18): "optimizer = MuonOptimizer(model.parameters(), lr=0.02)\n" + LOSS + "loss.backward()\n",
    ("FAQ.md", 19): "",
    ("FAQ.md", 20): "",
    ("FAQ.md", 21): "",
    ("FAQ.md", 22): "",
    ("FAQ.md", 23): "",
    ("FAQ.md", 24): "",
    ("FAQ.md", 25): "",
    ("FAQ.md", 27): "",
    ("FAQ.md", 33): "",
    ("FAQ.md", 34): LOSS,
    ("FAQ.md", 35): "",
    # from_pretrained("gpt2") gives a 2-layer GPT-2 here (no download): see tiny_pretrained
    ("FAQ.md", 36): "ids = torch.randint(0, 64, (2, 8))\ndataloader = [{'input_ids': ids, 'labels': ids}]\n",
    ("FAQ.md", 37): """
from types import SimpleNamespace

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, batch):
        logits = self.head(torch.relu(self.hidden(self.embed(batch))))
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits.flatten(0, 1), ((batch + 1) % 16).flatten()))

model = LM()
optimizer = MuonOptimizer(model.parameters(), lr=0.02)
dataloader = [torch.randint(0, 16, (4, 8)) for _ in range(3)]
step = 0
""",
    ("FAQ.md", 38): "",
    ("FAQ.md", 39): "optimizer = MuonOptimizer(model.parameters(), lr=0.02)\n" + LOSS + "loss.backward()\n",
    ("FAQ.md", 40): LOSS + "loss.backward()\n",
    ("FAQ.md", 42): "",
}

#: blocks that run on two gloo ranks (fully_shard needs a process group), in this order
DISTRIBUTED = [("README.md", 1), ("FAQ.md", 29), ("FAQ.md", 30), ("FAQ.md", 31)]

#: (document, block index) -> why it does not run here; none of them is about the optimizer
SKIP = {
    ("FAQ.md", 15): "dist.init_process_group(backend='nccl', init_method='env://') needs NCCL (CUDA GPUs) and "
                    "torchrun's environment variables",
    ("FAQ.md", 16): "FSDP1 arguments: torch's FSDP2 fully_shard() takes no backward_prefetch/forward_prefetch "
                    "(a TypeError from torch alone, with any optimizer)",
    ("FAQ.md", 26): "dist.init_process_group(backend='nccl', world_size=4, rank=0) needs NCCL and 3 more processes",
    ("FAQ.md", 28): "pseudo-code: DataLoader(dataset, sampler=sampler, ...) is a SyntaxError (positional '...' "
                    "after a keyword argument)",
    ("FAQ.md", 32): "model.cuda(): the FAQ's answer to the predecessor's 'no CPU training'; needs a CUDA GPU",
    ("FAQ.md", 41): "pdb.set_trace() waits for an interactive debugger",
}

#: the blocks whose construction must warn: an argument that means something else now
WARNS = {("README.md", 4): "beta2=0.99 turns on NorMuon", ("FAQ.md", 6): "gradient_accumulation_steps",
         ("FAQ.md", 20): "gradient_accumulation_steps"}

ALL = [(doc, i) for doc in ("README.md", "FAQ.md") for i in range(len(blocks(doc)))]


def test_every_block_is_run_or_skipped_with_a_reason():
    assert len(blocks("README.md")) == 5 and len(blocks("FAQ.md")) == 43
    listed = set(PRELUDE) | set(DISTRIBUTED) | set(SKIP)
    assert sorted(listed) == sorted(ALL), "a block is neither run nor skipped (or listed twice)"
    assert not set(PRELUDE) & set(SKIP) and not set(DISTRIBUTED) & (set(PRELUDE) | set(SKIP))
    # the blocks mention the predecessor only in their import lines
    for doc, i in ALL:
        body = "\n".join(line for line in blocks(doc)[i].splitlines() if not re.match(r"\s*from muon_fsdp import", line))
        assert "muon_fsdp" not in body, (doc, i)


@pytest.fixture
def tiny_pretrained(monkeypatch):
    """``AutoModelForCausalLM.from_pretrained("gpt2")`` without a download: a 2-layer GPT-2."""
    transformers = pytest.importorskip("transformers")

    def from_pretrained(name, *args, **kwargs):
        assert name == "gpt2"
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
        return transformers.AutoModelForCausalLM.from_config(config)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)


def run_block(doc: str, i: int) -> dict:
    code = swap_import(blocks(doc)[i])
    ns: dict = {"__name__": f"muon_fsdp_{doc[:-3].lower()}_{i}"}
    exec(compile(COMMON + PRELUDE[(doc, i)], f"<prelude of {doc} block {i}>", "exec"), ns)
    exec(compile(code, f"<{doc} block {i}>", "exec"), ns)
    return ns


@pytest.mark.parametrize("doc,i", sorted(PRELUDE), ids=[f"{d[:-3]}-{i}" for d, i in sorted(PRELUDE)])
def test_snippet_runs_as_written(doc, i, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)               # the checkpoint snippet writes optimizer.pt here
    monkeypatch.syspath_prepend(str(ROOT))    # `from examples.mixed_adamw import ...` from the repository
    if (doc, i) == ("FAQ.md", 36):
        request.getfixturevalue("tiny_pretrained")
    if (doc, i) == ("FAQ.md", 35):
        pytest.importorskip("pytorch_lightning")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = run_block(doc, i)
    changed = [w for w in caught if issubclass(w.category, mfx.MeaningChangedWarning)]
    if (doc, i) in WARNS:
        assert len(changed) == 1 and WARNS[(doc, i)] in str(changed[0].message), [str(w.message) for w in caught]
    else:
        assert not changed, [str(w.message) for w in changed]
    opt = ns["LitModel"](ns["model"]).configure_optimizers() if (doc, i) == ("FAQ.md", 35) else ns.get("optimizer")
    if "Optimizer(" in blocks(doc)[i] or "create_hybrid_optimizer(" in blocks(doc)[i]:
        assert isinstance(opt, torch.optim.Optimizer), (doc, i)


def test_readme_first_snippet_splits_and_trains(tmp_path, monkeypatch, caplog):
    """README block 0 on its own model (Linear(512, 2048) -> GELU -> Linear(2048, 512)):
    weights to Muon, biases to AdamW, said once in a log line; every parameter moves."""
    caplog.set_level(logging.INFO, logger="muonfx")
    code = swap_import(blocks("README.md")[0])
    code = code.replace("for input, target in dataloader:", "before = [p.detach().clone() for p in model.parameters()]\n"
                                                            "for input, target in dataloader:")
    ns: dict = {"dataloader": [(torch.randn(4, 512), torch.randn(4, 512))], "loss_fn": torch.nn.functional.mse_loss}
    exec(compile(code, "<README.md block 0>", "exec"), ns)
    opt = ns["optimizer"]
    assert [[tuple(p.shape) for p in g["params"]] for g in opt.param_groups] == [[(2048, 512), (512, 2048)],
                                                                                 [(2048,), (512,)]]
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[0]["lr"] == 0.02
    assert all(not torch.equal(p, b) for p, b in zip(ns["model"].parameters(), ns["before"]))
    lines = [r.getMessage() for r in caplog.records if "muonfx: MuonOptimizer:" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("muonfx: MuonOptimizer: Muon for 2 matrices, AdamW (lr 0.001) for 2 0-D/1-D "
                               "parameters (#2 (2048,), #4 (512,) of those given)"), lines[0]
    assert "param1" not in lines[0] and "strict=True" in lines[0]
    # model.parameters() has no names: the line says that embeddings would get Muon, and how to route them
    assert "pass model.named_parameters() or the model itself, or use mfx.create_hybrid_optimizer(model)" in lines[0]


def test_faq_checkpoint_snippet_round_trips(tmp_path, monkeypatch):
    """FAQ block 13 saves and loads the state dict; after a step with the fallback group
    the loaded optimizer continues exactly like the original."""
    monkeypatch.chdir(tmp_path)
    ns = run_block("FAQ.md", 13)
    model, opt = ns["model"], ns["optimizer"]
    for _ in range(2):
        opt.zero_grad()
        ns["loss_fn"](model(ns["input"]), ns["target"]).backward()
        opt.step()
    torch.save(opt.state_dict(), "optimizer.pt")
    twin = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    twin.load_state_dict(model.state_dict())
    opt2 = mfx.MuonOptimizer(twin.parameters(), lr=0.02, momentum=0.95, ns_steps=5)
    opt2.load_state_dict(torch.load("optimizer.pt", weights_only=True))
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        ns["loss_fn"](m(ns["input"]), ns["target"]).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_lightning_configure_optimizers_trains(tmp_path):
    """FAQ block 35's LitModel, as written, trained by a real Lightning Trainer for 2 steps."""
    pl = pytest.importorskip("pytorch_lightning")
    ns = run_block("FAQ.md", 35)

    class Trained(ns["LitModel"]):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 16), torch.randn(16, 16)),
                                       batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    before = [p.detach().clone() for p in model.parameters()]
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Trained(model), data)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _distributed_snippets(rank: int, world_size: int, codes: list[tuple[str, str]]) -> list[str]:
    import torch.nn as nn

    done = []
    ns: dict = {}
    for label, code in codes:
        if label == "FAQ.md 29":  # the FAQ's FSDP answers start from a fresh model
            torch.manual_seed(0)
            ns["model"] = nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model=32, nhead=4), num_layers=2)
        exec(compile(code, f"<{label}>", "exec"), ns)
        done.append(label)
    return done


@pytest.mark.slow
def test_fsdp_snippets_run_on_two_ranks():
    """README block 1 (fully_shard a TransformerEncoder, FSDPMuonOptimizer, train) and the
    FAQ's FSDP answers (blocks 29-31: fully_shard, FSDPMuonOptimizer(model=model, ...),
    unshard_params) on two gloo ranks; the data and loss the README leaves to the reader
    are one batch and MSE."""
    prelude = ("import torch\ntorch.manual_seed(0)\ndataloader = [(torch.randn(8, 2, 512), torch.randn(8, 2, 512))]\n"
               "loss_fn = torch.nn.functional.mse_loss\n")
    codes = [(f"{doc} {i}", (prelude if (doc, i) == ("README.md", 1) else "") + swap_import(blocks(doc)[i]))
             for doc, i in DISTRIBUTED]
    codes.append(("check", "assert len(full_params) == len(list(model.parameters()))\n"
                           "assert all(type(p).__name__ == 'DTensor' for p in model.parameters())\n"))
    results = run_world(_distributed_snippets, 2, codes, timeout=240)
    assert results == [[label for label, _ in codes]] * 2


# -- the predecessor's commands ----------------------------------------------------


def run(*cmd: str, cwd: Path = ROOT, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_pytest_cov_muon_fsdp_names_the_package():
    """``pytest tests/ --cov=muon_fsdp`` (the predecessor's README) stops with the fix
    instead of a bare 'unrecognized arguments'."""
    proc = run(sys.executable, "-m", "pytest", "tests/test_predecessor.py", "--cov=muon_fsdp", "-p", "no:cacheprovider",
               "--collect-only", "-q")
    assert proc.returncode != 0
    assert "--cov=muon_fsdp: the package is muonfx now; use --cov=muonfx" in proc.stderr + proc.stdout


def test_the_predecessors_test_file_names_where_its_tests_went():
    """``pytest tests/test_optimizer.py -v`` (the predecessor's README): one line naming the
    files that test the same things, not a bare "file not found"; the migration guide says so."""
    proc = run(sys.executable, "-m", "pytest", "tests/test_optimizer.py", "-v", "-p", "no:cacheprovider")
    out = proc.stderr + proc.stdout
    assert proc.returncode == 4, out  # pytest's usage error
    assert "tests/test_optimizer.py was muon_fsdp's test file; its subjects are tested in tests/test_parity.py" in out
    for name in ("tests/test_parity.py", "tests/test_predecessor.py", "tests/test_optim_integrations.py"):
        assert (ROOT / name).exists() and name in out
    guide = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    assert "| `pytest tests/test_optimizer.py -v` |" in guide


def test_muon_fsdp_command_points_to_muonfx(capsys):
    """The ``muon-fsdp`` command (pyproject's script) says what it runs now and runs it."""
    from muonfx.cli import legacy

    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^muon-fsdp = "muonfx\.cli\.legacy:main"', pyproject, re.M)
    assert legacy.translate(["check", "--full"])[0] == ["info"]
    assert legacy.translate(["train", "--steps", "3"])[0] == ["train", "--steps", "3"]
    assert legacy.main(["info", "--no-bf16-check"]) == 0
    out = capsys.readouterr()
    assert "muon-fsdp is now muonfx" in out.err and "running 'muonfx info --no-bf16-check'" in out.err
    assert "torch" in out.out


def test_train_gpt_old_flags_are_aliases(tmp_path, monkeypatch, capsys):
    """``examples/train_gpt.py --seq-length --save-dir --num-workers --no-mixed-precision``
    (the predecessor's flags) run, each with a deprecation line naming the new flag."""
    import importlib.util

    from muonfx.cli.corpus import load_corpus

    cache = tmp_path / "cache"
    load_corpus(cache)
    monkeypatch.setenv("MUONFX_CACHE_DIR", str(cache))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    save_dir = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            code = train_gpt.main(["--model", "tiny", "--steps", "2", "--batch-size", "2", "--threads", "1",
                                   "--eval-batches", "1", "--no-progress", "--device", "cpu", "--seq-length", "32",
                                   "--save-dir", str(save_dir), "--num-workers", "4", "--no-mixed-precision"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    err = capsys.readouterr().err
    assert "--seq-length 32 is deprecated" in err and "use --context 32" in err
    assert f"use --save {save_dir}/checkpoint.pt --out {save_dir}" in err
    assert "--num-workers 4 is deprecated" in err and "--no-mixed-precision is deprecated" in err
    assert "use --amp off" in err
    assert (save_dir / "checkpoint.pt").is_file() and (save_dir / "summary.json").is_file()
    import json

    summary = json.loads((save_dir / "summary.json").read_text())
    assert "--context 32" in summary["command"] and "--amp off" in summary["command"]


# -- silent changes of meaning -------------------------------------------------------


@pytest.mark.parametrize("call,fix", [
    (lambda m: mfx.create_hybrid_optimizer(m, 0.02, 1e-3, 0.0), "adamw_lr=0.001, muon_weight_decay=0.0"),
    (lambda m: mfx.MuonOptimizer(m.parameters(), 0.02, 0.9), "momentum=0.9"),
    (lambda m: mfx.FSDPMuonOptimizer(m, None, 0.02, 0.01, 0.9), "weight_decay=0.01, momentum=0.9"),
])
def test_old_positional_calls_name_the_keywords(call, fix):
    """The predecessor's positional orders are errors that say which keyword each
    extra argument becomes (nothing is accepted with a new meaning)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    with pytest.raises(TypeError) as e:
        call(model)
    assert f"Pass them by keyword: {fix}" in str(e.value) and "muon_fsdp" in str(e.value)


def test_fsdp_meaning_changes_warn_once_at_construction():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mfx.FSDPMuonOptimizer(model, beta2=0.99, gradient_accumulation_steps=2)
        mfx.FSDPMuonOptimizer(model)
        mfx.FSDPMuonOptimizer(model, beta2=None, gradient_accumulation_steps=1)
    messages = [str(w.message) for w in caught if w.category is mfx.MeaningChangedWarning]
    assert len(messages) == 1                          # one warning per construction, naming each change
    assert "\n" not in messages[0]                     # in one line, each change with its fix
    assert "(1) beta2=0.99 turns on NorMuon" in messages[0] and "drop it (beta2=None) for plain Muon" in messages[0]
    assert "(2) gradient_accumulation_steps=2" in messages[0] and "after EVERY micro-batch" in messages[0]
    with pytest.warns(mfx.MeaningChangedWarning, match=r"eps=1e-08 is the Newton-Schulz floor here: muon_fsdp's "
                                                       r"eps is row_eps=1e-08"):
        mfx.FSDPMuonOptimizer(model, eps=1e-8)
    assert all(w.filename == __file__ for w in caught)  # points at the caller's line


def test_fsdp_meaning_changes_are_said_on_rank_zero_only(monkeypatch):
    """Under torchrun every rank builds the optimizer: the warning comes once, from rank 0."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    for rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mfx.FSDPMuonOptimizer(model, beta2=0.99, eps=1e-8)
        assert len([w for w in caught if w.category is mfx.MeaningChangedWarning]) == expected, rank


# -- MuonOptimizer's AdamW fallback ----------------------------------------------------


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(16, 8)
        self.block = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 16, bias=False)
        self.out.weight = self.wte.weight          # tied head
        self.classifier = torch.nn.Linear(8, 8)    # head-like name

    def forward(self, idx):
        return self.out(self.norm(self.classifier(torch.relu(self.block(self.wte(idx))))))


def test_model_given_sends_embeddings_tied_and_named_heads_to_adamw():
    opt = mfx.MuonOptimizer(TiedLM(), lr=0.02, adamw_lr=3e-3, adamw_betas=(0.9, 0.99))
    muon_group, adamw_group = opt.param_groups
    assert muon_group["param_names"] == ["block.weight"]
    assert adamw_group["param_names"] == ["wte.weight", "block.bias", "norm.weight", "norm.bias",
                                          "classifier.weight", "classifier.bias"]
    assert adamw_group["lr"] == 3e-3 and adamw_group["betas"] == (0.9, 0.99) and "nesterov" not in adamw_group
    assert muon_group["nesterov"] is False


def test_parameters_given_split_by_ndim_and_groups_keep_their_settings():
    model = TiedLM()
    named = list(model.named_parameters())
    opt = mfx.MuonOptimizer([{"params": [p for _, p in named[:3]], "lr": 0.05},
                             {"params": [p for _, p in named[3:]]}], lr=0.02)
    # split by ndim, in the order given; parameters given without names get none (torch's
    # optimizers load state dicts between named and unnamed optimizers)
    assert [[next(i for i, (_, q) in enumerate(named) if q is p) for p in g["params"]] for g in opt.param_groups] == [
        [0, 1], [2], [5], [3, 4, 6]]
    assert not any("param_names" in g for g in opt.param_groups)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 1e-3, 0.02, 1e-3]
    # nothing to split: the groups stay as given (the checkpoint format of a matrices-only run)
    mats = mfx.MuonOptimizer([p for _, p in named if p.ndim == 2])
    assert len(mats.param_groups) == 1 and "param_names" not in mats.param_groups[0]


def test_named_parameters_route_embeddings_and_the_head_by_name(caplog):
    """GPT-2's names: with model.named_parameters() the embeddings and the head go to AdamW
    (as with the model itself), without names they cannot, and the log line says so."""
    class GPT2ish(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(50, 8), torch.nn.Embedding(16, 8)
            self.c_fc = torch.nn.Linear(8, 32)
            self.lm_head = torch.nn.Linear(8, 50, bias=False)

    model = GPT2ish()
    caplog.set_level(logging.INFO, logger="muonfx")
    opt = mfx.MuonOptimizer(model.named_parameters(), lr=0.02)
    assert [g["param_names"] for g in opt.param_groups] == [
        ["c_fc.weight"], ["wte.weight", "wpe.weight", "c_fc.bias", "lm_head.weight"]]
    plain = mfx.MuonOptimizer(model.parameters(), lr=0.02)
    assert [len(g["params"]) for g in plain.param_groups] == [4, 1]  # every matrix on Muon
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("muonfx: MuonOptimizer:")]
    assert "'wte.weight' (50, 8)" in said[0] and "without names" not in said[0], said
    assert "parameters without names cannot be routed, so embeddings and an output head get Muon too" in said[1]


def test_strict_refuses_and_the_fallback_trains_and_round_trips(tmp_path):
    with pytest.raises(ValueError, match=r"'block.bias' has shape \(8,\).*strict=True"):
        mfx.MuonOptimizer(TiedLM().named_parameters(), strict=True)
    with pytest.raises(ValueError, match="strict=True"):
        mfx.MuonOptimizer(TiedLM(), strict=True)
    with pytest.raises(TypeError, match="strict must be True or False"):
        mfx.MuonOptimizer(TiedLM(), strict="yes")

    torch.manual_seed(0)
    a, b = TiedLM(), TiedLM()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 16, (4, 6))

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()

    opt_a = mfx.MuonOptimizer(a)
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    step(a, opt_a)
    assert all(not torch.equal(p, before[n]) for n, p in a.named_parameters())
    torch.save(opt_a.state_dict(), tmp_path / "opt.pt")
    b.load_state_dict(a.state_dict())
    opt_b = mfx.MuonOptimizer(b)
    opt_b.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    step(a, opt_a)
    step(b, opt_b)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
