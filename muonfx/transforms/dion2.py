"""Dion2: orthogonalise a selected fraction of each matrix's rows (Ahn et al., 2025,
arXiv 2512.16928)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from tensordict import TensorDict

from .. import seam
from .._compat.dtensor import unstack_like
from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..hyperparams import check, check_float_dtype
from ..linalg import CoefficientSpec, NewtonSchulz, resolve
from ..linalg.precision import pinned_ns_dtype
from ..linalg.settings import EXTRA_ARG
from ..ops import foreach
from ._matrix import as_stacks
from .cautious import sums_over
from .orthogonalize import _PerBatch

#: the Newton-Schulz coefficients of microsoft/dion's ``zeropower_via_newtonschulz5``
#: (Polar Express's five steps, applied without a safety factor)
DION_COEFFICIENTS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                     (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


class ScaleByDion2State(NamedTuple):
    """State of :func:`scale_by_dion2`.

    Attributes:
        mu: the momentum, per matrix: the sum of the gradients, its selected rows
            multiplied by ``ef_decay`` after each step (error feedback).
    """

    mu: TensorDict


class _TopRows:
    """The matrix function: keep the ``ceil(fraction * rows)`` rows of largest L1 norm of
    each matrix (the others zero), orthogonalise. Zero rows stay exactly zero through
    Newton-Schulz, so this is the selected submatrix's polar factor, scattered back."""

    def __init__(self, fraction: float, ns) -> None:
        self.fraction, self.ns = fraction, ns

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        k = max(1, math.ceil(self.fraction * s.shape[-2]))
        idx = torch.topk(s.abs().sum(-1), k, dim=-1, sorted=False).indices
        keep = torch.zeros(s.shape[:-1], dtype=torch.bool, device=s.device).scatter_(-1, idx, True)
        return self.ns(torch.where(keep.unsqueeze(-1), s, torch.zeros((), dtype=s.dtype, device=s.device)))


def _row_sums(outs: list) -> list:
    """Per matrix row, the sum of ``|out|`` (the matrix view's rows: a conv weight's are
    its output channels), through the seam (rows split over shards are reduced)."""
    return sums_over([o.abs() for o in outs], lambda o: (-1,) if o.ndim <= 3 else tuple(range(1, o.ndim)))


def scale_by_dion2(fraction: float = 0.25, ef_decay: float = 0.95, ns_steps: int = 5,
                   ns_coefficients: CoefficientSpec = DION_COEFFICIENTS, eps: float = 1e-7,
                   ns_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Dion2's direction (microsoft/dion's ``dion2.py``, its shard-independent selection).

    Formula, per matrix (``g`` the incoming update, ``M`` the momentum at zero)::

        M <- M + g
        S = the ceil(fraction * rows) rows of M of largest L1 norm
        out = NS(M restricted to S), zero on the other rows
        M[S] <- ef_decay * M[S]

    Exactly ``ceil(fraction * rows)`` rows of each matrix's update are nonzero (a
    3-D stack: of each matrix of it). The selection and Newton-Schulz run as one matrix
    function through :mod:`muonfx.seam`, so under FSDP2, HSDP and tensor parallel each
    matrix is whole on its owner rank and the update is the one process's. Newton-Schulz
    runs on the matrix with its unselected rows zeroed (the same polar factor as the
    submatrix's: zero rows stay zero), with Dion's coefficients by default (see
    :func:`newton_schulz` for ``ns_*`` and ``eps``). Leafwise.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.randn(8, 16)}, [])
        >>> tx = mfx.scale_by_dion2(fraction=0.25)
        >>> out, state = tx.update(g, tx.init(g))
        >>> int((out["w"].abs().sum(-1) > 0).sum())      # ceil(0.25 * 8) rows
        2
    """
    fraction = float(fraction)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"scale_by_dion2: fraction must be in (0, 1], got {fraction!r}")
    ef_decay, eps = check("ef_decay", ef_decay), check("eps", eps)
    if not 0.0 <= ef_decay <= 1.0:
        raise ValueError(f"scale_by_dion2: ef_decay must be in [0, 1], got {ef_decay!r}")
    check_float_dtype("ns_dtype", ns_dtype)
    schedule = resolve(ns_coefficients, ns_steps, 1.0 if not isinstance(ns_coefficients, str) else None)
    pinned = pinned_ns_dtype() if ns_dtype is None else None

    def init_fn(params):
        keys, ps = leaves(params, "params")
        return ScaleByDion2State(zeros_like_leaves(keys, ps))

    def update_fn(updates, state, params=None, **extra_args):
        # the step plan's settings (default dtype, batch budget), as newton_schulz reads them
        settings = extra_args.get(EXTRA_ARG)
        pin = pinned if settings is None or ns_dtype is not None else settings.ns_dtype
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "dion2 state (mu)", like=gs)
        new_m = foreach("add", ms, gs)
        run = NewtonSchulz(schedule, eps, ns_dtype, "standard", accuracy="dtype",
                           triton=None if settings is None else settings.triton)
        if ns_dtype is None:
            run = _PerBatch(run, pin)
        outs = unstack_like(seam.map_matrices(_TopRows(fraction, run), as_stacks(keys, new_m, "scale_by_dion2"),
                                              settings), gs)
        if keys:  # error feedback on the rows the update took (found from its nonzero rows)
            new_m = [torch.where(t > 0, m * ef_decay, m) for m, t in zip(new_m, _row_sums(outs))]
        return build(keys, outs), ScaleByDion2State(build(keys, new_m))

    return LeafwiseTransformation(init_fn, update_fn)
