"""The Newton-Schulz iterations written with a symmetric product, for kernels that compute
only part of each symmetric result.

Every ``m x m`` product of the iterations is symmetric:

* standard: ``A = X X^T`` and ``b A + c A A`` (``A A = A A^T``, ``A`` symmetric);
* Gram form: ``R = X X^T``, ``p(R) = b R + c R R``, ``Q <- p Q`` and ``R <- p (R p)`` (all
  polynomials in the same ``R``, so they commute and every product is symmetric).

A *symmetric product* is a function ``product(x, y=None, alpha=1.0, beta=0.0, c0=None)``
returning ``alpha * X Y^T + beta * C0`` for batches ``[B, m, k]`` (``y`` defaults to
``x``; ``c0`` is ``[B, m, m]``) whose result is known to be symmetric: the Triton tiles of
:mod:`muonfx.linalg.triton_ns` (CUDA), and :func:`plain`, the full product (the
reference). :func:`standard` and :func:`gram` are the iterations of
:mod:`muonfx.linalg.newton_schulz` (same order of operations) on any of them.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["SymmetricProduct", "plain", "standard", "gram"]

SymmetricProduct = Callable[..., torch.Tensor]


def plain(x: torch.Tensor, y: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
          c0: torch.Tensor | None = None) -> torch.Tensor:
    """The symmetric product computed in full by torch's batched products (``bmm`` /
    ``baddbmm``): the reference the partial products are measured against.

    Example::

        >>> import torch
        >>> from muonfx.linalg.symmetric import plain
        >>> x = torch.randn(2, 3, 5, dtype=torch.float64)
        >>> torch.allclose(plain(x, alpha=2.0, beta=1.0, c0=x @ x.mT), 3 * (x @ x.mT))
        True
    """
    y = x if y is None else y
    if c0 is None:
        out = torch.bmm(x, y.mT)
        return out if alpha == 1.0 else out.mul_(alpha)
    return torch.baddbmm(c0, x, y.mT, beta=beta, alpha=alpha)


def standard(x: "torch.Tensor | list[torch.Tensor]", steps, product: SymmetricProduct) -> torch.Tensor:
    """The standard iteration with ``product`` for its symmetric products; ``x`` handed
    over in a list is taken out of it (as in ``newton_schulz._standard``)."""
    x = x.pop() if isinstance(x, list) else x
    for a, b, c in steps:
        gram_ = product(x)
        poly = product(gram_, gram_, alpha=c, beta=b, c0=gram_)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def gram(x: "torch.Tensor | list[torch.Tensor]", steps, restart: int | None, product: SymmetricProduct) -> torch.Tensor:
    """The Gram iteration with ``product`` for its symmetric products; ``x`` handed over in
    a list is taken out of it."""
    x = x.pop() if isinstance(x, list) else x
    steps = list(steps)
    seg = len(steps) if not restart else restart
    for start in range(0, len(steps), seg):
        part = steps[start:start + seg]
        r = product(x)
        q = None
        for i, (a, b, c) in enumerate(part):
            p = product(r, r, alpha=c, beta=b, c0=r)
            p.diagonal(dim1=-2, dim2=-1).add_(a)
            q = p if q is None else product(p, q)          # p q = p q^T (q symmetric)
            if i < len(part) - 1:
                r = product(p, product(p, r))               # p (p r)^T = p r p: symmetric
        x = torch.bmm(q, x)
    return x
