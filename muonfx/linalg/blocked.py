"""Newton-Schulz with symmetric products by block rows (the CPU).

A symmetric ``m x m`` result ``C = X Y^T`` (:mod:`muonfx.linalg.symmetric`) is cut into
``k`` block rows; block row ``i`` is computed only up to the diagonal (its first
``(i + 1) m / k`` columns, one ``torch.mm`` per matrix) and the blocks above the
diagonal are copied from those below it. That costs ``(k + 1) / (2 k)`` of the full
product's flops: 3/4 with two blocks, 2/3 with three, 5/8 with four. A standard iteration
then needs about ``3 m^2 n + 1.5 m^3`` flops (two blocks) instead of ``4 m^2 n + 2 m^3``.

Smaller products run below the matmul's peak, so the blocks pay off only on large
matrices: :func:`block_count` is the rule (measured on the project's 2-core machines,
``benchmarks/newton_schulz.py --only blocks``): four blocks from 512 in float32 (a whole
iteration in 0.70-0.93x the plain one's time), three from 640 in bf16 (0.87-0.96x; at
512 they gain nothing there). It is 1 (the plain batched products of
:mod:`muonfx.linalg.newton_schulz`) below those sizes and on every device but the CPU.

The same function as the plain iterations, products summed in another order: the results
differ by rounding (tested to the dtype's tolerance). Eagerly the iteration runs here;
inside ``torch.compile`` (the executor's compiled step) it is one opaque operator,
``torch.ops.muonfx.blocked_newton_schulz``, so the graph holds one node, not one per
block and matrix.
"""

from __future__ import annotations

import functools

import torch

from . import symmetric

__all__ = ["block_count", "block_product", "product", "orthogonalize", "BLOCK_ROWS"]

#: by the compute dtype's size in bytes: ``(smallest side, blocks)``; smaller matrices
#: take the plain products
BLOCK_ROWS: dict[int, tuple[int, int]] = {2: (640, 3), 4: (512, 4), 8: (512, 4)}


def block_count(m: int, device: "torch.device | str" = "cpu", dtype: torch.dtype = torch.float32) -> int:
    """How many block rows the symmetric products of an ``m x n`` matrix (``m <= n``)
    computed in ``dtype`` take on ``device``: 1 (the plain batched products) off the CPU
    and on smaller matrices; else :data:`BLOCK_ROWS`: 4 from 512 in float32/float64, 3
    from 640 in bf16/fp16.

    Example::

        >>> import torch
        >>> from muonfx.linalg.blocked import block_count
        >>> [block_count(m) for m in (256, 512, 1024)], block_count(512, dtype=torch.bfloat16)
        ([1, 4, 4], 1)
        >>> block_count(768, dtype=torch.bfloat16), block_count(2048, "cuda")
        (3, 1)
    """
    if torch.device(device).type != "cpu":
        return 1
    side, blocks = BLOCK_ROWS.get(dtype.itemsize, BLOCK_ROWS[4])
    return blocks if m >= side else 1


def block_product(x: torch.Tensor, y: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
                  c0: torch.Tensor | None = None, blocks: int = 2) -> torch.Tensor:
    """``alpha * X Y^T + beta * C0`` for a batch whose result is known to be symmetric,
    computed by ``blocks`` block rows up to the diagonal and mirrored.

    ``x``, ``y``: ``[B, m, k]`` (``y`` defaults to ``x``); ``c0``: ``[B, m, m]``, symmetric.

    Example::

        >>> import torch
        >>> from muonfx.linalg.blocked import block_product
        >>> x = torch.randn(2, 6, 9, dtype=torch.float64)
        >>> torch.allclose(block_product(x, blocks=3), x @ x.mT)
        True
    """
    y = x if y is None else y
    bsz, m, _ = x.shape
    out = torch.empty(bsz, m, m, dtype=x.dtype, device=x.device)
    edges = [m * i // blocks for i in range(blocks + 1)]
    last = edges[-2]
    for j in range(bsz):
        xj, yt, oj = x[j], y[j].T, out[j]
        for i in range(blocks - 1):
            r0, r1 = edges[i], edges[i + 1]
            oj[r0:r1, :r1] = torch.mm(xj[r0:r1], yt[:, :r1])
        # the last block row spans every column: its rows are contiguous, written in place
        torch.mm(xj[last:], yt, out=oj[last:])
    for i in range(blocks - 1):
        r0, r1 = edges[i], edges[i + 1]
        out[:, r0:r1, r1:] = out[:, r1:, r0:r1].mT
    # scaled and added afterwards, in one pass over the batch (oneDNN's bf16 addmm with a
    # beta runs slower than mm and an add); c0 is symmetric, so the mirrored blocks stay so
    if alpha != 1.0:
        out.mul_(alpha)
    if c0 is not None and beta != 0.0:
        out.add_(c0, alpha=beta)
    return out


def product(x: torch.Tensor, y: torch.Tensor, blocks: int) -> torch.Tensor:
    """``X Y^T`` for a result known to be symmetric, by ``blocks`` block rows where
    ``blocks > 1`` (a plain ``bmm`` otherwise); inside ``torch.compile`` one opaque
    operator, ``torch.ops.muonfx.block_product``. The spectral form's two symmetric
    products (``X X^T`` and ``V diag(h) V^T``) go through here."""
    if blocks <= 1:
        return torch.bmm(x, y.mT)
    if torch.compiler.is_compiling():
        return torch.ops.muonfx.block_product(x, y, int(blocks))
    return block_product(x, y, blocks=blocks)


@torch.library.custom_op("muonfx::block_product", mutates_args=())
def _block_product_op(x: torch.Tensor, y: torch.Tensor, blocks: int) -> torch.Tensor:
    return block_product(x, y, blocks=blocks)


@_block_product_op.register_fake
def _(x: torch.Tensor, y: torch.Tensor, blocks: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], y.shape[1])


def orthogonalize(x: "torch.Tensor | list[torch.Tensor]", steps, restart: int | None, gram: bool,
                  blocks: int) -> torch.Tensor:
    """The standard (or Gram) iteration on ``x`` with block-row symmetric products.
    Eagerly, ``x`` handed over in a list is taken out of it (the iteration frees it with
    its first new iterate); inside ``torch.compile`` it is one opaque operator."""
    if torch.compiler.is_compiling():
        flat = [float(c) for abc in steps for c in abc]
        x = x.pop() if isinstance(x, list) else x
        return torch.ops.muonfx.blocked_newton_schulz(x, flat, int(restart or 0), bool(gram), int(blocks))
    product = functools.partial(block_product, blocks=blocks)
    return symmetric.gram(x, steps, restart, product) if gram else symmetric.standard(x, steps, product)


@torch.library.custom_op("muonfx::blocked_newton_schulz", mutates_args=())
def _blocked_newton_schulz(x: torch.Tensor, coefficients: list[float], restart: int, gram: bool,
                           blocks: int) -> torch.Tensor:
    """The operator ``torch.compile`` sees: ``coefficients`` are the ``(a, b, c)`` triples
    flattened, ``restart`` 0 for none."""
    steps = [tuple(coefficients[i:i + 3]) for i in range(0, len(coefficients), 3)]
    product = functools.partial(block_product, blocks=blocks)
    out = symmetric.gram(x, steps, restart or None, product) if gram else symmetric.standard(x, steps, product)
    return out.contiguous()  # what the fake below promises


@_blocked_newton_schulz.register_fake
def _(x: torch.Tensor, coefficients: list[float], restart: int, gram: bool, blocks: int) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous
