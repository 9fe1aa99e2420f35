"""Which Newton-Schulz form a matrix takes (:class:`muonfx.linalg.NewtonSchulz`): the
rules of ``method="auto"``, the flop counts they compare, and the CPU's choice between
each matrix's own products and the batched ones. Rules of shapes, dtypes and devices,
decided without timing; the measurements behind each constant are in its comment.
"""

from __future__ import annotations

import torch

__all__ = ["ACCURACIES", "METHODS", "SPECTRAL_MIN_DIM", "CPU_PER_MATRIX_MIN", "spectral_pays_off", "auto_method",
           "standard_flops", "gram_flops", "default_restart", "gram_pays_off", "auto_takes_gram"]

#: what ``accuracy=`` of :func:`newton_schulz_batched` accepts (see there)
ACCURACIES = ("dtype", "bf16")

#: what ``method=`` of :func:`newton_schulz_batched` accepts (see there)
METHODS = ("auto", "standard", "gram", "spectral")

#: the smaller matrix side from which ``"auto"`` takes the spectral form on the CPU (in
#: float32 at bf16's accuracy): there LAPACK's eigendecomposition of the ``m x m`` Gram
#: matrix costs less than the iteration's products (measured on the project's 2-core
#: machines, time against the faster iteration, three runs: 1.07-1.45x at m = 128,
#: 0.83-1.12x at 256 (on par: the iterations, more accurate, keep it), 0.61-1.03x at 320,
#: 0.5-0.87x at 384 to 768; ``benchmarks/newton_schulz.py --only spectral``)
SPECTRAL_MIN_DIM = 320


#: the elements from which a CPU batch's matrices take their own 2-D products (one at a
#: time) rather than the batched ones: 256 x 512. Measured on 2-core AMD EPYC in bf16, one
#: thread, the standard iteration, per-matrix over batched: 31x (32 x 32), 5.1x (64 x 64),
#: 1.4x (128 x 256), 1.05x (192 x 384), 0.98x (256 x 512), 0.96x (512 x 1024)
CPU_PER_MATRIX_MIN = 256 * 512



def spectral_pays_off(m: int, n: int, device: "torch.device | str" = "cpu") -> bool:
    """True where the spectral form is faster than the iterations: on the CPU, for
    matrices whose smaller side is at least :data:`SPECTRAL_MIN_DIM` (elsewhere the
    eigendecomposition is the slower part: GPUs run it far below their matmul speed)."""
    return torch.device(device).type == "cpu" and min(m, n) >= SPECTRAL_MIN_DIM


def auto_method(m: int, n: int, dtype: torch.dtype, accuracy: str = "dtype", device: "torch.device | str" = "cpu",
                steps: int = 5) -> str:
    """What ``method="auto"`` computes for an ``m x n`` matrix in ``dtype`` on ``device``:
    ``"spectral"``, ``"gram"`` or ``"standard"``.

    * ``accuracy="bf16"`` with float32 (the device's default on CPUs that emulate bf16):
      the spectral form where it pays off (:func:`spectral_pays_off`), else the Gram
      form where it needs fewer flops (:func:`gram_pays_off`, no restarts);
    * bf16/fp16: the Gram form where it needs fewer flops counting its restarts;
    * otherwise (float32 asked for, float64): the standard form.

    Example::

        >>> import torch
        >>> from muonfx.linalg import auto_method
        >>> auto_method(512, 1024, torch.float32, "bf16"), auto_method(128, 512, torch.float32, "bf16")
        ('spectral', 'gram')
        >>> auto_method(512, 1024, torch.bfloat16), auto_method(512, 1024, torch.float32)
        ('gram', 'standard')
    """
    if dtype == torch.float32 and accuracy == "bf16":
        if spectral_pays_off(m, n, device):
            return "spectral"
        return "gram" if gram_pays_off(m, n, steps, None) else "standard"
    if dtype in (torch.bfloat16, torch.float16):
        return "gram" if gram_pays_off(m, n, steps, default_restart(dtype)) else "standard"
    return "standard"


def standard_flops(m: int, n: int, steps: int) -> int:
    """Flops of the standard iteration on one ``m x n`` matrix: ``K (4 m^2 n + 2 m^3)``, ``m <= n``."""
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m ** 3)


def gram_flops(m: int, n: int, steps: int, restart: int | None = None) -> int:
    """Flops of the Gram iteration with restarts every ``restart`` steps (``None``: never).

    A segment of ``L`` steps costs ``4 m^2 n`` (``R = X X^T`` and ``X <- Q X``) plus
    ``2 m^3`` per step for ``p(R)``, ``2 m^3`` per step after the first for ``Q <- p Q``
    and ``4 m^3`` per step but the last for ``R <- p R p``: ``4 m^2 n + (8 L - 6) m^3``.
    """
    m, n = min(m, n), max(m, n)
    segments = -(-steps // (restart or steps))
    return 4 * segments * m * m * n + (8 * steps - 6 * segments) * m ** 3


def default_restart(dtype: torch.dtype) -> int | None:
    """Gram restarts: every 3 steps in 16-bit dtypes (5 steps: 3 + 2), else never.

    Without restarts bf16 Gram diverges on ill-conditioned inputs. Restarting every 3
    steps is as accurate as every 2 (the published bf16 pattern) with the default keller
    schedule (relative error to the float64 iteration, 4x768x3072: 1.8e-2 vs 2.0e-2 on
    Gaussian inputs, 4.1e-2 vs 4.4e-2 at condition 1e3; standard bf16 1.0e-2 and 4.6e-2),
    and it costs 0.84-0.86x of the 2+2+1 pattern's time (``benchmarks/newton_schulz.py
    --only restarts``). Against standard bf16 the error is 0.8-2.7x with keller and up to
    4.2x with polar_express on 16 x 48 to 768 x 3072 matrices, and polar_express diverges on
    small ill-conditioned ones (16 x 48, condition 1e3: 47 vs 0.19; ``--only gram``)."""
    return 3 if dtype in (torch.bfloat16, torch.float16) else None


def gram_pays_off(m: int, n: int, steps: int, restart: int | None = None) -> bool:
    """True when the Gram iteration (restarting every ``restart`` steps) needs fewer flops
    than the standard one: for 5 steps, ``n > 1.2 m`` without restarts and ``n > 1.5 m``
    restarting every 2 or 3 steps (``m <= n``)."""
    m, n = min(m, n), max(m, n)
    segments = -(-steps // (restart or steps))  # gram_flops < standard_flops, inline (hot path)
    return steps > 1 and 4 * segments * m * m * n + (8 * steps - 6 * segments) * m ** 3 < steps * (
        4 * m * m * n + 2 * m ** 3)


def auto_takes_gram(dtype: torch.dtype, accuracy: str = "dtype") -> bool:
    """Whether ``method="auto"`` considers the Gram form in ``dtype`` (where it pays off,
    :func:`gram_pays_off`): always in 16-bit dtypes; in float32 only when the accuracy
    asked for is bfloat16's (``accuracy="bf16"``: the compute dtype is the device's
    default, not one the caller asked for); never in float64.

    Example::

        >>> import torch
        >>> from muonfx.linalg import auto_takes_gram
        >>> auto_takes_gram(torch.bfloat16), auto_takes_gram(torch.float32)
        (True, False)
        >>> auto_takes_gram(torch.float32, accuracy="bf16")
        True
    """
    if dtype in (torch.bfloat16, torch.float16):
        return True
    return dtype == torch.float32 and accuracy == "bf16"
