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
"""

from __future__ import annotations

import torch

__all__ = ["plan_pieces", "PartialStepError"]


class PartialStepError(RuntimeError):
    """A transform raised in a later piece of a step in pieces; the pieces before were
    written (raised from the transform's own error).

    Attributes:
        stepped: the names of the parameters that were stepped (and their state with them).
        pending: the names of the parameters that were not.
    """

    def __init__(self, what: str, stepped: list[str], pending: list[str]) -> None:
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
