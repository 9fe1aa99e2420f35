"""How many same-shape matrices go into one batched call: the one batching policy.

Newton-Schulz and every other matrix function run on batches ``[N, m, n]``. A batch
holds at most :func:`batch_bytes` bytes of input matrices, so the extra memory of the
matrix work is bounded whatever the model's size, and batches are still large enough
to keep the device busy:

* CPU: 8 MiB (about 2M float32 elements): the iterates stay in cache between the
  products; larger batches measured no faster on the project's 2-core machines.
* CUDA and other accelerators: 256 MiB (for example 16 float32 matrices of
  2048 x 2048, or 5 of 5632 x 2048): enough matrices to fill an H100, while a batch's
  bf16 work space (about 2.5x its float32 input) stays far below 1 GiB.

The local seam (:func:`muonfx.seam.local_map_matrices`) and the DTensor backend
(on the ranks that own whole matrices) both plan with :func:`plan_batches`.
:func:`set_batch_bytes` is the one knob.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["batch_bytes", "set_batch_bytes", "plan_batches", "DEFAULT_BATCH_BYTES"]

#: The device-sized defaults (bytes of input matrices per batch), by device type;
#: ``"*"`` covers every device type not named.
DEFAULT_BATCH_BYTES: dict[str, int] = {"cpu": 8 << 20, "*": 256 << 20}

_overrides: dict[str, int] = {}


def batch_bytes(device: torch.device | str) -> int:
    """The byte budget of one batch of matrices on ``device`` (see the module doc)."""
    kind = torch.device(device).type
    if kind in _overrides:
        return _overrides[kind]
    return DEFAULT_BATCH_BYTES.get(kind, DEFAULT_BATCH_BYTES["*"])


def set_batch_bytes(nbytes: int | None, device_type: str = "cuda") -> int | None:
    """Set (or with ``None`` reset to the default) the batch budget for a device type;
    returns the setting it replaced (``None``: the default was in force), so that a
    caller can put it back.

    Smaller budgets lower the step's peak memory; larger ones fill a device with more
    matrices per call. The result does not depend on it: matrices are independent.

    Example::

        >>> import muonfx as mfx
        >>> mfx.linalg.set_batch_bytes(64 << 20, "cuda")     # 64 MiB batches on GPUs
        >>> mfx.linalg.set_batch_bytes(None, "cuda")          # back to the default
        67108864
    """
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1):
        raise ValueError(f"set_batch_bytes: nbytes must be a positive int or None, got {nbytes!r}")
    previous = _overrides.get(device_type)
    if nbytes is None:
        _overrides.pop(device_type, None)
    else:
        _overrides[device_type] = nbytes
    return previous


def plan_batches(counts: Sequence[int], matrix_bytes: int, budget: int) -> list[list[tuple[int, int, int]]]:
    """Split stacks of same-shape matrices into batches of at most ``budget`` bytes.

    ``counts[i]`` is the number of matrices in stack ``i``, each ``matrix_bytes`` large.
    Returns batches, each a list of ``(stack, start, stop)`` slices in order; a batch
    holds at least one matrix (a single matrix larger than the budget goes alone).

    Example::

        >>> from muonfx.linalg.batching import plan_batches
        >>> plan_batches([3, 1], matrix_bytes=4, budget=8)
        [[(0, 0, 2)], [(0, 2, 3), (1, 0, 1)]]
    """
    per = max(1, budget // max(1, matrix_bytes))
    batches: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = per
    for i, k in enumerate(counts):
        start = 0
        while start < k:
            take = min(room, k - start)
            cur.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                batches.append(cur)
                cur, room = [], per
    if cur:
        batches.append(cur)
    return batches
