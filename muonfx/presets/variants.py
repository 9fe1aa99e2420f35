"""Variants: published Muon variants, each a short chain of public transforms.

=============================  ===============================================================
:func:`moonlight`              Muon with AdamW's lr and weight decay (Liu et al., 2025)
:func:`normuon`                Muon + per-row second-moment normalisation (Li et al., 2025)
:func:`muon_cautious`          Muon with cautious weight decay (Chen et al., 2025)
:func:`muon_with_momentum_warmup`  Muon with momentum 0.85 -> 0.95 over 300 steps (nanochat)
:func:`split_newton_schulz`    Newton-Schulz per block (q, k, v or per head)
:func:`muon_per_head`          Muon orthogonalising fused QKV weights per block
:func:`optax_muon`             optax ``contrib.muon``: bias-corrected Nesterov, NAdamW for the rest
:func:`modded_nanogpt_normuon` modded-nanogpt's NorMuon: wide matrices by column, lr^2 decay
=============================  ===============================================================

Their pieces live with their kind: :func:`muonfx.cautious_decay` in
:mod:`muonfx.transforms.decay`, :func:`muonfx.momentum_warmup` in :mod:`muonfx.schedules`,
:func:`muonfx.blockwise` (a matrix transform on blocks of each matrix) in
:mod:`muonfx.combine`.

MoE expert stacks need no recipe: :func:`muonfx.muon` treats a 3-D leaf ``[E, m, n]``
as ``E`` independent ``m x n`` matrices (each expert orthogonalised and shape-scaled on
its own, by ``(m, n)``), exactly as if the experts were ``E`` separate parameters::

    >>> import torch, muonfx as mfx
    >>> from tensordict import TensorDict
    >>> g = torch.randn(4, 16, 8)                       # 4 experts, 16 x 8 each
    >>> stacked = TensorDict({"experts": g}, [])
    >>> separate = TensorDict({f"e{i}": g[i] for i in range(4)}, [])
    >>> tx = mfx.muon(lr=0.02)
    >>> out, _ = tx.update(stacked, tx.init(stacked), stacked)
    >>> ref, _ = tx.update(separate, tx.init(separate), separate)
    >>> torch.allclose(out["experts"], torch.stack([ref[f"e{i}"] for i in range(4)]), atol=1e-6)
    True
"""

from __future__ import annotations

import re
from typing import Any, Callable, Hashable

import torch

from ..hyperparams import Slot, late_bound
from ..combine import SplitSizes, blockwise, chain, named_chain, partition
from ..core import GradientTransformation
from ..schedules import momentum_warmup
from ..transforms import (bias_corrected_momentum, cautious_decay, decoupled_decay, newton_schulz, row_normalize,
                         scale_by_adam, scale_by_learning_rate)
from ..wrappers import inject_hyperparams
from ._late import decay_times_lr, warming_up
from .options import MuonOptions, insert_step, takes_muon_options
from .standard import adamw, default_muon_labels, muon

__all__ = ["moonlight", "normuon", "muon_cautious", "muon_with_momentum_warmup", "split_newton_schulz",
           "muon_per_head", "optax_muon", "modded_nanogpt_normuon"]


# ---------------------------------------------------------------------------
# Moonlight
# ---------------------------------------------------------------------------


@late_bound("lr", "momentum", "weight_decay")
@takes_muon_options(defaults={"lr": 1e-3, "weight_decay": 0.1, "adjust_lr": "match_rms_adamw"},
                    changed={"eps": "eps is the Newton-Schulz floor here (torch.optim.Muon's eps, default 1e-7); "
                                    "it was Adam's epsilon in earlier muonfx versions, which is adamw_eps now "
                                    "(default 1e-8). Pass adamw_eps= for Adam's epsilon."})
def moonlight(
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    labels: Callable[[str, torch.Tensor], Hashable] | None = None,
    adamw_eps_before_bias_correction: bool = False,
    **muon_options: Any,
) -> GradientTransformation:
    """Moonlight's Muon (Liu et al., 2025, "Muon is Scalable for LLM Training").

    One lr and one weight decay for the whole model::

        partition({"muon":  muon(lr, ..., weight_decay, adjust_lr="match_rms_adamw"),
                   "adamw": adamw(lr, betas, adamw_eps, weight_decay)}, labels)

    so a matrix ``A x B`` moves by ``-lr * (0.2 * sqrt(max(A, B)) * NS(M) + wd * W)``.
    A full-rank orthogonal ``A x B`` matrix has RMS ``1 / sqrt(max(A, B))``: the Muon
    update's RMS is ``0.2 * lr``, in the range of AdamW's, so AdamW's lr and weight decay
    carry over. Every option of :func:`~muonfx.muon` (:class:`~muonfx.MuonOptions`) is
    taken, ``eps`` being the Newton-Schulz floor as there; ``betas`` and ``adamw_eps``
    (Adam's epsilon) are the AdamW part's. ``labels`` defaults to
    :func:`~muonfx.default_muon_labels` (embeddings, head, biases and norms get AdamW).
    Defaults follow Moonlight's released example (lr 1e-3, wd 0.1, momentum 0.95
    Nesterov, 5 NS steps, AdamW betas (0.9, 0.95), Adam epsilon 1e-8). Moonlight keeps
    momentum in the sum form ``M <- mu M + G``; muonfx's EMA form differs by a positive
    factor only, which Newton-Schulz normalises away. Moonlight's AdamW adds ``eps`` to
    the uncorrected ``sqrt(v)``; ``adamw_eps_before_bias_correction=True`` does the same
    (:func:`~muonfx.scale_by_adam`'s option), the default is torch's AdamW.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.moonlight(lr=3e-4, weight_decay=0.1)
    """
    opts = MuonOptions(**muon_options)
    if adamw_eps_before_bias_correction:
        b1, b2 = betas
        aux = named_chain(
            ("adam", scale_by_adam(b1, b2, adamw_eps, eps_before_bias_correction=True)),
            ("weight_decay", decoupled_decay(opts.weight_decay)),
            ("lr", scale_by_learning_rate(opts.lr)),
        )
    else:
        aux = adamw(lr=opts.lr, betas=betas, eps=adamw_eps, weight_decay=opts.weight_decay)
    return partition(
        {
            "muon": muon(**muon_options),
            "adamw": aux,
        },
        labels or default_muon_labels,
    )


# ---------------------------------------------------------------------------
# NorMuon
# ---------------------------------------------------------------------------


@late_bound("lr", "momentum", "weight_decay", "eps", "beta2", "row_eps")
@takes_muon_options(changed={"eps": "eps is the Newton-Schulz floor here (torch.optim.Muon's eps, default "
                                    "1e-7); it was the row normaliser's epsilon in earlier muonfx versions, which "
                                    "is row_eps now (default 1e-10). Pass row_eps= for that."})
def normuon(*, beta2: float = 0.95, row_eps: float = 1e-10, **muon_options: Any) -> GradientTransformation:
    """NorMuon (Li et al., 2025, "NorMuon: Making Muon more efficient and scalable").

    :func:`~muonfx.muon`'s options (:class:`~muonfx.MuonOptions`) and named chain, with
    ``"row_normalize"`` after the orthogonalisation::

        "momentum"       momentum(momentum, nesterov)
        "orthogonalize"  newton_schulz(ns_steps, ns_coefficients, eps, ns_dtype)
        "row_normalize"  row_normalize(beta2, row_eps, mu_dtype)  per-row RMS equalised, ||.||_F kept
        "scale_by_shape" scale_by_shape(adjust_lr)
        "weight_decay"   decoupled_decay(weight_decay)
        "lr"             scale_by_learning_rate(lr)

    ``eps`` is the Newton-Schulz floor (as in ``muon``); ``row_eps`` is the
    row normaliser's; ``mu_dtype`` is the dtype of the momentum buffer and of the row
    statistics. Defaults follow the authors' reference ``NorMuon`` optimizer
    (lr 0.02, momentum and beta2 0.95, Nesterov, row epsilon 1e-10, no weight decay,
    Keller's shape scale). Muon's orthogonalised update can leave rows (neurons) with
    very different magnitudes; NorMuon divides each row by the EMA of its RMS and
    rescales to the orthogonalised update's Frobenius norm.
    ``adjust_lr="match_rms_adamw"`` gives the paper's ``0.2``-RMS variant with
    AdamW-like learning rates. ``lr``, ``momentum``, ``weight_decay``, ``eps``, ``beta2``
    and ``row_eps`` are late-bound (:func:`muonfx.hyperparams.late_bound`): a new value
    of any of them builds nothing, nor compiles again under ``opt.compile()`` (but ``eps``,
    which Newton-Schulz's operator takes as a constant, as in ``muon``).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.normuon(lr=0.02, beta2=0.95)
        >>> list(tx.init(TensorDict({"w": torch.zeros(4, 8)}, [])))
        ['momentum', 'orthogonalize', 'row_normalize', 'scale_by_shape', 'weight_decay', 'lr']
    """
    opts = MuonOptions(**muon_options)
    rows = row_normalize(beta2, row_eps, mu_dtype=opts.mu_dtype, dims=opts.dims)
    return named_chain(*insert_step(opts.steps(), "orthogonalize", "row_normalize", rows).items())


# ---------------------------------------------------------------------------
# cautious weight decay (the transform itself: muonfx.transforms.decay)
# ---------------------------------------------------------------------------


@late_bound("lr", "momentum", "weight_decay", "eps")
@takes_muon_options(defaults={"weight_decay": 0.01})
def muon_cautious(**muon_options: Any) -> GradientTransformation:
    """Muon with Cautious Weight Decay (Chen et al., 2025).

    :func:`~muonfx.muon`'s options (:class:`~muonfx.MuonOptions`, ``weight_decay``
    defaulting to 0.01) and named chain, with ``"weight_decay"`` =
    :func:`cautious_decay`::

        W <- W - lr * (s(A, B) * O + wd * W * [sign(O) == sign(W)]),   O = NS(M)

    The paper reports CWD needs no retuning of ``weight_decay`` relative to decoupled
    decay; the default 0.01 is a mild Muon setting.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.muon_cautious(lr=0.02, weight_decay=0.01)
    """
    opts = MuonOptions(**muon_options)
    steps = opts.steps()
    steps["weight_decay"] = cautious_decay(opts.weight_decay)
    return named_chain(*steps.items())


# ---------------------------------------------------------------------------
# momentum warm-up
# ---------------------------------------------------------------------------


@late_bound("lr", "weight_decay", "eps", "momentum_start", "momentum_end", "warmup_steps")
@takes_muon_options(exclude=("momentum",))
def muon_with_momentum_warmup(
    *,
    momentum_start: float = 0.85,
    momentum_end: float = 0.95,
    warmup_steps: int = 300,
    **muon_options: Any,
) -> GradientTransformation:
    """Muon whose momentum warms up (nanochat / modded-nanogpt).

    ``inject_hyperparams(muon)(momentum=momentum_warmup(start, end, steps), **muon_options)``,
    the other options given to ``muon`` as they are (schedules injected too): the state is
    an :class:`~muonfx.InjectHyperparamsState`; ``state.hyperparams["momentum"]`` is the
    value used by the last update (``momentum_start`` right after ``init``).
    ``muon_options`` are :func:`~muonfx.muon`'s other options (:class:`~muonfx.MuonOptions`).
    ``lr``, ``weight_decay``, ``eps`` and the warm-up's three numbers are late-bound
    (:func:`muonfx.hyperparams.late_bound`): built with slots for them (by
    :class:`~muonfx.TransformOptimizer`), the warm-up is the schedule of their values at
    each update, and ``state.hyperparams`` records none (``{}``).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> tx = mfx.muon_with_momentum_warmup(lr=0.02)
        >>> tx.init(TensorDict({"w": torch.zeros(4, 4)}, [])).hyperparams["momentum"]
        0.85
    """
    warm = (momentum_start, momentum_end, warmup_steps)
    given = tuple(n for n, v in muon_options.items() if not callable(v))  # to muon as they are
    if Slot not in map(type, warm):
        return inject_hyperparams(muon, given)(momentum=momentum_warmup(*warm), **muon_options)
    return warming_up(inject_hyperparams(muon, given)(momentum=0.0, **muon_options), *warm)


# ---------------------------------------------------------------------------
# blocks of a matrix (fused QKV, per head)
# ---------------------------------------------------------------------------


def split_newton_schulz(split_sizes: SplitSizes, dim: int = 0, **ns_kwargs) -> GradientTransformation:
    """Newton-Schulz on blocks of each matrix: ``blockwise(newton_schulz(**ns_kwargs), split_sizes, dim)``.

    For a fused QKV weight ``[3d, d]``, ``split_sizes=d`` orthogonalises q, k and v
    separately; ``split_sizes=head_dim`` orthogonalises every head. Each block goes
    to :func:`muonfx.seam.map_matrices` as its own ``[1, m_i, n]`` stack, so all
    same-shape blocks (of all layers) run as one batch. ``ns_kwargs`` are
    :func:`~muonfx.newton_schulz`'s (``steps``, ``coefficients``, ``eps``, ...).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"qkv": torch.randn(24, 8)}, [])
        >>> out, _ = mfx.split_newton_schulz(8).update(g, mfx.EmptyState())
        >>> [round(torch.linalg.svdvals(b).max().item(), 1) < 1.2 for b in out["qkv"].split(8)]
        [True, True, True]
    """
    return blockwise(newton_schulz(**ns_kwargs), split_sizes, dim)


@late_bound("lr", "momentum", "weight_decay")
@takes_muon_options()
def muon_per_head(
    split_sizes: SplitSizes,
    qkv_pattern: str = r"qkv|c_attn",
    dim: int = 0,
    **muon_options: Any,
) -> GradientTransformation:
    """Muon that orthogonalises fused attention weights block by block (q/k/v or per head).

    :func:`~muonfx.muon`'s options (:class:`~muonfx.MuonOptions`) and named chain, with
    ``"orthogonalize"`` and ``"scale_by_shape"`` applied per block::

        "momentum"       momentum(momentum, nesterov)
        "orthogonalize"  partition({
                             "blocks": blockwise(chain(newton_schulz, scale_by_shape(adjust_lr)),
                                                 split_sizes, dim),
                             "whole":  chain(newton_schulz, scale_by_shape(adjust_lr))},
                           labels: "blocks" where re.search(qkv_pattern, dotted key))
        "weight_decay"   decoupled_decay(weight_decay)
        "lr"             scale_by_learning_rate(lr)

    Keys matching ``qkv_pattern`` (GPT-2's ``c_attn``, ``qkv``) are split along
    ``dim`` (``torch.split`` sizes) and each block is orthogonalised *and shape-scaled*
    as its own matrix, so a fused ``[3d, d]`` QKV weight moves exactly like separate
    ``q``, ``k``, ``v`` weights under :func:`~muonfx.muon`. Other matrices get plain
    Muon. Give it matrices only, as ``muon``.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.muon_per_head(split_sizes=64, qkv_pattern=r"attn\\.c_attn")
    """
    pattern = re.compile(qkv_pattern)
    steps = MuonOptions(**muon_options).steps()
    ns_and_scale = chain(steps.pop("orthogonalize"), steps.pop("scale_by_shape"))
    per_block = partition({"blocks": blockwise(ns_and_scale, split_sizes, dim), "whole": ns_and_scale},
                          lambda key, t: "blocks" if pattern.search(key) else "whole")
    return named_chain(*insert_step(steps, "momentum", "orthogonalize", per_block).items())


# ---------------------------------------------------------------------------
# other libraries' formulas, by name (see docs/migration.md)
# ---------------------------------------------------------------------------


def optax_labels(key: str, tensor: torch.Tensor) -> str:
    """optax ``contrib.muon``'s default split: ``"muon"`` for 2-D leaves, ``"adam"`` otherwise."""
    return "muon" if tensor.ndim == 2 else "adam"


@late_bound("lr", "weight_decay")
@takes_muon_options(defaults={"eps": 1e-8})
def optax_muon(
    *,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_weight_decay: float = 0.0,
    labels: Callable[[str, torch.Tensor], Hashable] | None = None,
    **muon_options: Any,
) -> GradientTransformation:
    """optax ``contrib.muon``'s arithmetic (its defaults; ``momentum`` is optax's ``beta``).

    ``partition({"muon": ..., "adam": ...}, labels)``, by default 2-D leaves to Muon and
    every other leaf (biases, norms, but also 3-D and 4-D ones) to Adam, as optax does::

        "muon":  bias_corrected_momentum(momentum, nesterov) -> newton_schulz(ns_steps, ns_coefficients, eps)
                 -> scale_by_shape(adjust_lr) -> decoupled_decay(weight_decay) -> scale_by_learning_rate(lr)
        "adam":  scale_by_adam(adam_b1, adam_b2, eps, nesterov=nesterov)    (NAdam when nesterov)
                 -> decoupled_decay(adam_weight_decay) -> scale_by_learning_rate(lr)

    What differs from :func:`~muonfx.muon`: the momentum is bias-corrected, and with
    Nesterov (optax's default) its two terms are corrected separately,
    ``beta * m / (1 - beta^(t+1)) + (1 - beta) * g / (1 - beta^t)``, which changes Muon's
    steps by 8-60 % from the second step on; the Adam part is NAdam then; one ``eps``
    (default optax's 1e-8) is both the Newton-Schulz floor and Adam's epsilon; the
    Adam part has the same ``lr`` and no weight decay by default. optax's
    ``consistent_rms=0.2`` is ``adjust_lr="match_rms_adamw"``. optax normalises by
    ``||X|| + eps`` where muonfx uses ``max(||X||, eps)`` (a relative ``eps / ||X||``).

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.optax_muon(lr=0.02)               # optax.contrib.muon(learning_rate=0.02)
    """
    opts = MuonOptions(**muon_options)
    steps = opts.steps()
    steps["momentum"] = bias_corrected_momentum(opts.momentum, opts.nesterov, opts.mu_dtype)
    adam = named_chain(
        ("adam", scale_by_adam(adam_b1, adam_b2, opts.eps, opts.mu_dtype, nesterov=opts.nesterov)),
        ("weight_decay", decoupled_decay(adam_weight_decay)),
        ("lr", scale_by_learning_rate(opts.lr)),
    )
    return partition({"muon": named_chain(*steps.items()), "adam": adam}, labels or optax_labels)


@late_bound("lr", "momentum", "weight_decay", "eps", "beta2", "row_eps")
@takes_muon_options(defaults={"ns_coefficients": "polar_express"})
def modded_nanogpt_normuon(*, beta2: float = 0.95, row_eps: float = 1e-10, **muon_options: Any) -> GradientTransformation:
    """modded-nanogpt's ``NorMuon`` for its matrices (the speedrun's arithmetic).

    :func:`~muonfx.muon`'s options (Polar Express coefficients by default), chain::

        "momentum"       momentum(momentum, nesterov)
        "orthogonalize"  newton_schulz(ns_steps, ns_coefficients, eps, ns_dtype)
        "row_normalize"  row_normalize(beta2, row_eps, axis="larger")   rows, or columns of wide matrices
        "weight_decay"   cautious_decay(weight_decay * lr)
        "scale_by_shape" scale_by_shape(adjust_lr)
        "lr"             scale_by_learning_rate(lr)

    so, with ``s = sqrt(max(1, A/B))`` and ``V`` the normalised update::

        W <- W - lr * s * V - lr^2 * s * weight_decay * W * [sign(V) == sign(W)]

    Two things differ from :func:`normuon`: the second moment is kept per column for
    wide matrices (``rows < cols``), per row otherwise; and the weight decay is
    cautious and scaled by ``lr^2`` times the shape factor (modded-nanogpt multiplies
    ``weight_decay * lr`` by its effective lr ``lr * s``). ``lr`` must be a number
    here, not a schedule (the decay depends on it); drive it with a scheduler on
    :class:`~muonfx.TransformOptimizer`. ``lr``, ``momentum``, ``weight_decay``, ``eps``,
    ``beta2`` and ``row_eps`` are late-bound (:func:`muonfx.hyperparams.late_bound`): the
    decay's ``weight_decay * lr`` is taken at each update, and a new value of any of them
    builds nothing, nor compiles again under ``opt.compile()`` (but ``eps``, as in
    :func:`normuon`). The reference divides by ``sqrt(max(v, 1e-10))``, this by
    ``sqrt(v) + row_eps``; both equal where ``v`` is not tiny.

    Example::

        >>> import muonfx as mfx
        >>> tx = mfx.modded_nanogpt_normuon(lr=0.02, weight_decay=0.025)
    """
    opts = MuonOptions(**muon_options)
    if callable(opts.lr):
        raise ValueError("modded_nanogpt_normuon: lr must be a number (the weight decay is scaled by lr^2); "
                         "drive it with an lr scheduler on TransformOptimizer instead of a schedule")
    steps = insert_step(opts.steps(), "orthogonalize", "row_normalize", row_normalize(beta2, row_eps, axis="larger",
                                                                                    mu_dtype=opts.mu_dtype,
                                                                                    dims=opts.dims))
    order = ("momentum", "orthogonalize", "row_normalize", "weight_decay", "scale_by_shape", "lr")
    steps["weight_decay"] = decay_times_lr(opts.weight_decay, opts.lr)
    return named_chain(*((name, steps[name]) for name in order))
