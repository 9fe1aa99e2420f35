"""Rank functions for the distributed cases of ``test_faults_cli.py`` and
``test_faults.py`` (run with ``dist_harness.run_world``; gloo on the CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

import muonfx as mfx  # noqa: E402


def _model(world: int, d: int = 16) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 4))
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _backward(model: nn.Module, rank: int, d: int = 16) -> None:
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(8, d, generator=g)).square().mean().backward()


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _state_locals(opt) -> dict:
    """Every optimizer state tensor of every group (local shards), cloned."""
    from helpers import flatten_state

    out = {}
    for g, rec in enumerate(opt.records):
        for k, v in flatten_state(rec.state):
            if isinstance(v, torch.Tensor):
                v = v.to_local() if hasattr(v, "to_local") else v
                out[(g, k)] = v.detach().clone()
    assert out, "no optimizer state found"
    return out


def rank_local_error(rank: int, world: int, bad_rank: int, hold_s: float) -> dict:
    """One good step; then ``bad_rank`` alone puts ``lr="abc"`` in its Muon group and every
    rank steps. The bad rank then stays alive for ``hold_s`` seconds (as a process that
    caught the error would). Returns each rank's error and how long its step took."""
    model = _model(world)
    opt = mfx.FSDPMuonOptimizer(model, lr=0.02)
    _backward(model, rank)
    opt.step()
    opt.zero_grad()
    _backward(model, rank)
    if rank == bad_rank:
        opt.param_groups[0]["lr"] = "abc"
    out = _attempt(opt, model)
    if rank == bad_rank:
        time.sleep(hold_s)
    return out


def agreement_cost(rank: int, world: int, steps: int = 30, d: int = 64) -> dict:
    """Seconds of the step's agreement (gather, checks and the one all-reduce) and of a
    whole step of TransformOptimizer(mfx.muon_adamw) on an FSDP2 model, median of ``steps``."""
    from muonfx.distributed.agree import step_group
    from muonfx.optim.agreement import agreed_work

    model = _model(world, d)
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, lr=0.02)
    _backward(model, rank, d)
    group = step_group(opt._dtensor_ref)
    times: dict = {"agree": [], "step": []}
    for i in range(2 * steps + 2):
        which = "agree" if i % 2 else "step"
        dist.barrier()
        t0 = time.perf_counter()
        agreed_work(opt.records, opt.param_groups, *group) if which == "agree" else opt.step()
        if i >= 2:
            times[which].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _attempt(opt, model) -> dict:
    """One ``opt.step()``: its error (type name, message) or None, its seconds, and
    whether every parameter and state tensor stayed as it was."""
    before = _locals(model)
    state_before = _state_locals(opt)
    t0 = time.perf_counter()
    out: dict = {}
    try:
        opt.step()
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = (type(e).__name__, str(e))
    out["seconds"] = time.perf_counter() - t0
    state_after = _state_locals(opt)
    out["unchanged"] = (all(torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
                        and state_before.keys() == state_after.keys()
                        and all(torch.equal(state_before[k], state_after[k]) for k in state_before))
    return out


def step_faults(rank: int, world: int, bad_rank: int = 1) -> dict:
    """TransformOptimizer(mfx.muon_adamw) on an FSDP2 model (4 Linear layers), one good
    step, then faults on ``bad_rank`` alone, each followed by a good step:

    * ``ns_steps``: ``ns_steps=0`` in its param group (a number its transform refuses);
    * ``ns_method``: ``ns_method="bogus"`` (a static setting: the transform cannot be built);
    * ``grad_none``: ``grad=None`` for ``0.weight`` while the other ranks have one;
    * ``grad_layout``: a gradient for ``0.weight`` laid out otherwise than the parameter
      (replicated where the parameter is a row shard: same shape, another local piece);
    then ``none_everywhere``: ``grad=None`` for ``0.weight`` on every rank (a consistent
    skip: that parameter does not move, the others do)."""
    model = _model(world)
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, lr=0.02)
    _backward(model, rank)
    opt.step()
    opt.zero_grad()
    out: dict = {}
    for fault, key, value in (("ns_steps", "ns_steps", 0), ("ns_method", "ns_method", "bogus"),
                              ("grad_none", None, None), ("grad_layout", None, None)):
        _backward(model, rank)
        group = opt.param_groups[0]
        old = group.get(key) if key else None
        if rank == bad_rank:
            if key:
                group[key] = value
            elif fault == "grad_none":
                model[0].weight.grad = None
            else:  # the whole gradient, replicated, where the parameter is a row shard
                w = model[0].weight
                model[0].weight.grad = DTensor.from_local(torch.zeros(w.shape), w.device_mesh,
                                                          [Replicate()], run_check=False)
        out[fault] = _attempt(opt, model)
        if key:
            group[key] = old
        opt.zero_grad()
        _backward(model, rank)  # fresh gradients on every rank (a forward is collective under FSDP2)
        before = _locals(model)
        opt.step()  # the step after a refused one runs on every rank
        opt.zero_grad()
        out[fault]["next_step_moved"] = all(not torch.equal(before[n], p.to_local())
                                            for n, p in model.named_parameters() if p.to_local().numel())
    _backward(model, rank)
    model[0].weight.grad = None
    before = _locals(model)
    opt.step()
    out["none_everywhere"] = {n: not torch.equal(before[n], p.to_local()) for n, p in model.named_parameters()}
    return out


def user_timeout(rank: int, world: int, late_s: float) -> dict:
    """Rank 1 reaches ``step()`` ``late_s`` seconds late (a hung data loader); the process
    group's timeout (the harness's, set by the test) bounds rank 0's wait in the step's
    first collective, the agreement."""
    model = _model(world)
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, lr=0.02)
    _backward(model, rank)
    if rank == 1:
        time.sleep(late_s)
    t0 = time.perf_counter()
    try:
        opt.step()
        err = None
    except Exception as e:  # noqa: BLE001
        err = type(e).__name__
    return {"error": err, "seconds": time.perf_counter() - t0}


def row_normalize_on_shards(rank: int, world: int, steps: int = 3, axis: str = "rows") -> dict:
    """``mfx.row_normalize`` on DTensors (row shards with fewer rows than ranks and empty
    shards, an expert stack with fewer experts than ranks, a conv weight, a column-sharded
    matrix) vs the same transform on the whole tensors: max abs error per step, and the
    collectives of each update (muonfx's counter and torch's CommDebugMode)."""
    from tensordict import TensorDict
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import muonfx.distributed as mdist

    mesh = init_device_mesh("cpu", (world,))
    mdist.install()
    g = torch.Generator().manual_seed(0)
    shapes = {"one_row": ((1, 6), 0), "two_rows": ((2, 5), 0), "tall": ((7, 3), 0), "experts": ((2, 3, 4), 0),
              "conv": ((3, 2, 3, 3), 0), "cols": ((5, 7), 1)}
    inputs = [{k: torch.randn(shape, generator=g) for k, (shape, _) in shapes.items()} for _ in range(steps)]
    tx = mfx.row_normalize(0.9, axis=axis)
    ref_state = tx.init(TensorDict(inputs[0], []))
    dt = lambda fulls: TensorDict({k: distribute_tensor(v, mesh, [Shard(shapes[k][1])])  # noqa: E731
                                   for k, v in fulls.items()}, [])
    state = tx.init(dt(inputs[0]))
    out: dict = {"errors": [], "reductions": [], "all_reduces": []}
    for fulls in inputs:
        ref, ref_state = tx.update(TensorDict(fulls, []), ref_state)
        mdist.comm_stats().reset()
        with CommDebugMode() as comm:
            got, state = tx.update(dt(fulls), state)
        out["reductions"].append(mdist.comm_stats().reductions)
        out["all_reduces"].append(sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op)))
        out["errors"].append({k: (ref[k] - got[k].full_tensor()).abs().max().item() for k in fulls})
        out["v_errors"] = {k: (ref_state.v[k] - state.v[k].full_tensor()).abs().max().item() for k in fulls}
    return out


def settings_differ(rank: int, world: int) -> dict:
    """TransformOptimizer(mfx.muon_adamw) on an FSDP2 model; one good step, then on rank 1
    alone, each followed by a good step: another Newton-Schulz dtype, another batch budget,
    another beta2 / lr / ns_steps / ns_method, the parameters listed in another order,
    and an extra param group. Each attempt's error and whether anything moved."""
    from muonfx.linalg import set_batch_bytes, set_default_ns_dtype

    model = _model(world)
    named = list(model.named_parameters())

    def make(order=named, extra=False):
        groups = [{"params": list(order)}]
        if extra:  # a group of one more (replicated) tensor, on this rank only
            groups.append({"params": [("extra", torch.nn.Parameter(torch.zeros(2)))], "tx": mfx.adamw})
        return mfx.TransformOptimizer(groups if extra else list(order), mfx.muon_adamw, lr=0.02)

    opt = make()
    _backward(model, rank)
    opt.step()
    opt.zero_grad()
    out: dict = {}

    def attempt(name, o, undo=lambda: None):
        _backward(model, rank)
        out[name] = _attempt(o, model)
        undo()
        o.zero_grad()

    if rank == 1:  # (the tests pin float32 through MUONFX_NS_DTYPE)
        set_default_ns_dtype(torch.bfloat16)
    opt.replan()
    attempt("ns_dtype", opt, lambda: set_default_ns_dtype(None))
    if rank == 1:
        set_batch_bytes(1 << 12, "cpu")
    attempt("budget", opt, lambda: set_batch_bytes(None, "cpu"))
    group = opt.param_groups[0]
    for key, value in (("adamw_betas", (0.9, 0.9)), ("lr", 0.03), ("ns_steps", 0), ("ns_method", "gram")):
        old = group[key]
        if rank == 1:
            group[key] = value
        attempt(key, opt, lambda old=old, key=key: group.__setitem__(key, old))
    for name, o in (("order", make(named[::-1] if rank == 1 else named)), ("extra_group", make(extra=rank == 1))):
        attempt(name, o)
    _backward(model, rank)
    before = _locals(model)
    opt.step()
    out["next_step_moved"] = all(not torch.equal(before[n], p.to_local())
                                 for n, p in model.named_parameters() if p.to_local().numel())
    return out


def mixed_cpus(rank: int, world: int) -> dict:
    """No Newton-Schulz dtype pinned anywhere, and the ranks' CPUs default to different
    ones (rank 0 bf16, rank 1 float32: nodes of two CPU generations). Two steps of
    MuonOptimizer on an FSDP2 model, then the same from the same start with float32 pinned
    on every rank: the ranks take float32 by rule, and end where the pinned run does."""
    import os

    from muonfx.linalg import precision, set_default_ns_dtype

    os.environ.pop("MUONFX_NS_DTYPE", None)
    set_default_ns_dtype(None)
    precision._cpu = precision.CpuChoice(torch.bfloat16 if rank == 0 else torch.float32, "a test's CPU")
    out: dict = {}
    for run in ("rule", "pinned"):
        if run == "pinned":
            set_default_ns_dtype(torch.float32)
        model = _model(world)
        opt = mfx.MuonOptimizer(model, lr=0.02)
        for _ in range(2):
            _backward(model, rank)
            opt.step()
            opt.zero_grad()
        out[run] = _locals(model)
        out[f"{run}_dtype"] = str(opt.plan.settings.ns_dtype)
    out["same"] = all(torch.equal(out["rule"][n], out["pinned"][n]) for n in out["rule"])
    del out["rule"], out["pinned"]
    return out
