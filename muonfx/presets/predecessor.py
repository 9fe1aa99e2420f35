"""The predecessor ``muon_fsdp``'s Muon chain, behind :class:`muonfx.FSDPMuonOptimizer`'s
matrices."""

from __future__ import annotations

from typing import Any

from ..combine import named_chain
from ..core import GradientTransformation
from ..hyperparams import late_bound
from ..transforms import row_normalize, scale
from ..wrappers import accumulate
from .options import MuonOptions, insert_step, takes_muon_options

__all__ = ["fsdp_muon"]


@late_bound("lr", "momentum", "weight_decay", "eps")
@takes_muon_options(defaults={"weight_decay": 0.01})
def fsdp_muon(
    *,
    ns_stepsize: float = 1.0,
    beta2: float | None = None,
    row_eps: float = 1e-8,
    gradient_accumulation_steps: int = 1,
    **muon_options: Any,
) -> GradientTransformation:
    """The chain behind :class:`~muonfx.FSDPMuonOptimizer`'s matrices: :func:`muonfx.muon`'s
    options (:class:`~muonfx.MuonOptions`, ``weight_decay`` defaulting to 0.01) and
    named chain, with two more steps::

        momentum -> newton_schulz -> [row_normalize(beta2, row_eps)] -> scale_by_shape
          -> scale(ns_stepsize) -> decoupled_decay -> scale_by_learning_rate

    wrapped in ``accumulate(..., gradient_accumulation_steps)`` when that is > 1.
    ``eps`` is the Newton-Schulz floor (as in ``muon``); ``row_eps`` the row
    normaliser's (used when ``beta2`` is given). ``lr``, ``momentum``, ``weight_decay``
    and ``eps`` are late-bound (:func:`muonfx.hyperparams.late_bound`).
    """
    opts = MuonOptions(**muon_options)
    steps = opts.steps()
    if beta2 is not None:
        steps = insert_step(steps, "orthogonalize", "row_normalize", row_normalize(beta2, row_eps, dims=opts.dims))
    tx = named_chain(*insert_step(steps, "scale_by_shape", "ns_stepsize", scale(ns_stepsize)).items())
    return accumulate(tx, gradient_accumulation_steps) if gradient_accumulation_steps > 1 else tx
