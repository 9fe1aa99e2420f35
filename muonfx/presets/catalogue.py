"""The optimizers people reach for after Muon, each a :func:`named_chain` of public
transforms: Lion, ADOPT, LaProp, C-AdamW (cautious updates), MARS-AdamW, MARS-Muon and
Schedule-Free AdamW.

Each preset names its reference (the arithmetic its parity test checks against).
"""

from __future__ import annotations

from typing import Any

import torch

from ..combine import chain, named_chain
from ..core import GradientTransformation
from ..hyperparams import check_args, late_bound
from ..schedules import ScalarOrSchedule
from ..transforms import (cautious, decoupled_decay, scale_by_dion2, scale_by_shape, scale_by_soap, mars_correction, scale_by_adam, scale_by_adopt, scale_by_laprop,
                          scale_by_learning_rate, scale_by_lion, schedule_free)
from ..transforms.schedule_free import WarmupWeight, check_warmup_steps
from .options import MuonOptions, takes_muon_options

__all__ = ["lion", "adopt", "laprop", "cautious_adamw", "mars_adamw", "mars_muon", "schedule_free_adamw", "dion2", "soap"]

#: the presets that take any parameter (0-D to 4-D); the others take matrices
ELEMENTWISE = ("lion", "adopt", "laprop", "cautious_adamw", "mars_adamw", "schedule_free_adamw", "soap")


def _betas(name: str, betas: Any) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"hyperparameter {name!r} must be a pair (beta1, beta2), got {betas!r}")
    return betas[0], betas[1]


@late_bound("lr", "weight_decay")
def lion(lr: ScalarOrSchedule = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
         weight_decay: float = 0.0) -> GradientTransformation:
    """Lion (Chen et al., 2023), as ``lion_pytorch.Lion`` computes it (same defaults).

    The chain ``scale_by_lion(b1, b2) -> decoupled_decay(wd) -> scale_by_learning_rate(lr)``::

        W <- W - lr * (sign(b1 * m + (1 - b1) * g) + wd * W);   m <- b2 * m + (1 - b2) * g

    State: one buffer per parameter (4 bytes per float32 element). Lion's steps all have
    size ``lr``: its usual lr is 3-10x smaller than AdamW's, its weight decay as much larger.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.lion(lr=3e-4, weight_decay=0.1)
    """
    check_args(lr=lr, betas=betas, weight_decay=weight_decay)
    b1, b2 = _betas("betas", betas)
    return named_chain(("lion", scale_by_lion(b1, b2)), ("weight_decay", decoupled_decay(weight_decay)),
                       ("lr", scale_by_learning_rate(lr)))


@late_bound("lr", "weight_decay")
def adopt(lr: ScalarOrSchedule = 1e-3, betas: tuple[float, float] = (0.9, 0.9999), eps: float = 1e-6,
          weight_decay: float = 0.0, decouple: bool = False) -> GradientTransformation:
    """ADOPT (Taniguchi et al., 2024), as the authors' ``adopt.py`` computes it (same defaults).

    The chain ``decoupled_decay(wd) -> scale_by_adopt(b1, b2, eps) -> scale_by_learning_rate(lr)``
    (``decouple=False``, the authors' default: the decay joins the gradient, an L2
    penalty), or ``scale_by_adopt -> decoupled_decay -> scale_by_learning_rate``
    (``decouple=True``: ``W <- W - lr * (mu + wd * W)``; the authors skip the decay on
    the first step, which only fills ``nu``, where this chain decays already). The first
    step leaves the parameters as they are (``decouple=False``). State: two buffers.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.adopt(lr=1e-3, weight_decay=0.01, decouple=True)
    """
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = _betas("betas", betas)
    direction = ("adopt", scale_by_adopt(b1, b2, eps))
    decay = ("weight_decay", decoupled_decay(weight_decay))
    steps = [direction, decay] if decouple else [decay, direction]
    return named_chain(*steps, ("lr", scale_by_learning_rate(lr)))


@late_bound("lr", "weight_decay")
def laprop(lr: ScalarOrSchedule = 4e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-15,
           weight_decay: float = 0.0) -> GradientTransformation:
    """LaProp (Ziyin et al., 2020), as the authors' ``laprop.py`` computes it at a constant lr.

    The chain ``scale_by_laprop(b1, b2, eps) -> decoupled_decay(wd) -> scale_by_learning_rate(lr)``::

        W <- W - lr * (m / (1 - b1^t) + wd * W),   m = EMA_b1(g / (sqrt(v / (1 - b2^t)) + eps))

    The decay is AdamW's (scaled by the lr; the authors' ``W <- W - wd * W`` is not).
    Defaults are the authors'. State: two buffers.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.laprop(lr=1e-3, betas=(0.9, 0.99))
    """
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = _betas("betas", betas)
    return named_chain(("laprop", scale_by_laprop(b1, b2, eps)), ("weight_decay", decoupled_decay(weight_decay)),
                       ("lr", scale_by_learning_rate(lr)))


@late_bound("lr", "weight_decay")
def cautious_adamw(lr: ScalarOrSchedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                   weight_decay: float = 0.0) -> GradientTransformation:
    """C-AdamW (Liang et al., 2024), as the authors' C-Optim ``AdamW`` computes it.

    The chain ``cautious(scale_by_adam(b1, b2, eps, eps_before_bias_correction=True))
    -> decoupled_decay(wd) -> scale_by_learning_rate(lr)``: AdamW's update with the
    elements that disagree in sign with the gradient masked (:func:`~muonfx.cautious`),
    epsilon added to the uncorrected ``sqrt(v)`` as the authors' code does. State: two
    buffers (Adam's).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.cautious_adamw(lr=1e-3, weight_decay=0.01)
    """
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = _betas("betas", betas)
    return named_chain(("adam", cautious(scale_by_adam(b1, b2, eps, eps_before_bias_correction=True))),
                       ("weight_decay", decoupled_decay(weight_decay)), ("lr", scale_by_learning_rate(lr)))


@late_bound("lr", "weight_decay")
def mars_adamw(lr: ScalarOrSchedule = 3e-3, betas: tuple[float, float] = (0.95, 0.99), eps: float = 1e-8,
               weight_decay: float = 0.0, gamma: float = 0.025, max_norm: float | None = 1.0) -> GradientTransformation:
    """MARS-AdamW (Yuan et al., 2024), as AGI-Arena/MARS's ``mars.py`` computes it
    (``mars_type="mars-adamw"``, ``is_approx=True``, ``optimize_1d=True``; same defaults).

    The chain ``mars_correction(gamma, b1, max_norm) -> scale_by_adam(b1, b2, eps) ->
    decoupled_decay(wd) -> scale_by_learning_rate(lr)``: Adam on the corrected gradient
    ``c = g + gamma * b1 / (1 - b1) * (g - g_prev)`` (each parameter's ``c`` clipped to
    norm ``max_norm``). With ``gamma=0, max_norm=None`` it is :func:`~muonfx.adamw`
    bit for bit. State: three buffers (Adam's two and the previous gradient).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.mars_adamw(lr=3e-3, gamma=0.025)
    """
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = _betas("betas", betas)
    return named_chain(("mars", mars_correction(gamma, b1, max_norm)), ("adam", scale_by_adam(b1, b2, eps)),
                       ("weight_decay", decoupled_decay(weight_decay)), ("lr", scale_by_learning_rate(lr)))


@late_bound("lr", "weight_decay", "eps")
@takes_muon_options()
def mars_muon(*, gamma: float = 0.025, max_norm: float | None = None, **options: Any) -> GradientTransformation:
    """MARS-M: Muon on the MARS-corrected gradient (AGI-Arena/MARS's ``MARS_M``).

    :func:`~muonfx.muon`'s chain (every :class:`~muonfx.MuonOptions` option) with
    ``mars_correction(gamma, momentum, max_norm)`` placed before the momentum, so the
    momentum averages ``c = g + gamma * beta / (1 - beta) * (g - g_prev)``. With
    ``gamma=0`` (and no ``max_norm``) it is :func:`~muonfx.muon` bit for bit. State:
    Muon's momentum and the previous gradient, per matrix.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.mars_muon(lr=0.02, gamma=0.025)
    """
    opts = MuonOptions(**options)
    return named_chain(("mars", mars_correction(gamma, opts.momentum, max_norm)), *opts.steps().items())


@late_bound("lr", "betas", "eps", "weight_decay", "warmup_steps", "r", "weight_lr_power")
def schedule_free_adamw(lr: float = 0.0025, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                        weight_decay: float = 0.0, warmup_steps: int = 0, r: float = 0.0,
                        weight_lr_power: float = 2.0) -> GradientTransformation:
    """Schedule-Free AdamW, as ``schedulefree.AdamWScheduleFreeReference`` (1.4.1) computes
    it (same defaults).

    ``schedule_free(chain(scale_by_adam(0, b2, eps), decoupled_decay(wd),
    scale_by_learning_rate(lr_k)), b1, weight)``: Adam without momentum (``b1`` is the
    interpolation's) steps ``z`` with ``lr_k = lr * min(1, (k + 1) / warmup_steps)``, the
    decay taken at ``y``; step ``k`` weighs ``(k + 1)^r * lr_k^weight_lr_power`` in the
    average ``x`` (:class:`~muonfx.transforms.schedule_free.WarmupWeight`). Use
    ``opt.eval()`` before evaluating and ``opt.train()`` after
    (:meth:`~muonfx.TransformOptimizer.eval`). State: ``z``, ``x`` and Adam's two
    moments (16 bytes per float32 element, the reference's ``z``, ``x``, ``y``,
    ``exp_avg_sq``). Every number is late-bound (:func:`muonfx.hyperparams.late_bound`):
    a scheduler or a new value builds nothing, and under ``opt.compile()`` compiles
    nothing again.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.schedule_free_adamw(lr=1e-3, warmup_steps=100)
    """
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, r=r, weight_lr_power=weight_lr_power)
    check_warmup_steps(warmup_steps)
    b1, b2 = _betas("betas", betas)
    weight = WarmupWeight(lr, warmup_steps, r, weight_lr_power)
    inner = chain(scale_by_adam(0.0, b2, eps), decoupled_decay(weight_decay), weight.lr_link())
    return schedule_free(inner, b1, weight)


_DION_SHAPES = {"spectral_norm": "spectral", "rms_norm": "match_rms_adamw", None: "none"}


@late_bound("lr", "weight_decay")
def dion2(lr: ScalarOrSchedule = 0.01, fraction: float = 0.25, ef_decay: float = 0.95, weight_decay: float = 0.01,
          adjust_lr: str | None = "spectral_norm", eps: float = 1e-7,
          ns_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Dion2 (Ahn et al., 2025) for matrices, as microsoft/dion's ``Dion2`` computes it
    (same defaults; its shard-independent row selection, which one process shares).

    The chain ``scale_by_dion2(fraction, ef_decay, eps=eps) -> scale_by_shape(adjust_lr) ->
    decoupled_decay(wd) -> scale_by_learning_rate(lr)``::

        W <- W - lr * (s(A, B) * U + wd * W),   U = NS(the top ceil(fraction * A) rows of M)

    ``adjust_lr``: ``"spectral_norm"`` (``s = sqrt(A / B)``), ``"rms_norm"``
    (``0.2 * sqrt(max(A, B))``) or ``None`` (1). Give it matrices (route 0-D/1-D
    parameters to AdamW or Lion, as Dion2's own param groups do). State: one buffer per
    matrix (4 bytes per float32 element).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.dion2(lr=0.01, fraction=0.25)
    """
    check_args(lr=lr, weight_decay=weight_decay)
    if adjust_lr not in _DION_SHAPES:
        raise ValueError(f"dion2: adjust_lr must be 'spectral_norm', 'rms_norm' or None, got {adjust_lr!r}")
    return named_chain(("dion2", scale_by_dion2(fraction, ef_decay, eps=eps, ns_dtype=ns_dtype)),
                       ("scale_by_shape", scale_by_shape(_DION_SHAPES[adjust_lr])),
                       ("weight_decay", decoupled_decay(weight_decay)), ("lr", scale_by_learning_rate(lr)))


@late_bound("lr", "weight_decay")
def soap(lr: ScalarOrSchedule = 3e-3, betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float = -1.0,
         eps: float = 1e-8, weight_decay: float = 0.01, precondition_frequency: int = 10, max_precond_dim: int = 10000,
         merge_dims: bool = False, precondition_1d: bool = False,
         normalize_grads: bool = False) -> GradientTransformation:
    """SOAP (Vyas et al., 2024), as the authors' ``soap.py`` (nikhilvyas/SOAP at f42d296)
    computes it (same defaults).

    The chain ``scale_by_soap(b1, b2, shampoo_beta, eps, ...) -> decoupled_decay(wd) ->
    scale_by_learning_rate(lr)``: Adam in the eigenbasis of Shampoo's factors, the basis
    refreshed by one QR power iteration every ``precondition_frequency`` steps. The
    reference decays the weights after the update (``W <- (W - lr * u) (1 - lr * wd)``)
    and not on the first step; this chain decays as AdamW (``W - lr * (u + wd * W)``,
    a difference of ``lr^2 * wd * u``). State: two moments per element plus the factors
    and bases (``2 * d^2`` per preconditioned dimension ``d``). Whole tensors only.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.soap(lr=3e-3, precondition_frequency=10)
    """
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = _betas("betas", betas)
    return named_chain(("soap", scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim,
                                              merge_dims, precondition_1d, normalize_grads)),
                       ("weight_decay", decoupled_decay(weight_decay)), ("lr", scale_by_learning_rate(lr)))
