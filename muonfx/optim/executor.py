"""The executor: the one place that knows how a step runs on real memory.

Transforms compute; the executor executes. A step is two phases:

1. **compute**: for every param group, call its (pure) transform on fresh
   TensorDicts of gradients, parameters and state. Nothing is written. Any error
   (a bad hyperparameter, a schedule returning NaN, a 1-D parameter in a Muon group,
   a transform's own exception) ends the step here, leaving every parameter, state
   tensor and param group exactly as it was.
2. **commit**: write each group's new state into its old state buffers (``copy_``;
   the buffers keep their identity, so references held by users, ``opt.state`` and
   checkpoints stay valid) and add the updates to the parameters (``p += u``, one
   ``_foreach_add_`` per group). Tensors of the new state or updates that share
   memory with an old state buffer or a parameter are copied first, so no write can
   change a value that a later write reads.

That is the eager step, the reference, correct everywhere. After :meth:`Executor.compile`
the whole step of every group (compute, write-back, ``p += u``) is one
``torch.compile`` graph instead, cached per set of groups and static hyperparameters
(``dynamic=True``; lr, momentum or weight decay changes recompile nothing on torch 2.13;
see :attr:`Executor.floats_specialize` for 2.10 and 2.11), where the
compiler stores in place and frees intermediates early. Matrix work is batched under a byte budget
by :mod:`muonfx.linalg.batching`; the same budget bounds the pieces in which a large
group with a leafwise transform (:func:`muonfx.leafwise`) is run, each piece computed and
written before the next (:meth:`Executor.pieces`), so a step's extra memory is that of
one piece. DTensor shards run their elementwise work on the local tensors
(:func:`muonfx.base.foreach`); only the seam sees whole matrices.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Any, Callable

import torch
from tensordict import TensorDictBase
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ..base import Key, build, foreach, is_leafwise, key_str, tree_pairs as _tree_pairs, tree_replace as _rebuild, tree_tensors
from ..linalg.batching import batch_bytes
from ..memory import AllocatorPeak
from ..schedules import ScheduleNotTraceable
from ..state_tree import frozen_scalars, merge, restrict, same_scalars, scalars_per_param, split, with_scalars
from ..wrappers import inject_hyperparams
from .groups import GroupWork, numeric_values, static_key as _static_key

__all__ = ["Executor", "GroupWork", "write_back"]

_log = logging.getLogger("muonfx")


def _storages(tensors: Any) -> list[int]:
    """The storage address of each tensor (of its local shard for a DTensor)."""
    out = []
    for t in tensors:
        if type(t).__name__ == "DTensor":
            t = t.to_local()
        out.append(t.untyped_storage().data_ptr())
    return out


def write_back(old: Any, new: Any, hazards: set[int] | None = None, pairs: list | None = None) -> Any:
    """Copy ``new``'s tensors into ``old``'s buffers where they match; return the
    state with those buffers (``old``'s tensors are written, ``new``'s are not).

    A tensor of ``new`` with the shape, dtype, device and type of the tensor at the same
    place of ``old`` is copied into it, and that buffer takes its place; anything else
    (scalars, other shapes) is taken from ``new``. A tensor of ``new`` that shares
    memory with a tensor of ``old`` (or with a storage in ``hazards``) and is not the
    buffer it goes to is copied first, so the order of the writes does not matter.
    (The executor passes ``pairs``, see :func:`muonfx.base.tree_pairs`, and ``hazards`` already
    holding ``old``'s storages, computed once for the whole commit.)

    Example::

        >>> import torch
        >>> from muonfx.optim.executor import write_back
        >>> buf = torch.zeros(2)
        >>> kept = write_back((buf,), (torch.ones(2),))
        >>> kept[0] is buf, buf.tolist()
        (True, [1.0, 1.0])
    """
    if pairs is None:
        pairs = _tree_pairs(old, new)
        hazards = set(_storages([o for o, _ in pairs if isinstance(o, torch.Tensor)])) | (hazards or set())
    if not pairs:
        return new
    unsafe = hazards or set()
    taken: dict[int, torch.Tensor] = {}
    dst, src = [], []
    for (o, n), addr in zip(pairs, _storages([n for _, n in pairs])):
        if n is o:
            continue
        s = n.clone() if addr in unsafe else n
        if (isinstance(o, torch.Tensor) and o.shape == s.shape and o.dtype == s.dtype
                and o.device == s.device and type(o) is type(s)):
            dtensor = type(o).__name__ == "DTensor"
            dst.append(o.to_local() if dtensor else o)
            src.append(s.to_local() if dtensor else s)
            taken[id(n)] = o
        elif s is not n:
            taken[id(n)] = s
    if dst:
        torch._foreach_copy_(dst, src)
    return _rebuild(new, taken) if taken else new


def _extra_memory(step: Callable[[], bool], work: list[GroupWork]) -> tuple[bool, int | None]:
    """Run ``step``; whether it ran, and the peak bytes it allocated beyond those allocated
    before it (CUDA's allocator statistics; on the CPU the allocator's records,
    :class:`muonfx.memory.AllocatorPeak`), or None where they cannot be had (another
    profiler running, no Kineto)."""
    devices = {p.device for w in work for p in w.params}
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        before = {}
        for d in cuda:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
            before[d] = torch.cuda.memory_allocated(d)
        ran = step()
        extra = 0
        for d in cuda:
            torch.cuda.synchronize(d)
            extra = max(extra, torch.cuda.max_memory_allocated(d) - before[d])
        return ran, extra
    if not AllocatorPeak.available():  # no Kineto, or the user's profiler is running
        return step(), None
    counter = AllocatorPeak()
    counter.__enter__()
    try:
        ran = step()
    finally:
        counter.__exit__(None, None, None)
    return ran, counter.peak


def _compiled_frames() -> int:
    """How many graphs dynamo has built in this process (recompilations included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _mib(n: int | None) -> str:
    return "an unmeasured amount of memory" if n is None else f"{n / 2 ** 20:.1f} MiB"


#: raised by torch.compile before a graph runs (nothing written): the step goes eager
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                   getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException))


def _schedule_not_traceable(e: BaseException | None) -> bool:
    """Whether ``e`` is (or was raised from, or wraps) :class:`muonfx.schedules.ScheduleNotTraceable`:
    dynamo re-raises a user's exception met while tracing as its own ``Unsupported``
    ("Observed exception"), the original's class name in the chained one's."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ScheduleNotTraceable) or "ScheduleNotTraceable" in type(e).__name__:
            return True
        e = e.__cause__ or e.__context__
    return False


def _compiler_failed(e: BaseException) -> bool:
    """Whether ``e`` is the compiler's failure, raised before the graph ran (nothing
    written): one of dynamo's own errors, or any other error but the transforms' own
    (``ValueError``, ``TypeError``: a bad hyperparameter, a parameter a transform
    refuses, raised while tracing, which the eager step raises again) that was raised
    while dynamo compiled the frame. Torch 2.10-2.13 let a bare ``AssertionError``
    ("sympy expression is NaN") out of tracing (muonfx's cosine schedules raised it until
    the hyperparameter check stopped comparing with infinity); errors of the running
    graph (out of memory) come from the compiled code, not from the compiler's frames,
    and are raised as they are."""
    if isinstance(e, _COMPILE_ERRORS):
        return True
    if isinstance(e, (ValueError, TypeError)) or not isinstance(e, Exception):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/_dynamo/convert_frame.py"):
            return True
        tb = tb.tb_next
    return False


def _write(old: Any, new: Any, params: list[torch.Tensor], updates: list[torch.Tensor]) -> Any:
    """Write the state ``new`` into ``old``'s buffers (:func:`write_back`) and add the
    updates to the parameters; return the state holding ``old``'s buffers. An update
    sharing memory with an old state buffer or a parameter is copied before either is
    written."""
    pairs = _tree_pairs(old, new)
    olds = [o for o, _ in pairs if isinstance(o, torch.Tensor)]
    addrs = _storages([*params, *olds, *updates])  # one pass: this runs for every group
    n = len(params) + len(olds)
    unsafe = set(addrs[:n])
    us = []
    for p, u, addr in zip(params, updates, addrs[n:]):
        us.append(u.clone() if addr in unsafe and u is not p else u)
    kept = write_back(old, new, unsafe, pairs)
    foreach("add_", params, us)
    return kept


def _store(old: Any, new: Any) -> Any:
    """:func:`write_back` for traced code (inside ``torch.compile``): copy ``new``'s
    tensors into ``old``'s matching buffers with no aliasing analysis (the compiler's
    functionalization orders the reads before the writes); return the state holding
    ``old``'s buffers.

    One ``copy_`` per buffer, not ``torch._foreach_copy_``: inductor (2.10-2.13) fuses a
    foreach copy into one loop that writes each buffer before it computes the next
    one's new value, so a new value that reads another old buffer read it overwritten
    (``accumulate(momentum(0.9), 2)``: the momentum took the zeroed sum, a 15 % wrong
    trajectory after 8 steps; aot_eager and eager were right)."""
    pairs = _tree_pairs(old, new)
    kept: list[torch.Tensor] = []  # what the state holds, in the pairs' order
    dst, src = [], []
    for o, n in pairs:
        if n is not o and (isinstance(o, torch.Tensor) and o.shape == n.shape and o.dtype == n.dtype
                           and o.device == n.device and type(o) is type(n)):
            dst.append(o)
            src.append(n)
            kept.append(o)
        else:
            kept.append(n)
    if not dst:
        return new
    for o, n in zip(dst, src):
        o.copy_(n)
    # by position, not by id(): torch 2.10's dynamo cannot trace id() of a tensor
    it = iter(kept)
    return _rebuild(new, fn=lambda _: next(it))


def _cohort_positions(w: GroupWork) -> dict[Any, list[int]]:
    """The positions (in ``w.params``) of the parameters that step, by counters: ``None``
    for the group's, else the tag of a parameter's own counters (``record.own``)."""
    own = w.record.own
    keys_all = w.record.keys
    if not own:
        return {None: list(range(len(w.idx)))}
    cohorts: dict[Any, list[int]] = {}
    for j, i in enumerate(w.idx):
        k = keys_all[i]
        tag = None if k not in own else tuple(
            (n, v.item() if isinstance(v, torch.Tensor) else v) for n, v in own[k].items())
        cohorts.setdefault(tag, []).append(j)
    return cohorts


def _idle_counters(w: GroupWork, state: Any, cohorts: dict[Any, list[int]]) -> dict[Key, dict[str, Any]]:
    """``record.own`` before this step's cohorts: when the group's counters advance, the
    parameters that do not step keep their counters as they were."""
    rec = w.record
    new_own = dict(rec.own)
    if None in cohorts and len(w.idx) != len(rec.keys):
        stepped = {rec.keys[i] for i in w.idx}
        idle = [k for k in rec.keys if k not in stepped and k not in rec.own]
        new_own.update(scalars_per_param(state, idle))
    return new_own


def _caught_up(own: dict[Key, dict[str, Any]], state: Any) -> dict[Key, dict[str, Any]]:
    """``own`` without the counters that equal the group's in ``state`` again."""
    if not own:
        return own
    now = scalars_per_param(state, list(own))
    return {k: c for k, c in own.items() if not same_scalars(c, now[k])}


def _one_cohort(w: GroupWork) -> bool:
    """Whether the parameters that step all have the group's counters and those that
    do not all have their own already: then the step is one plain (partial) call."""
    own = w.record.own
    keys = w.record.keys
    stepping = set(w.idx)
    return all((keys[i] in own) != (i in stepping) for i in range(len(keys)))


class Executor:
    """Runs the adapter's steps.

    **Eager** (the default, correct everywhere): pure compute for every group
    (:meth:`compute`), then one commit (:meth:`commit`): new state copied into the old
    buffers, ``p += u``.

    **Compiled** (after :meth:`compile`): once every group has made its first, eager
    step (which surfaces structural errors with clear messages), one function per set
    of static hyperparameters computes every group's update, writes the new state into
    the old buffers and adds the updates to the parameters, all inside one
    ``torch.compile`` graph. The compiler turns the copies into in-place stores and
    frees each intermediate as soon as it is dead, so the step allocates little and
    reads memory few times. Python-level errors (a bad hyperparameter, a transform's own
    exception) are raised while the function is traced, before the graph runs, so they
    change nothing either. Groups holding DTensors always run eagerly.

    Torch 2.10 and 2.11 specialise a graph to the values of float hyperparameters that go
    through Python arithmetic (their AOTAutograd keeps a float symbolic only through a few
    aten ops, not through ``1 - beta``), so each new value would recompile it, up to
    dynamo's limit; lr and momentum reach the graph as operands of tensor arithmetic and
    recompile nothing (``foreach("neg_mul")``, ``foreach("ema")``), nor does NorMuon's
    beta2 (``foreach("ema")`` in ``row_normalize``).
    Each compiled graph remembers the numeric hyperparameters of its last call; when a
    call with changed values builds a new graph, :attr:`floats_specialize` is set, the
    change is logged, and that graph's groups run eagerly from then on; afterwards a
    graph whose values changed is not called at all. Torch 2.13 recompiles nothing.

    **Automatic** (the default): for a set of groups holding at least
    :attr:`auto_min_elements` parameter elements, the executor measures the two paths
    on the machine at hand: one eager step is timed, the compiled step is built (its
    first call compiles, untimed), then compiled and eager steps are timed in turn until
    each has :attr:`auto_rounds` timings; the compiled step is kept for those groups if
    its fastest time is below :attr:`auto_margin` of eager's fastest (``choices``
    records it). The fastest, not one sample: on a shared machine one step can take
    10-20 % longer for reasons of its own (measured: a freshly compiled graph's first
    timed run, another process), enough to flip a single-sample choice. Below the threshold, and where compiling
    fails (no C++ compiler for inductor on the CPU, an untraceable transform), steps run
    eagerly. ``auto = False`` keeps every step eager; :meth:`compile` makes every step
    compiled.
    """

    #: parameters (elements) of a step's groups from which the automatic choice measures
    #: the compiled step: large enough that the one-time compilation (about a minute for
    #: GPT-2 small's AdamW on 2 CPU cores) pays for itself within a few hundred steps
    auto_min_elements: int = 1 << 24
    #: eager and compiled steps timed (alternately) before the automatic choice
    auto_rounds: int = 3
    #: the compiled step is kept when its fastest time is below this fraction of eager's
    auto_margin: float = 0.97

    def __init__(self) -> None:
        self.compile_kwargs: dict[str, Any] | None = None
        self._compiled: dict[Any, Callable[..., Any]] = {}
        #: measure and choose the faster path for large groups (see the class doc)
        self.auto = True
        #: the automatic choice per set of groups: ``"eager"`` or ``"compiled"``
        self.choices: dict[Any, str] = {}
        self._trials: dict[Any, dict[str, Any]] = {}
        self._clock: Callable[[], float] = time.perf_counter
        #: (group record id, static hyperparameters) of the transforms that have made a
        #: whole step: only those are run in pieces (see :meth:`pieces`)
        self._proven: set[tuple[int, tuple]] = set()
        self._plans: dict[tuple, list | None] = {}
        #: set when a compiled step ran (part of) its work eagerly instead
        self._fell_back = False
        #: per set of groups: "whole" (one graph) or "pieces", decided by the first
        #: compiled step's measured memory (see :meth:`_compiled_step`)
        self._compiled_mode: dict[Any, str] = {}
        self._bytes: dict[int, int] = {}
        #: per compiled graph: the numeric hyperparameters of its last call (see _run_fused)
        self._pins: dict[Any, tuple] = {}
        #: set once a compiled graph recompiled because a numeric hyperparameter changed:
        #: this torch specialises them (2.10, 2.11), so a graph runs only with its values
        self.floats_specialize = False

    def compile(self, **kwargs: Any) -> None:
        """Use ``torch.compile`` (``dynamic=True, fullgraph=True`` unless overridden)."""
        self.compile_kwargs = {"dynamic": True, "fullgraph": True, **kwargs}
        self._compiled = {}

    # -- eager: phase 1 ---------------------------------------------------------

    def compute(self, w: GroupWork) -> tuple[list[torch.Tensor], Any]:
        """The group's updates (aligned with ``w.params``) and its whole new state.

        Step counters are per parameter, as torch's: a parameter without a gradient
        keeps its counters (they go to ``record.own``), and parameters whose counters
        differ from the group's step in cohorts, one transform call per set of counters
        (see :meth:`_cohorts`). While every parameter steps every time, that is one call.
        """
        rec = w.record
        partial = len(w.idx) != len(rec.keys)
        if partial or rec.own:
            return self._cohorts(w)
        return self._compute(w, w.idx, rec.current_state(w.hp))

    def _cohorts(self, w: GroupWork) -> tuple[list[torch.Tensor], Any]:
        """:meth:`compute` for a step where some parameters have no gradient or their
        own counters: the parameters that step are grouped by their counters (the
        group's, or one of ``record.own``'s), each cohort computed on its sub-state
        with its counters; the new state takes the tensors of every cohort and the
        counters of the group's cohort, and ``w.own`` the counters of the others (and of
        the parameters that did not step, as they were)."""
        rec = w.record
        keys_all = rec.keys
        state = rec.current_state(w.hp)
        own = rec.own
        cohorts = _cohort_positions(w)
        new_own = _idle_counters(w, state, cohorts)
        updates: list[Any] = [None] * len(w.idx)
        new_state = state
        for tag in sorted(cohorts, key=lambda t: t is not None):  # the group's cohort first
            js = cohorts[tag]
            idx = [w.idx[j] for j in js]
            start = state if tag is None else with_scalars(state, own[keys_all[idx[0]]])
            sub_w = GroupWork(rec, w.hp, idx, [w.params[j] for j in js], [w.grads[j] for j in js])
            us, sub_state = self._compute(sub_w, idx, start)
            for j, u in zip(js, us):
                updates[j] = u
            if tag is None:
                new_state = merge(new_state, restrict(sub_state, {keys_all[i] for i in idx}))
            else:
                new_state = merge(new_state, restrict(sub_state, {keys_all[i] for i in idx}), scalars=False)
                cohort_keys = [keys_all[i] for i in idx]
                new_own.update(scalars_per_param(sub_state, cohort_keys))
        w.own = _caught_up(new_own, new_state)
        return updates, new_state

    def _compute(self, w: GroupWork, idx: list[int], state: Any, sub_state: bool = False
                 ) -> tuple[list[torch.Tensor], Any]:
        """The updates of the parameters at positions ``idx`` of the group and the whole
        new state (``state`` with their entries replaced); with ``sub_state``, ``state``
        is already theirs alone (a piece's) and so is the new state returned."""
        rec = w.record
        keys_all = rec.keys
        partial = len(idx) != len(keys_all)
        keys: list[Key] = [keys_all[i] for i in idx] if partial else keys_all
        if sub_state:
            partial = False
        sub = restrict(state, set(keys)) if partial else state
        upd, new_sub = rec.transform(w.hp).update(build(keys, w.grads), sub, build(keys, w.params))
        if not isinstance(upd, TensorDictBase):
            raise TypeError(f"the transform returned updates of type {type(upd).__name__}, not a TensorDict")
        updates = []
        for k, p in zip(keys, w.params):
            u = upd.get(k, None)
            if not isinstance(u, torch.Tensor):
                raise ValueError(f"the transform returned no update tensor for parameter {key_str(k)!r}")
            if u.shape != p.shape:
                raise ValueError(f"the transform's update for parameter {key_str(k)!r} has shape "
                                 f"{tuple(u.shape)}, the parameter {tuple(p.shape)}")
            updates.append(u)
        if len(upd.keys(include_nested=True, leaves_only=True)) != len(keys):
            raise ValueError("the transform returned updates for keys that are not parameters of this group")
        return updates, (merge(state, new_sub) if partial else new_sub)

    # -- eager: phase 2 ---------------------------------------------------------

    @staticmethod
    def commit(w: GroupWork, updates: list[torch.Tensor], new_state: Any) -> None:
        """Write the new state into the old buffers and add the updates to the parameters."""
        rec = w.record
        rec.state = _write(rec.state, new_state, w.params, updates)
        rec.stepped = True
        if w.own is not None:
            rec.own = w.own

    # -- compiled ---------------------------------------------------------------

    @staticmethod
    def _compilable(work: list[GroupWork]) -> tuple[bool, int]:
        """Whether the compiled step may run these groups, and their parameter elements.

        Not under a Python dispatch mode (a memory counter, a debug mode): dynamo then
        skips the frame and runs it eagerly, so the step must be the eager one."""
        ok, n = not is_in_torch_dispatch_mode(), 0
        for w in work:  # plain loops: this runs every step
            ok = ok and w.record.stepped and (not w.record.own and len(w.idx) == len(w.record.keys)
                                              or _one_cohort(w))
            for p in w.params:
                n += p.numel()
                if type(p).__name__ == "DTensor":
                    ok = False
        return ok, n

    @staticmethod
    def _key(work: list[GroupWork]) -> tuple:
        return tuple((id(w.record), tuple(w.idx), _static_key(w.hp)) for w in work)

    def _fused(self, work: list[GroupWork], sub_state: bool = False) -> Callable[..., Any] | None:
        """The compiled whole step for these groups, their present parameters and static
        hyperparameters (built and compiled once, then cached; None where it could not be
        traced). With ``sub_state`` (a piece) the states it takes are theirs alone."""
        key = ("piece",) + self._key(work) if sub_state else self._key(work)
        if key in self._compiled:
            return self._compiled[key]
        plans = []
        for w in work:
            rec = w.record
            partial = len(w.idx) != len(rec.keys) and not sub_state
            keys = [rec.keys[i] for i in w.idx]
            # traced from the plain factory: the graph rebuilds nothing at run time
            plans.append((inject_hyperparams(rec.factory)(**w.hp), keys, partial))

        def step_in_place(grads, params, states):
            new_states = []
            for (tx, keys, partial), gs, ps, state in zip(plans, grads, params, states):
                sub = restrict(state, set(keys)) if partial else state
                upd, new_sub = tx.update(build(keys, gs), sub, build(keys, ps))
                us = [upd.get(k) for k in keys]
                new_states.append(_store(state, merge(state, new_sub) if partial else new_sub))
                torch._foreach_add_(ps, us)
            return new_states

        kwargs = self.compile_kwargs or {"dynamic": True, "fullgraph": True}
        # a code object of its own for every compiled step (dynamo caches its graphs per
        # code object, at most a few each: one per piece would exhaust them), named after
        # what it runs; identical graphs (pieces of the same shapes) still share the
        # compiler's own cache
        code = step_in_place.__code__.replace(co_name=f"muonfx_step_{len(self._compiled)}")
        fresh = types.FunctionType(code, step_in_place.__globals__, code.co_name, None, step_in_place.__closure__)
        fn = self._compiled[key] = torch.compile(fresh, **kwargs)
        return fn

    # -- a step -----------------------------------------------------------------

    def step(self, work: list[GroupWork]) -> None:
        """Compute every group's update, then (only if all succeeded) commit them all."""
        if not work:
            return
        ok, elements = self._compilable(work)
        if not ok:
            self._eager_step(work)
        elif self.compile_kwargs is not None:
            if not self._compiled_step(work):
                self._eager_step(work)
        elif self.auto and elements >= self.auto_min_elements:
            self._auto_step(work)
        else:
            self._eager_step(work)

    def _compiled_step(self, work: list[GroupWork]) -> bool:
        """The compiled step; False (nothing written) where it cannot run.

        The first compiled step of a set of groups runs them as one graph and measures
        its extra memory (:func:`_extra_memory`). Where that exceeds twice the budget
        (:func:`muonfx.linalg.batch_bytes`) and some group can run in pieces (see
        :meth:`pieces`), later compiled steps run those groups in pieces, one graph per
        piece (:meth:`_compiled_pieces`); elsewhere the one graph stays. A graph with
        matrix work materialises its batches' inputs and outputs (measured on the CPU:
        0.6-1.5 times the model for Muon), one of elementwise work alone stores in place
        (AdamW: nothing), and pieces cost a graph each to compile and a call each to run
        (AdamW, GPT-2 small, on the CPU: 1.15x the step time, 3x the compile time).
        """
        key = self._key(work)
        mode = self._compiled_mode.get(key)
        runs, large = self._all_runs(work)
        if mode == "pieces":
            return self._compiled_pieces(work, runs, large)
        if mode == "whole":
            return self._compiled_whole(work, large)
        ran, extra = _extra_memory(lambda: self._compiled_whole(work, large), work)
        if not ran:
            return False
        runs, _ = self._all_runs(work)  # (that whole step may have proven the transform)
        budget = min(batch_bytes(w.params[0].device) for w in work)
        pieces = runs is not None and extra is not None and extra > 2 * budget
        self._compiled_mode[key] = "pieces" if pieces else "whole"
        _log.info("muonfx: the compiled optimizer step held %s extra: %s", _mib(extra),
                  "in pieces from now on" if pieces else "one graph")
        return True

    def _compiled_whole(self, work: list[GroupWork], large: list[GroupWork]) -> bool:
        """Every group in one graph; False (nothing written) where it cannot be built.
        ``large``: the groups larger than a piece (see :meth:`_all_runs`)."""
        new_states = self._run_fused(work, [w.record.current_state(w.hp) for w in work])
        if new_states is None:
            return False
        for w, st in zip(work, new_states):
            w.record.state = st
        if large:
            self._prove([w for w in work if any(w is x for x in large)])
        return True

    def _compiled_pieces(self, work: list[GroupWork], runs: list | None, large: list[GroupWork]) -> bool:
        """The compiled step with the groups that can run in pieces in pieces.

        Groups run whole go through one graph; a group run in pieces (see :meth:`pieces`)
        through one graph per piece, each piece computed and written before the next, so
        the graph's buffers are bounded by the piece. If a piece's graph cannot be built,
        that piece and the rest run eagerly (nothing is run twice). ``runs``, ``large``:
        :meth:`_all_runs` of ``work``."""
        whole = work if runs is None else [w for w, r in zip(work, runs) if r is None]
        if whole and not self._compiled_whole(whole, large):
            if len(whole) == len(work):
                return False
            self._eager_step(work)  # nothing of this step has been written yet
            return True
        if runs is None:
            return True
        for w, r in zip(work, runs):
            if r is None:
                continue
            ctx = _PieceStep(w, r)
            eager = False
            for n, (tag, pw) in enumerate(ctx.pieces):
                start = ctx.start(n)
                if not eager:
                    new = self._run_fused([pw], [start], sub_state=True)
                    if new is not None:
                        ctx.written(n, new[0])
                        continue
                    eager = True  # this graph cannot be built: this piece on, eagerly
                self._eager_piece(ctx, n, self._compute(pw, pw.idx, start, sub_state=True))
            ctx.finish()
        return True

    def _run_fused(self, work: list[GroupWork], states: list[Any], sub_state: bool = False) -> list[Any] | None:
        """Run the compiled step of ``work`` from ``states``; the new states, or None where
        the graph could not be built (raised while tracing or compiling, before it ran:
        nothing was written; the groups stay eager from now on)."""
        fused = self._fused(work, sub_state)
        if fused is None:
            self._fell_back = True
            return None
        key = ("piece",) + self._key(work) if sub_state else self._key(work)
        pin, last = tuple(numeric_values(w.hp) for w in work), self._pins.get(key)
        changed = last is not None and last != pin
        if changed and self.floats_specialize:
            return self._unpin(key, last, pin, recompiled=False)
        frames = _compiled_frames()
        try:
            out = fused([w.grads for w in work], [w.params for w in work], states)
        except Exception as e:
            if not _compiler_failed(e):
                raise
            # The eager step raises the transform's own error; if it succeeds instead, the
            # compiler cannot trace these groups: they stay eager.
            if _schedule_not_traceable(e):
                _log.warning("muonfx: a schedule of your own is evaluated inside the optimizer step, and torch %s "
                             "compiles min/max of traced floats wrongly (muonfx.schedules.FLOAT_MIN_MAX_MISCOMPILED): "
                             "the step runs eagerly from now on; muonfx.schedules or a torch.optim.lr_scheduler "
                             "keep it compiled", torch.__version__)
            elif not isinstance(e, _COMPILE_ERRORS):
                _log.info("muonfx: torch.compile failed on the optimizer step (%s: %s); it runs eagerly from now on",
                          type(e).__name__, e)
            self._compiled[key] = None
            self._fell_back = True
            return None
        self._pins[key] = pin
        if changed and _compiled_frames() > frames:
            # the graph ran, recompiled for the new values: the next change would recompile
            # again (up to dynamo's limit, then eager): from the next step on it is eager
            self.floats_specialize = True
            self._unpin(key, last, pin, recompiled=True)
        return out

    def _unpin(self, key: Any, last: tuple, pin: tuple, recompiled: bool) -> None:
        """Let the compiled graph ``key`` go (its groups run eagerly from now on), saying
        why; returns None (nothing ran) for :meth:`_run_fused`."""
        self._compiled[key] = None
        self._fell_back = True
        changes = sorted({f"{n} {a!r} -> {b!r}" for old, new in zip(last, pin) for (n, a), (_, b) in zip(old, new)
                          if a != b})
        _log.info("muonfx: torch %s %s the compiled optimizer step when a numeric hyperparameter changed (%s); "
                  "torch 2.13 and later keep them symbolic. The step runs eagerly from now on.",
                  torch.__version__, "recompiled" if recompiled else "would recompile", ", ".join(changes))
        return None

    def _timed(self, fn: Callable[[], Any], work: list[GroupWork]) -> float:
        devices = {p.device for w in work for p in w.params if p.device.type == "cuda"}
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = self._clock()
        fn()
        for d in devices:
            torch.cuda.synchronize(d)
        return self._clock() - t0

    def _auto_step(self, work: list[GroupWork]) -> None:
        """Measure eager and compiled steps in turn and keep the faster (see the class doc)."""
        key = self._key(work)
        choice = self.choices.get(key)
        if choice == "compiled":
            if not self._compiled_step(work):
                self._eager_step(work)
            return
        if choice == "eager":
            self._eager_step(work)
            return
        trial = self._trials.setdefault(key, {"eager": [], "compiled": [], "built": False})
        eager, compiled = trial["eager"], trial["compiled"]
        if not eager or (trial["built"] and len(compiled) == len(eager)):
            # eager first, then again after each compiled step: E, build, C, E, C, ...
            eager.append(self._timed(lambda: self._eager_step(work), work))
            return
        if not trial["built"]:  # build and compile (untimed: the first calls compile)
            first = self._compiled_mode.get(key) is None
            if first:
                _log.info("muonfx: compiling the optimizer step of %d group(s) to measure it against eager "
                          "(opt.executor.auto = False keeps it eager)", len(work))
            self._fell_back = False
            if not self._compiled_step(work):
                self._eager_step(work)
                self._fell_back = True
            if self._fell_back:  # (part of) it could not be compiled: eager for good
                self.choices[key] = "eager"
                del self._trials[key]
                return
            # built once the graphs the compiled step keeps are: the pieces', if the one
            # graph held too much, compile at the next step (untimed too)
            trial["built"] = not (first and self._compiled_mode.get(key) == "pieces")
            return
        ran: list[bool] = []
        took = self._timed(lambda: ran.append(self._compiled_step(work)), work)
        if not ran[0]:  # the graph let go (a hyperparameter change on a torch that specialises it)
            self._eager_step(work)
            self.choices[key] = "eager"
            del self._trials[key]
            return
        compiled.append(took)
        if len(compiled) < self.auto_rounds:
            return
        # the fastest of each: noise (another process, a first touch of fresh memory)
        # only ever adds time
        best_e, best_c = min(eager), min(compiled)
        self.choices[key] = "compiled" if best_c < self.auto_margin * best_e else "eager"
        _log.info("muonfx: optimizer step eager %.1f ms, compiled %.1f ms (fastest of %d each): %s",
                  1e3 * best_e, 1e3 * best_c, len(compiled), self.choices[key])
        if self.choices[key] == "eager":  # let the graphs go (the pieces' too)
            recs = {id(w.record) for w in work}
            for k in self._compiled:
                if k == key or k[0] == "piece" and k[1][0] in recs:
                    self._compiled[k] = None
        del self._trials[key]

    def _eager_step(self, work: list[GroupWork]) -> None:
        """Compute every group (nothing written), then commit every group.

        A group run in pieces (see :meth:`pieces`) contributes the first piece of each of
        its cohorts to the compute phase, so an error of the group (a bad hyperparameter
        or schedule value, the transform's own) is raised before anything is written; its
        other pieces are then computed and committed one after another."""
        runs, large = self._all_runs(work)
        if runs is None:
            results = [self.compute(w) for w in work]
            with torch.no_grad():
                for w, (updates, new_state) in zip(work, results):
                    self.commit(w, updates, new_state)
            if large:
                self._prove(large)
            return
        ctxs = [None if r is None else _PieceStep(w, r) for w, r in zip(work, runs)]
        heads: list[tuple] = []  # (piece step or None: whole, number of the piece, its work)
        for w, ctx in zip(work, ctxs):
            if ctx is None:
                heads.append((None, 0, w))
            else:
                heads.extend((ctx, n, ctx.pieces[n][1]) for n in ctx.heads)
        results: list[Any] = [self.compute(h) if ctx is None else self._compute(h, h.idx, ctx.start(n), sub_state=True)
                              for ctx, n, h in heads]
        for i, (ctx, n, h) in enumerate(heads):
            result, results[i] = results[i], None  # once written, let the new tensors go
            if ctx is None:
                with torch.no_grad():
                    self.commit(h, *result)
            else:
                self._eager_piece(ctx, n, result)
            del result
        for ctx in ctxs:
            if ctx is None:
                continue
            for n, (tag, pw) in enumerate(ctx.pieces):
                if n not in ctx.heads:
                    self._eager_piece(ctx, n, self._compute(pw, pw.idx, ctx.start(n), sub_state=True))
            ctx.finish()
        self._prove([w for w, r in zip(work, runs) if r is None and any(w is x for x in large)])

    def _eager_piece(self, ctx: "_PieceStep", n: int, result: tuple[list[torch.Tensor], Any]) -> None:
        """Write one computed piece: its state into its buffers, its updates into its
        parameters (the counters are written when the step ends)."""
        updates, new_sub = result
        pw = ctx.pieces[n][1]
        with torch.no_grad():
            # the piece's state holds the group's buffers: this writes them in place
            kept = _write(ctx.subs[n], new_sub, pw.params, updates)
        ctx.written(n, kept)

    # -- pieces -----------------------------------------------------------------

    def pieces(self, w: GroupWork) -> list[list[int]] | None:
        """How this step runs a group: ``None`` for whole, or its pieces (lists of
        positions in ``w.params``), each computed and written before the next.

        A group runs in pieces when its parameters hold more bytes than
        :func:`muonfx.linalg.batch_bytes` (the one budget of matrix work, sized to the
        device) and its transform is declared leafwise (:func:`muonfx.leafwise`: each
        parameter's update and state depend on that parameter alone), none is a
        DTensor, and the same transform has made a whole step before. Then the pieces
        compute exactly what the whole group computes: every piece starts from the
        step's scalars (counters, hyperparameters), those of its cohort when some
        parameters have counters of their own (they missed steps: torch's per-parameter
        ``step``) or have no gradient; and the step's extra memory is that of the
        largest piece instead of the group's. Same-shape parameters go together
        (Newton-Schulz batches stay full); a parameter larger than the budget is a piece
        of its own.

        A raising step still changes nothing: an error of the group (a bad hyperparameter
        or schedule value, a static hyperparameter that does not build) is raised by the
        first piece of a cohort, and those are computed before anything is written; the
        errors of one parameter (its shape, dtype or kind refused by the transform) do
        not change from step to step (torch keeps a gradient's shape, dtype and device
        those of its parameter), so the whole step this transform made first has ruled
        them out.
        """
        runs = self._all_runs([w])[0]
        return None if runs is None else [piece for _, pieces in runs[0] for piece in pieces]

    def _all_runs(self, work: list[GroupWork]) -> tuple[list | None, list[GroupWork]]:
        """:meth:`_runs` of every group (None when every group runs whole), and the
        groups larger than a piece (or of unknown size): a whole step of theirs proves
        their transform (see :meth:`pieces`). Cheap for small groups: one dictionary
        lookup and the budget."""
        out = None
        large: list[GroupWork] = []
        budgets: dict[Any, int] = {}
        for i, w in enumerate(work):
            rec = w.record
            size = self._bytes.get(id(rec))
            if size is None:
                size = self._size(w)
            device = w.params[0].device
            budget = budgets.get(device)
            if budget is None:
                budget = budgets[device] = batch_bytes(device)
            if size is not None and size <= budget:  # the whole group within the budget
                continue
            large.append(w)
            r = self._runs(w, budget) if rec.stepped else None
            if r is not None:
                if out is None:
                    out = [None] * len(work)
                out[i] = r
        return out, large

    def _runs(self, w: GroupWork, budget: int) -> list[tuple[Any, list[list[int]]]] | None:
        """``[(cohort tag, pieces)]`` of a group larger than ``budget`` (the group's
        cohort first), or None: whole."""
        rec = w.record
        if (id(rec), _static_key(w.hp)) not in self._proven or not is_leafwise(rec.transform(w.hp)):
            return None
        if not rec.own and len(w.idx) == len(rec.keys):  # every parameter steps, alike
            key = (id(rec), budget)
            if key not in self._plans:
                plan = _plan_pieces(w.params, budget)
                self._plans[key] = None if plan is None else [(None, plan)]
            return self._plans[key]
        runs = []
        for tag, js in sorted(_cohort_positions(w).items(), key=lambda t: t[0] is not None):
            plan = _plan_pieces([w.params[j] for j in js], budget, whole=True)
            if plan is None:
                return None
            runs.append((tag, [[js[j] for j in piece] for piece in plan]))
        return runs if sum(len(p) for _, p in runs) > 1 else None

    @staticmethod
    def _piece(w: GroupWork, piece: list[int]) -> GroupWork:
        return GroupWork(w.record, w.hp, [w.idx[j] for j in piece], [w.params[j] for j in piece],
                         [w.grads[j] for j in piece])

    def _size(self, w: GroupWork) -> int | None:
        """The bytes of all the group's parameters (None until a step has them all)."""
        if len(w.idx) != len(w.record.keys):
            return None
        size = self._bytes[id(w.record)] = sum([p.numel() * p.element_size() for p in w.params])
        return size

    def _prove(self, whole: list[GroupWork]) -> None:
        """Remember the transforms of these groups (larger than a piece) that made a whole step."""
        for w in whole:
            self._proven.add((id(w.record), _static_key(w.hp)))


class _PieceStep:
    """One group's step in pieces: the pieces (cohort tag and work, the group's cohort
    first), their sub-states (split from the group's state in one pass: they hold the
    group's buffers, so a piece written in place is written in the group's state), where
    each cohort starts, and the counters the step ends with (written by :meth:`finish`)."""

    def __init__(self, w: GroupWork, runs: list[tuple[Any, list[list[int]]]]) -> None:
        rec = w.record
        self.w = w
        self.state0 = rec.current_state(w.hp)
        self.pieces = [(tag, Executor._piece(w, piece)) for tag, pieces in runs for piece in pieces]
        #: the first piece of every cohort: computed before anything is written
        self.heads = [sum(len(p) for _, p in runs[:c]) for c in range(len(runs))]
        self.subs = split(self.state0, [{rec.keys[i] for i in pw.idx} for _, pw in self.pieces])
        self.own = _idle_counters(w, self.state0, _cohort_positions(w)) if rec.own or len(w.idx) != len(rec.keys) \
            else {}
        self.group_scalars: Any = None
        self.replaced: list[Any] = []

    def start(self, n: int) -> Any:
        """The sub-state piece ``n`` starts from: its buffers, and its cohort's counters
        as they were when the step began."""
        tag, pw = self.pieces[n]
        sub = self.subs[n]
        if tag is None:
            return sub
        return with_scalars(sub, self.w.record.own[pw.record.keys[pw.idx[0]]])

    def written(self, n: int, new_sub: Any) -> None:
        """Piece ``n`` wrote its state (``new_sub``: its buffers, its advanced counters)."""
        tag, pw = self.pieces[n]
        old = list(tree_tensors(self.subs[n]))
        new = list(tree_tensors(new_sub))
        if len(old) != len(new) or any(a is not b for a, b in zip(old, new)):
            self.replaced.append(new_sub)  # a tensor the commit could not write in place
        if tag is None:
            if self.group_scalars is None:
                self.group_scalars = frozen_scalars(new_sub)
        else:
            self.own.update(scalars_per_param(new_sub, [pw.record.keys[i] for i in pw.idx]))
        pw.record.stepped = True

    def finish(self) -> None:
        """Every piece is written: the group's counters, the parameters' own, and any
        tensor that was replaced rather than written in place."""
        rec = self.w.record
        state = rec.state
        for sub in self.replaced:
            state = merge(state, sub, scalars=False)
        if self.group_scalars is not None:
            state = merge(state, self.group_scalars)
        rec.state = state
        rec.own = _caught_up(self.own, state)


def _plan_pieces(params: list[torch.Tensor], budget: int, whole: bool = False) -> list[list[int]] | None:
    """Positions of ``params`` in pieces of at most ``budget`` bytes; None when a
    parameter is a DTensor, or (unless ``whole``) when one piece would hold them all.

    Same shape and dtype go together, in order of first appearance, so that a compiled
    step has few distinct pieces (one graph each) and Newton-Schulz batches stay full:
    a shape holding at least a quarter of the budget is cut into pieces of its own (a
    parameter larger than the budget alone); the smaller shapes share pieces.
    """
    if any(type(p).__name__ == "DTensor" for p in params):
        return None
    sizes = [p.numel() * p.element_size() for p in params]
    if not whole and sum(sizes) <= budget:
        return None
    kinds: dict[tuple, list[int]] = {}
    for j, p in enumerate(params):
        kinds.setdefault((tuple(p.shape), p.dtype), []).append(j)
    pieces: list[list[int]] = []
    small: list[int] = []
    for js in kinds.values():
        if sum(sizes[j] for j in js) < budget // 4:
            small.extend(js)
        else:
            pieces.extend(_pack(js, sizes, budget))
    pieces.extend(_pack(small, sizes, budget))
    return pieces if whole or len(pieces) > 1 else None


def _pack(js: list[int], sizes: list[int], budget: int) -> list[list[int]]:
    """``js`` in order, cut into runs of at most ``budget`` bytes (a larger one alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    room = budget
    for j in js:
        if cur and sizes[j] > room:
            out.append(cur)
            cur, room = [], budget
        cur.append(j)
        room -= sizes[j]
    if cur:
        out.append(cur)
    return out
