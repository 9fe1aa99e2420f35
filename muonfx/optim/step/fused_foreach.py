"""What the plan's lowerings in foreach passes share (:mod:`.fused_adam_family`): the
rules a group's chain and this step's tensors must meet, the state's buffers as lists,
the temporaries kept between steps on the CPU, numbers as the CPU's foreach ops take
them cheaply, with the chain's bits."""

from __future__ import annotations

from typing import Any

import torch

from ..._compat.dtensor import is_dtensor, local
from ...core import EmptyState
from ...counts import Counts, advance, by_count
from .fused import _DTYPES, _groups, _leaves, _locals, _number, step_values

__all__ = ["ForeachLowering"]


def _by_kind(lists: list[list]) -> list[list]:
    """``lists`` cut by the (device, dtype) of the first one's tensors (a fused kernel
    takes one of each): ``[lists]`` as they are where they have one."""
    parts = _groups(lists[0])
    if len(parts) == 1:
        return [lists]
    return [[[xs[i] for i in idx] for xs in lists] for idx in parts.values()]


def _by_count(ts: list[tuple[int, list[int]]], lists: list) -> list[tuple[int, list]]:
    """``[(t, the lists at t's positions)]`` for the counts ``ts`` (``[(t, positions)]``;
    a ``None`` list stays ``None``): the lists as they are while every parameter has the
    same count (the common case: no copy)."""
    if len(ts) == 1:
        return [(ts[0][0], lists)]
    return [(t, [None if xs is None else [xs[j] for j in pos] for xs in lists]) for t, pos in ts]


class _Ops:
    """The foreach ops of one run of a step, with the chain's bits, cheap on the CPU.

    A Python number as a foreach op's operand costs the CPU a wrapped tensor per element
    of the list (45 us for 28 tensors, against 12 us for a 0-D tensor, measured); so on
    the CPU, where every parameter has one dtype, a number goes as a 0-D tensor with the
    bits of the chain's op: of the dtype the op computes in (float32, float64 for float64
    lists; 0-D parameters included) for ``torch._foreach_mul(xs, s)`` (and add, div), of
    the list's own dtype for the in-place ``torch._foreach_mul_(xs, s)`` of 16-bit lists
    (which rounds ``s`` to it first). Elsewhere (GPUs, mixed dtypes) the numbers go as they are.
    Results the chain computes out of place go to the scratch (:func:`_scratch`)."""

    def __init__(self, memo: dict | None, keys: tuple, params: list[torch.Tensor], cpu: torch.dtype | None) -> None:
        self.memo, self.keys, self.params, self.cpu = memo, keys, params, cpu  # cpu: the one dtype of the CPU

    def num(self, s: float, inplace: bool = False) -> Any:
        """``s`` as the chain's ``foreach`` op takes it (``inplace``: its in-place mul)."""
        if self.cpu is None:
            return s
        if inplace and self.cpu in (torch.bfloat16, torch.float16):
            return torch.scalar_tensor(s, dtype=self.cpu)
        return torch.scalar_tensor(s, dtype=torch.float64 if self.cpu == torch.float64 else torch.float32)

    def mul_(self, xs: list[torch.Tensor], s: float) -> None:
        """``xs *= s`` with the bits of ``torch._foreach_mul(xs, s)``."""
        if self.cpu is None and any([x.dtype in (torch.bfloat16, torch.float16) for x in xs]):
            for x in xs:
                torch.mul(x, s, out=x)
        else:
            torch._foreach_mul_(xs, self.num(s))

    def scratch(self, n: int) -> list:
        if self.memo is None:
            return [None] * n
        hit = self.memo.get(("scratch", self.keys, n))
        if hit is None:
            hit = self.memo[("scratch", self.keys, n)] = _scratch(self.memo, self.params, n)
        return hit


def _scratch(memo: dict, like: list[torch.Tensor], n: int) -> list:
    """``n`` lists of tensors shaped like ``like`` to compute in, or ``n`` Nones off the
    CPU (the foreach ops then return new tensors). On the CPU, views of flat buffers kept
    in the plan's ``memo`` between steps, one per dtype and list, of the largest run's
    size: fresh memory costs the CPU a page fault per 4 KiB at every step (several times
    the arithmetic, measured); a GPU's caching allocator gives temporaries at no such cost."""
    if any([t.device.type != "cpu" for t in like]):
        return [None] * n

    def span(t: torch.Tensor) -> int:  # each view starts on a 64-byte boundary
        return -(-t.numel() * t.element_size() // 64) * 64 // t.element_size()

    sizes: dict[torch.dtype, int] = {}
    for t in like:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + span(t)
    flats = memo.setdefault("flat", {})
    grown = [(i, dt) for i in range(n) for dt, size in sizes.items() if (i, dt) not in flats or
             flats[(i, dt)].numel() < size]
    if grown:  # the views of the other runs go with the buffers they were cut from
        for k in [k for k in memo if isinstance(k, tuple) and k[0] == "scratch"]:
            del memo[k]
        for i, dt in grown:
            flats[(i, dt)] = torch.empty(sizes[dt], dtype=dt)
    out = []
    for i in range(n):
        at = dict.fromkeys(sizes, 0)
        views = []
        for t in like:
            k = at[t.dtype]
            views.append(flats[(i, t.dtype)][k:k + t.numel()].view(t.shape))
            at[t.dtype] = k + span(t)
        out.append(views)
    return out


#: on the CPU, a parameter of at least this many bytes steps alone: its passes then find
#: its tensors in the cache (the small GPT of ``benchmarks/catalogue_step.py``: LaProp's
#: step 11.9 -> 9.7 ms, ADOPT's 9.6 -> 9.4 ms; the tiny one's, whose largest parameter is
#: half of it, unchanged, measured)
ALONE_BYTES = 1 << 19


def _runs(memo: dict | None, keys: tuple, params: list[torch.Tensor]) -> list:
    """The step's runs of passes: ``[None]`` (every parameter at once) where the group
    holds at most the plan's batch budget (``memo["budget"]``, bytes) and no parameter
    steps alone, else the positions of consecutive parameters of at most that many bytes
    together, a larger one alone, and on the CPU each of at least :data:`ALONE_BYTES` alone."""
    hit = memo.get(("runs", keys)) if memo is not None else None
    if hit is None:
        budget = (memo.get("budget") if memo is not None else None) or 1 << 62
        sizes = [p.numel() * p.element_size() for p in params]
        alone = ALONE_BYTES if all([p.device.type == "cpu" for p in params]) else 1 << 62
        if sum(sizes) <= budget and max(sizes, default=0) < alone:
            hit = [None]
        else:
            hit, run, held = [], [], 0
            for j, n in enumerate(sizes):
                if n >= alone:
                    hit.append([j])
                    continue
                if run and held + n > budget:
                    hit, run, held = hit + [run], [], 0
                run, held = run + [j], held + n
            if run:
                hit.append(run)
        if memo is not None:
            memo[("runs", keys)] = hit
    return hit


def _layout(ts: list) -> list:
    """Each DTensor's mesh and placements (None for a plain tensor)."""
    return [(t.device_mesh, tuple(t.placements)) if is_dtensor(t) else None for t in ts]


class _Buffers:
    """The state buffers of a lowered group (its link's moments, MARS's previous gradient)
    as lists in the order of ``keys`` (their local shards where the parameters are
    DTensors), and whether each has its parameter's dtype, device and shape (and mesh and
    placements); kept in the plan's memo while the state holds the same TensorDicts (the
    step writes in place)."""

    def __init__(self, tds: tuple, keys: tuple, params: list[torch.Tensor]) -> None:
        self.tds, self.keys, self.ids = tds, keys, [id(p) for p in params]
        leaves = [_leaves(td, keys) for td in tds]
        #: the parameters' meshes and placements where one is a DTensor, else None
        self.layout = _layout(params) if any([is_dtensor(p) for p in params]) else None
        self.ok = self.layout is None or all([_layout(bs) == self.layout for bs in leaves])
        if self.layout is not None:
            params, leaves = _locals(params), [_locals(bs) for bs in leaves]
        self.lists = leaves
        self.sig = [(p.dtype, p.device, p.shape) for p in params]
        self.ok = self.ok and all([[(b.dtype, b.device, b.shape) for b in bs] == self.sig for bs in self.lists])
        kinds = {(p.dtype, p.device.type) for p in params}
        #: the parameters' dtype where they all have one and are on the CPU, else None
        self.cpu = next(iter(kinds))[0] if len(kinds) == 1 and next(iter(kinds))[1] == "cpu" else None

    @staticmethod
    def of(tds: tuple, keys: tuple, params: list[torch.Tensor], memo: dict | None) -> "_Buffers":
        bufs = memo.get("buffers") if memo is not None else None
        if bufs is None or bufs.keys != keys or any([a is not b for a, b in zip(bufs.tds, tds)]) or \
                bufs.ids != [id(p) for p in params]:
            bufs = _Buffers(tds, keys, params)
            if memo is not None:
                memo["buffers"] = bufs
        return bufs


class ForeachLowering:
    """A lowering in foreach passes on the state of one link (its moments ``mu`` and
    ``nu``): the rules (:meth:`why_not`, :meth:`ready`), the hyperparameters' checks
    (:meth:`check`) and the step (:meth:`step`, in runs of at most the plan's batch
    budget, each with its temporaries). A subclass names its link and the state's type,
    the orders of its preset's links and the other links' state types (``EmptyState``
    where not named), and computes one run in ``_run``."""

    name = ""
    #: the link whose state holds the moments (and the counts), its state's type, the
    #: orders of the preset's links (its ``named_chain``), the other links' state types
    link, kind = "", tuple
    orders: tuple = ()
    others: dict = {}
    #: every op elementwise: DTensor parameters (FSDP2, HSDP, tensor parallel shards) step
    #: as their local shards, their gradients and state laid out as they are
    on_shards = False
    #: the link's state counts its steps (``count``); else the preset's own count is read
    counted = True

    @classmethod
    def why_not(cls, hp: dict[str, Any], params: list[torch.Tensor]) -> str | None:
        """None where the lowered step computes the group's chain, else the reason."""
        for n, v in hp.items():
            if n == "betas":
                if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(b) for b in v)):
                    return f"betas {v!r} are not two numbers"
            elif n == "decouple":
                if not isinstance(v, bool):
                    return "decouple is not a bool"
            elif not (_number(v) or n == "max_norm" and v is None):
                return f"{n} is {'a schedule' if callable(v) else type(v).__name__}"
        for p in params:
            if is_dtensor(p):
                if not cls.on_shards:
                    return "DTensor parameters (its step sums over whole parameters)"
                p = local(p)
            if p.device.type not in ("cpu", "cuda"):
                return f"parameters on {p.device.type}"
            if p.dtype not in _DTYPES:
                return f"parameters of {p.dtype}"
        return None

    @classmethod
    def _tds(cls, inner: dict) -> tuple:
        """The state's TensorDicts the step writes, each like the parameters."""
        return inner[cls.link].mu, inner[cls.link].nu

    @classmethod
    def ready(cls, state: Any, params: list[torch.Tensor], grads: list[torch.Tensor], keys: tuple,
              memo: dict | None = None) -> str | None:
        """None where this step's state and gradients are what the lowered step takes."""
        hyper = getattr(state, "hyperparams", None)
        inner = getattr(state, "inner_state", None)
        if hyper is None or not isinstance(inner, dict) or tuple(inner) not in cls.orders \
                or not all([isinstance(inner[n], cls.kind if n == cls.link else cls.others.get(n, EmptyState))
                            for n in inner]) \
                or not isinstance(getattr(inner[cls.link] if cls.counted else state, "count", None), Counts):
            return f"the state is not {cls.__name__.removeprefix('Fused')}'s"
        if any([callable(v) and not isinstance(v, torch.Tensor) for v in hyper.values()]):
            return "a schedule in the state"
        try:
            bufs = _Buffers.of(cls._tds(inner), keys, params, memo)
        except (KeyError, TypeError, AttributeError):
            return "the state does not match the parameters"
        if not bufs.ok:
            return "the state differs from its parameters in dtype, device, shape or placements"
        if bufs.layout is not None:
            if _layout(grads) != bufs.layout:
                return "gradients differ from their parameters in mesh or placements"
            grads = _locals(grads)
        if [(g.dtype, g.device, g.shape) for g in grads] != bufs.sig or \
                any([g.layout != torch.strided for g in grads]):
            return "gradients differ from their parameters in dtype, device, shape or layout"
        return None

    @classmethod
    def check(cls, factory: Any, hp: dict[str, Any], state: Any) -> dict[str, Any]:
        """The hyperparameter values of this step (the group's ``hp`` with the state's
        injected numbers), checked by the rules the preset checks them by
        (:mod:`muonfx.hyperparams`: betas in range, lr, eps, weight decay finite and
        ``>= 0``): the chain's errors, raised before anything is written."""
        return step_values(hp, state)

    @classmethod
    def step(cls, state: Any, vals: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
             keys: tuple, memo: dict | None = None) -> Any:
        """Step the parameters and the state buffers in place, in runs of at most the
        plan's batch budget (:func:`_runs`); return the new state (the same buffers, the
        counts advanced). ``memo``: the group plan's (the budget, the buffers' lists, the
        runs, the scratch)."""
        inner = state.inner_state
        st = inner[cls.link]
        bufs = _Buffers.of(cls._tds(inner), keys, params, memo)
        lr, wd = float(vals["lr"]), float(vals["weight_decay"])
        b1, b2 = (float(b) for b in vals["betas"])
        ts = by_count(st.count, list(keys), f"{cls.link} state (count)") if cls.counted else \
            by_count(state.count, list(keys), "state (count)")
        if bufs.layout is not None:  # DTensors (on_shards): their local shards
            params, grads = _locals(params), _locals(grads)
        with torch.no_grad():
            for pos in _runs(memo, keys, params):
                if pos is None:
                    cls._run(_Ops(memo, keys, params, bufs.cpu), ts, grads, params, bufs.lists, lr, wd, b1, b2, vals)
                    continue
                at = {j: i for i, j in enumerate(pos)}
                sub = [(t, [at[j] for j in js if j in at]) for t, js in ts]
                pick = lambda xs: [xs[j] for j in pos]  # noqa: E731
                cls._run(_Ops(memo, tuple(pick(keys)), pick(params), bufs.cpu), [(t, js) for t, js in sub if js],
                         pick(grads), pick(params), [pick(b) for b in bufs.lists], lr, wd, b1, b2, vals)
        new_inner = {**inner, cls.link: st._replace(count=advance(st.count))} if cls.counted else inner
        injected = {n: vals[n] for n in state.hyperparams}
        return state._replace(count=advance(state.count), hyperparams=injected, inner_state=new_inner)

    @staticmethod
    def _second_moment(k: _Ops, vs: list[torch.Tensor], gs: list[torch.Tensor], b2: float) -> None:
        """``v <- b2 * v + (1 - b2) * g * g`` in place, as the chain's two ops (its bits)."""
        k.mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1.0 - b2)

    @staticmethod
    def _decay(k: _Ops, params: list[torch.Tensor], lr: float, wd: float) -> None:
        if wd != 0.0:
            torch._foreach_mul_(params, k.num(1.0 - lr * wd))
