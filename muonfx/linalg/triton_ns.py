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
for a tensor. The default route (:func:`muonfx.linalg.newton_schulz_batched`) takes it for
bf16/fp16 on CUDA when Triton is installed and :func:`takes` agrees:

* **measured per shape** (the default): the first batch of every matrix shape (and form)
  runs the iteration with these kernels and with torch's full products
  (:func:`muonfx.linalg.symmetric.plain`), timed after a warm-up, and later batches of
  that shape take the faster (:func:`choices`). The symmetric products save about a
  quarter of the flops; whether that beats cuBLAS's better use of the GPU depends on the
  GPU and the shape, so it is measured, not assumed;
* **switched** with :func:`set_enabled` or ``MUONFX_TRITON_NS=1`` / ``0`` (``auto``: measured).

If a launch ever fails, the torch products are used for the rest of the process (with one
warning on the ``muonfx`` logger). Inside ``torch.compile`` (the executor's compiled step)
the kernels are one opaque operator, ``torch.ops.muonfx.symmetric_newton_schulz``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import time

import torch

from . import symmetric

__all__ = ["available", "takes", "set_enabled", "choices", "orthogonalize", "sym_product", "standard_sym",
           "gram_sym", "interpreting"]

log = logging.getLogger("muonfx")


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``): CPU tensors, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INSTALLED = importlib.util.find_spec("triton") is not None


def available(t: torch.Tensor) -> bool:
    """Whether the symmetric Triton products can run for ``t``: Triton is installed and
    ``t`` is on CUDA (or, outside ``torch.compile``, on the CPU under the interpreter)."""
    if not _INSTALLED:
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and interpreting()


#: set_enabled's switch (None: MUONFX_TRITON_NS decides, "auto" by default)
_switch: bool | None = None
#: the measured choice per matrix shape and form (True: the Triton products); see choices()
_choices: dict[tuple, bool] = {}
_ENV = "MUONFX_TRITON_NS"


def set_enabled(enabled: bool | None) -> None:
    """Switch the symmetric Triton products on (``True``) or off (``False``) for every
    shape, or back to the measured choice per shape (``None``, the default). Overrides
    ``MUONFX_TRITON_NS`` (``1``/``on``, ``0``/``off``, ``auto``).

    Example::

        >>> from muonfx.linalg import triton_ns
        >>> triton_ns.set_enabled(False)   # torch's products everywhere
        >>> triton_ns.set_enabled(None)    # measured per shape (the default)
    """
    global _switch
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_enabled: enabled must be True, False or None, got {enabled!r}")
    _switch = enabled


def _mode() -> bool | None:
    """True/False where switched on/off, None where the choice is measured per shape."""
    if _switch is not None:
        return _switch
    value = os.environ.get(_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{_ENV}={os.environ[_ENV]!r}: use 1 (on), 0 (off) or auto (measured per shape)")


def _key(m: int, n: int, dtype: torch.dtype, device: torch.device, restart: int | None, gram: bool) -> tuple:
    return (str(device), dtype, min(m, n), max(m, n), bool(gram), (restart or None) if gram else None)


def _measures(t: torch.Tensor) -> bool:
    """Whether the choice for ``t``'s shape is measured (real GPUs; the interpreter, a
    test harness, always takes the kernels unless switched off)."""
    return t.device.type == "cuda"


def takes(t: torch.Tensor, dtype: torch.dtype, restart: int | None, gram: bool) -> bool:
    """Whether the Newton-Schulz of the batch ``t`` (``[B, m, n]``, either orientation),
    computed in ``dtype``, runs with the symmetric Triton products: they are
    :func:`available` for ``t``, not switched off, and, where the choice is measured, not
    measured slower than torch's products for this shape and form. A shape not measured
    yet takes them eagerly (that call measures) and not inside ``torch.compile`` (a graph
    cannot measure; the executor's first step of every group is eager, so its compiled
    steps find every shape measured)."""
    if not available(t):
        return False
    mode = _mode()
    if mode is not None:
        return mode
    if not _measures(t):
        return True
    return _choices.get(_key(t.shape[-2], t.shape[-1], dtype, t.device, restart, gram),
                        not torch.compiler.is_compiling())


def choices() -> dict[tuple, bool]:
    """The measured choices so far: ``{(device, dtype, smaller side, larger side, gram,
    restart): True where the Triton products were the faster}`` (a copy)."""
    return dict(_choices)


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
_verified = False


def orthogonalize(x: "torch.Tensor | list[torch.Tensor]", steps, restart: int | None,
                  gram: bool) -> torch.Tensor | None:
    """The standard (or Gram) iteration on ``x`` with the symmetric products, or None where
    the caller should use torch's products. Eagerly, ``x`` handed over in a list is taken
    out of it by the iteration, which frees it with its first new iterate (a caller that
    gets None normalises its input again).

    Eagerly, the first call for a shape measures the kernels against torch's products
    where the choice is measured (see the module doc; :func:`takes` then follows it), and
    the first failure of a launch is logged once (``muonfx`` logger) and every later call
    returns None. Inside ``torch.compile`` the kernels run as one opaque
    operator (``torch.ops.muonfx.symmetric_newton_schulz``) once an eager call has
    succeeded in this process (the executor's measured choice runs an eager step before
    compiling); until then the graph keeps torch's products, so a kernel that cannot
    build on some GPU never breaks a compiled step.
    """
    global _failed, _verified
    if torch.compiler.is_compiling():
        if not _verified or _failed:
            return None
        flat = [float(c) for abc in steps for c in abc]
        x = x.pop() if isinstance(x, list) else x
        return torch.ops.muonfx.symmetric_newton_schulz(x, flat, int(restart or 0), bool(gram))
    if _failed:
        return None
    held = x if isinstance(x, list) else [x]
    key = _key(held[0].shape[-2], held[0].shape[-1], held[0].dtype, held[0].device, restart, gram)
    try:
        if _mode() is None and _measures(held[0]) and key not in _choices:
            out = _measure(key, held.pop(), steps, restart, gram)  # runs it twice: keeps its input
        else:  # handed over: the iteration frees the input with its first new iterate
            out = gram_sym(held, steps, restart) if gram else standard_sym(held, steps)
    except Exception as e:  # noqa: BLE001 - any launch/compile failure: keep training on torch's path
        _failed = True
        log.warning("muonfx: the symmetric Triton Newton-Schulz failed (%s: %s); using torch's "
                    "products from now on", type(e).__name__, e)
        return None
    _verified = True
    return out


def _timed(fn, device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device``, queued work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda d=None: None)
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


#: timed runs of each side in the measurement (the fastest counts)
_ROUNDS = 2


def _measure(key: tuple, x: torch.Tensor, steps, restart: int | None, gram: bool) -> torch.Tensor:
    """The iteration on ``x`` with the Triton products (returned), after timing it against
    torch's full products on the same batch; the faster is recorded for ``key``. The first
    runs of each (Triton compiling and autotuning its kernel, cuBLAS choosing its) are not
    timed."""
    def triton_run() -> torch.Tensor:
        return gram_sym(x, steps, restart) if gram else standard_sym(x, steps)

    def torch_run() -> torch.Tensor:
        return symmetric.gram(x, steps, restart, symmetric.plain) if gram else symmetric.standard(x, steps,
                                                                                                  symmetric.plain)

    out = triton_run()
    torch_run()
    t_triton, t_torch = [], []
    for _ in range(_ROUNDS):
        t_triton.append(_timed(triton_run, x.device))
        t_torch.append(_timed(torch_run, x.device))
    faster = min(t_triton) < min(t_torch)
    _choices[key] = faster
    log.info("muonfx: Newton-Schulz of %d x %d %s matrices (batch of %d, %s form): Triton's symmetric products "
             "%.2f ms, torch's %.2f ms: %s from now on", key[2], key[3], str(x.dtype).removeprefix("torch."),
             x.shape[0], "Gram" if gram else "standard", 1e3 * min(t_triton), 1e3 * min(t_torch),
             "Triton's" if faster else "torch's")
    return out


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
