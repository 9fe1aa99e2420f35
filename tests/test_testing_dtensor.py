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
