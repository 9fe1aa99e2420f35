"""A step computed on fake tensors: what a group's transform would do, without data.

Running a group's pure update on fake tensors (``torch._subclasses.FakeTensorMode``: the
shapes, dtypes and devices of its gradients, parameters and state, no data, no
arithmetic) finds before anything is written every
error that depends on shapes, dtypes and kinds alone (a 1-D parameter in a Muon group, a
parameter resized since its state was made), and, through a seam backend that serves
fake tensors, which matrices the transform hands to the seam and how it would
orthogonalise them. The step plan uses it for groups that run in pieces (so that a step
in pieces changes nothing when it raises) and to describe itself (``print(opt.plan)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from ... import seam, tree
from ...core import Key, MatrixView, build, td_items
from ...core.view import label_of
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["MatrixWork", "DryRun", "dry_run", "fake_state"]


@dataclass(frozen=True)
class MatrixWork:
    """One batch of same-shape matrices the transform hands to the seam's matrix map."""

    rows: int
    cols: int
    count: int
    dtype: torch.dtype
    fn: Any
    view: tuple[MatrixView, tuple[int, ...]] | None = None  # an overridden view and its tensor's shape

    def compute(self, device: torch.device) -> tuple[str, str, str]:
        """``(dtype, method, products)`` the matrix function computes this batch with on
        ``device``: the Newton-Schulz compute dtype, its form, and whose products."""
        from ...linalg.newton_schulz import NewtonSchulz

        fn = self.fn
        pinned = getattr(fn, "pinned", None)
        if not isinstance(fn, NewtonSchulz):
            fn = getattr(fn, "ns", None)  # (newton_schulz's per-batch wrapper: the dtype per device)
            if not isinstance(fn, NewtonSchulz):
                return ("-", type(self.fn).__name__, "-")
            if self.dtype != torch.float64:
                fn = NewtonSchulz(fn.schedule, fn.eps, pinned, fn.method, fn.restart, fn.accuracy, fn.triton)
        return fn.route(self.rows, self.cols, self.dtype, device)


@dataclass
class DryRun:
    """What a dry run saw: the matrix batches handed to the seam (in order)."""

    matrices: list[MatrixWork] = field(default_factory=list)


class _FakeBackend:
    """A seam backend for fake tensors: records the matrix work, computes nothing."""

    def __init__(self, record: DryRun) -> None:
        self.record = record

    def claims(self, t: torch.Tensor) -> bool:
        return isinstance(t, FakeTensor)

    def map_matrices(self, fn, stacks: Sequence[torch.Tensor], settings: Any = None) -> list[torch.Tensor]:
        for s in stacks:
            self.record.matrices.append(MatrixWork(int(s.shape[-2]), int(s.shape[-1]), int(s.shape[0]), s.dtype, fn,
                                                   label_of(s)))
        return [torch.empty_like(s) for s in stacks]

    def map_matrix_groups(self, fn, groups: Sequence[Sequence[torch.Tensor]], settings: Any = None) -> list:
        for g in groups:
            s = g[0]
            self.record.matrices.append(MatrixWork(int(s.shape[-2]), int(s.shape[-1]), int(s.shape[0]), s.dtype, fn))
        return [[torch.empty_like(s) for s in g] for g in groups]

    def global_sum(self, fn, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")

    def sum_over(self, tensors: Sequence[torch.Tensor], dims: tuple[int, ...]) -> list[torch.Tensor]:
        return [t.sum(dims, keepdim=True) for t in tensors]


def fake_state(state: Any, mode: FakeTensorMode) -> Any:
    """``state`` with every tensor replaced by a fake tensor like it (of ``mode``)."""
    leaves, spec = tree.flatten(state)
    out = []
    for leaf in leaves:
        if isinstance(leaf, TensorDictBase):
            ks, vs = td_items(leaf)
            out.append(build(ks, [mode.from_tensor(v.detach()) if isinstance(v, torch.Tensor) else v for v in vs]))
        elif isinstance(leaf, torch.Tensor):
            out.append(mode.from_tensor(leaf.detach()))
        else:
            out.append(leaf)
    return tree.unflatten(out, spec)


def dry_run(transform: Any, keys: Sequence[Key], params: Sequence[torch.Tensor], state: Any | None,
            extra: dict | None = None) -> DryRun:
    """Run ``transform.update`` on fake copies of ``params`` (as gradients and as
    parameters) and of ``state`` (``None``: a fresh ``init``), with fake copies of the
    step's extra arguments ``extra``; return what the seam saw. Raises what the update
    raises."""
    record = DryRun()
    backend = _FakeBackend(record)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    seam.register_backend(backend)
    try:
        with torch.no_grad():
            ps = [mode.from_tensor(p.detach()) for p in params]
            st = None if state is None else fake_state(state, mode)
            xs = fake_state(extra, mode) if extra else {}
            with mode:
                grads = build(list(keys), [torch.empty_like(p) for p in ps])
                p_td = build(list(keys), ps)
                transform.update(grads, transform.init(p_td) if st is None else st, p_td, **xs)
    finally:
        seam.unregister_backend(backend)
    return record
