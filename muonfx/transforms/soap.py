"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al., 2024,
arXiv 2409.11321)."""

from __future__ import annotations

import math
from itertools import chain as _chain
from typing import NamedTuple

import torch
from tensordict import TensorDict

from .. import seam
from .._compat.dtensor import dtensor_class, dtensor_stack_views, row_sharded_like, unstack_like
from ..core import GradientTransformation, LeafwiseTransformation, aligned, build, leaves, zeros_like_leaves
from ..counts import Counts, advance, of, zeros
from ..hyperparams import check
from ..linalg.settings import EXTRA_ARG


class ScaleBySoapState(NamedTuple):
    """State of :func:`scale_by_soap`.

    Attributes:
        count: updates made so far, per parameter (the first only builds the basis).
        mu: Adam's first moment, in the eigenbasis, per parameter.
        nu: Adam's second moment, in the eigenbasis, per parameter.
        factors: Shampoo's factors (``E[G G^T]`` per preconditioned dimension), keyed
            ``parameter key + ("dim<i>",)``.
        bases: their eigenbases (columns by decreasing eigenvalue), keyed as ``factors``.
    """

    count: Counts
    mu: TensorDict
    nu: TensorDict
    factors: TensorDict
    bases: TensorDict


def _merged_shape(shape: tuple[int, ...], max_dim: int) -> list[int]:
    """Adjacent dimensions merged while their product stays <= ``max_dim`` (the
    reference's ``merge_dims``)."""
    out, cur = [], 1
    for sh in shape:
        if cur * sh > max_dim:
            if cur > 1:
                out.append(cur)
                cur = sh
            else:
                out.append(sh)
                cur = 1
        else:
            cur *= sh
    if cur > 1 or not out:
        out.append(cur)
    return out


def scale_by_soap(b1: float = 0.95, b2: float = 0.95, shampoo_beta: float | None = None, eps: float = 1e-8,
                  precondition_frequency: int = 10, max_precond_dim: int = 10000, merge_dims: bool = False,
                  precondition_1d: bool = False, normalize_grads: bool = False) -> GradientTransformation:
    """SOAP's direction (the authors' ``soap.py``, nikhilvyas/SOAP at f42d296).

    Per parameter ``G`` (viewed with merged dimensions under ``merge_dims``), one factor
    per dimension of size ``<= max_precond_dim`` (1-D only with ``precondition_1d``)::

        L_i <- lerp(L_i, G contracted with itself over every dim but i, 1 - shampoo_beta)
        first update: Q_i = eigenvectors of L_i (by decreasing eigenvalue); out = 0
        then:  g' = G x_i Q_i                        (projected: Q_i^T along each dim)
               mu <- b1 mu + (1 - b1) g';  nu <- b2 nu + (1 - b2) g'^2
               out = (sqrt(1 - b2^t) / (1 - b1^t)) * (mu / (sqrt(nu) + eps)) x_i Q_i^T
               every precondition_frequency updates: Q_i <- QR(L_i Q_i) (one power
               iteration, columns sorted by Q_i^T L_i Q_i's diagonal, nu permuted alike)
               mu follows the basis (back to the original space and into the new one)

    A side larger than ``max_precond_dim`` keeps the identity (a one-sided basis).
    ``shampoo_beta=None`` takes ``b2``. ``normalize_grads`` divides ``out`` by its RMS.
    Eigen-decompositions and QR in float32, as the reference's. Leafwise. On DTensors
    (FSDP2, HSDP, tensor parallel and FSDP2 + TP shards) a parameter's whole gradient, its
    moments, factors and bases meet on one owner rank through
    :func:`muonfx.seam.map_matrix_groups` (the matrix exchange Newton-Schulz takes), which
    runs the step above and sends each rank its pieces: the update is the one process's.
    The moments are stored as the parameter is; the factors and bases as DTensors on its
    mesh, cut along their rows over every mesh dim that cuts the parameter.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.randn(4, 3)}, [])
        >>> tx = mfx.scale_by_soap()
        >>> out, s = tx.update(g, tx.init(g))          # the first update builds the basis
        >>> bool((out["w"] == 0).all()), s.bases[("w", "dim0")].shape
        (True, torch.Size([4, 4]))
    """
    step = SoapStep(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims, precondition_1d,
                    normalize_grads)
    view_shape, sides, leaf_step = step.view_shape, step.sides, step.leaf

    def init_fn(params):
        keys, ps = leaves(params, "params")
        fk, fv, bv = [], [], []
        cls = dtensor_class()
        for k, p in zip(keys, ps):
            for i, (sh, on) in enumerate(zip(view_shape(p), sides(p))):
                if on:
                    fk.append(k + (f"dim{i}",))
                    f = torch.zeros(sh, sh, dtype=p.dtype, device=_local_device(p, cls))
                    q = torch.eye(sh, dtype=p.dtype, device=f.device)
                    if cls is not None and isinstance(p, cls):  # spread over the parameter's ranks
                        f, q = row_sharded_like(p, f), row_sharded_like(p, q)
                    fv.append(f)
                    bv.append(q)
        return ScaleBySoapState(zeros(keys), zeros_like_leaves(keys, ps),
                                zeros_like_leaves(keys, ps), build(fk, fv), build(fk, bv))

    def update_fn(updates, state, params=None, **extra_args):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "soap state (mu)", like=gs)
        vs = aligned(state.nu, keys, "soap state (nu)", like=gs)
        counts = of(state.count, keys, "soap state (count)")
        cls = dtensor_class()
        fk = list(state.factors.keys(include_nested=True, leaves_only=True))
        factors = {k: state.factors.get(k) for k in fk}
        bases = {k: state.bases.get(k) for k in fk}
        outs, new_ms, new_vs = [None] * len(keys), [None] * len(keys), [None] * len(keys)
        sharded = []  # (leaf position, factor keys): DTensor leaves with factors, through the seam

        def keep(n, f_keys, res):
            outs[n], new_ms[n], new_vs[n] = res[:3]
            for f, F, Q in zip(f_keys, res[3], res[4]):
                if f is not None:
                    factors[f], bases[f] = F, Q

        for n, (k, g, m, v, t) in enumerate(zip(keys, gs, ms, vs, counts)):
            f_keys = [k + (f"dim{i}",) if o else None for i, o in enumerate(sides(g))]
            if cls is not None and isinstance(g, cls) and any(f_keys) and g.numel() > 0:
                sharded.append((n, f_keys))
                continue
            keep(n, f_keys, leaf_step(g, m, v, [factors[f] if f else None for f in f_keys],
                                      [bases[f] if f else None for f in f_keys], t))
        if sharded:
            _through_seam(sharded, gs, ms, vs, counts, factors, bases, leaf_step, keep, extra_args.get(EXTRA_ARG))
        return build(keys, outs), ScaleBySoapState(advance(state.count), build(keys, new_ms), build(keys, new_vs),
                                                   build(fk, [factors[f] for f in fk]), build(fk, [bases[f] for f in fk]))

    return LeafwiseTransformation(init_fn, update_fn)


class SoapStep:
    """One parameter's SOAP step on whole tensors, for the settings of
    :func:`scale_by_soap` (checked here): :meth:`leaf`. Shared by the transform and the
    plan's lowering (:mod:`muonfx.optim.step.fused_soap`), which passes ``grams``."""

    def __init__(self, b1: float, b2: float, shampoo_beta: float | None, eps: float, precondition_frequency: int,
                 max_precond_dim: int, merge_dims: bool, precondition_1d: bool, normalize_grads: bool) -> None:
        self.b1, self.b2, self.eps = check("b1", b1), check("b2", b2), check("eps", eps)
        self.sb = self.b2 if shampoo_beta is None or shampoo_beta < 0 else check("shampoo_beta", shampoo_beta)
        for name, v in (("precondition_frequency", precondition_frequency), ("max_precond_dim", max_precond_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"scale_by_soap: {name} must be an int >= 1, got {v!r}")
        self.frequency, self.max_dim = precondition_frequency, max_precond_dim
        self.merge, self.p1d, self.normalize = merge_dims, precondition_1d, normalize_grads

    def view_shape(self, p: torch.Tensor) -> list[int]:
        """The shape the step views ``p`` by (merged dims under ``merge_dims``)."""
        if p.ndim <= 1:
            return list(p.shape) or [1]
        return _merged_shape(tuple(p.shape), self.max_dim) if self.merge else list(p.shape)

    def sides(self, p: torch.Tensor) -> list[bool]:
        """Per dimension of the view, whether it has a factor and a basis."""
        shape = self.view_shape(p)
        if p.ndim <= 1:
            return [self.p1d and shape[0] <= self.max_dim]
        return [sh <= self.max_dim for sh in shape]

    def refreshes(self, t: int) -> bool:
        """Whether the update at count ``t`` builds or refreshes the bases."""
        return t == 0 or t % self.frequency == 0

    def leaf(self, g, m, v, Fs, Qs, t, grams=None):
        """One parameter's step: ``(out, mu, nu, factors, bases)``, new tensors (its
        inputs are not written). ``grams`` (given by the lowering where the bases stay):
        ``Q_i^T Q_i`` per basis (None where there is none); the moment's way back to the
        original space and into the same basis, ``Q_i^T (Q_i mu)`` per dimension, is then
        ``(Q_i^T Q_i) mu``, one product per dimension instead of two (the same in exact
        arithmetic; ``Q_i`` is orthogonal to float32 rounding, so it is not the identity),
        and the factors come back as the new gradient's outer products, for the caller
        to lerp into the factors (``lerp(F, outer, 1 - shampoo_beta)``, as here): this
        step does not read them."""
        b1, b2, eps = self.b1, self.b2, self.eps
        shape = self.view_shape(g)
        gv = g.reshape(shape)
        stays = grams is not None and not self.refreshes(t)
        new_F = []
        for i, F in enumerate(Fs):
            if F is None:
                new_F.append(None)
                continue
            o = _outer(gv, i)
            new_F.append(o if stays else torch.lerp(F, o, 1.0 - self.sb, out=o))
        if t == 0:  # the basis from the first gradient; no step
            new_Q = [None if F is None else _eigenbasis(F) for F in new_F]
            return torch.zeros_like(g), m.clone(), v.clone(), new_F, new_Q
        gp = _project(gv, Qs)
        mu = (m.reshape(shape) * b1).add_(gp, alpha=1.0 - b1)
        nu = (v.reshape(shape) * b2).add_(gp.square(), alpha=1.0 - b2)
        d = nu.sqrt().add_(eps)
        ng = _project_back(torch.div(mu, d, out=d), Qs)
        if self.normalize:
            ng = ng / (1e-30 + torch.mean(ng**2) ** 0.5)
        out = ng.mul_(math.sqrt(1.0 - b2**t) / (1.0 - b1**t)).reshape(g.shape).contiguous()
        new_Q = list(Qs)
        if stays:
            mu = _project(mu, grams)
        else:
            mu_orig = _project_back(mu, Qs)
            if t % self.frequency == 0:
                for i, (F, Q) in enumerate(zip(new_F, Qs)):
                    if F is None:
                        continue
                    f32, q32 = F.float(), Q.float()
                    order = torch.argsort(torch.diag(q32.T @ f32 @ q32), descending=True)
                    nu = nu.index_select(i, order)
                    new_Q[i] = torch.linalg.qr(f32 @ q32[:, order])[0].to(Q.dtype).contiguous()
            mu = _project(mu_orig, new_Q)
        # state in the default (row-major) layout: a stored layout must not change
        # what the next step's products compute (the adapter copies into its buffers)
        return out, mu.reshape(g.shape).contiguous(), nu.reshape(g.shape).contiguous(), new_F, new_Q


def _local_device(p: torch.Tensor, cls) -> torch.device:
    return p.to_local().device if cls is not None and isinstance(p, cls) else p.device


def _whole_view(t: torch.Tensor) -> tuple[int, int]:
    """The ``[a, b]`` matrix a leaf travels as (its first dim by the rest; 1-D: one row)."""
    if t.ndim <= 1:
        return 1, t.numel()
    return int(t.shape[0]), int(t.numel() // t.shape[0])


def _through_seam(sharded, gs, ms, vs, counts, factors, bases, leaf_step, keep, settings) -> None:
    """SOAP's steps of DTensor leaves: each leaf's gradient, moments, factors and bases
    meet whole on one owner rank (:func:`muonfx.seam.map_matrix_groups`), which runs the
    step and sends every rank its pieces of the results."""
    groups, metas = [], []
    for n, f_keys in sharded:
        g, ab = gs[n], _whole_view(gs[n])
        on = [f for f in f_keys if f is not None]
        if g.ndim == 2 and not torch.is_grad_enabled():  # the shards' own views (as Newton-Schulz's)
            mats = dtensor_stack_views([g, ms[n], vs[n]], [ab] * 3)
        else:
            mats = [x.reshape(1, *ab) for x in (g, ms[n], vs[n])]
        for f in on:
            mats += [factors[f].unsqueeze(0), bases[f].unsqueeze(0)]
        groups.append(mats)
        metas.append((n, f_keys, tuple(g.shape), ab))

    def run(gi: int, j: int, mats: list) -> list:
        n, f_keys, shape, ab = metas[gi]
        g, m, v = (x.reshape(shape) for x in mats[:3])
        it = iter(mats[3:])
        Fs, Qs = [], []
        for f in f_keys:
            Fs.append(next(it) if f is not None else None)
            Qs.append(next(it) if f is not None else None)
        out, mu, nu, new_F, new_Q = leaf_step(g, m, v, Fs, Qs, counts[n])
        res = [out.reshape(ab), mu.reshape(ab), nu.reshape(ab)]
        for F, Q in zip(new_F, new_Q):
            if F is not None:
                res += [F, Q]
        return res

    for (n, f_keys, _, _), res in zip(metas, seam.map_matrix_groups(run, groups, settings)):
        on = [f for f in f_keys if f is not None]
        likes = [gs[n], ms[n], vs[n]] + [x for f in on for x in (factors[f], bases[f])]
        back = iter(unstack_like(res, likes))  # each result in the shape (and layout) of its input
        out, mu, nu = next(back), next(back), next(back)
        new_F, new_Q = [], []
        for f in f_keys:
            new_F.append(next(back) if f is not None else None)
            new_Q.append(next(back) if f is not None else None)
        keep(n, f_keys, (out, mu, nu, new_F, new_Q))


def _outer(g: torch.Tensor, i: int) -> torch.Tensor:
    """``g`` contracted with itself over every dimension but ``i``. A matrix's are the
    products ``tensordot`` makes of it (``g g^T`` and ``g^T g``), called directly."""
    if g.ndim == 2:
        return torch.mm(g, g.T) if i == 0 else torch.mm(g.T, g)
    dims = [*_chain(range(i), range(i + 1, g.ndim))]
    return torch.tensordot(g, g, dims=[dims, dims])


def _eigenbasis(f: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of ``f`` by decreasing eigenvalue, computed in float32."""
    f32 = f.float()
    _, q = torch.linalg.eigh(f32 + 1e-30 * torch.eye(f32.shape[0], device=f32.device))
    return torch.flip(q, [1]).to(f.dtype).contiguous()


def _project(x: torch.Tensor, qs: list) -> torch.Tensor:
    """``x`` with ``Q_i^T`` applied along each dimension (the identity where no basis). A
    matrix's steps are the products ``tensordot`` makes (``x^T Q``), called directly."""
    for q in qs:
        if q is None:
            x = x.permute(*range(1, x.ndim), 0)
        else:
            x = torch.mm(x.T, q) if x.ndim == 2 else torch.tensordot(x, q, dims=[[0], [0]])
    return x


def _project_back(x: torch.Tensor, qs: list) -> torch.Tensor:
    """``x`` with ``Q_i`` applied along each dimension (:func:`_project`'s inverse)."""
    for q in qs:
        if q is None:
            x = x.permute(*range(1, x.ndim), 0)
        else:
            x = torch.mm(x.T, q.T) if x.ndim == 2 else torch.tensordot(x, q, dims=[[0], [1]])
    return x
