"""The one seam for work that is not elementwise.

Almost every transform is elementwise and runs unchanged on whole tensors or on
shards. Two kinds of work need more, and go through this module only:

* :func:`map_matrices` maps a *matrix function* over a list of matrix stacks.
  A matrix function takes a batch ``[N, m, n]`` and returns a batch of the same
  shape, treating each of the ``N`` matrices independently (Newton-Schulz, per-row
  statistics). Locally, stacks of the same ``(m, n)``, dtype and device are
  transformed in batches bounded in bytes (:mod:`muonfx.linalg.batching`, the one
  batching policy). A matrix function may say which dtype it computes in
  (:func:`compute_dtype`): batches are then put together, and sent between ranks, in
  that dtype (bfloat16 Newton-Schulz on float32 gradients: half the bytes).
* :func:`map_matrix_groups` maps a function of *several* operands per matrix (a
  gradient with the matrices of state that go with it: SOAP's factors and bases) over
  groups of stacks: matrix ``j`` of every stack of a group meets whole in one call (on
  one owner rank under a backend), and the call's results replace them.
* :func:`global_sum` sums a per-tensor scalar over all leaves (global norms,
  non-finite counts). Locally it is a plain sum.
* :func:`sum_over` sums every tensor over some of its dims (per-row or per-matrix
  statistics), for all leaves in one reduction. Locally it is ``t.sum(dims, keepdim=True)``.

Backends (the distributed module installs one for DTensors) claim the tensors they
serve through :func:`register_backend`; transforms never import distributed code,
and backends never know which transform they serve.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from .linalg.batching import batch_bytes, plan_batches
from .linalg.settings import MatrixSettings

MatrixFn = Callable[[torch.Tensor], torch.Tensor]
ScalarFn = Callable[[torch.Tensor], torch.Tensor]
#: ``fn(group, index, matrices) -> matrices``: see :func:`map_matrix_groups`
GroupFn = Callable[[int, int, list], list]

__all__ = ["MatrixFn", "ScalarFn", "GroupFn", "Backend", "register_backend", "unregister_backend",
           "map_matrices", "map_matrix_groups", "global_sum", "sum_over", "local_map_matrices",
           "local_map_parts", "local_map_matrix_groups", "compute_dtype"]


def compute_dtype(fn: MatrixFn, stack: torch.Tensor) -> torch.dtype:
    """The dtype in which ``fn`` reads a batch like ``stack``: ``fn.compute_dtype`` where
    ``fn`` has that attribute (a dtype, or a method taking the stack) and it is narrower
    than ``stack.dtype``, else ``stack.dtype``.

    A matrix function that says it promises that it computes the same result from a
    batch cast to that dtype as from the batch itself (it reads its input at that
    precision), and that its results hold no more precision than that dtype. The seam
    and the backends then cast stacks to it *before* they concatenate or send them
    (a single stack that needs neither goes as it is),
    and cast the results back to the stacks' dtype: the results are the same, bit for
    bit, with fewer bytes copied and sent. Newton-Schulz says it
    (:class:`muonfx.linalg.NewtonSchulz`: bfloat16 on CUDA and CPUs with native bf16).

    Example::

        >>> import torch
        >>> from muonfx import seam
        >>> class Half:
        ...     def compute_dtype(self, stack): return torch.bfloat16
        ...     def __call__(self, batch): return batch.to(torch.bfloat16) * 2
        >>> out = seam.local_map_matrices(Half(), [torch.ones(1, 2, 2), torch.ones(3, 2, 2)])
        >>> [(o.shape[0], o.dtype, o.max().item()) for o in out]
        [(1, torch.float32, 2.0), (3, torch.float32, 2.0)]
    """
    said = getattr(fn, "compute_dtype", None)
    if said is not None and not isinstance(said, torch.dtype):
        said = said(stack)
    return said if said is not None and said.itemsize < stack.dtype.itemsize else stack.dtype


class Backend(Protocol):
    """What a seam backend provides (see ``muonfx.distributed``)."""

    def claims(self, t: torch.Tensor) -> bool:
        """True if this backend serves tensors like ``t``."""

    def map_matrices(self, fn: MatrixFn, stacks: Sequence[torch.Tensor],
                     settings: MatrixSettings | None = None) -> list[torch.Tensor]:
        """Apply ``fn`` to every matrix of every ``[k, m, n]`` stack; same shapes out.
        ``settings``: the step's :class:`~muonfx.linalg.MatrixSettings` (its batch
        budget), passed only when there is one."""

    def map_matrix_groups(self, fn: GroupFn, groups: Sequence[Sequence[torch.Tensor]],
                          settings: MatrixSettings | None = None) -> list[list[torch.Tensor]]:
        """Optional (:func:`map_matrix_groups`): ``fn`` on matrix ``j`` of every stack of
        each group, whole, once in the world; a backend without it has its groups computed
        by :func:`local_map_matrix_groups` on the tensors as they are."""

    def global_sum(self, fn: ScalarFn, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``sum(fn(t) for t in tensors)`` over the logical (whole) tensors, as a local 0-d tensor."""

    def sum_over(self, tensors: Sequence[torch.Tensor], dims: tuple[int, ...]) -> list[torch.Tensor]:
        """``t.sum(dims, keepdim=True)`` of each logical tensor, as tensors of ``t``'s kind."""


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


#: ``inputs(batch) -> tensors``: the inputs of one batch's parts, made when the batch runs
#: (``batch``: its ``(stack, start, stop)`` parts); see :func:`local_map_parts`
Inputs = Callable[[list], list]


def local_map_parts(fn: MatrixFn, stacks: Sequence[torch.Tensor], settings: MatrixSettings | None = None, *,
                    cast_back: bool = True, inputs: Inputs | None = None) -> list[tuple[int, int, int, torch.Tensor]]:
    """Apply ``fn`` to same-shape matrices in batches bounded in bytes: the result of each
    batch's part, ``(stack, start, stop, result)`` (matrices ``start:stop`` of stack
    ``stack``), in the order the batches ran.

    Stacks of the same ``(m, n)``, dtype and device are cut into batches of at most
    ``settings.budget(device type)`` bytes (:class:`~muonfx.linalg.MatrixSettings`; without
    settings the process's :func:`muonfx.linalg.batch_bytes`; see
    :func:`muonfx.linalg.plan_batches`). A batch of one part goes as it is (no copy; ``fn``
    casts it itself); a batch of several parts is concatenated along dim 0 in ``fn``'s
    :func:`compute_dtype`, and its results cast back to the stacks' own dtype, or, with
    ``cast_back=False``, left in ``fn``'s (for a caller that reads them once in a wider
    dtype: the plan's lowered Muon step).

    A matrix function may say the most matrices it wants in one call, ``fn.batch_limit(stack)``
    (an int, or None for no limit): Newton-Schulz on the CPU takes large matrices one at a
    time, so batching them would only copy them together and apart.

    ``inputs`` makes a batch's inputs when the batch runs, from its parts (the stacks then
    only give shapes, dtypes and devices): a caller whose input is itself computed (the
    lowered Muon step's Nesterov momentum) holds one batch of it at a time, not all.
    Inputs are never modified.
    """
    done: list[tuple[int, int, int, torch.Tensor]] = []
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(stacks):
        if s.ndim != 3:
            raise ValueError(f"map_matrices takes [k, m, n] stacks, got shape {tuple(s.shape)}")
        groups.setdefault((tuple(s.shape[1:]), s.dtype, s.device), []).append(i)
    budgets: dict[torch.device, int] = {}
    for (mn, dtype, device), idx in groups.items():
        mat_bytes = mn[0] * mn[1] * stacks[idx[0]].element_size()
        said = getattr(fn, "compute_dtype", None)  # compute_dtype(fn, stack), inline (hot path)
        if said is not None and not isinstance(said, torch.dtype):
            said = said(stacks[idx[0]])
        cdtype = said if said is not None and said.itemsize < dtype.itemsize else dtype
        counts = []
        for i in idx:
            counts.append(stacks[i].shape[0])
        if device not in budgets:
            budgets[device] = batch_bytes(device) if settings is None else settings.budget(device.type)
        budget = budgets[device]
        limit = getattr(fn, "batch_limit", None)  # the most matrices fn wants in one call
        limit = limit(stacks[idx[0]]) if limit is not None else None
        if limit is not None:
            budget = min(budget, limit * mat_bytes)
        for batch in plan_batches(counts, mat_bytes, budget):
            where = [(idx[j], a, b) for j, a, b in batch]
            if inputs is not None:
                parts = list(inputs(where))
            else:
                parts = [stacks[i] if (a, b) == (0, stacks[i].shape[0]) else stacks[i][a:b] for i, a, b in where]
            if len(parts) == 1:
                # one part goes as it is: fn casts it itself, and frees its own copy
                # sooner than a cast made here could be freed
                res: Sequence[torch.Tensor] = (fn(parts.pop()),)
            else:
                if cdtype != dtype:
                    # put together in the dtype fn reads: no float32 copy of a batch that fn
                    # casts to bfloat16 first; the results come back as they would have
                    # (fn's own results hold no more than cdtype)
                    low = []
                    while parts:  # each input freed once cast (inputs made for this batch)
                        low.append(parts.pop(0).to(cdtype))
                    joined = torch.cat(low)
                    del low
                    out = fn(joined)
                    del joined
                    out = out.to(dtype) if cast_back else out
                else:
                    joined = torch.cat(parts, dim=0)
                    del parts
                    out = fn(joined)
                    del joined
                res = out.split([b - a for _, a, b in where], dim=0)
            for (i, a, b), r in zip(where, res):
                done.append((i, a, b, r))
    return done


def local_map_matrices(fn: MatrixFn, stacks: Sequence[torch.Tensor],
                       settings: MatrixSettings | None = None) -> list[torch.Tensor]:
    """Apply ``fn`` to same-shape matrices in batches bounded in bytes (:func:`local_map_parts`);
    results in input order, a stack cut over several batches put back together. Inputs
    are never modified."""
    pieces: dict[int, list[torch.Tensor]] = {}
    for i, _, _, r in local_map_parts(fn, stacks, settings):
        pieces.setdefault(i, []).append(r)
    out = []
    for i, s in enumerate(stacks):
        ps = pieces.get(i)
        if ps is None:  # a stack of zero matrices: nothing to compute
            out.append(s.clone())
        else:
            out.append(ps[0] if len(ps) == 1 else torch.cat(ps, dim=0))
    return out


def map_matrices(fn: MatrixFn, stacks: Sequence[torch.Tensor],
                 settings: MatrixSettings | None = None) -> list[torch.Tensor]:
    """Apply the matrix function ``fn`` to each ``[k, m, n]`` stack in ``stacks``.

    ``fn`` must treat the matrices of a batch independently: ``fn(cat(a, b)) ==
    cat(fn(a), fn(b))``. Tensors claimed by a registered backend (e.g. DTensor
    shards) are served by it; the rest are batched locally (:func:`local_map_matrices`).
    ``settings`` (a step's :class:`~muonfx.linalg.MatrixSettings`) gives the batch
    budgets; None: the process's. Returns new tensors; the inputs are never modified.
    """
    if not _BACKENDS:
        return local_map_matrices(fn, stacks, settings)
    out: list[torch.Tensor | None] = [None] * len(stacks)
    for backend, idx in _split_by_backend(stacks):
        sub = [stacks[i] for i in idx]
        if backend is None:
            res = local_map_matrices(fn, sub, settings)
        else:
            res = backend.map_matrices(fn, sub) if settings is None else backend.map_matrices(fn, sub, settings)
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]


def local_map_matrix_groups(fn: GroupFn, groups: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """:func:`map_matrix_groups` on whole tensors: ``fn`` once per group and matrix, in order."""
    out = []
    for gi, group in enumerate(groups):
        k = group[0].shape[0]
        per: list[list[torch.Tensor]] = [[] for _ in group]
        for j in range(k):
            for acc, r in zip(per, fn(gi, j, [s[j] for s in group])):
                acc.append(r)
        out.append([torch.stack(acc) if acc else s.clone() for acc, s in zip(per, group)])
    return out


def map_matrix_groups(fn: GroupFn, groups: Sequence[Sequence[torch.Tensor]],
                      settings: MatrixSettings | None = None) -> list[list[torch.Tensor]]:
    """Apply ``fn`` to matrix ``j`` of every stack of each group, together.

    ``groups[g]`` is a sequence of ``[k, m_i, n_i]`` stacks with the same ``k`` (a
    gradient and the matrices of state that go with it, which may have other shapes);
    ``fn(g, j, [matrix j of each stack of group g])`` returns a list of matrices of the
    same shapes, which become matrix ``j`` of each of the group's results. Under a
    backend (DTensor shards) the stacks of a group share the backend and the matrices of
    one call meet whole on one owner rank (``fn`` runs there, once in the world), and
    each rank receives its pieces of the results. Returns new tensors, per group in
    order; the inputs are never modified.

    Example::

        >>> import torch
        >>> from muonfx import seam
        >>> def scale_by_trace(g, j, mats):          # a matrix and a factor of its own
        ...     x, f = mats
        ...     return [x / f.trace(), f]
        >>> factor = torch.diag(torch.tensor([1.0, 1.0, 2.0]))[None]
        >>> (x, f), = seam.map_matrix_groups(scale_by_trace, [(torch.ones(1, 2, 3), factor)])
        >>> x.flatten().tolist()
        [0.25, 0.25, 0.25, 0.25, 0.25, 0.25]
    """
    if not _BACKENDS:
        return local_map_matrix_groups(fn, groups)
    out: list = [None] * len(groups)
    for backend, idx in _split_by_backend([g[0] for g in groups]):
        sub = [groups[i] for i in idx]
        for gi, g in zip(idx, sub):
            if any((next((b for b in _BACKENDS if b.claims(t)), None) is not backend) for t in g[1:]):
                raise ValueError(f"map_matrix_groups: the stacks of group {gi} are served by several backends "
                                 "(DTensors with plain tensors); a group's stacks must be of one kind")
        run = getattr(backend, "map_matrix_groups", None)
        if run is None:
            res = local_map_matrix_groups(lambda g, j, mats: fn(idx[g], j, mats), sub)
        else:
            res = run(lambda g, j, mats: fn(idx[g], j, mats), sub, settings)
        for i, r in zip(idx, res):
            out[i] = list(r)
    return out


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


def sum_over(tensors: Sequence[torch.Tensor], dims: tuple[int, ...]) -> list[torch.Tensor]:
    """Each tensor summed over ``dims`` of the whole (logical) tensor, ``keepdim=True``.

    Formula: ``out[i] = tensors[i].sum(dims, keepdim=True)``. Per-row and per-matrix
    statistics (NorMuon's row second moments, per-matrix norms) go through here: a
    backend sums the local pieces and reduces the pieces of a dim that is sharded with
    one collective for all the tensors it serves, and returns tensors of its own kind
    (DTensors with the summed dims replicated). ``dims`` are the same for every tensor
    (negative dims count from the end).

    Example::

        >>> import torch
        >>> from muonfx import seam
        >>> rows, total = seam.sum_over([torch.ones(2, 3), torch.ones(4, 3)], (-1,))
        >>> rows.shape, total.flatten().tolist()
        (torch.Size([2, 1]), [3.0, 3.0, 3.0, 3.0])
    """
    if not _BACKENDS:
        return [t.sum(dims, keepdim=True) for t in tensors]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for backend, idx in _split_by_backend(tensors):
        sub = [tensors[i] for i in idx]
        res = [t.sum(dims, keepdim=True) for t in sub] if backend is None else backend.sum_over(sub, dims)
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]
