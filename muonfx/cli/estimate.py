"""How long a run will take, from time measured on this machine (no speed is assumed).

:class:`RunClock` is fed by the training loop: the seconds of each evaluation
batch and of each step's forward/backward and optimizer step. It says two things:

* :meth:`RunClock.rough` -- after the first validation batch of the step-0
  evaluation, when that one batch was slow (a big model on a CPU): a rough figure
  from one forward pass (a training step costs about three: forward and backward);
* :meth:`RunClock.measured` -- after a few training steps (the first one, which
  allocates, is not counted): the remaining steps at the measured step time plus
  the remaining evaluations at the measured evaluation time; with ``then`` (the
  ``--compare`` run that follows) also that run, at the measured forward/backward
  time (its optimizer step is not known yet) and the whole command;
* :meth:`RunClock.left` -- at every evaluation: the time left at the pace of the whole
  run so far. A machine's pace drifts (other jobs come and go, a cloud VM's burst
  credit runs out): on a shared 2-core VM the step time of 50-step stretches of one run
  varied from 0.52 to 0.96 s, so the first estimate alone was 12 % high for one run and
  8 % low for the next.
"""

from __future__ import annotations

from .progress import format_time

__all__ = ["RunClock", "evaluations_between"]

#: a forward and backward pass cost about three forward passes
STEP_PER_FORWARD = 3.0


def _n(count: int, word: str, plural: str = "") -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def evaluations_between(done: int, stop: int, total: int, every: int) -> int:
    """Evaluations after step ``done`` up to ``stop``: every ``every`` steps and at ``total``.

    Example::

        >>> evaluations_between(0, 600, 600, 50), evaluations_between(0, 10, 10, 4), evaluations_between(3, 3, 6, 3)
        (12, 3, 0)
    """
    n = stop // every - done // every
    if stop == total and total % every and done < total:
        n += 1
    return max(0, n)


class RunClock:
    """Times the parts of one run and turns them into estimates.

    Example::

        >>> c = RunClock(steps=600, stop=600, eval_every=50, eval_batches=16)
        >>> c.eval_seconds = 0.8                     # the step-0 evaluation
        >>> for s in (0.5, 0.30, 0.30, 0.30):        # steps 1-4: forward/backward ...
        ...     c.add_step(s, 0.05)                   # ... and optimizer seconds
        >>> c.ready()
        True
        >>> print(c.measured(done=4, name="muon_adamw", then="adamw"))
        [muon_adamw] expected: ~3:38 for this run: 596 steps to go at 0.35 s/step (measured over steps 2-4) and
        12 evaluations at 0.8 s; then adamw ~3:10; ~6:49 in all
    """

    def __init__(self, steps: int, stop: int, eval_every: int, eval_batches: int, warmup_steps: int = 3,
                 warmup_seconds: float = 5.0) -> None:
        self.steps, self.stop, self.eval_every, self.eval_batches = steps, stop, eval_every, eval_batches
        self.warmup_steps, self.warmup_seconds = warmup_steps, warmup_seconds
        self.eval_seconds: float | None = None  # one whole evaluation, when measured
        self.forward: list[float] = []          # seconds of each step's forward + backward
        self.optim: list[float] = []            # seconds of each step's optimizer step
        self.reported = False

    def add_step(self, forward_backward: float, optimizer: float) -> None:
        self.forward.append(forward_backward)
        self.optim.append(optimizer)

    def ready(self) -> bool:
        """True once the warm-up is measured: ``warmup_steps`` steps after the first, or
        ``warmup_seconds`` of them."""
        timed = len(self.forward) - 1
        if self.reported or timed < 1:
            return False
        return timed >= self.warmup_steps or sum(self.forward[1:]) + sum(self.optim[1:]) >= self.warmup_seconds

    def _per_eval(self, forward_backward: float) -> float:
        if self.eval_seconds is not None:
            return self.eval_seconds
        return self.eval_batches * forward_backward / STEP_PER_FORWARD

    def measured(self, done: int, name: str, then: str | None = None) -> str:
        """The estimate line after the warm-up; ``done`` is the step just taken (its
        evaluation, if it has one, is still to come)."""
        self.reported = True
        timed_f, timed_o = (self.forward[1:], self.optim[1:]) if len(self.forward) > 1 else (self.forward, self.optim)
        fb, opt = sum(timed_f) / len(timed_f), sum(timed_o) / len(timed_o)
        first = done - len(timed_f) + 1
        rest = max(0, self.stop - done)
        evals = evaluations_between(done - 1, self.stop, self.steps, self.eval_every)
        per_eval = self._per_eval(fb)
        mine = rest * (fb + opt) + evals * per_eval
        where = f"step {first}" if len(timed_f) == 1 else f"steps {first}-{done}"
        line = (f"[{name}] expected: ~{format_time(mine)} for this run: {_n(rest, 'step')} to go at {fb + opt:.2f} s/step "
                f"(measured over {where}) and {_n(evals, 'evaluation')} at {per_eval:.1f} s")
        if then:
            other = self.steps * fb + (1 + evaluations_between(0, self.steps, self.steps, self.eval_every)) * per_eval
            line += f"; then {then} ~{format_time(other)}; ~{format_time(mine + other)} in all"
        return line

    def left(self, done: int, step_seconds: float, per_eval: float, then: str | None = None) -> str:
        """``"~M:SS left"`` after step ``done`` (its evaluation included): the steps to go at
        ``step_seconds`` each (the run's pace so far) and the evaluations to go at
        ``per_eval``; with ``then``, also the ``--compare`` run that follows.

        Example::

            >>> c = RunClock(steps=600, stop=600, eval_every=50, eval_batches=16)
            >>> c.left(100, 0.5, 4.0), c.left(600, 0.5, 4.0)
            ('~4:50 left', '~0:00 left')
            >>> c.left(100, 0.5, 4.0, then="adamw")
            '~4:50 left, then adamw ~5:52'
        """
        rest = max(0, self.stop - done)
        mine = rest * step_seconds + evaluations_between(done, self.stop, self.steps, self.eval_every) * per_eval
        line = f"~{format_time(mine)} left"
        if then:
            other = self.steps * step_seconds + (1 + evaluations_between(0, self.steps, self.steps,
                                                                            self.eval_every)) * per_eval
            line += f", then {then} ~{format_time(other)}"
        return line

    def rough(self, forward: float, batch: str, name: str, device: str) -> str:
        """A first figure from one validation batch's forward pass of ``forward`` seconds."""
        step = STEP_PER_FORWARD * forward
        evals = 1 + evaluations_between(0, self.stop, self.steps, self.eval_every)
        total = self.stop * step + evals * self.eval_batches * forward
        return (f"[{name}] rough estimate: one forward pass of a {batch} batch took {forward:.1f} s on {device}; "
                f"at ~{STEP_PER_FORWARD:g} of them per training step (plus the optimizer's work), {_n(self.stop, 'step')} "
                f"and {_n(evals, 'evaluation')} of {_n(self.eval_batches, 'batch', 'batches')} take "
                f"~{format_time(total)} (a measured figure follows the first steps)")
