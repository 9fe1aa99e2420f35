"""The compatibility modules (muonfx._compat): the only code reading tensordict's and
DTensor's private fields. Each test names the versions its module was checked against,
and checks that the private fast path gives what the public API gives (the fallback taken
where a version lays its objects out differently)."""

from __future__ import annotations

import os
import tempfile

import pytest
import tensordict
import torch
import torch.distributed as dist
from tensordict import TensorDict

import muonfx as mfx
from muonfx._compat import dtensor as dt_compat
from muonfx._compat import tensordict as td_compat

# ---------------------------------------------------------------------------
# tensordict
# ---------------------------------------------------------------------------


def test_tensordict_has_the_private_layout_it_was_checked_against():
    assert td_compat.PRIVATE_LAYOUT, (
        f"tensordict {tensordict.__version__} lays a TensorDict out differently from the versions "
        f"muonfx._compat.tensordict was checked against ({', '.join(td_compat.CHECKED_AGAINST)}): muonfx runs on "
        "the public API there (slower); check the layout and update the module")


def _trees():
    a, b, c, d = (torch.randn(2, 3) for _ in range(4))
    return [
        ([("w",), ("b",)], [a, b]),                                                   # flat
        ([("layers", "0", "w"), ("layers", "1", "w"), ("head",)], [a, b, c]),         # nested
        ([("x", "y", "z"), ("x", "q"), ("top",), ("x", "y", "u")], [a, b, c, d]),     # deeper, interleaved
        ([("w",), ("w",)], [a, b]),                                                   # a repeated key
        ([], []),                                                                     # empty
    ]


def _walk_public(td):
    return ([k if isinstance(k, tuple) else (k,) for k in td.keys(include_nested=True, leaves_only=True)],
            list(td.values(include_nested=True, leaves_only=True)))


@pytest.mark.parametrize("private", [True, False], ids=["private", "public"])
def test_tensordict_build_and_td_items_equal_the_public_api(private, monkeypatch):
    """``build`` makes what ``TensorDict(dict(zip(keys, tensors)), batch_size=[])`` makes (the
    same tensors, keys in the same order, batch size, device, unlocked), and ``td_items``
    walks it as ``keys``/``values`` do, on either path."""
    if private and not td_compat.PRIVATE_LAYOUT:
        pytest.skip(f"tensordict {tensordict.__version__} lacks the private layout")
    monkeypatch.setattr(td_compat, "PRIVATE_LAYOUT", private)
    for keys, tensors in _trees():
        got = td_compat.build(keys, tensors)
        want = TensorDict(dict(zip(keys, tensors)), batch_size=[])
        assert type(got) is TensorDict and got.batch_size == want.batch_size and got.device == want.device
        assert not got.is_locked
        gk, gv = td_compat.td_items(got)
        wk, wv = _walk_public(want)
        assert gk == wk and all(x is y for x, y in zip(gv, wv)), keys
        assert td_compat.td_items(want)[0] == wk
        got["new"] = torch.zeros(1)  # a TensorDict like any other
        assert (got == got.clone()).all()


def test_a_step_on_the_public_tensordict_path_equals_the_private_one(monkeypatch):
    if not td_compat.PRIVATE_LAYOUT:
        pytest.skip(f"tensordict {tensordict.__version__} lacks the private layout")
    gen = torch.Generator().manual_seed(0)
    params = TensorDict({"a": {"w": torch.randn(8, 4, generator=gen)}, "b": torch.randn(6, 6, generator=gen)}, [])
    grads = params.apply(lambda t: torch.randn(t.shape, generator=gen))
    outs = []
    for private in (True, False):
        monkeypatch.setattr(td_compat, "PRIVATE_LAYOUT", private)
        tx = mfx.muon(lr=0.02, ns_dtype=torch.float32)
        state = tx.init(params)
        u, state = tx.update(grads, state, params)
        u, state = tx.update(grads, state, params)
        outs.append(mfx.apply_updates(params, u))
    assert (outs[0] == outs[1]).all()


# ---------------------------------------------------------------------------
# DTensor (a one-rank gloo world in this process)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_has_the_private_layout_it_was_checked_against(mesh):
    cls = dt_compat.dtensor_class()
    assert cls is not None and dt_compat.PRIVATE_LAYOUT is not None
    assert dt_compat.PRIVATE_LAYOUT, (
        f"torch {torch.__version__}'s DTensor keeps its shard and spec elsewhere than the versions "
        f"muonfx._compat.dtensor was checked against ({', '.join(dt_compat.CHECKED_AGAINST)}): muonfx runs on the "
        "public API there (slower); check the layout and update the module")


def _dtensors(mesh, n=4, seed=0):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    places = [[Shard(0)], [Shard(1)], [Replicate()]]
    return [distribute_tensor(torch.randn(6, 4, generator=gen), mesh, places[i % 3]) for i in range(n)]


def _same_dtensor(a, b):
    assert type(a) is type(b) and tuple(a.placements) == tuple(b.placements) and a.device_mesh == b.device_mesh
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    torch.testing.assert_close(a.to_local(), b.to_local(), rtol=0, atol=0)


def _each_path(monkeypatch, fn):
    """``fn()`` on the private path, then on the public one."""
    assert dt_compat.PRIVATE_LAYOUT, "torch's DTensor lacks the private layout"
    got = []
    for private in (True, False):
        monkeypatch.setattr(dt_compat, "PRIVATE_LAYOUT", private)
        got.append(fn())
    return got


def test_dtensor_shards_and_layout_equal_the_public_api(mesh, monkeypatch):
    ts = _dtensors(mesh) + [torch.ones(2)]
    cls = dt_compat.dtensor_class()
    with torch.no_grad():
        (sp, mp, st, lo), (sq, mq, su, lq) = _each_path(monkeypatch, lambda: (
            dt_compat.shards(ts, cls), dt_compat.meshes_and_placements(ts[:-1]), dt_compat.storages(ts),
            [dt_compat.local(t) for t in ts]))
    for a, b, c, d in zip(sp, sq, lo, lq):
        assert a.data_ptr() == b.data_ptr() == c.data_ptr() == d.data_ptr() and a.shape == b.shape
    assert sp[-1] is ts[-1] and st == su
    assert mp[0] == mq[0] and [tuple(p) for p in mp[1]] == [tuple(p) for p in mq[1]]
    with torch.no_grad():
        picked = dt_compat.shards(ts, cls, [1, 4])  # a subset, by position
    assert picked[0].data_ptr() == sp[1].data_ptr() and picked[1] is ts[4]


def test_dtensor_rewraps_and_stack_views_equal_the_public_api(mesh, monkeypatch):
    ts = _dtensors(mesh, 6)
    with torch.no_grad():
        def run():
            dt_compat._STACK_SPECS.clear()
            views = dt_compat.dtensor_stack_views(ts, [tuple(t.shape) for t in ts])
            views = dt_compat.dtensor_stack_views(ts, [tuple(t.shape) for t in ts])  # from the specs held
            back = dt_compat.unstack_like([v * 2 for v in views], ts)
            rewrapped = dt_compat.rewrap_all([t.to_local() + 1 for t in ts], ts)
            return views, back, rewrapped
        private, public = _each_path(monkeypatch, run)
    for a, b in zip(sum(private, []), sum(public, [])):
        _same_dtensor(a, b)


def test_a_dtensor_step_on_the_public_path_equals_the_private_one(mesh, monkeypatch):
    """Muon over DTensor parameters (Shard(0), Shard(1), Replicate()), through the seam's
    DTensor backend: the same parameters on either path."""
    from muonfx.distributed import install, uninstall

    def run():
        ts = _dtensors(mesh, 6, seed=1)
        params = [torch.nn.Parameter(t) for t in ts]
        for i, p in enumerate(params):
            p.grad = _dtensors(mesh, 6, seed=2 + i)[i]
        opt = mfx.TransformOptimizer([(f"w{i}", p) for i, p in enumerate(params)], mfx.muon, lr=0.02,
                                     weight_decay=0.1, ns_dtype=torch.float32)
        for _ in range(2):
            opt.step()
        return [p.detach() for p in params]

    install()
    try:
        private, public = _each_path(monkeypatch, run)
    finally:
        uninstall()
    for a, b in zip(private, public):
        _same_dtensor(a, b)


def test_local_indices_by_split_rule_and_by_fallback(mesh, monkeypatch):
    """Each placement's split rule (private ``_split_tensor``) and the fallback from
    ``local_range`` give the same rows on one rank; the 4-rank QK-clip worlds check them
    against ``muonfx.distributed.layout`` on ``Shard``, ``_StridedShard``, uneven and empty
    shards (``tests/qk_workers.py``)."""
    from torch.distributed.tensor import Shard

    ts = _dtensors(mesh, 3)
    want = [torch.arange(6), torch.arange(4)]
    for t in ts:
        for d in (0, 1):
            assert torch.equal(dt_compat.local_indices(t, d), want[d])
    assert torch.equal(dt_compat.local_indices(torch.zeros(5, 2), 0), torch.arange(5))
    monkeypatch.delattr(Shard, "_split_tensor")
    assert torch.equal(dt_compat.local_indices(ts[0], 0), torch.arange(6))
