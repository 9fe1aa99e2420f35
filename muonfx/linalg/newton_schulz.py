"""Batched Newton-Schulz orthogonalisation (approximate polar factor).

For a batch ``G`` of shape ``[N, m, n]`` every matrix is processed independently:

    X <- G (transposed to the wide orientation if m > n), cast to the compute dtype
    X <- X / max(||X||_F * safety, eps)
    for (a, b, c) in schedule:
        A <- X X^T
        B <- b A + c A A
        X <- a X + B X

The result is cast back to ``G``'s dtype. Flops per iteration and matrix with
``m <= n``: ``4 m^2 n + 2 m^3``. In bf16/fp16 on CUDA with Triton installed, the
symmetric products (``X X^T``, ``b A + c A A``) compute only their upper-triangular tiles
(:mod:`muonfx.linalg.triton_ns`): about ``3 m^2 n + m^3``.
"""

from __future__ import annotations

import torch

from .coefficients import Schedule
from . import triton_ns
from .ns_rules import (ACCURACIES, CPU_PER_MATRIX_MIN, METHODS, SPECTRAL_MIN_DIM, auto_method, auto_takes_gram,
                       default_restart, gram_flops, gram_pays_off, spectral_pays_off, standard_flops)
from .precision import ns_dtype_for

__all__ = ["newton_schulz_batched", "default_compute_dtype", "gram_pays_off", "gram_flops", "standard_flops",
           "default_restart", "auto_takes_gram", "auto_method", "spectral_pays_off", "ACCURACIES", "METHODS",
           "SPECTRAL_MIN_DIM", "NewtonSchulz"]

def default_compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The compute dtype used for ``t`` when none is given: see :mod:`muonfx.linalg.precision`
    (bfloat16 on CUDA and on CPUs with native bf16 matmul, float32 elsewhere, float64 for
    float64 input)."""
    return ns_dtype_for(t.device, t.dtype)


def _standard(x: "torch.Tensor | list[torch.Tensor]", steps) -> torch.Tensor:
    """The standard iteration on the normalised batch ``x``, or on the one tensor taken out
    of the list ``x``: a caller that hands its batch over in a list keeps no reference to
    it, so the iteration frees it with its first new iterate (eagerly, one batch fewer
    alive at the peak; not relying on how the interpreter passes a temporary argument,
    which changes once a PEP 523 frame hook has run in the process)."""
    x = x.pop() if isinstance(x, list) else x
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and (
            x.shape[0] == 1 or x.shape[-2] * x.shape[-1] >= CPU_PER_MATRIX_MIN):
        # on the CPU each large matrix's own 2-D products (torch.optim.Muon's mm and addmm),
        # and a batch of one: 1-5 % faster than the batched ones from 256 x 512 on (2-core
        # AMD EPYC, bf16; a batch of one through bmm/baddbmm copies its transposed
        # operands), torch's bits, and one matrix's work space at a time; written back into
        # the batch, which this function holds alone. Small matrices take the batched
        # products: one matrix at a time costs 1.4x at 128 x 256 and 31x at 32 x 32
        for i in range(x.shape[0]):
            xi = x[i]
            for a, b, c in steps:
                gram = xi @ xi.mT
                poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                xi = torch.addmm(xi, poly, xi, beta=a)
            if x.shape[0] == 1 and steps:
                return xi[None]  # a batch of one: its last iterate is the batch
            x[i].copy_(xi)
        return x
    for a, b, c in steps:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def _gram(x: "torch.Tensor | list[torch.Tensor]", steps, restart: int | None) -> torch.Tensor:
    """Iterate on the small Gram matrix ``R = X X^T`` (``m x m``, ``m <= n``).

    Every step is ``X <- p(R) X`` with ``p(R) = a I + b R + c R^2``, so after ``k``
    steps ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0``; all those polynomials
    commute, hence ``R_{k+1} = P R_k P``. Only the ``m x m`` products are iterated;
    ``X`` is touched twice per segment (``R_0`` and ``Q X_0``). ``restart`` re-forms
    ``X`` and ``R`` every that many steps (needed in low precision).
    """
    x = x.pop() if isinstance(x, list) else x  # as in _standard
    steps = list(steps)
    seg = len(steps) if not restart else restart
    for start in range(0, len(steps), seg):
        part = steps[start:start + seg]
        r = torch.bmm(x, x.mT)
        q = None
        for i, (a, b, c) in enumerate(part):
            p = torch.baddbmm(r, r, r, beta=b, alpha=c)
            p.diagonal(dim1=-2, dim2=-1).add_(a)
            q = p if q is None else torch.bmm(p, q)
            if i < len(part) - 1:
                r = torch.bmm(p, torch.bmm(r, p))
        x = torch.bmm(q, x)
    return x


def _spectral(x: "torch.Tensor | list[torch.Tensor]", steps) -> torch.Tensor:
    """The iteration's result computed from the eigendecomposition of ``R = X X^T``.

    Every step maps a singular value ``s`` of ``X`` to ``p(s^2) s`` with
    ``p(l) = a + b l + c l^2``, the singular vectors unchanged. So with
    ``R = V diag(l) V^T`` the K steps give ``X_K = V diag(h) V^T X`` where, per
    eigenvalue, ``h = p_1(l_1) ... p_K(l_K)`` and ``l_{k+1} = l_k p_k(l_k)^2``: the same
    function as the iteration, evaluated exactly on the spectrum (float32 eigenvectors
    of the squared matrix lose some accuracy on tiny singular values: within ~1e-3 of
    the exact iteration on matrices of 320 and more, ~1e-2 on a 48 x 128 matrix of
    condition 1e6, where bf16 is 0.1-1.7 away). The eigendecomposition runs in float32
    (float64 for float64 input). A matrix with a non-finite entry gives NaN, as the
    iterations do (LAPACK would refuse it).
    """
    x = x.pop() if isinstance(x, list) else x  # as in _standard
    r = torch.bmm(x, x.mT)
    finite = torch.isfinite(r).all(dim=-1).all(dim=-1)
    edtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    lam, v = torch.linalg.eigh(torch.where(finite[:, None, None], r, 0).to(edtype))
    del r
    lam = lam.clamp_min(0)  # rounding makes the smallest eigenvalues slightly negative
    h = torch.ones_like(lam)
    for a, b, c in steps:
        p = a + lam * (b + c * lam)
        h = h * p
        lam = lam * p * p
    h = torch.where(finite[:, None], h, float("nan"))
    q = torch.bmm(v * h.unsqueeze(-2), v.mT).to(x.dtype)
    return torch.bmm(q, x)


def newton_schulz_batched(
    g: torch.Tensor,
    schedule: Schedule,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "standard",
    restart: int | None = None,
    accuracy: str = "dtype",
) -> torch.Tensor:
    """Orthogonalise each matrix of ``g`` (``[N, m, n]``); returns a new tensor like ``g``.

    ``dtype``: the compute dtype; ``None`` means the device's default
    (:func:`muonfx.linalg.ns_dtype_for`: bfloat16 on CUDA and on CPUs with native bf16
    matmul, float32 elsewhere, float64 for float64 input).

    ``method``: ``"standard"`` (default: the iteration above, torch.optim.Muon's
    products, bit for bit its result in bf16 on the CPU), ``"gram"`` (iterate on the
    ``m x m`` Gram matrix, mathematically the same function), ``"spectral"`` (the same
    function evaluated on the eigendecomposition of the Gram matrix, see
    :func:`_spectral`; float32 or float64 eigenvectors whatever the compute dtype), or
    ``"auto"`` (:func:`auto_method`: in 16-bit dtypes the Gram form where it needs fewer
    flops counting its restarts, see :func:`gram_pays_off`, i.e. rectangular matrices
    with ``n > 1.5 m``. Its rounding error in bf16 is 0.8-4.2x the standard form's on
    the shapes measured, and with ``polar_express`` on small ill-conditioned matrices it
    can diverge: ``benchmarks/newton_schulz.py --only gram``. In float32 and float64 the
    standard form, unless ``accuracy="bf16"``: there the Gram and spectral forms' errors
    (up to ~1e-3 relative to the exact iteration; standard float32 ~1e-5) are far above
    the dtype's own).

    ``accuracy``: the accuracy ``"auto"`` must keep. ``"dtype"`` (default): that of the
    compute dtype, as above. ``"bf16"``: bfloat16's, what ``torch.optim.Muon`` computes:
    in float32 ``"auto"`` then takes the spectral form on CPU matrices of at least
    :data:`SPECTRAL_MIN_DIM` (up to 2x faster than the iterations there) and the Gram
    form where it pays off on smaller ones (without restarts); both stay 20-100x closer
    to the exact iteration than bf16 on ill-conditioned and low-rank inputs
    (``docs/performance.md``). The :func:`muonfx.newton_schulz` transform asks for it
    when its dtype is the device's default (none given, none pinned): float32 on CPUs
    that emulate bf16, where it is the fastest accurate-enough configuration. See
    :func:`auto_method`. ``restart`` (Gram
    only) re-forms ``X`` every that many steps; ``None`` means
    :func:`default_restart`: never in float32/float64 and every 3 steps in 16-bit
    dtypes. The whole batch is one call: how many matrices a
    batch holds is decided by :mod:`muonfx.linalg.batching` (the seam plans the
    batches). ``g`` is never modified, even when it already has the compute dtype.
    """
    return NewtonSchulz(schedule, eps, dtype, method, restart, accuracy)(g)


class NewtonSchulz:
    """:func:`newton_schulz_batched` with its settings bound: a matrix function of
    :mod:`muonfx.seam` (``NewtonSchulz(schedule, ...)(g)`` is
    ``newton_schulz_batched(g, schedule, ...)``; the settings are checked once, here).

    ``compute_dtype`` tells the seam the dtype it computes in (``dtype``; ``None``: the
    device's default, per batch), so batches are put together and sent between ranks in
    it (:func:`muonfx.seam.compute_dtype`): the same results, fewer bytes.

    Example::

        >>> import torch
        >>> from muonfx.linalg import NewtonSchulz, newton_schulz_batched, resolve
        >>> g = torch.randn(2, 8, 16)
        >>> ns = NewtonSchulz(resolve("keller", 5), dtype=torch.bfloat16)
        >>> ns.compute_dtype
        torch.bfloat16
        >>> torch.equal(ns(g), newton_schulz_batched(g, resolve("keller", 5), dtype=torch.bfloat16))
        True
    """

    def __init__(self, schedule: Schedule, eps: float = 1e-7, dtype: torch.dtype | None = None,
                 method: str = "standard", restart: int | None = None, accuracy: str = "dtype",
                 triton: bool | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown Newton-Schulz method {method!r}; use 'standard', 'gram', 'spectral' or 'auto'")
        if accuracy not in ACCURACIES:
            raise ValueError(f"unknown Newton-Schulz accuracy {accuracy!r}; use 'dtype' or 'bf16'")
        self.schedule, self.eps, self.method, self.restart, self.accuracy = schedule, eps, method, restart, accuracy
        self.compute_dtype = dtype
        #: whether the symmetric Triton products are asked for (None: the process switch,
        #: :func:`muonfx.linalg.triton_ns.requested`, read at each call)
        self.triton = triton

    def _choose(self, m: int, n: int, in_dtype: torch.dtype, device: torch.device) -> tuple:
        """``(compute dtype, method, restart)`` for ``m x n`` matrices of ``in_dtype`` on
        ``device`` (the rules of :func:`auto_method`)."""
        cdtype = self.compute_dtype if self.compute_dtype is not None else ns_dtype_for(device, in_dtype)
        restart = self.restart
        low = cdtype in (torch.bfloat16, torch.float16)
        if restart is None and low:  # default_restart(cdtype)
            restart = 3
        method = self.method
        if method == "auto":
            if cdtype == torch.float32 and self.accuracy == "bf16":
                method = "spectral" if device.type == "cpu" and min(m, n) >= SPECTRAL_MIN_DIM else (
                    "gram" if gram_pays_off(m, n, len(self.schedule.steps), restart) else "standard")
            else:
                method = "gram" if low and gram_pays_off(m, n, len(self.schedule.steps), restart) else "standard"
        return cdtype, method, restart

    def route(self, m: int, n: int, in_dtype: torch.dtype, device: "torch.device | str") -> tuple[str, str, str]:
        """``(compute dtype, method, products)`` of a batch of ``m x n`` matrices of
        ``in_dtype`` on ``device``, as names: what :meth:`__call__` does with it (the
        products: torch's batched ones, or the symmetric Triton kernels where they are
        asked for and available; their check runs on first use).

        Example::

            >>> import torch
            >>> from muonfx.linalg import NewtonSchulz, resolve
            >>> NewtonSchulz(resolve("keller", 5), dtype=torch.bfloat16, method="gram").route(256, 1024, torch.float32, "cpu")
            ('bfloat16', 'gram', 'torch')
        """
        device = torch.device(device)
        cdtype, method, restart = self._choose(m, n, in_dtype, device)
        if method == "spectral":
            products = "eigh"
        elif (cdtype in (torch.bfloat16, torch.float16) and (triton_ns.requested() if self.triton is None else self.triton)
              and triton_ns.runs_on(device)):
            products = "triton (checked on first use)"
        else:
            products = "torch"
        return str(cdtype).removeprefix("torch."), method, products

    def batch_limit(self, stack: torch.Tensor) -> int | None:
        """The most matrices like ``stack``'s that one call should take
        (:func:`muonfx.seam.local_map_parts` reads it): 1 where the CPU's standard iteration
        takes each matrix's own products (:data:`CPU_PER_MATRIX_MIN` elements and more), so
        that a batch of several would be put together only to be taken apart again; else
        None (the byte budget alone)."""
        m, n = stack.shape[-2], stack.shape[-1]
        if stack.device.type != "cpu" or m * n < CPU_PER_MATRIX_MIN or torch.compiler.is_compiling():
            return None
        return 1 if self._choose(m, n, stack.dtype, stack.device)[1] == "standard" else None

    def polar(self, g: torch.Tensor) -> torch.Tensor:
        """The polar factors of the ``[N, m, n]`` batch ``g`` in the compute dtype, as the
        iteration leaves them (a tall batch's as a transposed view): what :meth:`__call__`
        casts back to ``g``'s dtype. For a caller that reads the result once in a wider
        dtype (a lowered step adds it to float32 parameters, as torch.optim.Muon adds its
        bfloat16 update), which then needs no float32 copy of it."""
        if g.ndim != 3:
            raise ValueError(f"newton_schulz_batched takes [N, m, n], got {tuple(g.shape)}")
        schedule = self.schedule
        cdtype, method, restart = self._choose(g.shape[-2], g.shape[-1], g.dtype, g.device)
        low = cdtype in (torch.bfloat16, torch.float16)
        # one batched call; the normalised input is handed over in a list (see _standard), so
        # the iteration holds the only reference and frees it with its first new iterate
        tall = g.shape[-2] > g.shape[-1]
        steps, safety, eps = schedule.steps, schedule.safety, self.eps
        x = None
        if method == "spectral":
            x = _spectral([_normalized(g, safety, eps, cdtype, tall)], steps)
        elif low and triton_ns.takes(g, cdtype, restart, method == "gram", self.triton):
            # the same iteration with symmetric Triton products (CUDA); None: use torch's
            x = triton_ns.orthogonalize([_normalized(g, safety, eps, cdtype, tall)], steps, restart, method == "gram")
        if x is None:
            if method == "gram":
                x = _gram([_normalized(g, safety, eps, cdtype, tall)], steps, restart)
            else:
                x = _standard([_normalized(g, safety, eps, cdtype, tall)], steps)
        return x.mT if tall else x

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        if g.ndim != 3:
            raise ValueError(f"newton_schulz_batched takes [N, m, n], got {tuple(g.shape)}")
        schedule = self.schedule
        if torch.compiler.is_compiling() and g.device.type == "cpu" and not triton_ns.available(g):
            cdtype, method, restart = self._choose(g.shape[-2], g.shape[-1], g.dtype, g.device)
            # traced on the CPU (a compiled step): normalisation, iteration and cast are one
            # opaque operator that runs the eager code, so the compiled step computes what
            # the eager one does, bit for bit (inductor would keep the norm in float32 and
            # split the fused products: 1e-2 apart in bf16, not torch's)
            return torch.ops.muonfx.newton_schulz(g, [float(c) for abc in schedule.steps for c in abc],
                                                  float(schedule.safety), float(self.eps), cdtype, method,
                                                  int(restart or 0))
        x = self.polar(g)
        if torch.compiler.is_compiling():
            # traced (the executor's compiled step on CUDA): the cast stays a pointwise op that
            # the compiler fuses into whatever reads the result (scale, decay, the parameter
            # update), so no float32 copy of the batch is written and read back; the layout
            # is the compiler's to choose
            return x.to(g.dtype)
        if x.dtype == g.dtype:
            return x.contiguous()
        # one pass: cast back and lay out contiguously (a transposed result would otherwise
        # be cast, then copied again by a separate .contiguous())
        return torch.empty(x.shape, dtype=g.dtype, device=x.device).copy_(x)


@torch.library.custom_op("muonfx::newton_schulz", mutates_args=())
def _newton_schulz_op(g: torch.Tensor, coefficients: list[float], safety: float, eps: float, dtype: torch.dtype,
                      method: str, restart: int) -> torch.Tensor:
    """The operator ``torch.compile`` sees on the CPU: :class:`NewtonSchulz`'s eager call
    (``coefficients`` are the ``(a, b, c)`` triples flattened, ``method`` resolved, ``restart``
    0 for none); the result in ``g``'s dtype, contiguous."""
    steps = tuple(tuple(coefficients[i:i + 3]) for i in range(0, len(coefficients), 3))
    return NewtonSchulz(Schedule(steps, safety), eps, dtype, method, restart or None)(g)


@_newton_schulz_op.register_fake
def _(g: torch.Tensor, coefficients: list[float], safety: float, eps: float, dtype: torch.dtype, method: str,
      restart: int) -> torch.Tensor:
    return g.new_empty(g.shape)  # contiguous, g's dtype


def _normalized(g: torch.Tensor, safety: float, eps: float, cdtype: torch.dtype, tall: bool) -> torch.Tensor:
    """``g`` in ``cdtype``, wide, divided by ``max(||g||_F * safety, eps)``: a new tensor.

    A float16 batch's norms are taken in float32: float16's range (65504) is too small
    for a norm (the result was NaN where one exceeded it)."""
    x = g.to(cdtype)
    if tall:
        x = x.mT
    wide = torch.float32 if x.dtype == torch.float16 else None
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=wide)
    if x.dtype != torch.float64 and not (x.device.type == "cpu" and not torch.compiler.is_compiling()
                                         and not bool(torch.isinf(norm).any())):
        # Entries of ~1e19 and more overflow a float32 (or bfloat16) sum of squares: the
        # norm is inf and the result would be zero. The polar factor does not depend on
        # the scale, so those matrices are scaled by 2**-100 (exact) first. Branch-free (no
        # device sync): one multiply and one more norm, in place of nothing; where the
        # norm did not overflow the scale is 1 and every bit is as before. On the CPU (no
        # sync to avoid, eagerly or inside the compiled step's opaque operator) a batch
        # without an overflowing norm skips both passes: the same bits either way.
        down = torch.where(torch.isinf(norm), 2.0 ** -100, 1.0).to(x.dtype)
        x = x * down  # a new tensor: x may alias g when no cast happened
        norm = torch.where(down < 1, torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=wide), norm)
        den = norm * safety
        return x.div_(torch.where(down < 1, den, den.clamp_min(eps)))
    den = (norm * safety).clamp_min(eps)
    # in place where the cast made a new tensor; else out of place (x aliases g), cast back
    # where a float16 batch's float32 norm promoted the quotient (the same rounding)
    return x.div_(den) if g.dtype != cdtype else torch.div(x, den).to(cdtype)
