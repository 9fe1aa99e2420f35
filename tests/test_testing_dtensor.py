"""The DTensor variants of muonfx.testing's strategies, in a one-rank gloo world in this
process: sharded runs of muonfx transforms equal the plain runs (the multi-rank
behaviour is covered by tests/test_fsdp.py)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import muonfx as mfx
from muonfx.distributed import install, uninstall
from muonfx.testing import sharded_params_and_grads


@pytest.fixture(scope="module")
def mesh():
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    install()
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        uninstall()
        dist.destroy_process_group()


def _full(td):
    return td.apply(lambda t: t.full_tensor() if isinstance(t, DTensor) else t)


def test_sharded_strategy_runs_transforms_like_plain_tensors(mesh):
    @settings(max_examples=10, deadline=None, derandomize=True)
    @given(pg=sharded_params_and_grads(mesh, min_ndim=2, max_ndim=3, dtypes=(torch.float32,)))
    def check(pg):
        params, grads = pg
        assert all(isinstance(t, DTensor) for t in params.values(True, True))
        tx = mfx.muon(ns_dtype=torch.float32, weight_decay=0.1)
        u, _ = tx.update(grads, tx.init(params), params)
        ref_u, _ = tx.update(_full(grads), tx.init(_full(params)), _full(params))
        for k in ref_u.keys(True, True):
            torch.testing.assert_close(u[k].full_tensor(), ref_u[k], rtol=1e-6, atol=1e-7)

    check()


def _sharded(mesh, placements, n, seed=0):
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    named, plain = [], []
    for i in range(n):
        w, g = torch.randn(24, 40, generator=gen), torch.randn(24, 40, generator=gen)
        q = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, placements[i % len(placements)]))
        q.grad = distribute_tensor(g.clone(), mesh, placements[i % len(placements)])
        named.append((f"w{i}", q))
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        plain.append((f"w{i}", p))
    return named, plain


def test_a_dtensor_step_views_its_matrices_without_dtensors_view_rule_and_computes_the_same(mesh):
    """2-D DTensor matrices enter and leave Newton-Schulz as views of their shards under a
    spec computed once per layout: the step equals the one of plain tensors, every
    parameter keeps its placements, for Shard(0), Shard(1) and Replicate()."""
    from torch.distributed.tensor import Replicate, Shard

    named, plain = _sharded(mesh, [[Shard(0)], [Shard(1)], [Replicate()]], 6)
    opts = [mfx.TransformOptimizer(x, mfx.muon, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
            for x in (named, plain)]
    for _ in range(3):
        for o in opts:
            o.step()
    for (k, q), (_, p), want in zip(named, plain, [[Shard(0)], [Shard(1)], [Replicate()]] * 2):
        assert isinstance(q, DTensor) and tuple(q.placements) == tuple(want), k
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=1e-6, atol=1e-7, msg=k)


def test_a_dtensor_steps_python_calls_per_parameter_are_bounded(mesh):
    """The Python calls a DTensor group's step adds per parameter (sys.setprofile, 20 and
    200 matrices): 7 measured on torch 2.10 and 2.13 (521 when every matrix view went
    through DTensor's own rule, every mesh comparison rebuilt the mesh tensor and every
    result went through DTensor's decorated constructor; ``torch.optim.Muon`` on the same
    DTensors: 1,683 on 2.10, 1,882 on 2.13)."""
    import sys

    from torch.distributed.tensor import Shard

    def calls(n):
        named, _ = _sharded(mesh, [[Shard(0)]], n)
        opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02)
        opt.step()
        opt.step()
        count = [0]

        def prof(frame, event, arg):
            if event == "call":
                count[0] += 1

        sys.setprofile(prof)
        try:
            opt.step()
        finally:
            sys.setprofile(None)
        return count[0]

    per = (calls(200) - calls(20)) / 180
    assert per <= 20, per


def test_tune_steps_only_what_it_times_and_runs_no_hook(mesh, monkeypatch):
    """``opt.tune()`` times the groups it can compile and puts them back; a DTensor group
    beside them does not move (its counts stay), and the optimizer's step hooks (an
    average of the weights kept by a hook) see no trial step."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    plain = torch.nn.Parameter(torch.randn(8, 8))
    shard = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]))
    opt = mfx.TransformOptimizer([{"params": [("plain", plain)]}, {"params": [("shard", shard)]}], mfx.adamw, lr=0.1)
    hooks = []
    opt.register_step_post_hook(lambda o, a, k: hooks.append(1))
    plain.grad = torch.randn(8, 8)
    shard.grad = distribute_tensor(torch.randn(8, 8), mesh, [Replicate()])
    before = plain.detach().clone(), shard.full_tensor().clone()
    got = opt.tune(rounds=2)
    assert got["groups"] == [0], got
    assert torch.equal(plain, before[0]) and torch.equal(shard.full_tensor(), before[1])
    assert opt.transform_state(0).count == 0 and opt.transform_state(1).count == 0
    assert hooks == []
    opt.step()
    assert len(hooks) == 1 and opt.transform_state(1).count == 1


def test_each_optimizer_counts_its_own_exchange(mesh):
    """Every optimizer has its own CommStats (its steps' share of the exchange); the
    process counters (muonfx.distributed.comm_stats) count every one."""
    from torch.distributed.tensor import Shard

    from muonfx.distributed import comm_stats

    a, _ = _sharded(mesh, [[Shard(0)]], 3, seed=1)
    b, _ = _sharded(mesh, [[Shard(0)]], 5, seed=2)
    opts = [mfx.TransformOptimizer(x, mfx.muon, lr=0.02) for x in (a, b)]
    assert opts[0].comm_stats is not opts[1].comm_stats
    total = comm_stats().matrices_orthogonalized
    opts[0].step()
    opts[1].step()
    opts[1].step()
    assert opts[0].comm_stats.matrices_orthogonalized == 3
    assert opts[1].comm_stats.matrices_orthogonalized == 10
    assert comm_stats().matrices_orthogonalized - total == 13
    opts[1].comm_stats.reset()
    assert opts[1].comm_stats.matrices_orthogonalized == 0 and opts[0].comm_stats.matrices_orthogonalized == 3


def test_extra_args_reach_the_transforms_of_a_dtensor_step(mesh):
    from torch.distributed.tensor import Shard

    from muonfx.core import EmptyState, GradientTransformation

    seen = []

    def update_fn(updates, state, params=None, **extra_args):
        seen.append(extra_args["factor"])
        return updates.apply(lambda u: u * extra_args["factor"]), state

    named, plain = _sharded(mesh, [[Shard(0)]], 2)
    tx = lambda lr=0.1: mfx.chain(mfx.newton_schulz(dtype=torch.float32),  # noqa: E731
                                  GradientTransformation(lambda p: EmptyState(), update_fn), mfx.scale(-lr))
    opts = [mfx.TransformOptimizer(x, tx) for x in (named, plain)]
    for o in opts:
        o.step(factor=0.5)
    assert seen == [0.5, 0.5]
    for (k, q), (_, p) in zip(named, plain):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=1e-6, atol=1e-7, msg=k)


def test_the_dtensor_caches_are_bounded(mesh, monkeypatch):
    """The stack specs (muonfx._compat.dtensor.STACK_SPECS layouts), the meshes' process
    groups (backend.MESHES) and the exchange plans (DTensorBackend.PLANS) keep at most
    their documented number of entries."""
    from torch.distributed.tensor import Shard

    from muonfx._compat import dtensor as dt_compat
    from muonfx.core.cache import LRU
    from muonfx.distributed import backend

    assert backend._GROUPS.size == backend.MESHES and backend.BACKEND._plans.size == backend.DTensorBackend.PLANS
    monkeypatch.setattr(dt_compat, "STACK_SPECS", 2)
    monkeypatch.setattr(dt_compat, "_STACK_SPECS", {})
    monkeypatch.setattr(backend, "_GROUPS", LRU(2))
    monkeypatch.setattr(backend.BACKEND, "_plans", LRU(2))
    for n, rows in enumerate((8, 12, 16, 20)):
        meshn = init_device_mesh("cpu", (1,))  # a new mesh object each time
        from torch.distributed.tensor import distribute_tensor

        q = torch.nn.Parameter(distribute_tensor(torch.randn(rows, 6), meshn, [Shard(0)]))
        q.grad = distribute_tensor(torch.randn(rows, 6), meshn, [Shard(0)])
        mfx.TransformOptimizer([("w", q)], mfx.muon, lr=0.02).step()
        assert len(dt_compat._STACK_SPECS) <= 2 and len(backend._GROUPS) <= 2 and len(backend.BACKEND._plans) <= 2
    assert len(backend.BACKEND._plans) == 2 and len(dt_compat._STACK_SPECS) == 2
