"""muonfx on FSDP2 / DTensor, on CPU with gloo, in real multi-process worlds.

Each world (``tests/dist_harness.py``: spawned ranks, FileStore rendezvous, 60 s
collective timeout, overall timeout that kills every rank) runs many checks
(``tests/fsdp_workers.py``), because spawning a rank costs seconds. The worlds are
module-scoped fixtures:

* ``world2`` / ``world3``: parity with one process, mixed sharded + plain parameters
  with FSDPMuonOptimizer, empty and uneven shards, the matrix exchange's work and
  bytes, global transforms, refused inputs, and a DCP checkpoint (saved at W=2; at
  W=3 loaded from W=2 and a new one saved);
* ``world4``: HSDP on a 2 x 2 (replicate x shard) mesh;
* ``world2_resume``: loads the W=3 checkpoint at W=2.

Numbers measured on this CPU (single process = the same model on the whole batch,
per-parameter ``||a - b|| / ||a||``, max over parameters) are noted next to each
tolerance. Wall time of the file: about 2 minutes on 2 (shared) cores.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings

import pytest
import torch

# the spawned ranks import the workers by module name: make sure this folder is on the
# path whatever pytest's import mode (children inherit the parent's sys.path)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp_workers as fw  # noqa: E402
from helpers import sweep  # noqa: E402
from dist_harness import (COLLECTIVE_TIMEOUT_S, RankError, WorldTimeout, run_world,  # noqa: E402
                          selftest_hang, selftest_one_rank_fails)
from muonfx.distributed import assign_owners, shard_sizes  # noqa: E402

WORLD_TIMEOUT_S = 240  # a whole world (spawn + every check); hangs fail instead of stalling
# float32, standard NS iteration: FSDP's reduction order (chunk sums against one sum)
# against the single process, amplified by Newton-Schulz; measured up to 7.3e-7 (next to
# each use). Another CPU's float32 kernels round the products differently (their own
# 1e-6-scale floor, tests/test_parity.py): tolerance ~7x.
PARITY_TOL = 5e-6
# The Gram iteration (ns_method="auto" where it is taken) amplifies that noise more; and
# the runs that average gradients over ranks or normalise rows: measured up to 4.9e-6
# (next to each use), tolerance ~10x.
DEFAULT_NS_TOL = 5e-5
NS_STEPS_PER_STEP = 8  # Muon matrices in fw.Net: (qkv, proj, fc, out) x 2 blocks

SHARED_TASKS = ["parity", "mixed", "odd", "ns", "global", "bad"]


def worst(errors: dict[str, float]) -> tuple[str, float]:
    name = max(errors, key=errors.get)
    return name, errors[name]


# ---------------------------------------------------------------------------
# worlds
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def world2(ckpt_root):
    tasks = SHARED_TASKS + [("ckpt_save", {"path": str(ckpt_root / "w2"), "uninterrupted": True}),
                            ("ckpt_save_per_head", {"path": str(ckpt_root / "w2_per_head")})]
    return run_world(fw.world_main, 2, tasks, timeout=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world3(world2, ckpt_root):  # needs the W=2 checkpoint
    tasks = SHARED_TASKS + [("ckpt_resume", {"path": str(ckpt_root / "w2")}),
                            ("ckpt_save", {"path": str(ckpt_root / "w3")}),
                            ("ckpt_resume_per_head", {"path": str(ckpt_root / "w2_per_head")})]
    return run_world(fw.world_main, 3, tasks, timeout=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4():
    return run_world(fw.world_main, 4, ["hsdp"], timeout=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world2_resume(world3, ckpt_root):  # needs the W=3 checkpoint
    return run_world(fw.world_main, 2, [("ckpt_resume", {"path": str(ckpt_root / "w3")})], timeout=WORLD_TIMEOUT_S)


def get_world(request, W: int):
    return request.getfixturevalue(f"world{W}")


# ---------------------------------------------------------------------------
# the harness itself
# ---------------------------------------------------------------------------


def test_harness_reraises_a_rank_error_and_does_not_wait_for_the_others():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_world(selftest_one_rank_fails, 2, timeout=WORLD_TIMEOUT_S)
    elapsed = time.monotonic() - start
    errors = info.value.errors
    assert "ValueError: deliberate failure on rank 1" in errors[1], errors
    # rank 0 sat in a barrier rank 1 never joined: it errored (rank 1 closed its
    # connections) or was killed after the grace period; either way not waited for
    assert set(errors) <= {0, 1}
    assert elapsed < COLLECTIVE_TIMEOUT_S, elapsed


@pytest.mark.slow
def test_harness_kills_a_hung_world():
    start = time.monotonic()
    with pytest.raises(WorldTimeout, match="did not finish in 6s"):
        run_world(selftest_hang, 2, timeout=6)
    assert time.monotonic() - start < 20


# ---------------------------------------------------------------------------
# 1. parity with one process
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", sweep([2, 3], keep={"2"}))
def test_parity_fully_shard_transformer(request, W):
    """fully_shard(each block), fully_shard(root); each rank trains on its half/third
    of the batch for 10 steps; the single process trains on the whole batch.

    Measured (max over parameters, this CPU, 1 thread per rank):

    * ``mfx.muon_adamw(ns_dtype=float32)`` (standard NS iteration, the default):
      W=2 7.3e-7, W=3 6.2e-7 (blocks.*.proj.weight) -- tolerance PARITY_TOL;
    * torch.optim.AdamW, the floor: W=2 4.05e-7, W=3 3.54e-7 (blocks.0.ln.bias);
    * the same with ``ns_method="auto"`` (Gram iteration for the rectangular
      qkv/fc/out matrices): W=2 4.9e-6, W=3 4.1e-6 (blocks.*.qkv.weight) -- tolerance
      DEFAULT_NS_TOL. With identical data on every rank it is bit-exact at W=2, so this is FSDP's
      reduction-order noise (chunk sums vs one sum), which the Gram iteration amplifies
      ~7x more than the standard one (why the standard iteration is the default).
    """
    res = get_world(request, W)
    p = res[0]["parity"]
    std_name, std = worst(p["muon_adamw"])
    name, err = worst(p["muon_adamw_gram_ns"])
    fname, floor = worst(p["torch_adamw"])
    msg = (f"W={W}: muon_adamw {std:.3g} ({std_name}), tol {PARITY_TOL:g}; "
           f"muon_adamw with Gram NS {err:.3g} ({name}), tol {DEFAULT_NS_TOL:g}; "
           f"torch.optim.AdamW floor {floor:.3g} ({fname})")
    print(msg)
    assert std < PARITY_TOL, msg
    assert err < DEFAULT_NS_TOL, msg
    assert floor < PARITY_TOL, msg
    # each Muon matrix orthogonalised exactly once per step, somewhere; one all-to-all
    # each way per step; never the gather-everywhere fallback
    for opt in ("muon_adamw", "muon_adamw_gram_ns"):
        assert p[f"{opt}_ortho_total"] == NS_STEPS_PER_STEP * 10
        for r in range(W):
            st = res[r]["parity"][f"{opt}_stats"]
            assert st["collectives"] == 2 * 10, (r, st["collectives"])
            assert st["fallback_gathers"] == 0
    for r in range(W):
        assert res[r]["parity"]["torch_adamw_stats"]["collectives"] == 0


# ---------------------------------------------------------------------------
# 2. mixed sharded / plain parameters, FSDPMuonOptimizer, unshard_params
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", sweep([2, 3], keep={"2"}))  # the 3-rank world runs in the slow run
@pytest.mark.parametrize("beta2", [None, 0.95])
def test_mixed_sharded_and_plain_fsdp_muon_optimizer(request, W, beta2):
    """Only the blocks are fully_shard-ed; embed, lm_head and a root-level hidden matrix
    stay plain tensors (identical on every rank: identical data). FSDPMuonOptimizer with
    gradient_accumulation_steps=2, step() after every micro-batch.

    Measured max rel err: W=2 0.0 (beta2=None) / 2.1e-6 (0.95); W=3 2.0e-6 / 2.4e-6: the
    average of 3 equal gradients rounds, row_normalize's norms reduce in another order,
    and the default (Gram) NS amplifies that. Tolerance DEFAULT_NS_TOL.
    """
    res = get_world(request, W)
    key = f"beta2={beta2}"
    r0 = res[0]["mixed"][key]
    name, err = worst(r0["errors"])
    assert err < DEFAULT_NS_TOL, f"W={W} beta2={beta2}: max rel err {err:.3g} ({name})"
    for r in range(W):
        m = res[r]["mixed"][key]
        # the Muon group really mixes DTensor block matrices and the plain `mid` matrix
        assert {"DTensor", "Parameter"} <= set(m["groups"][0]), m["groups"]
        assert m["kinds"]["blocks.0.qkv.weight"] == "DTensor" and m["kinds"]["mid.weight"] == "Parameter"
        # parameters move on every 2nd call only, like the single-process run
        assert m["moved"] == [False, True] * 3 == r0["ref_moved"], m["moved"]
        # unshard_params: full plain tensors equal to the gathered ones; resharded on exit
        assert all(k != "DTensor" for k in m["inside_kinds"].values()), m["inside_kinds"]
        assert max(m["unshard_err"].values()) == 0.0, m["unshard_err"]
        assert m["after_kinds"] == m["kinds"]


# ---------------------------------------------------------------------------
# 3. empty and uneven shards
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", sweep([2, 3], keep={"2"}))  # the 3-rank world runs in the slow run
def test_empty_and_uneven_shards(request, W):
    """fw.Odd: Linear out_features 5 (uneven at 2 and 3), 2 and 4 (an empty shard at
    W=3: 1+1+0 and 2+2+0), 8. Same data on every rank; 6 steps of mfx.muon_adamw and of
    FSDPMuonOptimizer(beta2=0.95) (row_normalize on empty row shards).
    Measured max rel err: W=2 0.0 / 0.0, W=3 6.7e-7 / 4.8e-7 (the average of 3 equal
    gradients rounds)."""
    res = get_world(request, W)
    rows = {"a.weight": 5, "b.weight": 2, "b.bias": 2, "c.weight": 4, "c.bias": 4, "d.weight": 8, "d.bias": 8}
    for r in range(W):
        shapes = res[r]["odd"]["local_shapes"]
        for n, m in rows.items():
            assert shapes[n][0] == shard_sizes(m, W)[r], (r, n, shapes[n])
    if W == 3:
        assert res[2]["odd"]["local_shapes"]["b.weight"] == (0, 5)
        assert res[2]["odd"]["local_shapes"]["c.weight"] == (0, 2)
    for opt in ("muon_adamw", "fsdp_muon_normuon"):
        name, err = worst(res[0]["odd"][f"{opt}_errors"])
        assert err < PARITY_TOL, f"W={W} {opt}: max rel err {err:.3g} ({name})"
        assert min(res[0]["odd"][f"{opt}_moved"].values()) > 1e-2  # every parameter trained
        stats = [res[r]["odd"][f"{opt}_stats"] for r in range(W)]
        assert sum(st["matrices_orthogonalized"] for st in stats) == 4 * 6  # a, b, c, d x 6 steps
        assert all(st["fallback_gathers"] == 0 and st["collectives"] == 2 * 6 for st in stats), stats
        # NorMuon's row statistics: row shards' rows are local; every matrix's norms are one
        # all-reduce per step (seam.sum_over), whatever the number of matrices
        assert all(st["reductions"] == (6 if opt == "fsdp_muon_normuon" else 0) for st in stats), stats


# ---------------------------------------------------------------------------
# 4. the exchange: work and bytes
# ---------------------------------------------------------------------------


def expected_received(mats: list[tuple[int, int]], W: int) -> list[int]:
    """Elements each rank receives in the owner exchange of ``mats`` ([(split, other)]:
    the sharded dim's size and the other dim's size), from the plan's own functions:
    forward, an owner receives every other rank's shard of each matrix it owns;
    backward, every rank receives its shard of each matrix another rank owns."""
    owners = assign_owners([s * o for s, o in mats], W)
    out = []
    for me in range(W):
        got = 0
        for (s, o), owner in zip(mats, owners):
            sizes = shard_sizes(s, W)
            if owner == me:
                got += sum(sizes[r] * o for r in range(W) if r != me)
            else:
                got += sizes[me] * o
        out.append(got)
    return out


def owner_bound(n: int, split: int, other: int, W: int) -> float:
    """The issue's bound for one same-shape group: 2 E (W-1) / W^2 per matrix, with the
    group padded to a multiple of W and the sharded dim padded to a multiple of W."""
    n_padded = math.ceil(n / W) * W
    E = math.ceil(split / W) * W * other
    return n_padded * 2 * E * (W - 1) / W ** 2


@pytest.mark.parametrize("W", sweep([2, 3], keep={"2"}))  # the 3-rank world runs in the slow run
def test_exchange_work_and_bytes(request, W):
    """mfx.newton_schulz() once on DTensors, after install() and comm_stats().reset():
    row-sharded, column-sharded, expert stacks sharded on experts or on rows, replicated,
    and a float64 mix of shapes (tall, an empty shard at W=3, a conv weight).

    Measured, elements received per rank: rows (5 x [16, 24], Shard(0)): W=2 [960, 960]
    (bound 1152), W=3 [912, 912, 672] (bound 1152); cols (4 x [12, 10], Shard(1)):
    W=2 [240, 240] (bound 240), W=3 [240, 216, 168] (bound 384); experts_rows (3 x [8, 12]
    inside a Shard(1) stack): W=3 [132, 132, 120] (bound 144). NS results equal the
    single-process ones bit for bit (measured 0.0 in every case)."""
    res = get_world(request, W)
    # (n, split dim size, other dim size)
    cases = {"rows": (5, 16, 24), "cols": (4, 10, 12), "experts_rows": (3, 8, 12)}
    for case, (n, split, other) in cases.items():
        exp = expected_received([(split, other)] * n, W)
        bound = owner_bound(n, split, other, W)
        got = [res[r]["ns"][case]["stats"]["elements_received"] for r in range(W)]
        print(f"W={W} {case}: received {got}, expected {exp}, bound {bound:g}")
        assert got == exp, (case, got, exp)
        assert max(got) <= bound, (case, got, bound)
        for r in range(W):
            st = res[r]["ns"][case]["stats"]
            assert st["collectives"] == 2, (case, r, st)  # one all-to-all each way, one shape group
            assert st["fallback_gathers"] == 0
            assert st["bytes_received"] == 4 * st["elements_received"]  # float32
            assert st["ortho_total"] == n  # every matrix exactly once, over all ranks
    # mixed shapes, one of them with an empty shard at W=3, and a conv weight: still
    # one exchange each way; counts from the plan
    mixed = [(30, 7), (2, 9), (9, 14), (9, 14), (5, 12)]  # tall, tiny, sq, sq2, conv [5, 3*2*2]
    exp = expected_received(mixed, W)
    assert [res[r]["ns"]["mixed"]["stats"]["elements_received"] for r in range(W)] == exp
    for r in range(W):
        st = res[r]["ns"]["mixed"]["stats"]
        assert st["collectives"] == 2 and st["bytes_received"] == 8 * st["elements_received"], st  # float64
    assert res[0]["ns"]["mixed"]["stats"]["ortho_total"] == 5
    # expert stacks sharded on the expert dim: no communication, each expert once
    for r in range(W):
        st = res[r]["ns"]["experts"]["stats"]
        assert st["collectives"] == 0 and st["elements_received"] == 0, st
        assert st["ortho_total"] == 5 + 2
    if W == 3:
        assert res[2]["ns"]["experts"]["local_shapes"]["e2"] == (0, 6, 6)
    # replicated matrices: no communication, each transformed once (counted on one rank)
    for r in range(W):
        st = res[r]["ns"]["replicated"]["stats"]
        assert st["collectives"] == 0 and st["ortho_total"] == 1, st
    # bf16 Newton-Schulz of float32 shards: the same elements, sent in bf16 (2 bytes each),
    # and results equal to single-process NS bit for bit (bf16 in, bf16 out, cast back)
    exp = expected_received([(16, 24)] * 5, W)
    assert [res[r]["ns"]["rows_bf16"]["stats"]["elements_received"] for r in range(W)] == exp
    for r in range(W):
        st = res[r]["ns"]["rows_bf16"]["stats"]
        assert st["collectives"] == 2 and st["bytes_received"] == 2 * st["elements_received"], st
        assert worst(res[r]["ns"]["rows_bf16"]["errors"])[1] == 0.0
    # results: DTensors with the input's placements, equal to single-process NS
    for case in ("rows", "cols", "experts", "experts_rows", "replicated", "mixed", "rows_bf16"):
        for r in range(W):
            c = res[r]["ns"][case]
            assert set(c["types"].values()) == {"DTensor"} and all(c["same_placements"].values()), c
            name, err = worst(c["errors"])
            assert err < (1e-12 if case == "mixed" else PARITY_TOL), (case, r, name, err)


# ---------------------------------------------------------------------------
# 5. HSDP
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_hsdp_2x2_mesh(world4):
    """fully_shard(mesh=2x2 replicate x shard) on fw.Net, 10 steps.

    * same data on every rank: the gradient average of 4 equal terms is exact, so this
      isolates the optimizer on HSDP shards. Measured: 0.0 (bit-identical).
    * each rank a quarter of the batch: measured 5.5e-6 (blocks.1.qkv.weight); plain
      FSDP on a 1-D mesh of 4 ranks gives the same order on the same data, so this is
      reduction-order noise amplified by NS, not HSDP. Tolerance DEFAULT_NS_TOL.
    """
    res = world4
    h0 = res[0]["hsdp"]
    assert set(h0["placements"].values()) == {"(Replicate(), Shard(dim=0))"}, h0["placements"]
    name, err = worst(h0["same_errors"])
    assert err < PARITY_TOL, f"HSDP same data: {err:.3g} ({name})"
    name, err = worst(h0["split_errors"])
    assert err < DEFAULT_NS_TOL, f"HSDP split data: {err:.3g} ({name})"
    for data in ("same", "split"):
        # each replica (2) orthogonalises each matrix once per step
        assert h0[f"{data}_ortho_total"] == 2 * NS_STEPS_PER_STEP * 10
        for r in range(4):
            st = res[r]["hsdp"][f"{data}_stats"]
            assert st["collectives"] == 2 * 10 and st["fallback_gathers"] == 0, st
    # functional: (Replicate(), Shard(0)) and (Replicate(), Shard(1)) matrices: one
    # exchange each way inside each replica; each replica transforms each matrix once
    for r in range(4):
        h = res[r]["hsdp"]
        name, err = worst(h["ns_errors"])
        assert err < PARITY_TOL, (r, name, err)
        assert h["ns_stats"]["collectives"] == 2
        assert h["ns_ortho_total"] == 2 * 3
        assert abs(h["norm"] - h["norm_ref"]) <= 1e-6 * h["norm_ref"]
        # (Shard(0), Shard(1)) on the 2 x 2 mesh: gathered, transformed, re-sharded
        assert h["fallback_stats"]["fallback_gathers"] == 1, h["fallback_stats"]
        assert h["fallback_placements"] == "(Shard(dim=0), Shard(dim=1))"
        assert h["fallback_error"] < PARITY_TOL
        # bf16 Newton-Schulz: gathered in bf16, the result equal to one process's bit for bit
        assert h["fallback_bf16_gathers"] == 1 and h["fallback_bf16_error"] == 0.0, h
        assert h["fallback_bf16_dtype"] == "torch.float32(Shard(dim=0), Shard(dim=1))"


# ---------------------------------------------------------------------------
# 6. checkpoints across world sizes
# ---------------------------------------------------------------------------

# Resumed runs (mfx.muon_adamw, default NS) vs the uninterrupted single-process run.
# The floor, measured as the uninterrupted W=2 FSDP run (6 steps) vs the single process:
# 4.2e-6 (blocks.1.qkv.weight); resumed runs measured 4.2e-6 (W=2 -> 1), 3.7e-6
# (W=2 -> 3), 3.0e-6 (W=3 -> 2), i.e. at the floor: the reload itself is exact
# (asserted with torch.equal). Tolerance ~12x the floor (another CPU's kernels: see PARITY_TOL).
CKPT_TOL = 5e-5


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), (what, k)
        else:
            assert a[k] == b[k], (what, k, a[k], b[k])


def _assert_resharded_state(res: list, W: int) -> None:
    for r in range(W):
        layout = res[r]["ckpt_resume"]["layout"]
        assert layout, "no optimizer state tensors"
        for k, v in layout.items():
            assert v["param_dtensor"] and v["dtensor"] and v["same_placements"], (r, k, v)
            assert v["local_shape"] == v["param_local_shape"], (r, k, v)
        # e.g. blocks.0.qkv.weight [72, 24]: 36 rows per rank at W=2, 24 at W=3
        assert layout["blocks.0.qkv.weight:muon.momentum.mu"]["local_shape"] == (shard_sizes(72, W)[r], 24)


@pytest.mark.slow
def test_checkpoint_across_world_sizes(world2, world3, world2_resume, ckpt_root):
    """DCP save at W=2 after 3 steps; load at W=1 (this process), at W=3; save at W=3
    (after 3 steps there) and load at W=2; each continues 3 steps."""
    saved2 = world2[0]["ckpt_save"]
    saved3 = world3[0]["ckpt_save"]
    batches = fw.ckpt_batches()

    # the uninterrupted single-process run
    torch.manual_seed(0)
    ref = fw.Net()
    ref_opt = fw.make_muon(ref)
    fw.train_lm(ref, ref_opt, batches)
    ref_params = fw.full_params(ref)

    # W=1: a plain model in this process
    model = fw.ckpt_model(1, seed=123)
    opt = fw.make_muon(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        fw.load_checkpoint(model, opt, str(ckpt_root / "w2"), no_dist=True)
    _assert_same_state(fw.full_params(model), saved2["params"], "W=2 -> W=1 params")
    _assert_same_state(fw.dump_opt_state(model, opt), saved2["state"], "W=2 -> W=1 optimizer state")
    fw.train_lm(model, opt, batches[3:])
    resumed = {"W=2 -> 1": fw.full_params(model)}

    # W=2 -> W=3 and W=3 -> W=2: exact reload, state resharded as DTensors
    for res, W, saved, what in ((world3, 3, saved2, "W=2 -> 3"), (world2_resume, 2, saved3, "W=3 -> 2")):
        for r in range(W):
            _assert_same_state(res[r]["ckpt_resume"]["loaded"], saved["params"], f"{what} params")
            _assert_same_state(res[r]["ckpt_resume"]["loaded_state"], saved["state"], f"{what} optimizer state")
        _assert_resharded_state(res, W)
        resumed[what] = res[0]["ckpt_resume"]["params"]

    floor = worst(fw.rel_errors(ref_params, saved2["uninterrupted"]))
    errs = {what: worst(fw.rel_errors(ref_params, p)) for what, p in resumed.items()}
    msg = f"resumed vs uninterrupted single process: {errs}; floor (uninterrupted W=2): {floor}"
    print(msg)
    assert all(e < CKPT_TOL for _, e in errs.values()), msg
    # the saved step counts came back (3 steps before the checkpoint)
    counts = [v for k, v in saved2["state"].items() if k.endswith("count")]
    assert counts and all(c == 3 for c in counts), counts


# ---------------------------------------------------------------------------
# 7. refused inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", sweep([2, 3], keep={"2"}))  # the 3-rank world runs in the slow run
def test_refused_parameters_raise_on_every_rank(request, W):
    """A Partial placement and a 1-rank sub-mesh next to the full mesh: a ValueError
    naming the parameter on every rank, before any collective (the world finished:
    nobody hung)."""
    res = get_world(request, W)
    for r in range(W):
        bad = res[r]["bad"]
        assert bad["partial"] is not None and "'pending'" in bad["partial"] and "Partial" in bad["partial"], bad
        for key in ("meshes", "meshes_fsdp_muon"):
            assert bad[key] is not None and "'lonely'" in bad[key], bad
            assert f"ranks [{r}]" in bad[key] and str(list(range(W))) in bad[key], bad


# ---------------------------------------------------------------------------
# 8. global transforms
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("W", sweep([2, 3], keep={"2"}))  # the 3-rank world runs in the slow run
def test_global_transforms_on_shards(request, W):
    """clip_by_global_norm / global_norm and apply_if_finite on DTensors sharded in rows,
    columns, with an empty shard, an expert stack and a replicated vector. A NaN in the
    last rank's shard at step 2 makes every rank skip. Measured: bit-identical."""
    res = get_world(request, W)
    norms = {res[r]["global"]["norm"] for r in range(W)}
    assert len(norms) == 1, norms  # identical on every rank
    g0 = res[0]["global"]
    assert abs(g0["norm"] - g0["norm_ref"]) <= 1e-6 * g0["norm_ref"]
    for r in range(W):
        g = res[r]["global"]
        assert max(g["clip_errors"].values()) < PARITY_TOL, g["clip_errors"]
        assert g["skips"] == g["skips_ref"] == [(0, True, 0), (1, False, 1), (0, True, 1)], g["skips"]
        assert g["all_zero"] == [False, True, False]
        for step in g["errors"]:
            assert max(step.values()) <= 1e-6, g["errors"]


# ---------------------------------------------------------------------------
# 9. the FSDP builders take Muon's options (one process, plain tensors)
# ---------------------------------------------------------------------------


def _small_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 8), torch.nn.Linear(8, 11))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randint(0, 11, (4, 5), generator=gen)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("coefficients", ["you", "polar_express", "keller"])
def test_fsdp_muon_honours_ns_coefficients(coefficients):
    """``fsdp_muon(ns_coefficients=...)`` runs Newton-Schulz with those coefficients:
    exactly ``mfx.muon``'s update with the same options; and ``FSDPMuonOptimizer`` on a
    plain model moves exactly as ``create_hybrid_optimizer`` with the same settings."""
    import muonfx as mfx
    from muonfx.distributed.fsdp import fsdp_muon
    from tensordict import TensorDict

    torch.manual_seed(0)
    params = TensorDict({"w": torch.randn(16, 8), "e": torch.randn(3, 8, 4)}, [])
    grads = params.apply(torch.randn_like)

    def one_update(tx):
        return tx.update(grads, tx.init(params), params)[0]

    opts = dict(lr=0.1, weight_decay=0.01, ns_dtype=torch.float32)
    mine = one_update(fsdp_muon(ns_coefficients=coefficients, **opts))
    ref = one_update(mfx.muon(ns_coefficients=coefficients, **opts))
    for k in ("w", "e"):
        assert torch.equal(mine[k], ref[k]), k
    if coefficients != "keller":
        assert not torch.equal(mine["w"], one_update(fsdp_muon(ns_coefficients="keller", **opts))["w"])

    m1, m2 = _small_lm(), _small_lm()
    fsdp = mfx.FSDPMuonOptimizer(m1, ns_coefficients=coefficients, ns_dtype=torch.float32)
    assert fsdp.param_groups[0]["ns_coefficients"] == coefficients
    hybrid = mfx.create_hybrid_optimizer(m2, muon_weight_decay=0.01, ns_coefficients=coefficients,
                                         ns_dtype=torch.float32)
    a, b = _steps(m1, fsdp), _steps(m2, hybrid)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_checkpoint_of_state_kept_per_block_across_world_sizes(world2, world3):
    """Adam inside blockwise keeps its moments per 24-row head of the fused qkv weights
    (entries keyed ``(*key, "block<i>")``): saved with DCP at W=2, they load at W=3 exactly
    and the resumed run continues as the uninterrupted single-process one does."""
    saved = world2[0]["ckpt_save_per_head"]
    heads = sorted(k for k in saved["state"] if k.startswith("blocks.0.qkv.weight:") and ".block" in k)
    assert heads == sorted(f"blocks.0.qkv.weight:heads.0.0.{m}.block{i}" for m in ("mu", "nu") for i in range(3))
    assert all(saved["state"][k].shape == (24, 24) for k in heads)
    for r in range(3):
        _assert_same_state(world3[r]["ckpt_resume_per_head"]["loaded_state"], saved["state"], "W=2 -> 3 per head")
    torch.manual_seed(0)
    ref = fw.Net()
    fw.train_lm(ref, fw.make_per_head(ref), fw.ckpt_batches())
    name, err = worst(fw.rel_errors(fw.full_params(ref), world3[0]["ckpt_resume_per_head"]["params"]))
    assert err < CKPT_TOL, (name, err)
