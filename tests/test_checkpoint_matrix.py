"""Checkpoints across layouts: saved under FSDP2 at 4 ranks, continued under FSDP2 at 2
ranks, one plain process, HSDP 2 x 2 and FSDP2 + TP (dp 2 x tp 2), and back.

The model, the optimizer (:func:`muonfx.create_hybrid_optimizer`: Muon on the
matrices, AdamW on the biases, norms and head) and the data stream (seeded per step) are
the same in every layout (``tests/ckpt_matrix_workers.py``). The uninterrupted run is
FSDP2 at 4 ranks for :data:`~ckpt_matrix_workers.STEPS` steps (and it is compared with
one process). Then:

* **from FSDP2 W=4**: a run of 3 steps under FSDP2 at 4 ranks saves a checkpoint, in
  both ways ``docs/fsdp.md`` documents: sharded (``torch.distributed.checkpoint`` with
  ``get_state_dict`` / ``set_state_dict``) and as a full state dict (one file written by
  rank 0). Each other layout loads it into a freshly built model and optimizer (another
  initialisation), which must then hold exactly the saved parameters and optimizer state
  (``torch.equal`` on the full tensors), every state tensor a DTensor with its
  parameter's placements and local shape (a plain tensor in the plain process), and
  every step count 3 (the full state dict: not under FSDP2 + TP, see
  :data:`WHOLE_TARGETS`);
* **back to FSDP2 W=4**: each of the runs that loaded the sharded checkpoint saves its
  own after one more step (counts 4), both ways, and FSDP2 at 4 ranks loads each, with
  the same checks;
* every run continues to step 6 and must end within :data:`TOL` (relative, per parameter,
  on the gathered full tensors) of the uninterrupted run, with every count 6.

The runs are in float64 (Newton-Schulz included): in float32 the layouts' own reduction
orders (FSDP2's chunked gradient sums, tensor parallelism's partial products), amplified
by Newton-Schulz, already differ by up to 7e-7 after 8 steps with no checkpoint at all
(``docs/fsdp.md``), so a 1e-6 tolerance would measure the layouts rather than the
checkpoint. In float64 that floor is about 1e-15, and a checkpoint that lost or misplaced
anything (a shard of a moment in the wrong rows, a count reset) misses by orders of
magnitude. Measured (2-core AMD EPYC VM, torch 2.13.0+cpu): every pair, both ways of
saving, within 5e-16 of the uninterrupted run; the uninterrupted W=4 run 1.5e-15 from one
process. Without saving ``ns_dtype`` by its name, ``get_state_dict(full_state_dict=True)``
refused the optimizer's state dict (``Unexpected value type <class 'torch.dtype'>``).

Three launches: a 4-rank world (the uninterrupted run, the W=4 save, the HSDP and
FSDP2 + TP continuations and their way back), a 2-rank world (FSDP2 W=2), then the plain
runs in this process, and a second 4-rank world (back from W=2 and from the plain
process). About 100 s on 2 shared cores.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_matrix_workers as cw  # noqa: E402
from dist_harness import run_world  # noqa: E402
from fsdp_workers import rel_errors  # noqa: E402
from helpers import one_intra_op_thread  # noqa: E402,F401

pytestmark = pytest.mark.slow

#: relative difference allowed from the uninterrupted run (measured: under 1e-15)
TOL = 1e-6
WORLD_TIMEOUT_S = 300  # the harness's hang guard for a whole world
TARGETS = ("fsdp2", "plain", "hsdp", "fsdp_tp")
#: a full state dict does not load under FSDP2 + TP here: torch's ``distribute_tensor``
#: (which ``set_state_dict(full_state_dict=True)`` calls) asserts on a ``_StridedShard``
#: that splits unevenly (``up``'s 15 rows per tp rank, 8 + 7 over dp), already for the
#: model's weights (torch 2.13); sharded checkpoints load there, and a full state dict
#: saved under FSDP2 + TP loads elsewhere
WHOLE_TARGETS = ("fsdp2", "plain", "hsdp")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """Every run of the matrix, by name (rank 0's result for the worlds):
    ``ref`` and ``ref_plain`` (uninterrupted), ``save`` (W=4, saves at step 3), ``<target>``
    (loads W=4's sharded checkpoint, saves both kinds at step 4), ``whole_<target>`` (loads
    W=4's full state dict), ``back_<target>`` and ``back_whole_<target>`` (W=4 loads the
    target's checkpoints)."""
    root = tmp_path_factory.mktemp("ckpt_matrix")
    w4, w4_whole = str(root / "fsdp4"), str(root / "fsdp4.pt")

    def onward(layout: str) -> tuple[str, dict]:
        return layout, dict(layout=layout, load_from=w4, start=cw.SAVE_AT, save_to=str(root / layout),
                            save_whole_to=str(root / f"{layout}.pt"), save_at=cw.BACK_AT)

    def onward_whole(layout: str) -> tuple[str, dict]:
        return f"whole_{layout}", dict(layout=layout, load_from=w4_whole, load_whole=True, start=cw.SAVE_AT)

    def back(layout: str) -> list[tuple[str, dict]]:
        return [(f"back_{layout}", dict(layout="fsdp4", load_from=str(root / layout), start=cw.BACK_AT)),
                (f"back_whole_{layout}", dict(layout="fsdp4", load_from=str(root / f"{layout}.pt"), load_whole=True,
                                              start=cw.BACK_AT))]

    out: dict = {}
    jobs = [("ref", dict(layout="fsdp4")),
            ("save", dict(layout="fsdp4", save_to=w4, save_whole_to=w4_whole, save_at=cw.SAVE_AT)),
            onward("hsdp"), onward("fsdp_tp"), onward_whole("hsdp"), *back("hsdp"), *back("fsdp_tp")]
    res = run_world(cw.world_main, 4, jobs, timeout=WORLD_TIMEOUT_S)
    out.update({name: res[0][name] for name, _ in jobs})
    out["ranks"] = [r["ref"] for r in res]
    jobs = [onward("fsdp2"), onward_whole("fsdp2")]
    res = run_world(cw.world_main, 2, jobs, timeout=WORLD_TIMEOUT_S)
    out.update({name: res[0][name] for name, _ in jobs})
    with torch.random.fork_rng(devices=[]):
        out["ref_plain"] = cw.run("plain")
        for name, kwargs in (onward("plain"), onward_whole("plain")):
            out[name] = cw.run(**kwargs)
    jobs = [*back("fsdp2"), *back("plain")]
    res = run_world(cw.world_main, 4, jobs, timeout=WORLD_TIMEOUT_S)
    out.update({name: res[0][name] for name, _ in jobs})
    return out


def _worst(ref: dict, got: dict) -> tuple[str, float]:
    errs = rel_errors(ref, got)
    name = max(errs, key=errs.get)
    return name, errs[name]


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert isinstance(b[k], torch.Tensor) and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)
        else:
            assert a[k] == b[k], (what, k, a[k], b[k])


def _assert_counts(counts: dict, params: dict, n: int, what: str) -> None:
    """Every parameter has a step count and every count is ``n``."""
    assert {k.split(":")[0] for k in counts} == set(params), (what, sorted(counts))
    assert all(c == n for c in counts.values()), (what, n, counts)


def _assert_loaded(run: dict, saved: dict, n: int, what: str) -> None:
    loaded = run["loaded"]
    _assert_equal(loaded["params"], saved["params"], f"{what}: parameters after the load")
    _assert_equal(loaded["state"], saved["state"], f"{what}: optimizer state after the load")
    _assert_counts(loaded["counts"], loaded["params"], n, f"{what}: counts after the load")
    assert loaded["layout"] and all(loaded["layout"].values()), (what, loaded["layout"])


def test_uninterrupted_runs_agree(matrix):
    """The reference: FSDP2 at 4 ranks, 6 steps; one process ends where it does, every
    rank gathers the same parameters, and saving a checkpoint changes nothing."""
    ref = matrix["ref"]["final"]
    name, err = _worst(ref["params"], matrix["ref_plain"]["final"]["params"])
    print(f"uninterrupted FSDP2 W=4 vs one process: {err:.1e} ({name})")
    assert err < TOL, (name, err)
    _assert_counts(ref["counts"], ref["params"], cw.STEPS, "uninterrupted")
    for r, other in enumerate(matrix["ranks"]):
        _assert_equal(other["final"]["params"], ref["params"], f"rank {r}'s gathered parameters")
    _assert_equal(matrix["save"]["final"]["params"], ref["params"], "the run that saved at step 3")
    _assert_counts(matrix["save"]["saved"]["counts"], ref["params"], cw.SAVE_AT, "the W=4 save")
    moved = _worst(ref["params"], matrix["save"]["saved"]["params"])[1]
    assert moved > 1e-3, moved  # steps 4-6 move every parameter: the comparison means something


@pytest.mark.parametrize("target", TARGETS)
def test_from_fsdp2_w4(matrix, target):
    """Saved under FSDP2 W=4 at step 3 (sharded), loaded under ``target``, continued to step 6."""
    _check_onward(matrix, target, target)


@pytest.mark.parametrize("target", WHOLE_TARGETS)
def test_from_fsdp2_w4_full_state_dict(matrix, target):
    """Saved under FSDP2 W=4 at step 3 as a full state dict, loaded under ``target``."""
    _check_onward(matrix, target, f"whole_{target}")


@pytest.mark.parametrize("target", TARGETS)
def test_back_to_fsdp2_w4(matrix, target):
    """Saved under ``target`` at step 4 (after the sharded load above and one step),
    loaded under FSDP2 W=4, continued to step 6."""
    _check_back(matrix, target, f"back_{target}")


@pytest.mark.parametrize("target", TARGETS)
def test_back_to_fsdp2_w4_full_state_dict(matrix, target):
    """The same, saved as a full state dict."""
    _check_back(matrix, target, f"back_whole_{target}")


def _check_onward(matrix: dict, target: str, name: str) -> None:
    run = matrix[name]
    _assert_loaded(run, matrix["save"]["saved"], cw.SAVE_AT, f"{name}: W=4 -> {target}")
    param, err = _worst(matrix["ref"]["final"]["params"], run["final"]["params"])
    print(f"{name}: fsdp4 -> {target}: {err:.1e} ({param})")
    assert err < TOL, (name, param, err)
    _assert_counts(run["final"]["counts"], run["final"]["params"], cw.STEPS, f"{name} at the end")


def _check_back(matrix: dict, target: str, name: str) -> None:
    saved = matrix[target]["saved"]
    _assert_counts(saved["counts"], saved["params"], cw.BACK_AT, f"the {target} save")
    run = matrix[name]
    _assert_loaded(run, saved, cw.BACK_AT, f"{name}: {target} -> W=4")
    param, err = _worst(matrix["ref"]["final"]["params"], run["final"]["params"])
    print(f"{name}: {target} -> fsdp4: {err:.1e} ({param})")
    assert err < TOL, (name, param, err)
    _assert_counts(run["final"]["counts"], run["final"]["params"], cw.STEPS, f"{name} at the end")
