"""Newton-Schulz with symmetric Triton products (CUDA; the interpreter runs it on a CPU).

Every ``m x m`` product of the Newton-Schulz iterations is symmetric
(:mod:`muonfx.linalg.symmetric`, which writes the iterations for any symmetric product).
One kernel computes ``C = alpha * X Y^T + beta * C0`` for such a symmetric result: each
program computes one tile on or above the diagonal (a ``BLOCK x BLOCK`` block of rows
``i`` and columns ``j >= i``), accumulating in float32, and stores its entries on and above
the diagonal at their place and those strictly above it transposed, so the result is
exactly symmetric. Only those ``T (T + 1) / 2`` tiles get a program, so the
products cost about ``(T + 1) / (2 T)`` of a full one with ``T`` tiles per side: a standard
iteration ``3 m^2 n + m^3`` instead of ``4 m^2 n + 2 m^3`` flops, for large ``m``. The
remaining ``X <- a X + B X`` is a general product (``torch.baddbmm``).

The functions here compute exactly the iterations of :mod:`muonfx.linalg.newton_schulz`
(same order of operations, float32 accumulation, one rounding per product); the tests
compare them to it in bf16 on square, wide, tall, ragged and single-matrix batches.
Triton is optional and imported lazily: :func:`available` says whether this path can run
for a tensor. torch's batched products are the rule on every device: measured on an H100
(``docs/performance.md``) the symmetric kernels were slower than cuBLAS's batched products
on six of seven Muon shapes (up to 2.7x) and level on the seventh. The kernels run only
when asked for:

* **switched on** with :func:`set_enabled` (``True``) or ``MUONFX_TRITON_NS=1``; an
  optimizer captures the switch when its step plan is built;
* **checked on first use per shape**: the first time a matrix shape (and form, dtype,
  device) would take them, the kernels and torch's products each orthogonalise the same
  seeded random batch of that shape; if the kernels' distance to the float32 iteration
  exceeds torch's bf16 rounding (more than 1.5x torch's distance plus 2e-3), they are
  refused for that shape with one warning on the ``muonfx`` logger and torch's products
  are used (:func:`verdicts`). No timing decides anything.

If a launch ever fails, the torch products are used for the rest of the process (with one
warning on the ``muonfx`` logger). Inside ``torch.compile`` (the executor's compiled step)
the kernels are one opaque operator, ``torch.ops.muonfx.symmetric_newton_schulz``, for the
shapes checked before the graph was traced (the optimizer's plan checks them when it is
built); other shapes keep torch's products there.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from . import symmetric

__all__ = ["available", "runs_on", "takes", "set_enabled", "requested", "verify", "verdicts", "orthogonalize", "sym_product",
           "standard_sym", "gram_sym", "interpreting"]

log = logging.getLogger("muonfx")


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``): CPU tensors, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INSTALLED = importlib.util.find_spec("triton") is not None


def runs_on(device: "torch.device | str") -> bool:
    """Whether the kernels can run on ``device``: Triton is installed, and the device is a
    GPU (or the CPU under the interpreter)."""
    kind = torch.device(device).type
    return _INSTALLED and (kind == "cuda" or kind == "cpu" and interpreting())


def available(t: torch.Tensor) -> bool:
    """Whether the symmetric Triton products can run for ``t``: Triton is installed and
    ``t`` is on CUDA (or, outside ``torch.compile``, on the CPU under the interpreter)."""
    if not _INSTALLED:
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and interpreting()


#: set_enabled's switch (None: MUONFX_TRITON_NS decides, off by default)
_switch: bool | None = None
#: per matrix shape and form, whether the kernels passed their check (see verify())
_verdicts: dict[tuple, bool] = {}
_ENV = "MUONFX_TRITON_NS"


def set_enabled(enabled: bool | None) -> None:
    """Ask for the symmetric Triton products (``True``), keep torch's (``False``), or let
    ``MUONFX_TRITON_NS`` decide (``None``, the default: off unless it says ``1``/``on``).
    Shapes whose check fails keep torch's products either way (:func:`verify`). An
    optimizer reads the switch when its step plan is built.

    Example::

        >>> from muonfx.linalg import triton_ns
        >>> triton_ns.set_enabled(True)    # the kernels, where they pass their check
        >>> triton_ns.set_enabled(None)    # MUONFX_TRITON_NS decides (off by default)
    """
    global _switch
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_enabled: enabled must be True, False or None, got {enabled!r}")
    _switch = enabled


def requested() -> bool:
    """Whether the kernels are asked for: :func:`set_enabled`, else ``MUONFX_TRITON_NS``
    (``1``/``on``/``true``/``yes``: on; ``0``/``off``/``auto``/unset: off)."""
    if _switch is not None:
        return _switch
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "auto", "0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"{_ENV}={os.environ[_ENV]!r}: use 1 (on) or 0 (off)")


def _key(m: int, n: int, dtype: torch.dtype, device: torch.device, restart: int | None, gram: bool) -> tuple:
    return (str(device), dtype, min(m, n), max(m, n), bool(gram), (restart or None) if gram else None)


def takes(t: torch.Tensor, dtype: torch.dtype, restart: int | None, gram: bool, asked: bool | None = None) -> bool:
    """Whether the Newton-Schulz of the batch ``t`` (``[B, m, n]``, either orientation),
    computed in ``dtype``, runs with the symmetric Triton products: they are asked for
    (``asked``; ``None``: :func:`requested`), :func:`available` for ``t``, and passed their
    check for this shape (:func:`verify`; eagerly, a shape not checked yet is checked now;
    inside ``torch.compile`` only shapes checked before take them)."""
    if not (requested() if asked is None else asked) or not available(t):
        return False
    key = _key(t.shape[-2], t.shape[-1], dtype, t.device, restart, gram)
    verdict = _verdicts.get(key)
    if verdict is None:
        if torch.compiler.is_compiling():
            return False
        verdict = verify(t.shape[-2], t.shape[-1], dtype, t.device, restart, gram)
    return verdict


def verdicts() -> dict[tuple, bool]:
    """The checks made so far: ``{(device, dtype, smaller side, larger side, gram,
    restart): True where the kernels passed}`` (a copy)."""
    return dict(_verdicts)


#: the check's batch: this many seeded random matrices of the shape
_CHECK_BATCH = 2


def verify(m: int, n: int, dtype: torch.dtype, device: torch.device | str, restart: int | None,
           gram: bool, steps=None) -> bool:
    """Check the kernels on an ``m x n`` shape once (cached): the standard (or Gram)
    iteration of a seeded random batch, normalised as Newton-Schulz normalises it, with
    the kernels and with torch's products, both in ``dtype``; each compared with the
    iteration in float32 on the same batch. The kernels pass when their distance is at
    most 1.5x torch's plus 2e-3 (the rounding of a 16-bit dtype); otherwise they are
    refused for the shape, with one warning on the ``muonfx`` logger. A launch that
    fails refuses them for the process (see :func:`orthogonalize`)."""
    global _failed
    device = torch.device(device)
    key = _key(m, n, dtype, device, restart, gram)
    if key in _verdicts:
        return _verdicts[key]
    if steps is None:
        from .coefficients import resolve

        steps = resolve("keller", 5).steps
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_CHECK_BATCH, min(m, n), max(m, n), generator=gen).to(device)
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    lo = x.to(dtype)
    ref = symmetric.gram(x, steps, restart, symmetric.plain) if gram else symmetric.standard(x, steps, symmetric.plain)
    try:
        ours = gram_sym(lo, steps, restart) if gram else standard_sym(lo, steps)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot launch: torch's products from now on
        _failed = True
        log.warning("muonfx: the symmetric Triton Newton-Schulz failed (%s: %s); using torch's "
                    "products from now on", type(e).__name__, e)
        _verdicts[key] = False
        return False
    theirs = symmetric.gram(lo, steps, restart, symmetric.plain) if gram else symmetric.standard(lo, steps,
                                                                                                   symmetric.plain)

    def rel(a: torch.Tensor) -> float:
        return float((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))

    e_ours, e_torch = rel(ours), rel(theirs)
    ok = e_ours == e_ours and e_ours <= 1.5 * e_torch + 2e-3
    _verdicts[key] = ok
    if not ok:
        log.warning("muonfx: the symmetric Triton Newton-Schulz of %d x %d %s matrices (%s form) differs from "
                    "torch's products beyond %s rounding (distance to the float32 iteration %.3g, torch's %.3g): "
                    "torch's products are used for this shape", min(m, n), max(m, n),
                    str(dtype).removeprefix("torch."), "Gram" if gram else "standard",
                    str(dtype).removeprefix("torch."), e_ours, e_torch)
    return ok


#: the tiles autotuned on a GPU: ``(BLOCK, BLOCK_K, num_warps, num_stages)``
GPU_TILES = ((128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 4))


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def sym_kernel(x_ptr, y_ptr, c0_ptr, out_ptr, m: tl.constexpr, k: tl.constexpr, alpha, beta,
                   sxb, sxm, sxk, syb, sym, syk, scb, scm, scn, sob, som, son,
                   HAS_C0: tl.constexpr, UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program per tile on or above the diagonal, numbered column by column:
        # tile (i, j), i <= j, is number j (j + 1) / 2 + i
        t = tl.program_id(0)
        b = tl.program_id(1)
        pid_j = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
        pid_j = tl.where((pid_j + 1) * (pid_j + 2) // 2 <= t, pid_j + 1, pid_j)  # float rounding
        pid_j = tl.where(pid_j * (pid_j + 1) // 2 > t, pid_j - 1, pid_j)
        pid_i = t - pid_j * (pid_j + 1) // 2
        rows = pid_i * BLOCK + tl.arange(0, BLOCK)
        cols = pid_j * BLOCK + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        x_base = x_ptr + b * sxb
        y_base = y_ptr + b * syb
        acc = tl.full((BLOCK, BLOCK), 0.0, tl.float32)  # (tl.zeros is a jit function: the interpreter needs it set up at import)
        for k0 in range(0, k, BLOCK_K):  # static bounds: shapes are few, and autotuned per (m, k) anyway
            kk = k0 + ks
            xt = tl.load(x_base + rows[:, None] * sxm + kk[None, :] * sxk,
                         mask=(rows[:, None] < m) & (kk[None, :] < k), other=0.0)
            yt = tl.load(y_base + cols[:, None] * sym + kk[None, :] * syk,
                         mask=(cols[:, None] < m) & (kk[None, :] < k), other=0.0)
            if UPCAST:  # the interpreter's dot mishandles bf16: exact products in float32 instead
                xt = xt.to(tl.float32)
                yt = yt.to(tl.float32)
            acc += tl.dot(xt, tl.trans(yt))
        acc = acc * alpha
        inside = (rows[:, None] < m) & (cols[None, :] < m)
        if HAS_C0:
            c0 = tl.load(c0_ptr + b * scb + rows[:, None] * scm + cols[None, :] * scn, mask=inside, other=0.0)
            acc += beta * c0.to(tl.float32)
        if ROUND_BF16:  # the interpreter truncates float32 -> bf16; round to nearest even first
            bits = acc.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            acc = bits.to(tl.float32, bitcast=True)
        val = acc.to(out_ptr.dtype.element_ty)
        o_base = out_ptr + b * sob
        # the upper triangle (row <= column) at its place, its strict part mirrored: every
        # (r, c) and (c, r) pair holds the same computed value, also inside a diagonal tile
        # (whose dot need not be bitwise symmetric). Masks, not branches: older
        # interpreters cannot branch on a program id.
        tl.store(o_base + rows[:, None] * som + cols[None, :] * son, val,
                 mask=inside & (rows[:, None] <= cols[None, :]))
        tl.store(o_base + cols[:, None] * som + rows[None, :] * son, tl.trans(val),
                 mask=(cols[:, None] < m) & (rows[None, :] < cols[:, None]))

    configs = [triton.Config({"BLOCK": block, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)
               for block, block_k, warps, stages in GPU_TILES]
    tuned = triton.autotune(configs, key=["m", "k"])(sym_kernel)
    return sym_kernel, tuned, triton


def sym_product(x: torch.Tensor, y: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
                c0: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * X Y^T + beta * C0`` for a batch whose result is known to be symmetric.

    ``x``, ``y``: ``[B, m, k]`` (``y`` defaults to ``x``); ``c0``: ``[B, m, m]``, symmetric.
    Only tiles on and above the diagonal are computed; each is stored at its place and
    mirrored. The result has ``x``'s dtype, accumulated in float32 and rounded once.
    """
    y = x if y is None else y
    bsz, m, k = x.shape
    out = torch.empty(bsz, m, m, dtype=x.dtype, device=x.device)
    # the kernel's offsets (batch index times batch stride) are 32-bit: launch sub-batches
    # whose tensors each span fewer than 2**31 elements (a batch budget raised far above
    # the default, set_batch_bytes, makes such batches)
    per = min(_fits(t) for t in (x, y, out, c0))
    for b0 in range(0, bsz, per):
        part = slice(b0, b0 + per)
        _launch(x[part], y[part], alpha, beta, None if c0 is None else c0[part], out[part])
    return out


#: the largest element offset the kernel computes in 32 bits
_MAX_OFFSET = 2 ** 31 - 1


def _fits(t: torch.Tensor | None) -> int:
    """How many matrices of the batch ``t`` one launch may take: the largest offset,
    ``(count - 1) * stride(0)`` plus the last entry's within its matrix, stays at most
    :data:`_MAX_OFFSET` (at least 1; any count for None or a batch stride of 0)."""
    if t is None or t.stride(0) == 0:
        return 1 << 62
    within = sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:]))
    return max(1, (_MAX_OFFSET - within) // abs(t.stride(0)) + 1)


def _launch(x: torch.Tensor, y: torch.Tensor, alpha: float, beta: float, c0: torch.Tensor | None,
            out: torch.Tensor, tile: tuple[int, int] | None = None) -> None:
    """One launch. Under the interpreter the tile is ``tile`` (``(BLOCK, BLOCK_K)``: the
    tests run the GPU's :data:`GPU_TILES` there too) or a small one; on a GPU autotuned."""
    bsz, m, k = x.shape
    plain, tuned, triton = _kernels()
    c = c0 if c0 is not None else out  # a valid pointer; unread when HAS_C0 is False
    args = (x, y, c, out, m, k, float(alpha), float(beta),
            *x.stride(), *y.stride(), *c.stride(), *out.stride())
    if interpreting():
        block, block_k = tile or (16 if m <= 64 else 32, 16)
        tiles = triton.cdiv(m, block)
        grid = (tiles * (tiles + 1) // 2, bsz)
        plain[grid](*args, HAS_C0=c0 is not None, UPCAST=True, ROUND_BF16=x.dtype == torch.bfloat16,
                    BLOCK=block, BLOCK_K=block_k)
    else:
        def grid(meta):
            tiles = triton.cdiv(m, meta["BLOCK"])
            return (tiles * (tiles + 1) // 2, bsz)
        tuned[grid](*args, HAS_C0=c0 is not None, UPCAST=False, ROUND_BF16=False)


def standard_sym(x: "torch.Tensor | list[torch.Tensor]", steps) -> torch.Tensor:
    """The standard iteration (``_standard`` of :mod:`.newton_schulz`) with symmetric
    products; ``x`` handed over in a list is taken out of it (as there)."""
    return symmetric.standard(x, steps, sym_product)


def gram_sym(x: "torch.Tensor | list[torch.Tensor]", steps, restart: int | None) -> torch.Tensor:
    """The Gram iteration (``_gram`` of :mod:`.newton_schulz`) with symmetric products;
    ``x`` handed over in a list is taken out of it."""
    return symmetric.gram(x, steps, restart, sym_product)


_failed = False


def orthogonalize(x: "torch.Tensor | list[torch.Tensor]", steps, restart: int | None,
                  gram: bool) -> torch.Tensor | None:
    """The standard (or Gram) iteration on ``x`` with the symmetric products, or None where
    the caller should use torch's products. Eagerly, ``x`` handed over in a list is taken
    out of it by the iteration, which frees it with its first new iterate (a caller that
    gets None normalises its input again). Call it where :func:`takes` agreed.

    The first failure of a launch is logged once (``muonfx`` logger) and every later call
    returns None. Inside ``torch.compile`` the kernels run as one opaque operator
    (``torch.ops.muonfx.symmetric_newton_schulz``).
    """
    global _failed
    if _failed:
        return None
    if torch.compiler.is_compiling():
        flat = [float(c) for abc in steps for c in abc]
        x = x.pop() if isinstance(x, list) else x
        return torch.ops.muonfx.symmetric_newton_schulz(x, flat, int(restart or 0), bool(gram))
    held = x if isinstance(x, list) else [x]
    try:
        # handed over: the iteration frees the input with its first new iterate
        return gram_sym(held, steps, restart) if gram else standard_sym(held, steps)
    except Exception as e:  # noqa: BLE001 - any launch/compile failure: keep training on torch's path
        _failed = True
        log.warning("muonfx: the symmetric Triton Newton-Schulz failed (%s: %s); using torch's "
                    "products from now on", type(e).__name__, e)
        return None


@torch.library.custom_op("muonfx::symmetric_newton_schulz", mutates_args=())
def _symmetric_newton_schulz(x: torch.Tensor, coefficients: list[float], restart: int, gram: bool) -> torch.Tensor:
    """The operator ``torch.compile`` sees: ``coefficients`` are the ``(a, b, c)`` triples
    flattened, ``restart`` 0 for none."""
    steps = [tuple(coefficients[i:i + 3]) for i in range(0, len(coefficients), 3)]
    out = gram_sym(x, steps, restart or None) if gram else standard_sym(x, steps)
    return out.contiguous()  # what the fake below promises, whatever x's strides


@_symmetric_newton_schulz.register_fake
def _(x: torch.Tensor, coefficients: list[float], restart: int, gram: bool) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous
