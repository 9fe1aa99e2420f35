"""FSDP2 conveniences: the predecessor's ``FSDPMuonOptimizer`` and ``unshard_params``
(its matrices' chain is :func:`muonfx.presets.predecessor.fsdp_muon`)."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterable, Iterator

import torch

from ..core import GradientTransformation
from ..hyperparams import late_bound
from ..logs import say_once
from ..presets import adamw
from ..presets.options import MeaningChangedWarning, MuonOptions, takes_muon_options
from ..presets.predecessor import fsdp_muon
from ..wrappers import accumulate
from .muon_optimizer import _embedding_ids, model_labels
from .qk_clip import QKClip
from .routing import check_muon_reached, rule_of
from .optimizer import TransformOptimizer
from .step.fused import FusedAdamW, register
from .step.fused_muon import FusedMuon

__all__ = ["FSDPMuonOptimizer", "unshard"]


@late_bound("lr", "betas", "eps", "weight_decay")
def _adamw_accumulated(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    gradient_accumulation_steps: int = 1,
) -> GradientTransformation:
    tx = adamw(lr, betas, eps, weight_decay)
    return accumulate(tx, gradient_accumulation_steps) if gradient_accumulation_steps > 1 else tx


# without gradient accumulation the group is mfx.adamw's chain: torch's fused AdamW kernel runs it
register(_adamw_accumulated, FusedAdamW,
         lambda hp: None if hp.get("gradient_accumulation_steps", 1) == 1 else "gradient accumulation")
# the matrices without row normalisation and accumulation: Muon's chain and a constant scale
register(fsdp_muon, FusedMuon,
         lambda hp: "gradient accumulation" if hp.get("gradient_accumulation_steps", 1) != 1 else
         "row normalisation (beta2)" if hp.get("beta2") is not None else None)


def _is_rank_zero() -> bool:
    """Rank 0 of the initialised process group, of a ``torchrun`` launch (``RANK``) not yet
    initialised, or a single process: where a once-per-job message is said."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


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
    output head) get :func:`fsdp_muon`, with every option of :func:`muonfx.muon`
    (:class:`~muonfx.MuonOptions`, ``weight_decay`` defaulting to 0.01; ``eps`` is the
    Newton-Schulz floor); other parameters get AdamW (``adamw_lr``, ``adamw_betas``,
    ``adamw_eps``, ``adamw_weight_decay``). Works on ``fully_shard``-ed models, plain
    models and mixes; the matrix work is split across ranks by the DTensor seam backend.

    Differences from the predecessor: ``beta2`` defaults to ``None`` (plain Muon); the
    predecessor's README used ``beta2=0.99``, which here turns on NorMuon-style row
    normalisation (:func:`muonfx.row_normalize`, with ``row_eps``; the predecessor's
    ``eps`` is ``row_eps`` here). ``ns_stepsize`` multiplies the
    orthogonalised update. ``gradient_accumulation_steps=k`` means: call ``step()``
    after every micro-batch; parameters move on every k-th call, with the mean
    gradient.

    A model in which no parameter gets Muon (flattened 1-D parameters, none at least
    2-D, every matrix an embedding or a head) raises
    :class:`~muonfx.optim.routing.NoMuonError` naming why, unless ``allow_no_muon=True``.

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> opt = mfx.FSDPMuonOptimizer(model, lr=0.02)    # also on a fully_shard-ed model
    """

    @takes_muon_options(defaults={"weight_decay": 0.01}, legacy_name="muon_fsdp.FSDPMuonOptimizer", legacy_order=(
        "weight_decay", "momentum", "nesterov", "ns_steps", "ns_stepsize", "beta2", "row_eps",
        "gradient_accumulation_steps"))
    def __init__(
        self,
        model: torch.nn.Module,
        params: Iterable[Any] | None = None,
        *,
        ns_stepsize: float = 1.0,
        beta2: float | None = None,
        row_eps: float = 1e-8,
        gradient_accumulation_steps: int = 1,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        qk_clip: QKClip | None = None,
        allow_no_muon: bool = False,
        **muon_options: Any,
    ) -> None:
        self.model = model
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        if qk_clip is not None and gradient_accumulation_steps > 1:
            raise ValueError("FSDPMuonOptimizer: qk_clip with gradient_accumulation_steps > 1 would clip at every "
                             "micro-batch; accumulate in .grad instead (gradient_accumulation_steps=1, step() once "
                             "per k micro-batches: the recorder keeps the maximum over them)")
        changed = []  # one line in all, each change with its fix
        if beta2 is not None:
            changed.append(f"beta2={beta2!r} turns on NorMuon row normalisation here (muon_fsdp ignored it): "
                           "drop it (beta2=None) for plain Muon")
        if muon_options["eps"] != MuonOptions.eps:
            changed.append(f"eps={muon_options['eps']!r} is the Newton-Schulz floor here: muon_fsdp's eps is "
                           f"row_eps={muon_options['eps']!r}")
        if gradient_accumulation_steps > 1:
            changed.append(f"gradient_accumulation_steps={gradient_accumulation_steps}: call zero_grad() and step() "
                           "after EVERY micro-batch (muonfx sums and steps once every "
                           f"{gradient_accumulation_steps}), or pass 1 if your loop accumulates in .grad")
        if changed and _is_rank_zero():  # once, not once per rank
            warnings.warn("FSDPMuonOptimizer, read differently from muon_fsdp: " + "; ".join(
                f"({i}) {c}" for i, c in enumerate(changed, 1)), MeaningChangedWarning, stacklevel=3)
        named = list(model.named_parameters()) if params is None else list(params)
        plain = bool(named) and not isinstance(named[0], tuple)
        if plain:  # named by the model where it has them all; else (torch's rule: all or none) left unnamed
            by_id = {id(p): n for n, p in model.named_parameters()}
            plain = not all(id(p) in by_id for p in named)
            named = [("" if plain else by_id[id(p)], p) for p in named]
        named = [(n, p) for n, p in named if p.requires_grad]
        label = model_labels(model)
        muon_params = [p if plain else (n, p) for n, p in named if label(n, p) == "muon"]
        other = [p if plain else (n, p) for n, p in named if label(n, p) != "muon"]
        embedding = _embedding_ids(model)
        routing = [(n, tuple(p.shape), str(label(n, p)), rule_of(n, p, label(n, p), id(p) in embedding))
                   for n, p in named]
        check_muon_reached("FSDPMuonOptimizer", routing, allow_no_muon)
        groups = []
        if muon_params:
            groups.append(dict(
                params=muon_params, tx=fsdp_muon, **muon_options, ns_stepsize=ns_stepsize, beta2=beta2,
                row_eps=row_eps, gradient_accumulation_steps=gradient_accumulation_steps,
            ))
        if other:
            groups.append(dict(
                params=other, tx=_adamw_accumulated, lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                weight_decay=adamw_weight_decay, gradient_accumulation_steps=gradient_accumulation_steps,
            ))
        if not groups:
            raise ValueError("FSDPMuonOptimizer: no trainable parameters")
        super().__init__(groups, fsdp_muon, qk_clip=qk_clip)
        #: where each parameter went and by which rule (:mod:`muonfx.optim.routing`)
        self.routing = routing
        if other and _is_rank_zero():
            shown = ", ".join(repr(x[0]) if isinstance(x, tuple) else str(tuple(x.shape)) for x in other[:3]) + (
                f" and {len(other) - 3} more" if len(other) > 3 else "")
            say_once("FSDPMuonOptimizer fallback", (
                f"muonfx: FSDPMuonOptimizer gives {len(other)} parameter(s) that are not hidden matrices ({shown}: "
                f"biases, norms, embeddings, the output head) AdamW (lr={adamw_lr:g}), the matrices Muon"))

    def unshard_params(self) -> contextlib.AbstractContextManager:
        """Context manager: the model's parameters are full tensors inside, resharded on exit."""
        return unshard(self.model)
