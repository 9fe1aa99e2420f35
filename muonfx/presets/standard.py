"""Ready-made optimizers, each a :func:`named_chain` of public transforms.

The chain names ("momentum", "orthogonalize", "adam", ...) make the state
addressable: ``state["momentum"].mu``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Hashable

import torch

from ..combine import named_chain, partition
from ..core import GradientTransformation
from ..hyperparams import check_args, check_betas, late_bound
from ..schedules import ScalarOrSchedule
from ..transforms import decoupled_decay, scale_by_adam, scale_by_learning_rate
from .options import MuonOptions, takes_muon_options

__all__ = ["muon", "adamw", "muon_adamw", "default_muon_labels", "ADAMW_KEY_PATTERN"]


@late_bound("lr", "momentum", "weight_decay", "eps")
@takes_muon_options(positional=True)
def muon(**options: Any) -> GradientTransformation:
    """Muon for matrix parameters (2-D, 3-D expert stacks, conv weights).

    ``muon(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="keller",
    weight_decay=0.0, adjust_lr="original", eps=1e-7, ns_dtype=None, ns_method="standard",
    mu_dtype=None)``: the options are :class:`~muonfx.MuonOptions`, defined once and
    forwarded by every builder that runs Muon. The chain, as torch.optim.Muon computes it::

        momentum(momentum, nesterov) -> newton_schulz(ns_steps, ns_coefficients, eps, ns_dtype)
          -> scale_by_shape(adjust_lr) -> decoupled_decay(weight_decay) -> scale_by_learning_rate(lr)

    so ``W <- W - lr * (s(A, B) * NS(M) + wd * W)``. ``adjust_lr`` is
    ``"original"`` (``None`` means the same, as in torch), ``"match_rms_adamw"`` or
    ``"spectral"``. ``eps`` is the floor of the Newton-Schulz normaliser (torch's
    meaning). Defaults follow Keller Jordan's Muon (lr 0.02, no weight decay);
    torch.optim.Muon's own defaults are lr 1e-3, weight_decay 0.1. ``ns_dtype=None``
    computes in the device's fastest accurate-enough dtype (bfloat16 on CUDA and on CPUs
    with native bf16 matmul, float32 elsewhere: :func:`muonfx.linalg.ns_dtype_for`)
    and ``ns_method="standard"`` is torch.optim.Muon's iteration: where the default dtype
    is bf16 (and with ``ns_dtype=torch.bfloat16`` anywhere) the Newton-Schulz output is
    torch's bit for bit on the CPU; where it is float32 the same iteration is computed
    with less rounding. ``ns_method="gram"`` (or ``"auto"``) takes the Gram-matrix
    iteration, the same function in fewer flops on rectangular matrices, at up to 4x
    bf16's rounding error (see :func:`newton_schulz` and ``docs/evidence.md``).
    State: one momentum buffer per matrix, in ``mu_dtype`` (e.g. ``torch.bfloat16`` to
    halve it) or the parameter's dtype. ``lr``, ``momentum``, ``weight_decay`` and
    ``eps`` are late-bound (:func:`muonfx.hyperparams.late_bound`): an lr scheduler or a
    momentum change runs the same chain with the new numbers, without building it again.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.muon(lr=0.02, weight_decay=0.01)
    """
    return named_chain(*MuonOptions(**options).steps().items())


@late_bound("lr", "betas", "eps", "weight_decay")
def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """AdamW, as torch.optim.AdamW computes it (same arguments, same defaults).

    The chain: ``scale_by_adam(b1, b2, eps, amsgrad=, maximize=) -> decoupled_decay(wd)
    -> scale_by_learning_rate(lr)``, so ``W <- W - lr * (m_hat / (sqrt(v_hat) + eps) + wd * W)``;
    with ``amsgrad=True`` ``v_hat`` is the bias-corrected largest second moment so far
    (state ``adam.nu_max``), with ``maximize=True`` the moments are those of ``-g``
    (torch's arithmetic for both). ``betas`` are two numbers, or two one-element
    tensors (not one of each, as in torch). ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are late-bound (:func:`muonfx.hyperparams.late_bound`).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.adamw(lr=3e-4, betas=(0.9, 0.95))
        >>> tx = mfx.adamw(lr=3e-4, amsgrad=True, maximize=True)    # torch.optim.AdamW's options
    """
    check_betas("betas", betas)
    check_args(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    b1, b2 = betas
    return named_chain(
        ("adam", scale_by_adam(b1, b2, eps, amsgrad=amsgrad, maximize=maximize)),
        ("weight_decay", decoupled_decay(weight_decay)),
        ("lr", scale_by_learning_rate(lr)),
    )


#: dotted-key pattern of parameters that get AdamW in :func:`muon_adamw` even when 2-D:
#: embeddings and the output head.
ADAMW_KEY_PATTERN = re.compile(
    r"(^|\.)(embed\w*|\w*embedding\w*|wte|wpe|tok_embeddings|pos|pos_\w*|position\w*|lm_head|head|output|"
    r"unembed\w*|classifier)(\.|$)"
)


def default_muon_labels(key: str, tensor: torch.Tensor) -> str:
    """``"adamw"`` for 0-D/1-D tensors, embeddings and the output head; else ``"muon"``."""
    if tensor.ndim < 2 or ADAMW_KEY_PATTERN.search(key):
        return "adamw"
    return "muon"


@late_bound("lr", "momentum", "weight_decay", "eps", "adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay")
@takes_muon_options()
def muon_adamw(
    *,
    adamw_lr: ScalarOrSchedule = 1e-3,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.01,
    labels: Callable[[str, torch.Tensor], Hashable] | None = None,
    **muon_options: Any,
) -> GradientTransformation:
    """Muon for hidden matrices, AdamW for everything else, as one transform.

    ``partition({"muon": muon(...), "adamw": adamw(...)}, labels)``: every option of
    :func:`muon` (:class:`~muonfx.MuonOptions`: ``lr``, ``momentum``, ..., ``eps`` the
    Newton-Schulz floor, ..., ``mu_dtype``) goes to the Muon part; ``adamw_lr``,
    ``adamw_betas``, ``adamw_eps`` (Adam's epsilon) and ``adamw_weight_decay`` to the
    AdamW part. The default ``labels`` (:func:`default_muon_labels`) sends 0-D/1-D
    tensors (biases, norms) and keys matching :data:`ADAMW_KEY_PATTERN` (embeddings:
    ``embed*``, ``*embedding*``, ``wte``, ``wpe``, ``tok_embeddings``, ``pos``, ``pos_*``,
    ``position*``; the head: ``lm_head``,
    ``head``, ``output``, ``unembed*``, ``classifier``) to AdamW. Pass your own
    ``labels(key, tensor) -> "muon" | "adamw"`` to override. AdamW betas default to
    (0.9, 0.95), the usual companion setting for Muon. The numbers of both parts (the
    learning rates, momentum, betas, epsilons and weight decays) are late-bound
    (:func:`muonfx.hyperparams.late_bound`).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.muon_adamw(lr=0.02, adamw_lr=3e-3)
    """
    check_betas("adamw_betas", adamw_betas)
    check_args(adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay)
    return partition(
        {
            "muon": muon(**muon_options),
            "adamw": adamw(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay),
        },
        labels or default_muon_labels,
    )
