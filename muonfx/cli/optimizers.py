"""``--optimizer NAME``: the optimizers ``muonfx train`` can build, all from muonfx.

* ``muon_adamw``: :func:`muonfx.create_hybrid_optimizer`: Muon (``--lr``) on the hidden
  matrices, AdamW (``--adamw-lr``, betas 0.9/0.95) on embeddings, head, norms, biases.
* ``adamw``: ``TransformOptimizer(model.named_parameters(), mfx.adamw, ...)`` on
  everything (lr: ``--lr`` when given, else 1e-2, the best of a small sweep).
* any other preset of :mod:`muonfx.presets.standard` (a function returning a
  ``GradientTransformation``): one taking ``adamw_lr`` gets the whole model with
  ``lr=--lr, adamw_lr=--adamw-lr``; a matrix optimizer (``muon``) gets every
  parameter of 2 or more dimensions (embeddings and head included: the "Muon on
  everything it can take" ablation) and AdamW (``--adamw-lr``) the 0-D/1-D rest.
* a preset of :mod:`muonfx.presets.catalogue`: ``mars_muon`` and ``dion2`` as ``muon`` above; the
  elementwise ones (``lion``, ``adopt``, ``laprop``, ``cautious_adamw``, ``mars_adamw``,
  ``schedule_free_adamw``, ``soap``) on every parameter, with ``--lr`` (else the best lr of a sweep
  on the main job, :data:`MAIN_JOB_LR`) and ``--weight-decay``.
"""

from __future__ import annotations

import inspect

import torch

from ..core import GradientTransformation
from ..optim import TransformOptimizer
from ..optim.muon_optimizer import create_hybrid_optimizer
from ..optim.qk_clip import QKClip
from ..optim.routing import check_muon_reached, routes
from ..presets import catalogue, standard as presets
from ..presets.options import MuonOptions

__all__ = ["optimizer_names", "check_optimizer", "build_optimizer", "default_lr", "preset_lr", "MUON_LR",
           "ADAMW_BETAS", "MAIN_JOB_LR"]

#: lr of the Muon optimizers when ``--lr`` is not given: Muon's own default
MUON_LR = MuonOptions().lr
#: lr of ``--optimizer adamw`` (and of the ``--compare adamw`` baseline) when ``--lr`` is not
#: given: the best of the sweep 3e-3 / 1e-2 / 3e-2 at the defaults (docs/evidence.md)
ADAMW_LR = 1e-2
ADAMW_BETAS = (0.9, 0.95)
#: lr of the elementwise catalogue presets when ``--lr`` is not given: the best of a sweep
#: of each preset's own default times 0.3 to 30 on the main job (100 steps of the tiny
#: model, seed 0; docs/evidence.md). The presets' own defaults are their references'
#: (lion-pytorch's 1e-4, the ADOPT authors' 1e-3, ...), 3-30x below these here.
MAIN_JOB_LR = {"lion": 1e-3, "adopt": 1e-2, "laprop": 1.2e-2, "cautious_adamw": 1e-2, "mars_adamw": 9e-3,
               "schedule_free_adamw": 7.5e-3, "soap": 3e-2}


def _factory(name: str):
    """The preset called ``name`` (of :mod:`muonfx.presets.standard` or ``catalogue``), or None."""
    for module in (presets, catalogue):
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    return None


def _elementwise(name: str) -> bool:
    """A catalogue preset that takes every parameter (not a matrix optimizer)."""
    return name in catalogue.ELEMENTWISE


def optimizer_names() -> list[str]:
    """Every preset of :mod:`muonfx.presets.standard` and :mod:`muonfx.presets.catalogue`
    that builds a transform, sorted.

    Example::

        >>> from muonfx.cli.optimizers import optimizer_names
        >>> {"adamw", "muon", "muon_adamw"} <= set(optimizer_names())
        True
    """
    names = []
    for name in [*presets.__all__, *catalogue.__all__]:
        fn = _factory(name)
        if not inspect.isfunction(fn):
            continue
        ret = inspect.signature(fn).return_annotation
        if ret is GradientTransformation or ret == "GradientTransformation":
            names.append(name)
    return sorted(names)


def check_optimizer(name: str) -> str | None:
    """``None`` if ``name`` is known, else a one-line error listing the valid names."""
    valid = optimizer_names()
    if name in valid:
        return None
    return f"unknown optimizer {name!r}; choose one of: {', '.join(valid)}"


def default_lr(name: str, adamw_lr: float) -> float:
    """``--lr``'s default: the tuned AdamW lr for ``adamw``, :data:`MAIN_JOB_LR` for the
    elementwise catalogue presets (the preset's own default for one not swept), Muon's
    for the rest (``adamw_lr`` is the AdamW part of the hybrids, tuned separately)."""
    if _elementwise(name):
        return MAIN_JOB_LR.get(name, preset_lr(name))
    return ADAMW_LR if name == "adamw" else MUON_LR


def preset_lr(name: str) -> float:
    """The lr the preset ``name`` itself defaults to (its reference's) for the elementwise
    catalogue presets; AdamW's tuned lr for ``adamw``, Muon's for the rest.

    Example::

        >>> from muonfx.cli.optimizers import default_lr, preset_lr
        >>> preset_lr("lion"), default_lr("lion", 3e-3)
        (0.0001, 0.001)
    """
    if _elementwise(name):
        return inspect.signature(_factory(name)).parameters["lr"].default
    return ADAMW_LR if name == "adamw" else MUON_LR


def build_optimizer(name: str, model: torch.nn.Module, lr: float | None, adamw_lr: float,
                    weight_decay: float, ns_method: str = "standard", qk_clip: QKClip | None = None
                    ) -> TransformOptimizer:
    """The optimizer ``--optimizer name`` stands for, on ``model`` (``ns_method``: the
    Newton-Schulz form of its Muon part, where it has one; ``qk_clip``: the optimizers'
    QK-clip option)."""
    err = check_optimizer(name)
    if err:
        raise ValueError(err)
    lr = default_lr(name, adamw_lr) if lr is None else lr
    if name == "muon_adamw":
        return create_hybrid_optimizer(model, muon_lr=lr, adamw_lr=adamw_lr, adamw_betas=ADAMW_BETAS,
                                       adamw_weight_decay=weight_decay, ns_method=ns_method, qk_clip=qk_clip)
    if name == "adamw":
        return TransformOptimizer(model.named_parameters(), presets.adamw, lr=lr, betas=ADAMW_BETAS,
                                  weight_decay=weight_decay, qk_clip=qk_clip)
    factory = _factory(name)
    if _elementwise(name):
        return TransformOptimizer(model.named_parameters(), factory, lr=lr, weight_decay=weight_decay,
                                  qk_clip=qk_clip)
    sig = inspect.signature(factory).parameters
    muon_kw = {"ns_method": ns_method} if "ns_method" in sig else {}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if "adamw_lr" in sig:  # a whole-model preset (like muon_adamw)
        extra = {"adamw_betas": ADAMW_BETAS, "adamw_weight_decay": weight_decay}
        kw = {k: v for k, v in extra.items() if k in sig}
        return TransformOptimizer(named, factory, lr=lr, adamw_lr=adamw_lr, qk_clip=qk_clip, **kw, **muon_kw)
    matrices = [(n, p) for n, p in named if p.ndim >= 2]
    rest = [(n, p) for n, p in named if p.ndim < 2]
    check_muon_reached(f"--optimizer {name}", routes(named, lambda n, p: "muon" if p.ndim >= 2 else "adamw"),
                       allow=False)
    groups = [dict(params=matrices, tx=factory, lr=lr, **muon_kw)]
    if rest:
        groups.append(dict(params=rest, tx=presets.adamw, lr=adamw_lr, betas=ADAMW_BETAS, weight_decay=weight_decay))
    return TransformOptimizer(groups, factory, qk_clip=qk_clip)


def describe(opt: torch.optim.Optimizer) -> list[dict]:
    """Per param group: transform name, lr, number of tensors and of parameters."""
    out = []
    for gi, g in enumerate(opt.param_groups):
        factory = opt.records[gi].factory if hasattr(opt, "records") else None
        out.append({
            "tx": getattr(factory, "__name__", "?"),
            "lr": g["lr"],
            "tensors": len(g["params"]),
            "params": int(sum(p.numel() for p in g["params"])),
        })
    return out
