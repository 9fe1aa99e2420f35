"""Run ``muonfx <argv>`` with a SIGINT sent to this process at a chosen moment (tests).

    python tests/interrupt_driver.py WHERE CALL -- train ...

WHERE: ``batch`` (right after drawing the CALL-th batch: the data generator has moved,
the step is not done), ``step`` (inside the CALL-th ``opt.step()``, as Newton-Schulz
starts: momentum is updated, parameters are not), ``eval`` (inside the CALL-th
evaluation). The signal is real (``os.kill``), so Python's handler runs where it
would for a Ctrl-C at that moment.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> int:
    where, call = sys.argv[1], int(sys.argv[2])
    argv = sys.argv[sys.argv.index("--") + 1:]
    import muonfx.seam as seam
    from muonfx.cli import main as cli_main
    from muonfx.cli import train

    calls = 0

    def hit() -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            os.kill(os.getpid(), signal.SIGINT)

    if where == "batch":
        orig_batch = train.sample_batch

        def sample_batch(*a, **k):
            out = orig_batch(*a, **k)
            hit()
            return out

        train.sample_batch = sample_batch
    elif where == "step":
        orig_map = seam.map_matrices

        def map_matrices(*a, **k):
            hit()
            return orig_map(*a, **k)

        seam.map_matrices = map_matrices
    elif where == "eval":
        orig_eval = train.evaluate

        def evaluate(*a, **k):
            hit()
            return orig_eval(*a, **k)

        train.evaluate = evaluate
    else:
        raise SystemExit(f"unknown WHERE {where!r}")
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
