"""The hypothesis strategies of :mod:`muonfx.testing` (import them from there).

They know nothing of the laws, which draw their examples with them.

Every strategy keeps its examples small (sides of at most 8 to 16) so that
property suites stay fast. Tensor values come from a drawn integer seed fed to a
``torch.Generator``, not element by element: hypothesis shrinks the seed, the
shapes and the key structure, not individual numbers.
"""

from __future__ import annotations

from typing import Sequence

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

__all__ = [
    "DEFAULT_DTYPES",
    "keys",
    "key_paths",
    "shapes",
    "seeds",
    "random_tensor",
    "param_tensordicts",
    "params_and_grads",
    "singular_values",
    "matrices",
    "as_dtensors",
    "sharded_params_and_grads",
]

#: Floating dtypes drawn by default: the ones parameters are kept in.
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16)

_FIRST = "abcdefghijklmnopqrstuvwxyz"
_REST = _FIRST + "0123456789_"


def keys(max_size: int = 6) -> st.SearchStrategy[str]:
    """Valid TensorDict key names: a lowercase letter followed by up to ``max_size - 1``
    lowercase letters, digits or underscores (never a dot, so a key's dotted name,
    as muonfx shows it, is unambiguous)."""
    if max_size < 1:
        raise ValueError(f"keys: max_size must be >= 1, got {max_size}")
    return st.builds(
        lambda head, tail: head + tail,
        st.sampled_from(_FIRST),
        st.text(alphabet=_REST, max_size=max_size - 1),
    )


@st.composite
def key_paths(draw, min_leaves: int = 1, max_leaves: int = 5, nested: bool = True) -> list[tuple[str, ...]]:
    """A list of distinct leaf keys, each a tuple of 1 or 2 names (2 only if ``nested``).

    No key is a prefix of another (a name is either a leaf or a sub-TensorDict), so
    the list is a valid set of TensorDict leaf keys.
    """
    if not 0 <= min_leaves <= max_leaves:
        raise ValueError(f"key_paths: need 0 <= min_leaves <= max_leaves, got {min_leaves}, {max_leaves}")
    n = draw(st.integers(min_leaves, max_leaves))
    tops = draw(st.lists(keys(), min_size=n, max_size=n, unique=True))
    paths: list[tuple[str, ...]] = []
    remaining = n
    for top in tops:
        if remaining == 0:
            break
        if nested and draw(st.booleans()):
            # a sub-TensorDict with between 1 and the remaining number of leaves (at most 3)
            k = draw(st.integers(1, min(3, remaining)))
            subs = draw(st.lists(keys(), min_size=k, max_size=k, unique=True))
            paths.extend((top, s) for s in subs)
            remaining -= k
        else:
            paths.append((top,))
            remaining -= 1
    return paths


def shapes(min_dims: int = 0, max_dims: int = 4, max_side: int = 8, min_side: int = 1) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes with ``min_dims..max_dims`` dims, each side in ``min_side..max_side``.

    ``min_side=0`` also draws empty tensors.
    """
    if not 0 <= min_dims <= max_dims:
        raise ValueError(f"shapes: need 0 <= min_dims <= max_dims, got {min_dims}, {max_dims}")
    return st.lists(
        st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims
    ).map(tuple)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.Generator.manual_seed``."""
    return st.integers(0, 2**31 - 1)


def random_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A finite ``N(0, scale^2)`` tensor, reproducible from ``seed``.

    Drawn in float64 and cast to ``dtype``, so the values of a given seed and shape
    agree across dtypes up to rounding.
    """
    gen = torch.Generator().manual_seed(int(seed))
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale).to(dtype)


_SCALES = (1e-2, 1.0, 10.0)


def _shape_strategy(shapes_arg, min_ndim: int, max_ndim: int, max_side: int):
    if shapes_arg is None:
        return shapes(min_ndim, max_ndim, max_side=max_side)
    if isinstance(shapes_arg, st.SearchStrategy):
        return shapes_arg
    return st.sampled_from([tuple(s) for s in shapes_arg])


@st.composite
def param_tensordicts(
    draw,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    nested: bool = True,
    min_leaves: int = 1,
    max_leaves: int = 5,
    min_ndim: int = 0,
    max_ndim: int = 4,
    max_side: int = 8,
) -> TensorDict:
    """TensorDicts (batch size ``[]``) shaped like ``TensorDict.from_module(model)``.

    Args:
        shapes: a strategy of shapes, or a list of shapes to sample from; ``None``
            draws shapes with ``min_ndim..max_ndim`` dims and sides ``1..max_side``.
        dtypes: each leaf's dtype is drawn from these.
        nested: allow 2-level keys (``("layer", "weight")``).
        min_leaves, max_leaves: bounds on the number of leaves.

    Values are finite ``N(0, s^2)`` numbers, ``s`` drawn from ``{0.01, 1, 10}``.
    """
    shape_st = _shape_strategy(shapes, min_ndim, max_ndim, max_side)
    paths = draw(key_paths(min_leaves, max_leaves, nested))
    dtype_st = st.sampled_from(list(dtypes))
    out = {}
    for path in paths:
        shape = draw(shape_st)
        dtype = draw(dtype_st)
        seed = draw(seeds())
        scale = draw(st.sampled_from(_SCALES))
        out[path] = random_tensor(shape, dtype, seed, scale)
    return TensorDict(out, batch_size=[])


@st.composite
def params_and_grads(
    draw,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    nested: bool = True,
    min_leaves: int = 1,
    max_leaves: int = 5,
    min_ndim: int = 0,
    max_ndim: int = 4,
    max_side: int = 8,
) -> tuple[TensorDict, TensorDict]:
    """``(params, grads)``: two TensorDicts with identical keys, shapes and dtypes.

    Takes the arguments of :func:`param_tensordicts`; the gradients are independent
    draws (their own seeds and scales).
    """
    params = draw(param_tensordicts(shapes, dtypes, nested, min_leaves, max_leaves, min_ndim, max_ndim, max_side))
    grads = {}
    for k, p in params.items(include_nested=True, leaves_only=True):
        grads[k] = random_tensor(p.shape, p.dtype, draw(seeds()), draw(st.sampled_from(_SCALES)))
    return params, TensorDict(grads, batch_size=[])


@st.composite
def singular_values(draw, n: int, max_cond: float = 10.0) -> torch.Tensor:
    """``n`` singular values (float64, descending) with largest ``1`` and condition
    number ``s_max / s_min`` drawn in ``[1, max_cond]``; the rest are log-uniform
    between the extremes."""
    if n < 1:
        raise ValueError(f"singular_values: n must be >= 1, got {n}")
    if not max_cond >= 1.0:
        raise ValueError(f"singular_values: max_cond must be >= 1, got {max_cond}")
    cond = draw(st.floats(1.0, max_cond))
    gen = torch.Generator().manual_seed(draw(seeds()))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    u[0] = 0.0  # the largest singular value is exactly 1
    if n >= 2:  # and the smallest is 1 / cond: the drawn condition number is attained
        u[-1] = 1.0
    s = torch.exp(-u * torch.log(torch.tensor(cond, dtype=torch.float64)))
    return torch.sort(s, descending=True).values


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A ``rows x cols`` matrix with orthonormal columns (``rows >= cols``), Haar-ish via QR."""
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))


@st.composite
def matrices(
    draw,
    min_side: int = 1,
    max_side: int = 8,
    max_cond: float = 10.0,
    dtype: torch.dtype = torch.float64,
    scales: tuple[float, float] = (1e-2, 1e2),
    batch: int | None = None,
) -> torch.Tensor:
    """Well-conditioned matrices ``c * U diag(s) V^T`` with known spectrum.

    ``U``, ``V`` are random orthonormal, ``s`` comes from :func:`singular_values`
    (largest 1, condition number at most ``max_cond``) and ``c`` is log-uniform in
    ``scales``. The shape ``m x n`` has sides in ``min_side..max_side``. With
    ``batch`` the result is a ``[batch, m, n]`` stack of independent such matrices.
    Built in float64 and cast to ``dtype``.

    The exact polar factor of each matrix is ``U V^T`` and its singular values are
    ``c * s`` (up to the rounding of the cast).
    """
    m = draw(st.integers(min_side, max_side))
    n = draw(st.integers(min_side, max_side))
    k = min(m, n)
    count = 1 if batch is None else batch
    mats = []
    for _ in range(count):
        s = draw(singular_values(k, max_cond))
        lo, hi = scales
        log_c = draw(st.floats(float(torch.log10(torch.tensor(lo))), float(torch.log10(torch.tensor(hi)))))
        gen = torch.Generator().manual_seed(draw(seeds()))
        u = _orthonormal(m, k, gen)
        v = _orthonormal(n, k, gen)
        mats.append((10.0**log_c) * (u * s) @ v.T)
    out = torch.stack(mats) if batch is not None else mats[0]
    return out.to(dtype)



# ---------------------------------------------------------------------------
# DTensor variants (FSDP2-style shards)
# ---------------------------------------------------------------------------


def as_dtensors(td: TensorDict, mesh, placements=None) -> TensorDict:
    """Every leaf of ``td`` distributed over ``mesh`` with ``torch.distributed.tensor``.

    ``placements`` defaults to FSDP2's layout: ``Shard(0)`` on every mesh dim for leaves
    with at least one dim (uneven and empty shards included), ``Replicate()`` for 0-D
    leaves. Every rank must pass the same ``td`` (draw it with the same seed on every
    rank, e.g. ``settings(derandomize=True)``). Needs an initialised process group.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for k, t in td.items(include_nested=True, leaves_only=True):
        pl = placements if placements is not None else (
            [Shard(0)] * mesh.ndim if t.ndim > 0 else [Replicate()] * mesh.ndim)
        out[k] = distribute_tensor(t, mesh, pl)
    return TensorDict(out, batch_size=[])


@st.composite
def sharded_params_and_grads(draw, mesh, placements=None, **kwargs) -> tuple[TensorDict, TensorDict]:
    """:func:`params_and_grads` with every leaf a DTensor on ``mesh`` (see :func:`as_dtensors`).

    Compare against a single-process run with ``t.full_tensor()``. Keyword arguments
    go to :func:`params_and_grads`.
    """
    params, grads = draw(params_and_grads(**kwargs))
    return as_dtensors(params, mesh, placements), as_dtensors(grads, mesh, placements)
