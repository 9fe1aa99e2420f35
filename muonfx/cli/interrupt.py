"""Ctrl-C, SIGTERM and SIGHUP during training: stop (and save) at the last completed step.

A ``KeyboardInterrupt`` raised wherever the signal lands (between drawing a batch and
counting the step, or inside ``opt.step()``) would leave a half-done step behind: the
data generator one batch ahead of the step counter, or parameters half updated. So
while training runs, SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and
``torchrun`` send to stop a job) only set :attr:`StepInterrupt.requested`; the loop
reads it after the forward pass, after the backward pass and after each step. Set
before ``opt.step()`` began, the step in progress is abandoned (its gradients dropped,
the data generator put back before its batch: the parameters and optimizer state never
moved), so a job that is given a few seconds' grace is not kept waiting for a backward
pass; set during ``opt.step()``, the step is finished. The loop then saves the last
completed step with ``--save`` and raises :class:`Interrupted`: the command exits with
128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP: a closed
terminal or SSH connection saves as SIGTERM does). Under ``--fsdp`` no step is
abandoned: the flag travels with the loss all-reduce, so every rank finishes the current
step and stops after the same one (abandoning a step there would need the ranks to agree
in the middle of FSDP2's collectives).

Without ``--fsdp`` a second signal quits at once, without saving. Under ``--fsdp``
every signal only asks to stop: ``torchrun`` forwards the terminal's Ctrl-C to the
ranks a second time, and a rank that left early would strand the others in the
collective save.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Callable

__all__ = ["StepInterrupt", "Interrupted", "SIGNALS"]

#: the signals that stop a run at its last completed step (SIGHUP: the terminal or the SSH connection
#: went away; where the platform has it)
SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


class Interrupted(KeyboardInterrupt):
    """The run stopped at its last completed step because of signal ``signum``."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class StepInterrupt:
    """Context manager: SIGINT and SIGTERM set :attr:`requested` (and :attr:`signum`,
    the first one's number) instead of raising or ending the process.

    ``on_first(signum)`` is called once, at the first signal (to say what happens next).
    ``force_on_second``: a second signal raises :class:`Interrupted` right away.
    Outside the main thread (where Python cannot install handlers) it does nothing.

    Example::

        >>> with StepInterrupt() as stop:
        ...     for step in range(3):
        ...         pass                      # one whole step
        ...         if stop.requested:
        ...             break
        >>> stop.requested, stop.signum
        (False, None)
    """

    def __init__(self, on_first: Callable[[int], None] | None = None, force_on_second: bool = True) -> None:
        self.requested = False
        self.signum: int | None = None
        self.on_first = on_first
        self.force_on_second = force_on_second
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.force_on_second:
            self._restore()
            raise Interrupted(signum)
        if not self.requested:
            self.requested, self.signum = True, int(signum)
            if self.on_first is not None:
                self.on_first(int(signum))

    def __enter__(self) -> StepInterrupt:
        try:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread: leave the signals as they are
            pass
        return self

    def _restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()
        sys.stderr.flush()
