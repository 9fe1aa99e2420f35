"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al., 2024,
arXiv 2409.11321)."""

from __future__ import annotations

import math
from itertools import chain as _chain
from typing import NamedTuple

import torch
from tensordict import TensorDict

from .._compat.dtensor import dtensor_class
from ..core import (GradientTransformation, LeafwiseTransformation, aligned, build, key_str, leaves,
                    zeros_like_leaves)
from ..counts import Counts, advance, of, zeros
from ..hyperparams import check


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
    Eigen-decompositions and QR in float32, as the reference's. Leafwise. Plain tensors
    only for now: a DTensor leaf (FSDP2, TP) is refused by name.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> g = TensorDict({"w": torch.randn(4, 3)}, [])
        >>> tx = mfx.scale_by_soap()
        >>> out, s = tx.update(g, tx.init(g))          # the first update builds the basis
        >>> bool((out["w"] == 0).all()), s.bases[("w", "dim0")].shape
        (True, torch.Size([4, 4]))
    """
    b1, b2, eps = check("b1", b1), check("b2", b2), check("eps", eps)
    sb = b2 if shampoo_beta is None or shampoo_beta < 0 else check("shampoo_beta", shampoo_beta)
    for name, v in (("precondition_frequency", precondition_frequency), ("max_precond_dim", max_precond_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"scale_by_soap: {name} must be an int >= 1, got {v!r}")

    def view_shape(p: torch.Tensor) -> list[int]:
        if p.ndim <= 1:
            return list(p.shape) or [1]
        return _merged_shape(tuple(p.shape), max_precond_dim) if merge_dims else list(p.shape)

    def sides(p: torch.Tensor) -> list[bool]:
        shape = view_shape(p)
        if p.ndim <= 1:
            return [precondition_1d and shape[0] <= max_precond_dim]
        return [sh <= max_precond_dim for sh in shape]

    def init_fn(params):
        keys, ps = leaves(params, "params")
        fk, fv, bv = [], [], []
        for k, p in zip(keys, ps):
            for i, (sh, on) in enumerate(zip(view_shape(p), sides(p))):
                if on:
                    fk.append(k + (f"dim{i}",))
                    fv.append(torch.zeros(sh, sh, dtype=p.dtype, device=p.device))
                    bv.append(torch.eye(sh, dtype=p.dtype, device=p.device))
        return ScaleBySoapState(zeros(keys), zeros_like_leaves(keys, ps),
                                zeros_like_leaves(keys, ps), build(fk, fv), build(fk, bv))

    def update_fn(updates, state, params=None):
        keys, gs = leaves(updates)
        ms = aligned(state.mu, keys, "soap state (mu)", like=gs)
        vs = aligned(state.nu, keys, "soap state (nu)", like=gs)
        counts = of(state.count, keys, "soap state (count)")
        cls = dtensor_class()
        fk, fv = list(state.factors.keys(include_nested=True, leaves_only=True)), None
        factors = {k: state.factors.get(k) for k in fk}
        bases = {k: state.bases.get(k) for k in fk}
        outs, new_ms, new_vs = [], [], []
        for k, g, m, v, t in zip(keys, gs, ms, vs, counts):
            if cls is not None and isinstance(g, cls):
                raise ValueError(f"scale_by_soap: leaf {key_str(k)!r} is a DTensor; SOAP runs on whole tensors "
                                 "(FSDP2 and tensor-parallel layouts are not supported yet)")
            shape = view_shape(g)
            on = sides(g)
            fkeys = [k + (f"dim{i}",) if o else None for i, o in enumerate(on)]
            Fs = [factors[f] if f else None for f in fkeys]
            Qs = [bases[f] if f else None for f in fkeys]
            gv = g.reshape(shape)
            new_F = [None if F is None else torch.lerp(F, _outer(gv, i), 1.0 - sb) for i, F in enumerate(Fs)]
            if t == 0:  # the basis from the first gradient; no step
                new_Q = [None if F is None else _eigenbasis(F) for F in new_F]
                outs.append(torch.zeros_like(g))
                new_ms.append(m.clone())
                new_vs.append(v.clone())
            else:
                s = t
                gp = _project(gv, Qs)
                mu = (m.reshape(shape) * b1).add_(gp, alpha=1.0 - b1)
                nu = (v.reshape(shape) * b2).add_(gp.square(), alpha=1.0 - b2)
                ng = _project_back(mu / (nu.sqrt() + eps), Qs)
                if normalize_grads:
                    ng = ng / (1e-30 + torch.mean(ng**2) ** 0.5)
                outs.append((ng * (math.sqrt(1.0 - b2**s) / (1.0 - b1**s))).reshape(g.shape).contiguous())
                mu_orig = _project_back(mu, Qs)
                new_Q = list(Qs)
                if s % precondition_frequency == 0:
                    for i, (F, Q) in enumerate(zip(new_F, Qs)):
                        if F is None:
                            continue
                        f32, q32 = F.float(), Q.float()
                        order = torch.argsort(torch.diag(q32.T @ f32 @ q32), descending=True)
                        nu = nu.index_select(i, order)
                        new_Q[i] = torch.linalg.qr(f32 @ q32[:, order])[0].to(Q.dtype).contiguous()
                # state in the default (row-major) layout: a stored layout must not change
                # what the next step's products compute (the adapter copies into its buffers)
                new_ms.append(_project(mu_orig, new_Q).reshape(g.shape).contiguous())
                new_vs.append(nu.reshape(g.shape).contiguous())
            for f, F, Q in zip(fkeys, new_F, new_Q):
                if f is not None:
                    factors[f], bases[f] = F, Q
        return build(keys, outs), ScaleBySoapState(advance(state.count), build(keys, new_ms), build(keys, new_vs),
                                                   build(fk, [factors[f] for f in fk]), build(fk, [bases[f] for f in fk]))

    return LeafwiseTransformation(init_fn, update_fn)


def _outer(g: torch.Tensor, i: int) -> torch.Tensor:
    """``g`` contracted with itself over every dimension but ``i``."""
    dims = [*_chain(range(i), range(i + 1, g.ndim))]
    return torch.tensordot(g, g, dims=[dims, dims])


def _eigenbasis(f: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of ``f`` by decreasing eigenvalue, computed in float32."""
    f32 = f.float()
    _, q = torch.linalg.eigh(f32 + 1e-30 * torch.eye(f32.shape[0], device=f32.device))
    return torch.flip(q, [1]).to(f.dtype).contiguous()


def _project(x: torch.Tensor, qs: list) -> torch.Tensor:
    """``x`` with ``Q_i^T`` applied along each dimension (the identity where no basis)."""
    for q in qs:
        x = torch.tensordot(x, q, dims=[[0], [0]]) if q is not None else x.permute(*range(1, x.ndim), 0)
    return x


def _project_back(x: torch.Tensor, qs: list) -> torch.Tensor:
    """``x`` with ``Q_i`` applied along each dimension (:func:`_project`'s inverse)."""
    for q in qs:
        x = torch.tensordot(x, q, dims=[[0], [1]]) if q is not None else x.permute(*range(1, x.ndim), 0)
    return x
