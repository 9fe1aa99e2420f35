"""Helpers shared by several test modules (imported as ``from helpers import ...``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tensordict import TensorDictBase

from muonfx.cli import main


def default_signals() -> None:
    """``preexec_fn`` of a child the test sends signals to: SIGINT, SIGTERM and SIGHUP at
    their defaults, also where the test process itself was started with them ignored
    (``nohup ... &``, some CI runners), which a child would inherit (and Python then
    installs no KeyboardInterrupt handler)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def run_main(argv: list[str]) -> int:
    """``muonfx <argv>`` in this process, leaving torch's threads and RNG as they were."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            return main(argv)
    finally:
        torch.set_num_threads(threads)


def flatten_state(obj, prefix=""):
    """(path, value) for every tensor and number of a state tree (NamedTuples, dicts,
    TensorDicts, tuples); callables (schedules) are skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, TensorDictBase):
        for k, v in obj.items(include_nested=True, leaves_only=True):
            yield f"{prefix}/{k}", v
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten_state(v, f"{prefix}/{k}")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from flatten_state(v, f"{prefix}[{i}]")
    elif not callable(obj):
        yield prefix, obj


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Tiny tensors: one intra-op thread is fastest, and stays fast on a loaded runner
    (import it into a test module to apply it there)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def sweep(values, keep, ids=None):
    """The values of a long ``parametrize`` sweep: those whose id is in ``keep`` run in the
    default suite, the others only in the slow run (``python -m pytest -q -m slow``).

    ``ids``: the ids of ``values`` (default: the values themselves, as strings)."""
    ids = [str(v) for v in values] if ids is None else list(ids)
    unknown = set(keep) - set(ids)
    assert not unknown, f"sweep: keep names no value: {sorted(unknown)}"
    return [pytest.param(v, id=i, marks=() if i in keep else pytest.mark.slow) for v, i in zip(values, ids)]


def resumed(model, opt, fresh, make_opt):
    """``fresh`` and a new optimizer (``make_opt(fresh)``) given ``model``'s and ``opt``'s
    state through ``torch.save`` and ``torch.load(weights_only=True)``, as a resumed run
    gets them; returns that optimizer."""
    import io

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh.load_state_dict(saved["model"])
    new = make_opt(fresh)
    new.load_state_dict(saved["opt"])
    return new


# -- refusals: an error that names the culprit, and nothing changed --------


def snapshot(*objs):
    """A copy of every tensor and number of each state tree in ``objs`` (see :func:`flatten_state`)."""
    return [[(p, v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for p, v in flatten_state(o)]
            for o in objs]


def assert_unchanged(snap, *objs):
    """``objs`` hold what :func:`snapshot` saw, bit for bit (NaNs where NaNs were; meta
    tensors by shape and dtype)."""
    now = snapshot(*objs)
    assert len(now) == len(snap)
    for before, after in zip(snap, now):
        assert [p for p, _ in before] == [p for p, _ in after]
        for (path, b), (_, a) in zip(before, after):
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{path} changed"
                if b.is_meta:
                    continue
                if b.layout != torch.strided:
                    a, b = a.to_dense(), b.to_dense()
                a, b = (torch.view_as_real(t) if t.is_complex() else t for t in (a, b))
                assert torch.equal(a, b) or bool(torch.isnan(a).any() and torch.allclose(
                    a, b, equal_nan=True, rtol=0, atol=0)), f"{path} changed"
            else:
                assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{path} changed"


def refused(exc, match, fn, *inputs):
    """``fn()`` raises ``exc`` whose message matches ``match``; ``inputs`` are unchanged."""
    snap = snapshot(*inputs)
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(snap, *inputs)


def small_model(seed=0):
    """A two-layer ``nn.Sequential`` (4 -> 8 -> 3), seeded."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def backward(model, seed):
    """Gradients of a seeded batch on ``model`` (``small_model``), set afresh."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=gen)
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """``[n]``: how many times ``owner.name`` (a staticmethod, such as a fused kernel's
    ``step``) is called from now on, counted by a wrapper ``monkeypatch`` removes."""
    n = [0]
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        n[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(counted))
    return n


def one_rank_dtensor(shape: tuple) -> tuple:
    """A DTensor of ``shape`` (random, sharded on dim 0) in a one-rank gloo world of this
    process, and the function that ends the world."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1), rank=0,
                            world_size=1)
    return distribute_tensor(torch.randn(shape), init_device_mesh("cpu", (1,)), [Shard(0)]), dist.destroy_process_group


def seeded_grads(named: list, step: int, skip: int | None = None) -> None:
    """Give each ``(name, parameter)`` of ``named`` a gradient drawn at seed ``100 + step``
    in its dtype (the one at place ``skip`` none: it sits the step out)."""
    gen = torch.Generator().manual_seed(100 + step)
    for i, (_, p) in enumerate(named):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = None if i == skip else g


def shared_grads(lists: list, step: int, skip: int | None = None, seed: int = 100, zeros: float = 0.0) -> None:
    """Give the parameters at one place in each of ``lists`` (lists of ``(name, parameter)``,
    one per optimizer compared) the same gradient, drawn at seed ``seed + step`` in their
    dtype, about a fraction ``zeros`` of its entries zero; the ones at place ``skip`` none
    (they sit the step out)."""
    gen = torch.Generator().manual_seed(seed + step)
    for i, ps in enumerate(zip(*lists)):
        if i == skip:
            for _, p in ps:
                p.grad = None
            continue
        g = torch.randn(ps[0][1].shape, generator=gen)
        if zeros:
            g = g * (torch.rand(g.shape, generator=gen) > zeros)
        g = g.to(ps[0][1].dtype)
        for _, p in ps:
            p.grad = g.to(p.device, copy=True)


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
