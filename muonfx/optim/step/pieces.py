"""Steps in pieces: a large leafwise group computed and written piece by piece.

A group whose present parameters hold more bytes than the batch budget
(:func:`muonfx.linalg.batch_bytes`) and whose transform is leafwise
(:func:`muonfx.leafwise`: each parameter's update and state depend on that parameter
alone) is cut into pieces of at most the budget (:func:`plan_pieces`); each piece is
computed from its share of the state (:func:`muonfx.tree.split`) and written before the
next, so the step's extra memory is that of the largest piece instead of the group's.
A piece is a step of some parameters: their counts advance, the others' do not
(:class:`muonfx.counts.Counts`), so the pieces compute exactly what the whole group
computes.

What muonfx can detect is detected before the first write: a dry run of the group on
fake tensors when its plan is built (shapes, dtypes, kinds: :mod:`.dryrun`), and the
first piece of every group computed before anything is written (hyperparameters,
schedules). An error a transform of your own raises in a later piece ends the step with
:class:`PartialStepError`, which names the parameters that were stepped; the state stays
consistent (each stepped parameter's state and counts moved with it, the others'
did not).

The same holds between groups: a step that stops after some groups (or pieces) were
written, by an error or by a ``KeyboardInterrupt``, keeps what was written, each group's
counts with its parameters (:func:`stops_part_way`). An error then raises
:class:`PartialStepError` naming what was stepped and what was not; an interrupt goes on
as it is, with a note naming what was stepped. A Ctrl-C never lands inside one group's
(or piece's) write: it is held until that write and its bookkeeping are done
(:class:`held_interrupts`), so "what was stepped" is exact.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import torch

from ... import tree

__all__ = ["plan_pieces", "PartialStepError", "stops_part_way", "held_interrupts", "interrupted_keeps", "partial",
           "finish_all", "merged"]


class PartialStepError(RuntimeError):
    """A transform raised in a later piece of a step in pieces; the pieces before were
    written (raised from the transform's own error).

    Attributes:
        stepped: the names of the parameters that were stepped (and their state with them).
        pending: the names of the parameters that were not.
    """

    def __init__(self, what: str, stepped: list[str], pending: list[str]) -> None:
        self.what = what
        self.stepped = stepped
        self.pending = pending
        few = ", ".join(stepped[:6]) + (f" and {len(stepped) - 6} more" if len(stepped) > 6 else "")
        super().__init__(f"{what}; the parameters stepped before it ({len(stepped)}: {few}) keep their step, "
                         f"with their state; the other {len(pending)} and their state are as they were")


def plan_pieces(params: list[torch.Tensor], budget: int) -> tuple | None:
    """Positions of ``params`` in pieces of at most ``budget`` bytes; None when one piece
    would hold them all.

    Same shape and dtype go together, in order of first appearance, so that a compiled
    step has few distinct pieces (one graph each) and Newton-Schulz batches stay full:
    a shape holding at least a quarter of the budget is cut into pieces of its own (a
    parameter larger than the budget alone); the smaller shapes share pieces.
    """
    sizes = [p.numel() * p.element_size() for p in params]
    if sum(sizes) <= budget:
        return None
    kinds: dict[tuple, list[int]] = {}
    for j, p in enumerate(params):
        kinds.setdefault((tuple(p.shape), p.dtype), []).append(j)
    pieces: list[tuple] = []
    small: list[int] = []
    for js in kinds.values():
        if sum(sizes[j] for j in js) < budget // 4:
            small.extend(js)
        else:
            pieces.extend(_pack(js, sizes, budget))
    pieces.extend(_pack(small, sizes, budget))
    return tuple(pieces) if len(pieces) > 1 else None


def _pack(js: list[int], sizes: list[int], budget: int) -> list[tuple]:
    """``js`` in order, cut into runs of at most ``budget`` bytes (a larger one alone)."""
    out: list[tuple] = []
    cur: list[int] = []
    room = budget
    for j in js:
        if cur and sizes[j] > room:
            out.append(tuple(cur))
            cur, room = [], budget
        cur.append(j)
        room -= sizes[j]
    if cur:
        out.append(tuple(cur))
    return out


# -- a step that stops part-way ------------------------------------------------------
# ``x`` below is the runner's share of one group in a step: ``plan`` (keys, pieces),
# ``state``, ``finish(state)`` (the group's state after the step) and ``names(positions)``.


def _names(written: list[tuple]) -> list[str]:
    return [name for x, positions in written for name in x.names(positions)]


def _interrupt_note(e: BaseException, written: list[tuple]) -> None:
    stepped = _names(written)
    if stepped and hasattr(e, "add_note"):
        e.add_note(f"muonfx: the step was interrupted part-way; stepped (state and counts with them): "
                   f"{', '.join(stepped[:10])}{' ...' if len(stepped) > 10 else ''}; the other parameters "
                   "and their state are as they were")


@contextlib.contextmanager
def stops_part_way(groups: list, written: list[tuple]) -> Iterator[None]:
    """Around a step's writes (``written``: ``(group, positions)`` in the order written):
    an error once something was written raises :class:`PartialStepError` from it, naming
    the parameters of ``written`` as stepped and every other present parameter of
    ``groups`` as pending; an interrupt (any other ``BaseException``) goes on with a note
    naming what was stepped. Nothing written: the exception goes on as it is."""
    try:
        yield
    except Exception as e:
        if not written:
            raise
        done = {(id(x), j) for x, positions in written for j in positions}
        pending = [name for x in groups for j in range(len(x.plan.keys)) if (id(x), j) not in done
                   for name in x.names((j,))]
        if isinstance(e, PartialStepError):  # raised by a group in pieces: the other groups' pending too
            if e.pending == pending:
                raise
            raise PartialStepError(e.what, e.stepped, pending) from e.__cause__
        raise PartialStepError(f"{type(e).__name__}: {e}", _names(written), pending) from e
    except BaseException as e:
        _interrupt_note(e, written)
        raise


class held_interrupts:
    """Context manager around one write (a group's or a piece's state and parameters, and
    the record of it): a SIGINT (Ctrl-C) that arrives inside goes to the handler it would
    have gone to (Python's ``KeyboardInterrupt``, or the program's own) as the write ends,
    so no interrupt lands between a group's state and its parameters, or between a
    compiled graph's stores and its counts. A second SIGINT inside is delivered at once,
    after the first (a compile can take minutes: the second Ctrl-C is not kept waiting;
    a handler that quits on the second signal sees two). Outside the main
    thread, or where SIGINT is ignored or at its default, or with ``hold=False`` (a
    compiled graph's first call, which compiles it: a Ctrl-C there stops the compile at
    once), it does nothing.

    Example::

        >>> with held_interrupts():
        ...     pass                      # one group's write
    """

    __slots__ = ("_hold_them", "_prev", "_got")

    def __init__(self, hold: bool = True) -> None:
        self._hold_them = hold

    def __enter__(self) -> "held_interrupts":
        self._prev = None
        if self._hold_them and threading.current_thread() is threading.main_thread():
            prev = signal.getsignal(signal.SIGINT)
            if callable(prev):
                self._got = None
                signal.signal(signal.SIGINT, self._hold)
                self._prev = prev
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        prev = self._prev
        if self._got is None or prev is None:
            self._got = (signum, frame)
            return
        self._prev = None  # a second one: both now, in order (a handler of its own counts them)
        signal.signal(signal.SIGINT, prev)
        first, self._got = self._got, None
        prev(*first)
        prev(signum, frame)

    def __exit__(self, *exc: Any) -> bool:
        prev, self._prev = self._prev, None
        if prev is None:
            return False
        if signal.getsignal(signal.SIGINT) == self._hold:
            signal.signal(signal.SIGINT, prev)
        if self._got is not None:
            prev(*self._got)
        return False


@contextlib.contextmanager
def interrupted_keeps(x: Any, kept: list, written: list[tuple]) -> Iterator[None]:
    """Around a group's pieces: a ``KeyboardInterrupt`` (or any other ``BaseException``
    that is not an error of a transform: those raise :class:`PartialStepError`) between two
    pieces keeps the state of the pieces written so far, counts included, so each
    parameter's state and count moved with it; the exception goes on (:func:`stops_part_way`
    notes what was stepped)."""
    try:
        yield
    except Exception:
        raise
    except BaseException:
        if kept:
            x.finish(merged(x.state, kept))
        raise


def partial(x: Any, kept: list, n: int, written: list[tuple], e: Exception) -> None:
    """Piece ``n`` of ``x`` raised ``e`` after earlier pieces (and groups) were written:
    keep what was written, raise :class:`PartialStepError` naming it."""
    if kept:
        x.finish(merged(x.state, kept))
    pending = [name for pc in x.plan.pieces[n:] for name in x.names(pc)]
    raise PartialStepError(f"param group {x.plan.index}, piece {n + 1} of {len(x.plan.pieces)}: "
                           f"{type(e).__name__}: {e}", _names(written), pending) from e


def finish_all(done: list[tuple]) -> None:
    """``x.finish(state)`` for every ``(x, state)`` of groups already written (a compiled
    graph writes them all at once): an interrupt while one takes its state still lets the
    others take theirs (their counts move with their parameters), then goes on."""
    todo = list(done)
    try:
        while todo:
            x, state = todo[0]
            x.finish(state)
            todo.pop(0)
    except BaseException:
        while todo:
            x, state = todo.pop(0)
            x.finish(state)
        raise


def merged(state: Any, parts: list) -> Any:
    """``state`` with every part (the pieces written so far) merged back, at once."""
    return tree.merge_parts(state, parts)
