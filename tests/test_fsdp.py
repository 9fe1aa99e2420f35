"""muonfx on FSDP2 / DTensor, on CPU with gloo, in real multi-process worlds.

Each world (``tests/dist_harness.py``: spawned ranks, FileStore rendezvous, 60 s
collective timeout, overall timeout that kills every rank) runs many checks
(``tests/fsdp_workers.py``), because spawning a rank costs seconds. The worlds are
module-scoped fixtures:

* ``world2`` / ``world3``: parity with one process, mixed sharded + plain parameters
  with FSDPMuonOptimizer, empty and uneven shards, the matrix exchange's work and
  bytes, global transforms, refused inputs, and a DCP checkpoint (saved at W=2; at
  W=3 loaded from W=2 and a new one saved);
* ``world4``: HSDP on a 2 x 2 (replicate x shard) mesh; tensor parallel alone and under
  FSDP2 (dp 2 x tp 2), HSDP and CPU offload on a residual MLP; expert-parallel stacks;
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
from muonfx.distributed import shard_sizes  # noqa: E402
from muonfx.distributed.layout import stack_layout  # noqa: E402
from muonfx.distributed.plan import plan_exchange  # noqa: E402

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
    return run_world(fw.world_main, 4, ["hsdp", "mesh", "ep"], timeout=WORLD_TIMEOUT_S)


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
    # each way per step (one bucket); one plan, made at the first step
    for opt in ("muon_adamw", "muon_adamw_gram_ns"):
        assert p[f"{opt}_ortho_total"] == NS_STEPS_PER_STEP * 10
        for r in range(W):
            st = res[r]["parity"][f"{opt}_stats"]
            assert st["collectives"] == 2 * 10, (r, st["collectives"])
            assert st["plans"] <= 1
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
        assert all(st["plans"] <= 1 and st["collectives"] == 2 * 6 for st in stats), stats
        # NorMuon's row statistics: row shards' rows are local; every matrix's norms are one
        # all-reduce per step (seam.sum_over), whatever the number of matrices
        assert all(st["reductions"] == (6 if opt == "fsdp_muon_normuon" else 0) for st in stats), stats


# ---------------------------------------------------------------------------
# 4. the exchange: work and bytes
# ---------------------------------------------------------------------------


def expected_received(stacks: list[tuple[tuple[int, int, int], int]], W: int) -> list[int]:
    """Elements each rank receives in the exchange of ``stacks`` ([(stack shape, cut
    dim)] on a 1-D mesh of W ranks), from the plan (:mod:`muonfx.distributed.plan`,
    pure: computed here, in one process), which the ranks must follow exactly."""
    lays = [stack_layout(shape, (W,), [("S", dim)]) for shape, dim in stacks]
    return plan_exchange(lays, [list(range(W))] * len(lays), W, 1, 1 << 30).bytes_received()


def test_plan_of_groups_keeps_each_group_on_one_owner_and_in_one_bucket():
    """``plan_exchange(..., lead=)`` (``seam.map_matrix_groups``: SOAP's gradient with its
    moments, factors and bases): matrix ``j`` of every stack of a group goes to one owner
    in one bucket, sized by the group's bytes; every group travels; each owner's program
    lists its groups, lead first."""
    from muonfx.distributed.exchange import rank_program

    W = 3
    shapes = [((2, 6, 4), 1), ((2, 6, 6), 1), ((2, 4, 4), 2),   # group 0: two matrices each
              ((1, 5, 3), 2), ((1, 5, 5), 1)]                   # group 1: one each
    lead = (0, 0, 0, 3, 3)
    lays = [stack_layout(shape, (W,), [("S", dim)]) for shape, dim in shapes]
    plan = plan_exchange(lays, [list(range(W))] * len(lays), W, 4, 6 * 6 * 4, lead)
    assert plan.units is not None and sorted(i for u in plan.units for i in u) == list(range(len(plan.matrices)))
    assert len(plan.units) == 3  # group 0's two matrices and group 1's one
    for unit in plan.units:
        mats = [plan.matrices[i] for i in unit]
        assert [lead[m.stack] for m in mats] == [mats[0].stack] * len(mats)
        assert len({m.index for m in mats}) == 1 and len({m.owner for m in mats}) == 1
        assert len({m.bucket for m in mats}) == 1 and mats[0].bucket >= 0
    # one group per bucket under a budget smaller than any group: buckets sized by groups
    per_owner: dict = {}
    for unit in plan.units:
        per_owner.setdefault(plan.matrices[unit[0]].owner, []).append(plan.matrices[unit[0]].bucket)
    assert all(sorted(b) == list(range(len(b))) for b in per_owner.values())
    owned = [sum(len(bk.groups) for bk in rank_program(plan, r).buckets) for r in range(W)]
    assert sum(owned) == 3 and max(owned) - min(owned) <= 1  # balanced over the ranks
    for r in range(W):
        prog = rank_program(plan, r)
        assert prog.grouped and not prog.local
        for bk in prog.buckets:
            for s, j, slots in bk.groups:
                assert lead[s] == s and len(slots) == len(set(slots)) == (3 if s == 0 else 2)
    # without groups, the same stacks plan as before: one owner per matrix, no units
    assert plan_exchange(lays, [list(range(W))] * len(lays), W, 4, 1 << 30).units is None


def owner_bound(n: int, split: int, other: int, W: int) -> float:
    """The bound for one same-shape group: 2 E (W-1) / W^2 per matrix, with the
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
    # (n, split dim size, other dim size, the stacks as the transform sees them)
    cases = {"rows": (5, 16, 24, [((1, 16, 24), 1)] * 5), "cols": (4, 10, 12, [((1, 12, 10), 2)] * 4),
             "experts_rows": (3, 8, 12, [((3, 8, 12), 1)])}
    for case, (n, split, other, stacks) in cases.items():
        exp = expected_received(stacks, W)
        bound = owner_bound(n, split, other, W)
        got = [res[r]["ns"][case]["stats"]["elements_received"] for r in range(W)]
        print(f"W={W} {case}: received {got}, expected {exp}, bound {bound:g}")
        assert got == exp, (case, got, exp)
        assert max(got) <= bound, (case, got, bound)
        for r in range(W):
            st = res[r]["ns"][case]["stats"]
            assert st["collectives"] == 2, (case, r, st)  # one bucket: one all-to-all each way
            assert st["bytes_received"] == 4 * st["elements_received"]  # float32
            assert st["ortho_total"] == n  # every matrix exactly once, over all ranks
    # mixed shapes, one of them with an empty shard at W=3, and a conv weight: still
    # one exchange each way; counts from the plan
    mixed = [((1, 30, 7), 1), ((1, 2, 9), 1), ((1, 9, 14), 1), ((1, 9, 14), 1), ((1, 5, 12), 1)]  # conv [5, 3*2*2]
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
    # a replicated matrix: transformed once in the world, its owner sends the result to the others
    got = sorted(res[r]["ns"]["replicated"]["stats"]["elements_received"] for r in range(W))
    assert got == [0] + [60] * (W - 1), got
    for r in range(W):
        st = res[r]["ns"]["replicated"]["stats"]
        assert st["collectives"] == 2 and st["ortho_total"] == 1, st
    # bf16 Newton-Schulz of float32 shards: the same elements, sent in bf16 (2 bytes each),
    # and results equal to single-process NS bit for bit (bf16 in, bf16 out, cast back)
    exp = expected_received([((1, 16, 24), 1)] * 5, W)
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
      reduction-order noise amplified by NS (fw.Net's attention gradients), not HSDP.
      Tolerance DEFAULT_NS_TOL. (test_tensor_parallel_meshes holds HSDP to 2e-6 on a
      net whose gradients have full rank.)

    Newton-Schulz runs once per matrix in the world: the work is split over all 4 ranks
    of replicate x shard, the results sent to both replicas.
    """
    res = world4
    h0 = res[0]["hsdp"]
    assert set(h0["placements"].values()) == {"(Replicate(), Shard(dim=0))"}, h0["placements"]
    name, err = worst(h0["same_errors"])
    assert err < PARITY_TOL, f"HSDP same data: {err:.3g} ({name})"
    name, err = worst(h0["split_errors"])
    assert err < DEFAULT_NS_TOL, f"HSDP split data: {err:.3g} ({name})"
    for data in ("same", "split"):
        assert h0[f"{data}_ortho_total"] == NS_STEPS_PER_STEP * 10
        for r in range(4):
            st = res[r]["hsdp"][f"{data}_stats"]
            assert st["collectives"] == 2 * 10 and st["plans"] <= 1, st
            assert st["matrices_orthogonalized"] == 2 * 10, st  # 8 matrices over 4 ranks
    # functional: (Replicate(), Shard(0)) and (Replicate(), Shard(1)) matrices: one exchange
    # each way over the 4 ranks, each matrix transformed once in the world
    for r in range(4):
        h = res[r]["hsdp"]
        name, err = worst(h["ns_errors"])
        assert err < PARITY_TOL, (r, name, err)
        assert h["ns_stats"]["collectives"] == 2
        assert h["ns_ortho_total"] == 3
        assert abs(h["norm"] - h["norm_ref"]) <= 1e-6 * h["norm_ref"]
        # (Shard(0), Shard(1)) on the 2 x 2 mesh: the same exchange, pieces from 4 ranks
        assert h["s2_stats"]["collectives"] == 2 and h["s2_ortho_total"] == 1, h["s2_stats"]
        assert h["s2_placements"] == "(Shard(dim=0), Shard(dim=1))"
        assert h["s2_error"] < PARITY_TOL
        # bf16 Newton-Schulz: sent in bf16, the result equal to one process's bit for bit
        st = h["s2_bf16_stats"]
        assert st["bytes_received"] == 2 * st["elements_received"] and h["s2_bf16_error"] == 0.0, h
        assert h["s2_bf16_dtype"] == "torch.float32(Shard(dim=0), Shard(dim=1))"


# ---------------------------------------------------------------------------
# 5b. tensor parallel alone and under FSDP2, HSDP, CPU offload, expert parallel (W=4)
# ---------------------------------------------------------------------------

MESH_TOL = 2e-6  # the target for these layouts; measured values in the docstring


@pytest.mark.slow
@pytest.mark.parametrize("layout", fw.RES_LAYOUTS)
def test_tensor_parallel_meshes(world4, layout):
    """fw.ResMLP (an input matrix, 2 residual MLP blocks, a head), 8 steps of mfx.muon_adamw
    on 4 gloo ranks vs one process on the whole batch:

    * ``fsdp_tp``: dp 2 x tp 2, ``up`` colwise and ``down`` rowwise (parallelize_module),
      then fully_shard over dp: ``_StridedShard(0) x Shard(0)``, ``Shard(0) x Shard(1)``,
      and ``inp`` on the dp slice (lifted to ``Shard(0) x Replicate()``);
    * ``tp``: tensor parallel alone over 4 ranks (every rank the whole batch);
    * ``hsdp``: replicate 2 x shard 2; ``offload``: fully_shard with CPUOffloadPolicy.

    Measured max relative error (this CPU, 1 thread per rank): fsdp_tp 6.3e-7, tp 5.0e-7,
    hsdp 7.2e-7, offload 8.1e-7 (blocks.0.up.weight); torch.optim.AdamW on the same
    layouts (the floor) 5e-8 to 7e-8. The same net in one process with the batch's
    gradient summed in 2 or 4 chunks instead of at once (reduction order alone) moves
    Muon by 4e-7 to 7e-7: the tolerance (the issue's target) is ~2.5x that. Each Muon matrix is orthogonalised once per step in the whole
    world, and every rank sends exactly what the plan (``describe``) says.
    """
    r0 = world4[0]["mesh"][layout]
    name, err = worst(r0["errors"])
    fname, floor = worst(r0["floor"])
    msg = f"{layout}: {err:.3g} ({name}); torch.optim.AdamW floor {floor:.3g} ({fname})"
    print(msg)
    assert err < MESH_TOL, msg
    assert r0["moved"] > 1e-3, r0["moved"]  # every parameter trained
    steps = 8
    # (under tensor parallelism alone ``inp`` is a plain tensor, the same on every rank,
    # transformed by each: the seam's local path, not counted here)
    assert r0["ortho_total"] == (fw.RES_MATRICES - (layout == "tp")) * steps
    W = 4
    for r in range(W):
        m = world4[r]["mesh"][layout]
        st = m["stats"]
        assert st["collectives"] == 2 * st["buckets"] and st["buckets"] == steps, st  # one bucket per step
        assert st["bytes_sent"] == m["plan_sent"][r] * steps, (r, st["bytes_sent"], m["plan_sent"])
    if layout == "fsdp_tp":
        pl = r0["placements"]
        assert pl["blocks.0.up.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", pl
        assert pl["blocks.0.down.weight"] == "(Shard(dim=0), Shard(dim=1))", pl
        assert pl["inp.weight"] == "(Shard(dim=0),)", pl
    if layout in ("tp", "offload"):
        # every matrix cut over all 4 ranks: all ranks together send at most 1.1x the floor,
        # each matrix's pieces to its owner and back: 2 (W-1)/W of its bytes
        total = sum(world4[r]["mesh"][layout]["plan_sent"][r] for r in range(W))
        floor_bytes = 2 * (W - 1) / W * r0["matrix_elements"] * 4
        assert total <= 1.1 * floor_bytes, (total, floor_bytes)


@pytest.mark.slow
def test_expert_parallel_stacks(world4):
    """Expert stacks as DTensors, 4 steps of mfx.muon, the same gradients on every rank:

    * ``ep``: ``[8, 12, 16]`` and ``[3, 6, 8]`` (a rank without experts) Shard(0) over 4
      ranks: every expert orthogonalised on its own rank, no collective at all;
    * ``ep_dp``: ``[4, 12, 16]`` on an (ep 2, dp 2) mesh, experts over ep, rows over dp:
      each expert is exchanged only between the 2 ranks of its dp group.

    Measured: equal to one process bit for bit (0.0)."""
    W = 4
    for case, n_mats in (("ep", 11), ("ep_dp", 4)):
        r0 = world4[0]["ep"][case]
        name, err = worst(r0["errors"])
        assert err < MESH_TOL, (case, name, err)
        assert r0["ortho_total"] == n_mats * 4
        assert "batch dim 0" in r0["describe"], r0["describe"]
    for r in range(W):
        st = world4[r]["ep"]["ep"]["stats"]
        assert st["collectives"] == 0 and st["bytes_sent"] == 0 and st["bytes_received"] == 0, st
    plan = world4[0]["ep"]["ep_dp"]["plan"]
    for mp in plan.matrices:  # ranks 0, 1 hold experts 0, 1; ranks 2, 3 experts 2, 3
        group = {mp.owner // 2}
        assert {p.rank // 2 for p in mp.sources + mp.targets} == group, mp
    for r in range(W):
        st = world4[r]["ep"]["ep_dp"]["stats"]
        assert st["bytes_sent"] == plan.bytes_sent()[r] * 4 > 0, (r, st)


def test_describe_shows_batch_and_matrix_dims():
    """``describe`` on plain tensors (one process): expert stacks are a batch of matrices,
    conv weights one flattened matrix, 1-D tensors and the head go to AdamW."""
    from muonfx.distributed import describe

    d = describe([("moe.experts", torch.zeros(8, 16, 32)), ("conv.weight", torch.zeros(4, 3, 2, 2)),
                  ("fused.w", torch.zeros(16, 256)), ("ln.weight", torch.zeros(16)),
                  ("lm_head.weight", torch.zeros(11, 16))])
    rows = {r["parameter"]: r for r in d.rows}
    assert rows["moe.experts"]["matrix view"] == "batch dim 0 (8) of 16x32 matrices (dims 1 x 2)"
    assert rows["conv.weight"]["matrix view"] == "4x12 matrix (dims 0 x 1*2*3)"
    assert rows["fused.w"]["matrix view"] == "16x256 matrix (dims 0 x 1)"
    assert rows["ln.weight"]["route"] == rows["lm_head.weight"]["route"] == "adamw"
    text = str(d)
    assert "moe.experts" in text and "batch dim 0 (8)" in text


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
    """A Partial placement, and a mesh over rank 0 alone next to the full mesh: a
    ValueError naming the parameter on every rank, before any collective (the world
    finished: nobody hung). A 1-rank *named slice* of a mesh that other parameters live
    on is served instead: it is the same tensor replicated over the other mesh dim (one
    step of muon on a ones gradient moves every entry alike, on every rank)."""
    res = get_world(request, W)
    for r in range(W):
        bad = res[r]["bad"]
        assert bad["partial"] is not None and "'pending'" in bad["partial"] and "Partial" in bad["partial"], bad
        for key in ("meshes", "meshes_fsdp_muon"):
            assert bad[key] is not None and "'lonely'" in bad[key], bad
            assert "ranks [0]" in bad[key] and str(list(range(W))) in bad[key], bad
        assert bad["sliced_step"] == res[0]["bad"]["sliced_step"]
        vals = {v for row in bad["sliced_step"] for v in row}
        assert len(vals) == 1 and vals != {1.0}, vals


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
    from muonfx.presets.predecessor import fsdp_muon
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
