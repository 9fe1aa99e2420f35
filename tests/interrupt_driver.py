"""Run ``muonfx <argv>`` with a signal arriving at a chosen moment (tests).

    python tests/interrupt_driver.py WHERE CALL [SIGNAL] -- train ...

WHERE: ``batch`` (right after drawing the CALL-th batch: the data generator has moved,
the step is not done), ``step`` (inside the CALL-th ``opt.step()``, as Newton-Schulz
starts: momentum is updated, parameters are not), ``eval`` (inside the CALL-th
evaluation): there this process sends itself SIGNAL (default SIGINT). ``forward`` and
``backward`` (the CALL-th training step's forward pass, as its loss is computed; its
backward pass, as it starts): there it prints ``driver: paused in the WHERE pass of step
CALL`` and waits, inside that pass, until a signal sent from outside has reached the
command's handler (the test sends it on reading the line). The signal is real
(``os.kill``), so Python's handler runs where it would for one sent at that moment.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: a bound on the wait for the outside signal: only a hung test reaches it
WAIT_S = 600.0


def _wait_for_the_signal(where: str, n: int) -> None:
    print(f"driver: paused in the {where} pass of step {n}", flush=True)
    handler = signal.getsignal(signal.SIGTERM)
    stop = getattr(handler, "__self__", None)  # the command's StepInterrupt
    assert stop is not None, "the command installed no signal handler"
    end = time.monotonic() + WAIT_S
    while not stop.requested:
        if time.monotonic() > end:
            raise SystemExit(f"driver: no signal came within {WAIT_S:.0f} s")
        time.sleep(0.005)


def main() -> int:
    where, call = sys.argv[1], int(sys.argv[2])
    sep = sys.argv.index("--")
    sig = getattr(signal, "SIG" + sys.argv[3]) if sep > 3 else signal.SIGINT
    argv = sys.argv[sep + 1:]
    import muonfx.seam as seam
    from muonfx.cli import main as cli_main
    from muonfx.cli import model, train

    calls = 0

    def hit() -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            os.kill(os.getpid(), sig)

    if where == "batch":
        orig_batch = train.sample_batch

        def sample_batch(*a, **k):
            out = orig_batch(*a, **k)
            hit()
            return out

        train.sample_batch = sample_batch
    elif where == "step":
        orig_map = seam.local_map_parts  # the Newton-Schulz batches, lowered or through the chain

        def local_map_parts(*a, **k):
            hit()
            return orig_map(*a, **k)

        seam.local_map_parts = local_map_parts
    elif where == "eval":
        orig_eval = train.evaluate

        def evaluate(*a, **k):
            hit()
            return orig_eval(*a, **k)

        train.evaluate = evaluate
    elif where in ("forward", "backward"):
        orig_loss = model.GPT.loss

        def loss(self, *a, **k):
            out = orig_loss(self, *a, **k)
            if not self.training:  # an evaluation
                return out
            nonlocal calls
            calls += 1
            n = calls
            if n == call and where == "forward":
                _wait_for_the_signal(where, n)
            elif n == call:
                out.register_hook(lambda g: (_wait_for_the_signal(where, n), g)[1])
            return out

        model.GPT.loss = loss
    else:
        raise SystemExit(f"unknown WHERE {where!r}")
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
