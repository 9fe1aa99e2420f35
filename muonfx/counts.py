"""Per-parameter step counts: :class:`Counts`, the one counter type of muonfx's states.

torch keeps ``state[p]["step"]`` per parameter: a parameter that gets no gradient in a
step does not step, and its bias correction (or schedule) goes on from its own count.
muonfx's transforms keep every count they need (Adam's bias correction, bias-corrected
momentum, schedules, the micro-steps of gradient accumulation) in a :class:`Counts`:
one Python int per parameter key, stored compactly as its distinct values (almost
always one). A :class:`Counts` is keyed like the parameters, so taking the state of
some parameters (a step where others have no gradient, a piece of a large group) and
putting it back are the same key operations as for the TensorDicts of the state
(:mod:`muonfx.tree`); a group of parameters with different counts is still one
update call, whose transforms compute per count.

The counts are Python ints, not tensors: a schedule is a Python function of the step,
and inside ``torch.compile`` an int input stays one symbolic number per distinct count
(a tensor would have to be read back to the host). Checkpoints hold them per parameter
(``"adam.count": 3``), as they always did.

Example::

    >>> from muonfx.counts import Counts, advance, by_count, zeros
    >>> c = zeros([("a",), ("b",)])
    >>> c = advance(c)
    >>> by_count(c, [("a",), ("b",)])
    [(1, [0, 1])]
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

Key = tuple[str, ...]

__all__ = ["Counts", "zeros", "of", "by_count", "per_count", "common", "advance", "from_values", "values_of"]


class Counts(NamedTuple):
    """Step counts per parameter key.

    Attributes:
        keys: the parameter keys, in order.
        values: the distinct counts (one while every parameter has made every step).
        index: per key, the position of its count in ``values``, one character each
            (``chr(position)``: a string, so that ``torch.compile`` takes it as a constant
            and only the counts themselves as numbers); ``None`` when there is one value
            for all.
    """

    keys: tuple
    values: tuple
    index: str | None = None

    def __eq__(self, other: object) -> bool:
        """Equal to another :class:`Counts` with the same counts, and to an int when every
        parameter has that count (``state.count == 3``)."""
        if isinstance(other, int) and not isinstance(other, bool):
            return self.index is None and bool(self.values) and self.values[0] == other
        if isinstance(other, Counts):
            return self.keys == other.keys and values_of(self) == values_of(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = tuple.__hash__

    def __int__(self) -> int:
        """The count, where every parameter has the same (``ValueError`` otherwise)."""
        if not self.values:
            raise ValueError("Counts of no parameter has no count")
        if self.index is not None:
            raise ValueError(f"the parameters have different counts {sorted(set(self.values))}; read them per "
                             "parameter (muonfx.counts.of, or the optimizer's state_dict)")
        return self.values[0]

    def __repr__(self) -> str:
        if self.index is None:
            return f"Counts({len(self.keys)} keys at {self.values[0] if self.values else '-'})"
        return f"Counts({len(self.keys)} keys at {sorted(set(self.values))})"


def zeros(keys: Sequence[Key]) -> Counts:
    """Counts of zero for every key (what ``init`` creates; with no keys, the count of
    an empty share, which still advances with its transform's updates)."""
    return Counts(tuple(keys), (0,))


def from_values(keys: Sequence[Key], counts: Sequence[int]) -> Counts:
    """The :class:`Counts` holding ``counts[i]`` for ``keys[i]`` (stored compactly)."""
    keys = tuple(keys)
    if not keys:
        return Counts((), ())
    distinct: dict[int, int] = {}
    index = "".join([chr(distinct.setdefault(int(c), len(distinct))) for c in counts])
    if len(distinct) == 1:
        return Counts(keys, tuple(distinct))
    return Counts(keys, tuple(distinct), index)


def values_of(c: Counts) -> list[int]:
    """The count of every key of ``c``, in ``c.keys``' order."""
    if not isinstance(c, Counts):
        raise TypeError(f"expected Counts, got {type(c).__name__}")
    if c.index is None:
        return [c.values[0]] * len(c.keys) if c.values else []
    vals = c.values
    return [vals[ord(ch)] for ch in c.index]


def of(c: Counts, keys: Sequence[Key], what: str = "counts") -> list[int]:
    """The count of each of ``keys`` (``ValueError`` naming the keys ``c`` lacks or has
    beyond them). A plain int (a count written into a state by hand) is every key's."""
    if not isinstance(c, Counts):
        return [int(c)] * len(keys)
    if c.keys == tuple(keys):
        return values_of(c)
    mine = dict(zip(c.keys, values_of(c)))
    if set(mine) != set(keys):
        from .core import key_str

        missing = sorted(key_str(k) for k in keys if k not in mine)
        extra = sorted(key_str(k) for k in set(mine) - set(keys))
        raise ValueError(f"{what} do not match the updates: missing keys {missing}, extra keys {extra}")
    return [mine[k] for k in keys]


def common(c: Counts, default: int = 0) -> int:
    """The count every key shares (also of a share with no keys), else ``default``."""
    if not isinstance(c, Counts):
        return int(c)
    return c.values[0] if c.index is None and c.values else default


def by_count(c: Counts, keys: Sequence[Key], what: str = "counts") -> list[tuple[int, list[int]]]:
    """``[(count, positions in keys)]``, one entry per distinct count, in order of first
    appearance: one entry ``(t, all positions)`` while every parameter has made every
    step; empty for no keys."""
    n = len(keys)
    if not n:
        return []
    if not isinstance(c, Counts):  # a count written into the state by hand: every key's
        return [(int(c), list(range(n)))]
    if c.keys == tuple(keys):
        if c.index is None:
            return [(c.values[0], list(range(n)))]
        where: dict[int, list[int]] = {}
        for j, ch in enumerate(c.index):  # by position in values: constants when traced
            where.setdefault(ord(ch), []).append(j)
        return [(c.values[i], js) for i, js in where.items()]
    return by_count(from_values(keys, of(c, keys, what)), keys)


def per_count(c: Counts, keys: Sequence[Key], what: str, fn: Any, *lists: Sequence[Any]) -> list:
    """``fn(count, *subsets)`` once per distinct count, on the entries of ``lists`` (each
    aligned with ``keys``) at that count's positions; its results put back in ``keys``'
    order. One call on the whole lists while every parameter has the same count.

    Example::

        >>> c = from_values([("a",), ("b",)], [3, 5])
        >>> per_count(c, [("a",), ("b",)], "counts", lambda t, xs: [x * t for x in xs], [1.0, 1.0])
        [3.0, 5.0]
    """
    groups = by_count(c, keys, what)
    if len(groups) == 1:
        return list(fn(groups[0][0], *lists))
    out: list = [None] * len(keys)
    for count, pos in groups:
        for j, x in zip(pos, fn(count, *[[lst[j] for j in pos] for lst in lists])):
            out[j] = x
    return out


def advance(c: Counts, by: int = 1) -> Counts:
    """Every count plus ``by`` (a plain int: plus ``by``)."""
    if not isinstance(c, Counts):
        return c + by
    return Counts(c.keys, tuple([v + by for v in c.values]), c.index)
