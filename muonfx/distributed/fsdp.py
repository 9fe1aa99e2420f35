"""FSDP2 conveniences: the predecessor's ``FSDPMuonOptimizer`` and ``unshard_params``."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from ..base import GradientTransformation
from ..combine import named_chain
from ..optim import TransformOptimizer
from ..familiar import model_labels
from ..linalg import CoefficientSpec
from ..presets import adamw
from ..transforms import (decoupled_decay, momentum as _momentum, newton_schulz, row_normalize, scale,
                          scale_by_learning_rate, scale_by_shape)
from ..wrappers import accumulate

__all__ = ["FSDPMuonOptimizer", "fsdp_muon", "unshard"]


def fsdp_muon(
    lr: float = 0.02,
    momentum: float = 0.95,
    weight_decay: float = 0.01,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_stepsize: float = 1.0,
    beta2: float | None = None,
    eps: float = 1e-8,
    gradient_accumulation_steps: int = 1,
    adjust_lr: str = "original",
    ns_dtype: torch.dtype | None = None,
    ns_coefficients: CoefficientSpec = "keller",
) -> GradientTransformation:
    """The chain behind :class:`FSDPMuonOptimizer`'s matrices::

        momentum -> newton_schulz -> [row_normalize(beta2, eps)] -> scale_by_shape
          -> scale(ns_stepsize) -> decoupled_decay -> scale_by_learning_rate

    wrapped in ``accumulate(..., gradient_accumulation_steps)`` when that is > 1.
    """
    steps = [
        ("momentum", _momentum(momentum, nesterov=nesterov)),
        ("orthogonalize", newton_schulz(ns_steps, ns_coefficients, dtype=ns_dtype)),
    ]
    if beta2 is not None:
        steps.append(("row_normalize", row_normalize(beta2, eps)))
    steps += [
        ("scale_by_shape", scale_by_shape(adjust_lr)),
        ("ns_stepsize", scale(ns_stepsize)),
        ("weight_decay", decoupled_decay(weight_decay)),
        ("lr", scale_by_learning_rate(lr)),
    ]
    tx = named_chain(*steps)
    return accumulate(tx, gradient_accumulation_steps) if gradient_accumulation_steps > 1 else tx


def _adamw_accumulated(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    gradient_accumulation_steps: int = 1,
) -> GradientTransformation:
    tx = adamw(lr, betas, eps, weight_decay)
    return accumulate(tx, gradient_accumulation_steps) if gradient_accumulation_steps > 1 else tx


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unshard(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block every FSDP2 module's parameters are full tensors; resharded on exit."""
    mods = _fsdp_modules(model)
    for m in mods:
        m.unshard()
    try:
        yield model
    finally:
        for m in reversed(mods):
            m.reshard()


class FSDPMuonOptimizer(TransformOptimizer):
    """The predecessor's FSDP optimizer, as a :class:`muonfx.TransformOptimizer`.

    Matrices (2-D and more, except embeddings, found by module type or name, and the
    output head) get
    :func:`fsdp_muon`; other parameters get AdamW (``adamw_lr``, ``adamw_betas``,
    ``adamw_weight_decay``). Works on ``fully_shard``-ed models, plain models and
    mixes; the matrix work is split across ranks by the DTensor seam backend.

    Differences from the predecessor: ``beta2`` defaults to ``None`` (plain Muon); the
    predecessor's README used ``beta2=0.99``, which here turns on NorMuon-style row
    normalisation (:func:`muonfx.row_normalize`). ``ns_stepsize`` multiplies the
    orthogonalised update. ``gradient_accumulation_steps=k`` means: call ``step()``
    after every micro-batch; parameters move on every k-th call, with the mean
    gradient.

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> opt = mfx.FSDPMuonOptimizer(model, lr=0.02)    # also on a fully_shard-ed model
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: Iterable[Any] | None = None,
        lr: float = 0.02,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_stepsize: float = 1.0,
        beta2: float | None = None,
        eps: float = 1e-8,
        gradient_accumulation_steps: int = 1,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_weight_decay: float = 0.01,
        ns_dtype: torch.dtype | None = None,
        ns_coefficients: CoefficientSpec = "keller",
    ) -> None:
        self.model = model
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        named = list(model.named_parameters()) if params is None else list(params)
        if named and not isinstance(named[0], tuple):
            by_id = {id(p): n for n, p in model.named_parameters()}
            named = [(by_id.get(id(p), f"param{i}"), p) for i, p in enumerate(named)]
        named = [(n, p) for n, p in named if p.requires_grad]
        label = model_labels(model)
        muon_params = [(n, p) for n, p in named if label(n, p) == "muon"]
        other = [(n, p) for n, p in named if label(n, p) != "muon"]
        groups = []
        if muon_params:
            groups.append(dict(
                params=muon_params, tx=fsdp_muon, lr=lr, momentum=momentum, weight_decay=weight_decay,
                nesterov=nesterov, ns_steps=ns_steps, ns_stepsize=ns_stepsize, beta2=beta2, eps=eps,
                gradient_accumulation_steps=gradient_accumulation_steps, ns_dtype=ns_dtype,
                ns_coefficients=ns_coefficients,
            ))
        if other:
            groups.append(dict(
                params=other, tx=_adamw_accumulated, lr=adamw_lr, betas=tuple(adamw_betas),
                weight_decay=adamw_weight_decay, gradient_accumulation_steps=gradient_accumulation_steps,
            ))
        if not groups:
            raise ValueError("FSDPMuonOptimizer: no trainable parameters")
        super().__init__(groups, fsdp_muon)

    def unshard_params(self) -> contextlib.AbstractContextManager:
        """Context manager: the model's parameters are full tensors inside, resharded on exit."""
        return unshard(self.model)
