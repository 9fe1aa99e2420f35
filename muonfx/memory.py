"""Measure the extra memory of an optimizer step, on any device.

``step_memory(opt.step, device)`` is the peak number of bytes allocated during one call
beyond those allocated before it: ``torch.cuda.max_memory_allocated`` on CUDA, and on
the CPU :class:`AllocatorPeak`, which replays the CPU allocator's own allocation and
free records (the profiler's memory events) in time order. Both see every allocation
of the step, those inside a compiled (inductor) graph included, so the figure is that
of the path the executor actually ran. :class:`FreshMemory` counts new storages op by
op through the dispatcher instead: it sees only eager ops, and, being a dispatch mode,
makes the executor run its eager step. The benchmarks print ``step_memory`` next to
torch's optimizers; ``tests/test_memory.py`` states the executor's bounds with both.

Example::

    >>> import torch, muonfx as mfx
    >>> from muonfx.memory import step_memory
    >>> w = torch.nn.Parameter(torch.zeros(256))
    >>> opt = mfx.TransformOptimizer([("w", w)], mfx.adamw, fused=False)  # the chain, transform by transform
    >>> w.grad = torch.ones(256); opt.step()          # the first step creates the state
    >>> step_memory(opt.step, torch.device("cpu")) >= 256 * 4
    True
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllocatorPeak", "FreshMemory", "step_memory", "state_bytes", "state_per_element"]


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


class AllocatorPeak:
    """Peak bytes allocated on the CPU inside the block beyond those allocated before it,
    from the allocator's own records (``torch.profiler`` with ``profile_memory=True``:
    one event per allocation and per free, with its size), replayed in time order.

    Unlike :class:`FreshMemory` it changes nothing about how the block runs and sees
    allocations that bypass the dispatcher (the buffers of a compiled graph). Needs
    torch's Kineto profiler (``torch.autograd.kineto_available()``; the standard wheels
    have it). Memory the block frees that was allocated before it counts negatively,
    as with ``torch.cuda.max_memory_allocated``.

    Example::

        >>> import torch
        >>> from muonfx.memory import AllocatorPeak
        >>> x = torch.randn(1000)
        >>> with AllocatorPeak() as m:
        ...     y = x * 2                  # 4000 bytes
        ...     z = y + 1                  # 8000 live
        ...     del y, z
        >>> 8000 <= m.peak < 8100          # and the few bytes of the scalars 2 and 1
        True
    """

    def __init__(self) -> None:
        self.peak = 0
        self._prof: Any = None

    @staticmethod
    def available() -> bool:
        """Kineto is there and no profiler is running (a second profiling session would
        end the running one: the user's profile would be lost)."""
        return bool(torch.autograd.kineto_available()) and not torch.autograd._profiler_enabled()

    def __enter__(self) -> "AllocatorPeak":
        from torch.profiler import ProfilerActivity, profile

        if torch.autograd._profiler_enabled():
            raise RuntimeError("AllocatorPeak: a profiler is already running; its session would be ended")

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        events = [(e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        live = peak = 0
        for _, nbytes in sorted(events, key=lambda e: e[0]):
            live += nbytes
            peak = max(peak, live)
        self.peak = peak
        self._prof = None


def step_memory(step: Callable[[], object], device: torch.device) -> int:
    """Extra bytes of one call of ``step``: the peak allocated during it beyond what was
    allocated before. Run it outside the timed rounds, after a first step has created
    the optimizer's state (and, for the executor's automatic choice, after it has
    chosen: the figure is that of the path the step runs). CUDA:
    ``torch.cuda.max_memory_allocated``; CPU: :class:`AllocatorPeak` (or, without the
    Kineto profiler or while another profiler runs, :class:`FreshMemory`, which sees the
    eager path only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    counter: AllocatorPeak | FreshMemory = AllocatorPeak() if AllocatorPeak.available() else FreshMemory()
    with counter:
        step()
    return counter.peak


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor an optimizer holds in ``opt.state`` (its buffers: moments,
    previous gradients, Shampoo factors and bases, ...; step counters kept as Python
    numbers count 0). Works for any ``torch.optim.Optimizer``; muonfx's create their
    state when they are built, torch's at their first step.

    Example::

        >>> import torch, muonfx as mfx
        >>> from muonfx.memory import state_bytes
        >>> w = torch.nn.Parameter(torch.zeros(16, 8))
        >>> state_bytes(mfx.TransformOptimizer([("w", w)], mfx.adamw))   # two float32 moments
        1024
    """
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def state_per_element(opt: torch.optim.Optimizer) -> float:
    """:func:`state_bytes` over the number of parameter elements of ``opt``'s groups: 8.0
    for AdamW's two float32 moments, 4.0 for Muon's or Lion's one buffer.

    Example::

        >>> import torch, muonfx as mfx
        >>> from muonfx.memory import state_per_element
        >>> w = torch.nn.Parameter(torch.zeros(16, 8))
        >>> state_per_element(mfx.TransformOptimizer([("w", w)], mfx.lion))
        4.0
    """
    elements = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return state_bytes(opt) / elements
