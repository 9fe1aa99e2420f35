"""The optimizer classes users of torch.optim.Muon and the predecessor muon_fsdp know,
as thin builders on :class:`muonfx.TransformOptimizer`."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

import torch

from .optim import TransformOptimizer
from .options import takes_muon_options
from .presets import adamw, default_muon_labels, muon

__all__ = ["MuonOptimizer", "create_hybrid_optimizer", "model_labels"]


def model_labels(model: torch.nn.Module) -> Callable[[str, torch.Tensor], Hashable]:
    """A label function for ``model``: ``"adamw"`` for the parameters of its
    ``nn.Embedding``/``nn.EmbeddingBag`` modules (whatever their names), otherwise
    :func:`muonfx.default_muon_labels` (0-D/1-D tensors and embedding/head names)."""
    embedding_params = {
        id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        for p in m.parameters(recurse=False)
    }

    def labels(name: str, p: torch.Tensor) -> Hashable:
        return "adamw" if id(p) in embedding_params else default_muon_labels(name, p)

    return labels


class MuonOptimizer(TransformOptimizer):
    """Muon as a ``torch.optim.Optimizer`` (the predecessor's signature and defaults).

    ``MuonOptimizer(params, lr=0.02, *, momentum=0.95, nesterov=False, ns_steps=5,
    ns_coefficients="keller", weight_decay=0.0, adjust_lr="original", eps=1e-7,
    ns_dtype=None, ns_method="standard", mu_dtype=None)`` is
    ``TransformOptimizer(params, mfx.muon, ...)``: the options are :func:`muonfx.muon`'s
    (:class:`~muonfx.MuonOptions`, ``eps`` the Newton-Schulz floor), and every one is a
    param-group hyperparameter read at each step. Note the predecessor's
    ``nesterov=False`` default (torch.optim.Muon and ``mfx.muon`` use ``True``). Every
    parameter must be a matrix (2-D, 3-D stack or conv weight); use
    :func:`create_hybrid_optimizer` for a whole model.

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
        >>> opt = mfx.MuonOptimizer(model.parameters(), lr=0.02, momentum=0.95, weight_decay=0.01)
    """

    @takes_muon_options(defaults={"nesterov": False})
    def __init__(self, params: Iterable[Any], **muon_options: Any) -> None:
        super().__init__(params, muon, **muon_options)
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.ndim < 2:
                    raise ValueError(
                        f"MuonOptimizer: parameter {self._name(gi, i)!r} has shape {tuple(p.shape)}; Muon "
                        "needs matrices. Give 0-D/1-D parameters (biases, norms) and embeddings to AdamW: "
                        "mfx.create_hybrid_optimizer(model, ...) splits a model for you."
                    )


@takes_muon_options(rename={"lr": "muon_lr", "momentum": "muon_momentum", "weight_decay": "muon_weight_decay"})
def create_hybrid_optimizer(
    model: torch.nn.Module,
    *,
    adamw_lr: float = 1e-3,
    adamw_weight_decay: float = 0.01,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    labels: Callable[[str, torch.Tensor], Hashable] | None = None,
    **muon_options: Any,
) -> TransformOptimizer:
    """One optimizer: Muon for hidden matrices, AdamW for embeddings, head, biases, norms.

    Parameters are split with ``labels(name, param) -> "muon" | "adamw"`` (default:
    parameters of ``nn.Embedding``/``nn.EmbeddingBag`` modules, then
    :func:`muonfx.default_muon_labels` by name and ndim) into two param groups of ONE
    :class:`TransformOptimizer`, so one lr scheduler drives both (each group keeps
    its own base lr) and one ``state_dict`` holds everything. The Muon group takes
    every option of :func:`muonfx.muon` (:class:`~muonfx.MuonOptions`), with ``lr``,
    ``momentum`` and ``weight_decay`` named ``muon_lr``, ``muon_momentum`` and
    ``muon_weight_decay`` here; ``eps`` is the Newton-Schulz floor. The AdamW group takes
    ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` (Adam's epsilon) and
    ``adamw_weight_decay``, and accepts sparse gradients (``nn.Embedding(sparse=True)``)
    by densifying them. Frozen parameters (``requires_grad=False``) are left out.

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
        >>> opt = mfx.create_hybrid_optimizer(model, muon_lr=0.02, adamw_lr=1e-3)
        >>> [len(g["params"]) for g in opt.param_groups]
        [2, 3]
    """
    label_fn = labels or model_labels(model)
    groups: dict[str, list] = {"muon": [], "adamw": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lbl = label_fn(name, p)
        if lbl not in groups:
            raise ValueError(f"create_hybrid_optimizer: label {lbl!r} for parameter {name!r}; use 'muon' or 'adamw'")
        if lbl == "muon" and p.ndim < 2:
            raise ValueError(f"create_hybrid_optimizer: parameter {name!r} ({p.ndim}-D) cannot use Muon")
        groups[lbl].append((name, p))
    param_groups = []
    if groups["muon"]:
        param_groups.append(dict(params=groups["muon"], tx=muon, **muon_options))
    if groups["adamw"]:
        param_groups.append(dict(
            params=groups["adamw"], tx=adamw, lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
            weight_decay=adamw_weight_decay, sparse_grad="densify",
        ))
    if not param_groups:
        raise ValueError("create_hybrid_optimizer: the model has no trainable parameters")
    return TransformOptimizer(param_groups, muon)
