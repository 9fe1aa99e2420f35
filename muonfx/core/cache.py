""":class:`LRU`: the bounded cache of the package's process-wide memos."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable

__all__ = ["LRU"]


class LRU(OrderedDict):
    """A dict of at most ``size`` entries: storing one more drops the least recently used
    (read with :meth:`get` or stored).

    Example::

        >>> from muonfx.core.cache import LRU
        >>> c = LRU(2)
        >>> c["a"], c["b"] = 1, 2
        >>> c.get("a")
        1
        >>> c["c"] = 3          # "b" was used least recently
        >>> list(c)
        ['a', 'c']
    """

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"LRU: size must be a positive int, got {size!r}")
        super().__init__()
        self.size = size

    def get(self, key: Hashable, default: Any = None) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key: Hashable, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
