"""Measure the extra memory of an optimizer step, on any device.

``step_memory(opt.step, device)`` is the peak number of bytes allocated during one call
beyond those allocated before it: ``torch.cuda.max_memory_allocated`` on CUDA, and on
the CPU :class:`FreshMemory`, which counts every newly allocated storage op by op until
it is freed. The benchmarks print it next to torch's optimizers; ``tests/test_memory.py``
states the executor's bounds with it.

Example::

    >>> import torch, muonfx as mfx
    >>> from muonfx.memory import step_memory
    >>> w = torch.nn.Parameter(torch.zeros(256))
    >>> opt = mfx.TransformOptimizer([("w", w)], mfx.adamw)
    >>> w.grad = torch.ones(256); opt.step()          # the first step creates the state
    >>> step_memory(opt.step, torch.device("cpu")) >= 256 * 4
    True
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FreshMemory", "step_memory"]


class FreshMemory(TorchDispatchMode):
    """Peak bytes of tensor storage allocated inside the block and still alive
    (the CPU's stand-in for ``torch.cuda.max_memory_allocated``).

    Every op's outputs are inspected: an output whose storage is new (not one of the
    op's inputs', not seen before) counts until its storage is freed (a finalizer on
    the storage object, which torch keeps alive exactly as long as the storage).
    Allocations that do not go through the dispatcher (the buffers inside a compiled
    inductor kernel) are not seen.
    """

    def __init__(self) -> None:
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


def step_memory(step: Callable[[], object], device: torch.device) -> int:
    """Extra bytes of one call of ``step``: the peak allocated during it beyond what was
    allocated before. Run it outside the timed rounds (the CPU counter slows every op),
    after a first step has created the optimizer's state."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with FreshMemory() as m:
        step()
    return m.peak
