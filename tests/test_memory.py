"""Optimizer state memory: Muon keeps one buffer per matrix (optionally bf16), AdamW two;
a step's extra working memory, measured op by op, is bounded by the largest group."""

import weakref

import pytest
import torch
from tensordict import TensorDict
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import muonfx as mfx
from muonfx.base import tree_tensors


def _params():
    gen = torch.Generator().manual_seed(0)
    return TensorDict({"a": torch.randn(16, 32, generator=gen), "b": torch.randn(3, 8, 8, generator=gen),
                       "c": torch.randn(4, 2, 3, 3, generator=gen)}, [])


def _state_bytes(state):
    return sum(t.numel() * t.element_size() for t in tree_tensors(state))


def test_muon_state_is_one_buffer_per_matrix():
    p = _params()
    param_bytes = sum(t.numel() * t.element_size() for t in p.values())
    state = mfx.muon().init(p)
    assert len(list(tree_tensors(state))) == 3
    assert _state_bytes(state) == param_bytes
    half = mfx.muon(mu_dtype=torch.bfloat16).init(p)
    assert _state_bytes(half) == param_bytes // 2
    assert all(t.dtype == torch.bfloat16 for t in tree_tensors(half))


def test_adamw_state_is_two_buffers_per_parameter():
    p = _params()
    param_bytes = sum(t.numel() * t.element_size() for t in p.values())
    state = mfx.adamw().init(p)
    assert _state_bytes(state) == 2 * param_bytes


def test_bf16_momentum_tracks_float32_momentum():
    p = _params()
    g = p.apply(lambda t: torch.randn_like(t))
    full, half = mfx.muon(ns_dtype=torch.float32), mfx.muon(ns_dtype=torch.float32, mu_dtype=torch.bfloat16)
    sf, sh = full.init(p), half.init(p)
    for _ in range(3):
        uf, sf = full.update(g, sf, p)
        uh, sh = half.update(g, sh, p)
    for k in ("a", "b", "c"):
        rel = ((uf[k] - uh[k]).norm() / uf[k].norm()).item()
        assert rel < 0.05, (k, rel)  # bf16 storage of the EMA only



# ---------------------------------------------------------------------------
# a step's extra working memory, measured
# ---------------------------------------------------------------------------


class FreshMemory(TorchDispatchMode):
    """Peak bytes of tensor storage allocated inside the block and still alive.

    Every op's outputs are inspected: an output whose storage is new (not one of the
    op's inputs', not seen before) counts until its storage is freed (a finalizer on
    the storage object, which torch keeps alive exactly as long as the storage).
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self.seen or st.nbytes() == 0:
                continue
            if inputs is None:
                inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                          if isinstance(a, torch.Tensor)}
            if key in inputs:
                continue
            self.seen.add(key)
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key, st.nbytes())
        return out


def test_fresh_memory_counts_allocations_and_frees():
    x = torch.randn(1000)
    with FreshMemory() as m:
        y = x * 2           # 4000 bytes
        x.mul_(2)           # in place: nothing new
        z = y + 1           # 8000 live
        del y               # 4000 live
        w = z[:10]          # a view: nothing new
        del z, w            # 0 live
        v = x.sqrt()        # 4000 again, peak stays 8000
    assert m.peak == 8000 and m.live == 4000
    del v


def _step_peak(factory, shapes, donate_grads, **kw):
    gen = torch.Generator().manual_seed(0)
    named = [(k, torch.nn.Parameter(torch.randn(*s, generator=gen))) for k, s in shapes.items()]
    opt = mfx.TransformOptimizer(named, factory, lr=0.01, **kw)
    opt.donate_grads = donate_grads
    for step in range(3):  # the first step allocates the state; measure a later one
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 2:
            with FreshMemory() as m:
                opt.step()
        else:
            opt.step()
    return m.peak, sum(p.numel() * p.element_size() for _, p in named)


def _distinct_shapes(n):
    """n matrices of different shapes (one per same-shape group), the largest 96x128."""
    return {f"w{i}": (96 - i, 128 - 2 * i) for i in range(n)}


def test_adamw_step_allocates_one_scratch_or_nothing_with_donated_grads():
    shapes = _distinct_shapes(12) | {"b": (96,)}
    peak, model = _step_peak(mfx.adamw, shapes, donate_grads=False)
    assert model <= peak <= model + 256  # the update's one buffer per parameter (torch's foreach AdamW: the same)
    peak, _ = _step_peak(mfx.adamw, shapes, donate_grads=True)
    assert peak <= 256  # the gradients are the scratch: only 0-d scalars are new


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_step_memory_does_not_grow_with_the_model(ns_dtype):
    """With donated gradients, a Muon step's extra memory is a few copies of the largest
    same-shape group, whatever the number of groups (measured: 5.4x one matrix in float32,
    3.2x in bf16, for 8 or 32 groups)."""
    largest = 96 * 128 * 4
    small_peak, small_model = _step_peak(mfx.muon, _distinct_shapes(8), True, ns_dtype=ns_dtype)
    big_peak, big_model = _step_peak(mfx.muon, _distinct_shapes(32), True, ns_dtype=ns_dtype)
    assert big_model > 2.5 * small_model
    assert big_peak <= 1.05 * small_peak, (small_peak, big_peak)
    assert big_peak <= 7 * largest, big_peak / largest
    # without donation the update itself is a copy of the model (the functional output)
    peak, model = _step_peak(mfx.muon, _distinct_shapes(24), False, ns_dtype=ns_dtype)
    assert peak >= model
