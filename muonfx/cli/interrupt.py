"""Ctrl-C during training: finish the step, then stop (and save) at a step boundary.

A ``KeyboardInterrupt`` raised wherever the signal lands (between drawing a batch and
counting the step, or inside ``opt.step()``) would leave a half-done step behind: the
data generator one batch ahead of the step counter, or parameters half updated. So
while training runs, SIGINT only sets :attr:`StepInterrupt.requested`; the loop reads
it at its step boundaries (under ``--fsdp`` the flag travels with the loss all-reduce,
so every rank stops after the same step), saves with ``--save``, and exits 130.

Without ``--fsdp`` a second Ctrl-C quits at once, without saving. Under ``--fsdp``
every SIGINT only asks to stop: ``torchrun`` forwards the terminal's Ctrl-C to the
ranks a second time, and a rank that left early would strand the others in the
collective save.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Callable

__all__ = ["StepInterrupt"]


class StepInterrupt:
    """Context manager: SIGINT sets :attr:`requested` instead of raising.

    ``on_first`` is called once, at the first SIGINT (to say what happens next).
    ``force_on_second``: a second SIGINT raises ``KeyboardInterrupt`` right away.
    Outside the main thread (where Python cannot install handlers) it does nothing.

    Example::

        >>> with StepInterrupt() as stop:
        ...     for step in range(3):
        ...         pass                      # one whole step
        ...         if stop.requested:
        ...             break
        >>> stop.requested
        False
    """

    def __init__(self, on_first: Callable[[], None] | None = None, force_on_second: bool = True) -> None:
        self.requested = False
        self.on_first = on_first
        self.force_on_second = force_on_second
        self._previous = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.force_on_second:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if not self.requested:
            self.requested = True
            if self.on_first is not None:
                self.on_first()

    def __enter__(self) -> StepInterrupt:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        except ValueError:  # not the main thread: leave SIGINT as it is
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False
        sys.stderr.flush()
