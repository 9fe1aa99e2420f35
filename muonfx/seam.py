"""The one seam for work that is not elementwise.

Almost every transform is elementwise and runs unchanged on whole tensors or on
shards. Two kinds of work need more, and go through this module only:

* :func:`map_matrices` maps a *matrix function* over a list of matrix stacks.
  A matrix function takes a batch ``[N, m, n]`` and returns a batch of the same
  shape, treating each of the ``N`` matrices independently (Newton-Schulz, per-row
  statistics). Locally, stacks of the same ``(m, n)``, dtype and device are
  concatenated and transformed as one batch (on the CPU, in batches of about
  :data:`CPU_BATCH_ELEMENTS` elements).
* :func:`global_sum` sums a per-tensor scalar over all leaves (global norms,
  non-finite counts). Locally it is a plain sum.

Backends (the distributed module installs one for DTensors) claim the tensors they
serve through :func:`register_backend`; transforms never import distributed code,
and backends never know which transform they serve.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

MatrixFn = Callable[[torch.Tensor], torch.Tensor]
ScalarFn = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["MatrixFn", "ScalarFn", "Backend", "register_backend", "unregister_backend",
           "map_matrices", "global_sum", "local_map_matrices", "CPU_BATCH_ELEMENTS"]


class Backend(Protocol):
    """What a seam backend provides (see ``muonfx.distributed``)."""

    def claims(self, t: torch.Tensor) -> bool:
        """True if this backend serves tensors like ``t``."""

    def map_matrices(self, fn: MatrixFn, stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Apply ``fn`` to every matrix of every ``[k, m, n]`` stack; same shapes out."""

    def global_sum(self, fn: ScalarFn, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``sum(fn(t) for t in tensors)`` over the logical (whole) tensors, as a local 0-d tensor."""


_BACKENDS: list[Backend] = []


def register_backend(backend: Backend) -> None:
    """Install ``backend`` for the tensors it claims (idempotent)."""
    if backend not in _BACKENDS:
        _BACKENDS.insert(0, backend)


def unregister_backend(backend: Backend) -> None:
    if backend in _BACKENDS:
        _BACKENDS.remove(backend)


def _split_by_backend(tensors: Sequence[torch.Tensor]):
    """Group indices by the backend that claims each tensor (None: local)."""
    groups: dict[int, tuple[Backend | None, list[int]]] = {}
    for i, t in enumerate(tensors):
        owner = next((b for b in _BACKENDS if b.claims(t)), None)
        groups.setdefault(id(owner), (owner, []))[1].append(i)
    return list(groups.values())


#: On the CPU, same-shape stacks are concatenated into batches of at most about this many
#: elements (a stack larger than that goes alone, uncopied): past it, batching gains
#: nothing there and the concatenation and the batch's temporaries only cost memory
#: traffic. On other devices a whole same-shape group is one batch.
CPU_BATCH_ELEMENTS = 1 << 21


def _batches(idx: list[int], stacks: Sequence[torch.Tensor]) -> list[list[int]]:
    if stacks[idx[0]].device.type != "cpu" or torch.compiler.is_compiling():
        return [idx]
    out: list[list[int]] = []
    size = 0
    for i in idx:
        n = stacks[i].numel()
        if out and size + n <= CPU_BATCH_ELEMENTS:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out


def local_map_matrices(fn: MatrixFn, stacks: Sequence[torch.Tensor],
                       overwrite: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Batch same-shape stacks into calls of ``fn``; results in input order.

    A batch with a single stack is passed as it is (no copy). Larger batches are
    concatenated along dim 0, transformed once, and split back into views. On the CPU a
    batch holds at most about :data:`CPU_BATCH_ELEMENTS` elements, elsewhere the whole
    same-shape group. Where ``overwrite[i]`` is true the result is copied into
    ``stacks[i]`` as soon as its batch is done (and ``stacks[i]`` returned), so the
    extra memory is one batch's, not the model's.
    """
    out: list[torch.Tensor | None] = [None] * len(stacks)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(stacks):
        if s.ndim != 3:
            raise ValueError(f"map_matrices takes [k, m, n] stacks, got shape {tuple(s.shape)}")
        groups.setdefault((tuple(s.shape[1:]), s.dtype, s.device), []).append(i)
    for idx in (b for group in groups.values() for b in _batches(group, stacks)):
        if len(idx) == 1:
            pieces = [fn(stacks[idx[0]])]
        else:
            res = fn(torch.cat([stacks[i] for i in idx], dim=0))
            pieces = list(res.split([stacks[i].shape[0] for i in idx], dim=0))
        for i, piece in zip(idx, pieces):
            if overwrite is not None and overwrite[i] and piece.dtype == stacks[i].dtype:
                out[i] = stacks[i].copy_(piece)
            else:
                out[i] = piece
        del pieces
    return out  # type: ignore[return-value]


def map_matrices(fn: MatrixFn, stacks: Sequence[torch.Tensor],
                 overwrite: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Apply the matrix function ``fn`` to each ``[k, m, n]`` stack in ``stacks``.

    ``fn`` must treat the matrices of a batch independently: ``fn(cat(a, b)) ==
    cat(fn(a), fn(b))``. Tensors claimed by a registered backend (e.g. DTensor
    shards) are served by it; the rest are batched locally. ``overwrite[i]`` allows
    writing the result into ``stacks[i]`` (local stacks only).
    """
    if not _BACKENDS:
        return local_map_matrices(fn, stacks, overwrite)
    out: list[torch.Tensor | None] = [None] * len(stacks)
    for backend, idx in _split_by_backend(stacks):
        sub = [stacks[i] for i in idx]
        if backend is None:
            res = local_map_matrices(fn, sub, None if overwrite is None else [overwrite[i] for i in idx])
        else:
            res = backend.map_matrices(fn, sub)
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]


def global_sum(fn: ScalarFn, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum(fn(t) for t in tensors)`` as a 0-d float32 (or float64) tensor.

    ``fn`` maps one tensor to a 0-d tensor and must be additive over any split of
    the tensor's elements (a sum of squares, a count), so that a backend can apply
    it to shards and add the pieces up.
    """
    if len(tensors) == 0:
        return torch.zeros((), dtype=torch.float32)
    parts: list[torch.Tensor] = []
    groups = [(None, list(range(len(tensors))))] if not _BACKENDS else _split_by_backend(tensors)
    for backend, idx in groups:
        sub = [tensors[i] for i in idx]
        if backend is None:
            parts.extend(fn(t) for t in sub)
        else:
            parts.append(backend.global_sum(fn, sub))
    device = parts[0].device
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return torch.stack([p.to(device=device, dtype=dtype) for p in parts]).sum()
