"""The compiled step: one ``torch.compile`` graph computes the groups' updates, writes the
new state into the old buffers and adds the updates to the parameters.

The compiler turns the copies into in-place stores and frees each intermediate as soon
as it is dead, so the step allocates little and reads memory few times. A graph is built
per set of groups, present parameters and static hyperparameters (``dynamic=True``: lr,
momentum or weight decay changes, and the step counts, recompile nothing on torch 2.13;
see :class:`CompiledSteps` for 2.10 and 2.11), from the plain factory: the graph rebuilds
nothing at run time. Python-level errors (a bad hyperparameter, a transform's own
exception) are raised while the function is traced, before the graph runs, so they
change nothing. Where the compiler fails (no C++ compiler for inductor on the CPU, an
untraceable transform) the step runs eagerly from then on, and the ``muonfx`` logger
says so once.
"""

from __future__ import annotations

import time
import types
from typing import Any, Callable

import torch

from ...core import build
from ...logs import say_once
from ...schedules import ScheduleNotTraceable
from ...wrappers import inject_hyperparams
from ...core.cache import LRU
from ..groups import numeric_values, static_key
from .writeback import store

__all__ = ["CompiledSteps", "compiler_failed"]


def _compiled_frames() -> int:
    """How many graphs dynamo has built in this process (recompilations included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


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


def compiler_failed(e: BaseException) -> bool:
    """Whether ``e`` is the compiler's failure, raised before the graph ran (nothing
    written): one of dynamo's own errors, or any other error but the transforms' own
    (``ValueError``, ``TypeError``: a bad hyperparameter, a parameter a transform
    refuses, raised while tracing, which the eager step raises again) that was raised
    while dynamo compiled the frame. Torch 2.10-2.13 let a bare ``AssertionError``
    ("sympy expression is NaN") out of tracing; errors of the running graph (out of
    memory) come from the compiled code, not from the compiler's frames, and are raised
    as they are."""
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


def _graph(units: list[tuple[Any, list]], kwargs: dict, name: str) -> Callable[..., Any]:
    """The compiled function of ``units`` (``(transform, keys)`` per group or piece):
    ``fn(grads, params, states, extra) -> new states``, writing in place; ``extra``, the
    step's extra arguments, are inputs of the graph like the gradients."""

    def step_in_place(grads, params, states, extra):
        new_states = []
        for (tx, keys), gs, ps, state in zip(units, grads, params, states):
            upd, new = tx.update(build(keys, gs), state, build(keys, ps), **extra)
            us = [upd.get(k) for k in keys]
            new_states.append(store(state, new))
            torch._foreach_add_(ps, us)
        return new_states

    # a code object of its own for every compiled step (dynamo caches its graphs per code
    # object, at most a few each: one per piece would exhaust them), named after what it
    # runs; identical graphs (pieces of the same shapes) still share the compiler's cache
    code = step_in_place.__code__.replace(co_name=name)
    fresh = types.FunctionType(code, step_in_place.__globals__, code.co_name, None, step_in_place.__closure__)
    return torch.compile(fresh, **kwargs)


class CompiledSteps:
    """The compiled graphs of an optimizer, the groups the compiler could not take, and
    how torch treats float hyperparameters.

    Torch 2.10 and 2.11 specialise a graph to the values of float hyperparameters that go
    through Python arithmetic (their AOTAutograd keeps a float symbolic only through a few
    aten ops, not through ``1 - beta``), so each new value would recompile it, up to
    dynamo's limit; lr and momentum reach the graph as operands of tensor arithmetic and
    recompile nothing (``foreach("neg_mul")``, ``foreach("ema")``), nor does NorMuon's
    beta2. Each graph remembers the numeric hyperparameters of its last call; when a call
    with changed values builds a new graph, the groups' ``"compile"`` setting becomes
    ``False`` (saved in the ``state_dict``, so a resumed run steps as the uninterrupted
    one), :attr:`floats_specialize` is set and the ``muonfx`` logger says so once.
    Torch 2.13 recompiles nothing.
    """

    #: compiled graphs kept per optimizer (one per set of groups, present parameters and
    #: static hyperparameters: a model whose present parameters change from step to step
    #: would otherwise keep one for every subset it met); the least recently used goes first
    GRAPHS = 16

    def __init__(self) -> None:
        self.graphs: dict[Any, Callable[..., Any]] = LRU(self.GRAPHS)
        self._made = 0
        self._pins: dict[Any, tuple] = LRU(self.GRAPHS)
        #: (param group index, static hyperparameters) the compiler could not take
        self.failed: set[tuple] = set()
        #: set once a graph recompiled because a numeric hyperparameter changed
        self.floats_specialize = False
        #: param group indices whose "compile" setting must become False (the runner sets it)
        self.off: set[int] = set()

    def run(self, key: Any, units: list[tuple[Any, list]], hps: list[dict], grads: list, params: list,
            states: list, kwargs: dict, where: list[tuple[int, dict]], extra: dict | None = None) -> list[Any] | None:
        """Run the graph of ``units`` (built on first use) with the step's extra arguments
        ``extra`` (inputs of the graph); the new states, or None where
        the compiler failed before the graph ran (nothing written; the groups ``where``
        (index, hyperparameters) step eagerly from now on, and the logger says so once)."""
        fn = self.graphs.get(key)
        first = fn is None
        if first:
            fn = self.graphs[key] = _graph([(inject_hyperparams(tx)(**hp), keys) for (tx, keys), hp in zip(units, hps)],
                                           kwargs, f"muonfx_step_{self._made}")
            self._made += 1
        pin, last = tuple(numeric_values(hp) for hp in hps), self._pins.get(key)
        changed = last is not None and last != pin
        if changed and self.floats_specialize:  # this torch would recompile: not called at all
            self._specialised(last, pin, where, recompiled=False)
            return None
        frames = _compiled_frames()
        t0 = time.monotonic()
        try:
            out = fn(grads, params, states, {} if extra is None else extra)
        except Exception as e:
            if not compiler_failed(e):
                raise
            self._failed(e, where)
            return None
        if first:
            say_once("compiled",
                     "muonfx: compiled the optimizer step of param group(s) %s in %.1f s (torch.compile, asked for by "
                     "opt.compile() or the group's \"compile\" setting); torch's compile cache makes it faster in "
                     "the next process (TORCHINDUCTOR_CACHE_DIR)", ", ".join(str(gi) for gi, _ in where),
                     time.monotonic() - t0)
        self._pins[key] = pin
        if changed and _compiled_frames() > frames:
            self._specialised(last, pin, where, recompiled=True)
        return out

    def _failed(self, e: BaseException, where: list[tuple[int, dict]]) -> None:
        for gi, hp in where:
            self.failed.add((gi, static_key(hp)))
        groups = ", ".join(str(gi) for gi, _ in where)
        if _schedule_not_traceable(e):
            say_once("schedule not traceable",
                     "muonfx: a schedule of your own is evaluated inside the optimizer step of param group(s) %s, and "
                     "torch %s compiles min/max of traced floats wrongly (muonfx.schedules.FLOAT_MIN_MAX_MISCOMPILED): "
                     "they step eagerly from now on; muonfx.schedules or a torch.optim.lr_scheduler keep them compiled",
                     groups, torch.__version__)
        else:
            say_once("compile failed",
                     "muonfx: torch.compile failed on the optimizer step of param group(s) %s (%s: %s); they step "
                     "eagerly from now on", groups, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")

    def _specialised(self, last: tuple, pin: tuple, where: list[tuple[int, dict]], recompiled: bool) -> None:
        self.floats_specialize = True
        self.off.update(gi for gi, _ in where)
        changes = sorted({f"{n} {a!r} -> {b!r}" for old, new in zip(last, pin) for (n, a), (_, b) in zip(old, new)
                          if a != b})
        say_once("floats specialise",
                 "muonfx: torch %s %s the compiled optimizer step when a numeric hyperparameter changed (%s); "
                 "torch 2.13 and later keep them symbolic. Param group(s) %s step eagerly from now on (their "
                 "\"compile\" setting is now False).", torch.__version__,
                 "recompiled" if recompiled else "would recompile", ", ".join(changes),
                 ", ".join(str(gi) for gi, _ in where))
