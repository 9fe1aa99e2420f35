"""A progress bar: tqdm when it is installed, else a plain line on stderr."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "format_time", "format_rate"]


def format_time(seconds: float) -> str:
    """``format_time(75) == '1:15'``; hours when needed."""
    s = int(max(0, seconds) + 0.5)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rate(tokens_per_s: float) -> str:
    """Tokens per second with a unit that keeps three significant figures, never ``0.0k``.

    Example::

        >>> [format_rate(r) for r in (0.42, 37.0, 850.4, 6789.0, 12345.0, 2.5e6)]
        ['0.42 tok/s', '37 tok/s', '850 tok/s', '6.79k tok/s', '12.3k tok/s', '2.50M tok/s']
    """
    r = max(0.0, float(tokens_per_s))
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if r >= scale:
            v = r / scale
            return f"{v:.{2 if v < 9.995 else 1 if v < 99.95 else 0}f}{unit} tok/s"
    return f"{r:.2g} tok/s" if r < 9.95 else f"{r:.0f} tok/s"


class Progress:
    """``update(step, loss, tokens)`` after each step; ``write(line)`` for log lines.

    ``enabled=False`` shows no bar (``write`` still prints, to stdout). The token
    rate counts training time only: ``exclude(seconds)`` takes out time spent on
    something else (the evaluations).
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "", enabled: bool = True) -> None:
        self.total, self.step, self.desc, self.enabled = total, initial, desc, enabled
        self.start_step, self.t0, self.tokens = initial, time.perf_counter(), 0
        self._last_plain = 0.0
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                                 file=sys.stderr, mininterval=0.5)

    def tokens_per_s(self) -> float:
        """Training tokens per second since the start, time given to :meth:`exclude` left out."""
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (spent on something other than training) out of the rate and the ETA's clock."""
        self.t0 += seconds

    def update(self, step: int, loss: float, tokens: int, extra: str = "") -> None:
        """Count ``tokens`` and show ``step``, ``loss`` and ``extra`` (e.g. ``"max logit 41.2"``)."""
        self.tokens += tokens
        extra = f", {extra}" if extra else ""
        done = step - self.step
        self.step = step
        if not self.enabled:
            return
        tps = self.tokens_per_s()
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.3f}{extra}, {format_rate(tps)}", refresh=False)
            self._bar.update(done)
            return
        now = time.perf_counter()
        if now - self._last_plain < 2.0 and step < self.total:
            return
        self._last_plain = now
        rate = (step - self.start_step) / (now - self.t0) if now > self.t0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        end = "\r" if sys.stderr.isatty() else "\n"
        shown = extra.replace(",", " |")
        print(f"{self.desc} step {step}/{self.total} | loss {loss:.3f}{shown} | {format_rate(tps)} | "
              f"ETA {format_time(eta)}", end=end, file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            if self.enabled and sys.stderr.isatty():
                print(file=sys.stderr)
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)
