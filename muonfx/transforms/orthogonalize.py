"""Newton-Schulz orthogonalisation of matrix leaves (the heart of Muon)."""

from __future__ import annotations

from typing import Any

import torch

from .. import seam
from .._compat.dtensor import unstack_like
from ..core import Dims, EmptyState, GradientTransformation, LeafwiseTransformation, build, leaves
from ..hyperparams import VALUES_ARG, Slot, check, check_float_dtype
from ..linalg import CoefficientSpec, NewtonSchulz, resolve
from ..linalg.newton_schulz import METHODS
from ..linalg.precision import device_ns_dtype, pinned_ns_dtype
from ..linalg.settings import EXTRA_ARG
from ._matrix import as_stacks, from_stacks, leaf_views


class _PerBatch:
    """The matrix function for updates on several devices or of several dtypes: each
    batch in its own compute dtype (float64 stays float64; else ``pinned`` or the
    batch's device's own)."""

    def __init__(self, ns: NewtonSchulz, pinned: torch.dtype | None) -> None:
        self.ns, self.pinned = ns, pinned

    def compute_dtype(self, batch: torch.Tensor) -> torch.dtype:
        if batch.dtype == torch.float64:
            return torch.float64
        return self.pinned or device_ns_dtype(batch.device)

    def _at(self, g: torch.Tensor) -> NewtonSchulz:
        ns = self.ns
        return NewtonSchulz(ns.schedule, ns.eps, self.compute_dtype(g), ns.method, ns.restart, ns.accuracy, ns.triton)

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        return self._at(g)(g)

    def polar(self, g: torch.Tensor) -> torch.Tensor:
        return self._at(g).polar(g)

    def batch_limit(self, stack: torch.Tensor) -> int | None:
        return self._at(stack).batch_limit(stack)


class _Polar:
    """A matrix function's polar factors left in its compute dtype (``fn.polar``)."""

    def __init__(self, fn: "NewtonSchulz | _PerBatch") -> None:
        self.fn, self.compute_dtype, self.batch_limit = fn, fn.compute_dtype, fn.batch_limit

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        return self.fn.polar(g)


class NSRule:
    """What :func:`newton_schulz` computes with, fixed when it is built: the schedule, the
    compute dtype asked for (or the process's pin read then), the method. The transform
    and the plan's lowered Muon step (:mod:`muonfx.optim.step.fused_muon`) both take
    their matrix function from :meth:`matrix_fn`, so they run the same code."""

    def __init__(self, steps: int = 5, coefficients: CoefficientSpec = "keller", dtype: torch.dtype | None = None,
                 safety: float | None = None, method: str = "standard") -> None:
        check_float_dtype("dtype", dtype)
        self.schedule = resolve(coefficients, steps, safety)
        if method not in METHODS:
            raise ValueError(f"newton_schulz: unknown method {method!r}; use 'auto', 'standard', 'gram' or 'spectral'")
        self.dtype, self.method = dtype, method
        # a process-wide override (set_default_ns_dtype, MUONFX_NS_DTYPE) is read now, once:
        # the transform computes the same thing at every step whatever the setting later says
        self.built_pin = pinned_ns_dtype() if dtype is None else None

    def matrix_fn(self, gs: list[torch.Tensor], eps: float, settings: Any = None,
                  polar: bool = False) -> Any:
        """The matrix function for the leaves ``gs`` of one update (``settings``: the
        step's :class:`muonfx.linalg.MatrixSettings`, or None); with ``polar`` its results
        stay in the compute dtype (:meth:`muonfx.linalg.NewtonSchulz.polar`)."""
        dtype = self.dtype
        pinned = self.built_pin if settings is None or dtype is not None else settings.ns_dtype
        # no dtype asked for: the device's default, which promises bf16's accuracy (what
        # torch.optim.Muon computes), so "auto" (asked for) may take the Gram form in float32 too
        accuracy = "bf16" if dtype is None and pinned is None else "dtype"
        one = dtype
        if one is None and gs and len({(g.device, g.dtype) for g in gs}) == 1:
            # float64 stays float64; else the pinned dtype or the device's own (a fact of
            # the machine), once per update rather than per batch
            one = torch.float64 if gs[0].dtype == torch.float64 else pinned or device_ns_dtype(gs[0].device)
        run: Any = NewtonSchulz(self.schedule, eps, one, self.method, accuracy=accuracy,
                                triton=None if settings is None else settings.triton)
        if one is None:  # leaves on several devices or of several dtypes: per batch
            run = _PerBatch(run, pinned)
        return _Polar(run) if polar else run


def newton_schulz(
    steps: int = 5,
    coefficients: CoefficientSpec = "keller",
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    safety: float | None = None,
    method: str = "standard",
    *,
    dims: Dims = None,
) -> GradientTransformation:
    """Replace each matrix by an approximate polar factor (``U V^T`` of its SVD).

    Formula, per matrix ``G`` (transposed to the wide orientation when it has more
    rows than columns)::

        X <- G / max(||G||_F * safety, eps)
        for (a, b, c) in schedule:   A <- X X^T;  X <- a X + (b A + c A A) X

    Args:
        steps: number of iterations (torch.optim.Muon: 5).
        coefficients: a preset name (``"keller"``, ``"you"``, ``"polar_express"``,
            ``"cubic"``), one ``(a, b, c)`` triple, or a sequence of per-step triples
            (a short sequence repeats its last triple).
        eps: floor of the normaliser (torch.optim.Muon: 1e-7); a number, or a
            :class:`muonfx.hyperparams.Slot` read at each update.
        dtype: compute dtype; ``None`` means the device's default
            (:func:`muonfx.linalg.ns_dtype_for`): bfloat16 on CUDA and on CPUs with
            native bf16 matmul, float32 elsewhere, float64 for float64 input;
            overridable process-wide with :func:`muonfx.linalg.set_default_ns_dtype`
            or ``MUONFX_NS_DTYPE``, read once when the transform is built (later changes
            apply to transforms built later). The output keeps the update's dtype.
        safety: normalisation safety factor; ``None`` uses the preset's (1.02 for
            polar_express, else 1).
        method: ``"standard"`` (default), ``"gram"``, ``"spectral"`` or ``"auto"``.
            ``"standard"`` is torch.optim.Muon's iteration: in bf16 on the CPU its
            result bit for bit (the same fused products), eagerly and compiled.
            ``"gram"`` iterates on the small ``m x m`` Gram matrix; ``"spectral"``
            evaluates the same function on the Gram matrix's eigendecomposition (each
            eigenvalue goes through the schedule's polynomials, then one product
            applies the result). ``"auto"`` (:func:`muonfx.linalg.auto_method`) takes
            the fastest of them that keeps the accuracy of the precision it runs in:

            * bf16/fp16 (given or the device's default): the Gram form on rectangular
              matrices with ``n > 1.5 m`` (restarting every 3 steps). Its distance to
              the exact iteration is 0.8-2.7x standard bf16's with keller, up to 4.2x
              with polar_express (16 x 48 to 768 x 3072), below the 5-step schedule's
              own distance to the exact polar factor (0.09-0.45); polar_express on
              small ill-conditioned matrices can diverge (``benchmarks/newton_schulz.py
              --only gram``). It needs 70-93 % of the standard flops there.
            * float32 as the device's default (``dtype=None`` and no process-wide pin,
              on a CPU that emulates bf16): the spectral form on matrices whose
              smaller side is at least 320 (:data:`muonfx.linalg.SPECTRAL_MIN_DIM`;
              up to 2x faster than the iterations there, CPU only), the Gram form on
              smaller rectangular ones with ``n > 1.2 m`` (no restarts). The default
              promises bf16's accuracy, what torch.optim.Muon computes; both are
              within ~1e-3 of the exact iteration on matrices of that size, 20-100x
              closer than bf16 (``docs/performance.md``).
            * float32 given (``dtype=torch.float32``, ``set_default_ns_dtype`` or
              ``MUONFX_NS_DTYPE``) and float64: always standard; there the Gram form's
              error (~1e-4..1e-3) would be far above the dtype's own (~1e-6), and it
              amplifies small input perturbations more (FSDP2 reduction-order noise
              grows from ~7e-7 to ~5e-6 over 10 steps).

            See :func:`muonfx.linalg.newton_schulz_batched` and
            :func:`muonfx.linalg.auto_method`.
        dims: per-leaf matrix views (:class:`muonfx.MatrixView`) overriding the default
            one below: a mapping dotted key -> view, or a callable ``(key, tensor) ->
            view | None`` (optax's ``muon_weight_dimension_numbers``). Give
            :func:`scale_by_shape` the same ``dims`` (``muon(dims=...)`` does).

    A matrix whose float32 (or bfloat16) norm overflows (entries of ~1e19 and more) is
    scaled by ``2**-100`` before it is normalised, so it gets the update of the same
    matrix at a sane scale instead of zero (no device sync; nothing changes where the
    norm is finite).

    Leaves: 2-D are matrices, 3-D are batches of matrices (MoE experts), 4-D+ are
    viewed as ``[out, in*kh*kw]`` (:func:`muonfx.core.default_view`), unless ``dims``
    says otherwise. 0-D/1-D leaves raise ``ValueError`` naming the key;
    route them with :func:`mask_by_ndim` or :func:`partition`. Same-shape matrices are
    orthogonalised in batches (bounded in bytes) through :func:`muonfx.seam.map_matrices`.

    The extra argument ``matrix_settings`` of a call (a
    :class:`muonfx.linalg.MatrixSettings`, which an optimizer's step passes) gives the
    default dtype, the batch budgets and the Triton switch of this call; without it the
    process defaults serve (the dtype read when the transform was built).

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.randn(8, 32)}, [])
        >>> tx = mfx.newton_schulz()
        >>> o, _ = tx.update(g, tx.init(g))
        >>> s = torch.linalg.svdvals(o["w"])
        >>> bool(((s > 0.6) & (s < 1.2)).all())
        True
    """
    eps = check("eps", eps)
    late = type(eps) is Slot  # a number read at each update
    rule = NSRule(steps, coefficients, dtype, safety, method)

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        settings = extra_args.get(EXTRA_ARG)
        keys, gs = leaves(updates)
        run = rule.matrix_fn(gs, extra_args[VALUES_ARG][eps.key] if late else eps, settings)
        views = None if dims is None else leaf_views(dims, keys, gs, "newton_schulz")
        outs = seam.map_matrices(run, as_stacks(keys, gs, "newton_schulz", views), settings)
        return build(keys, unstack_like(outs, gs) if views is None else from_stacks(outs, gs, views)), state

    return LeafwiseTransformation(init_fn, update_fn)
