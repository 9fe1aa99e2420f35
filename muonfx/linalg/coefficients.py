"""Newton-Schulz coefficient schedules.

Each schedule is a list of ``(a, b, c)`` triples, one per iteration of

    A <- X X^T;   B <- b A + c A A;   X <- a X + B X

plus a *safety* factor on the initial Frobenius normalisation. Sources:

* ``keller``: Keller Jordan's quintic, the same triple every step (torch.optim.Muon's default).
* ``you``: You Jiacheng's 5-step schedule (tight singular-value band for well
  conditioned inputs).
* ``polar_express``: Amsel et al., "The Polar Express" (2025), normalised with safety 1.02.
* ``cubic``: the classic Newton-Schulz cubic ``(1.5, -0.5, 0)``; converges to the exact
  polar factor, slowly.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence, Union

Triple = tuple[float, float, float]
CoefficientSpec = Union[str, Triple, Sequence[Triple]]

KELLER: Triple = (3.4445, -4.7750, 2.0315)

PRESETS: dict[str, tuple[tuple[Triple, ...], float]] = {
    "keller": ((KELLER,), 1.0),
    "you": (
        (
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        ),
        1.0,
    ),
    "polar_express": (
        (
            (8.156554524902461, -22.48329292557795, 15.878769915207462),
            (4.042929935166739, -2.808917465908714, 0.5000178451051316),
            (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
            (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
            (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        ),
        1.02,
    ),
    "cubic": (((1.5, -0.5, 0.0),), 1.0),
}


class Schedule(NamedTuple):
    """A resolved schedule: one triple per iteration and the normalisation safety factor."""

    steps: tuple[Triple, ...]
    safety: float


def _triple(x, where: str) -> Triple:
    try:
        t = tuple(float(v) for v in x)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: expected an (a, b, c) triple of numbers, got {x!r}") from None
    if len(t) != 3 or not all(math.isfinite(v) for v in t):
        raise ValueError(f"{where}: expected an (a, b, c) triple of finite numbers, got {x!r}")
    return t  # type: ignore[return-value]


def resolve(coefficients: CoefficientSpec, steps: int, safety: float | None = None) -> Schedule:
    """Turn a coefficient spec into ``steps`` triples.

    ``coefficients`` is a preset name, one triple (repeated ``steps`` times) or a
    sequence of per-step triples. A sequence shorter than ``steps`` repeats its last
    triple (as Polar Express prescribes for extra iterations); a longer one is cut to
    its first ``steps`` triples. ``safety`` overrides the preset's safety factor.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1 or steps >= 100:
        raise ValueError(f"ns steps must be an int in [1, 99], got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(
                f"unknown Newton-Schulz coefficients {coefficients!r}; presets: {sorted(PRESETS)}"
            )
        seq, preset_safety = PRESETS[coefficients]
    else:
        try:
            items = list(coefficients)
        except TypeError:
            raise TypeError(
                f"coefficients must be a preset name, an (a, b, c) triple or a sequence of "
                f"triples, got {coefficients!r}"
            ) from None
        # a flat sequence of numbers is meant as one triple (a wrong length says so)
        if items and all(isinstance(v, (int, float)) for v in items):
            seq = (_triple(items, "coefficients"),)
        else:
            if not items:
                raise ValueError("coefficients: empty sequence of triples")
            seq = tuple(_triple(t, f"coefficients[{i}]") for i, t in enumerate(items))
        preset_safety = 1.0
    full = tuple(seq[min(i, len(seq) - 1)] for i in range(steps))
    s = preset_safety if safety is None else float(safety)
    if not s > 0:
        raise ValueError(f"safety must be positive, got {safety!r}")
    return Schedule(full, s)
