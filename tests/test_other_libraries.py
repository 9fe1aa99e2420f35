"""Other Muon libraries' by-design differences, each reachable by name in muonfx and
checked against the library's formula, written out here in plain torch (float64).

* optax ``contrib.muon``: bias-corrected Nesterov momentum, NAdamW for non-matrices
  (:func:`muonfx.optax_muon`, :func:`muonfx.bias_corrected_momentum`,
  ``scale_by_adam(nesterov=True)``);
* dion's ``adjust_lr=None``: no shape scale (``adjust_lr="none"``);
* modded-nanogpt's NorMuon: wide matrices normalised per column, cautious weight decay
  scaled by ``lr^2`` times the shape factor (:func:`muonfx.modded_nanogpt_normuon`,
  ``row_normalize(axis="larger")``);
* Moonlight's AdamW: epsilon before the bias correction
  (``moonlight(adamw_eps_before_bias_correction=True)``,
  ``scale_by_adam(eps_before_bias_correction=True)``).
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx

F64 = torch.float64
KELLER = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def ns_reference(g: torch.Tensor, coefficients, eps: float, safety: float = 1.0) -> torch.Tensor:
    """Quintic Newton-Schulz as the references write it: transpose tall matrices,
    X / (safety * ||X|| + eps), then X <- a X + (b A + c A A) X with A = X X^T."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() * safety + eps)
    for a, b, c in coefficients:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def run(tx, params: TensorDict, grads: list[TensorDict]) -> list[TensorDict]:
    """The parameters after each step of ``tx`` (functional loop)."""
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update(g, state, params)
        params = mfx.apply_updates(params, u)
        out.append(params)
    return out


def data(shapes: dict, steps: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = TensorDict({k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}, [])
    grads = [TensorDict({k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}, [])
             for _ in range(steps)]
    return params, grads


# -- optax contrib.muon ------------------------------------------------------------------


def optax_muon_reference(params, grads, lr, beta, eps, wd, b1, b2, adam_wd, nesterov):
    """optax.contrib.muon: 2-D leaves Muon with bias-corrected (Nesterov) momentum and
    Keller's width scale sqrt(max(1, fan_out / fan_in)) (a torch weight [out, in] is
    optax's [in, out] transposed, so fan_out / fan_in = rows / cols here); other leaves
    optax.adamw(nesterov=nesterov) (NAdamW)."""
    p = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    out = []
    for t, g in enumerate(grads, start=1):
        for k in p:
            gk = g[k]
            if p[k].ndim == 2:
                mu[k] = beta * mu[k] + (1 - beta) * gk
                if nesterov:
                    mhat = beta * mu[k] / (1 - beta ** (t + 1)) + (1 - beta) * gk / (1 - beta**t)
                else:
                    mhat = mu[k] / (1 - beta**t)
                o = ns_reference(mhat, [KELLER] * 5, eps)
                rows, cols = p[k].shape
                u = math.sqrt(max(1.0, rows / cols)) * o + wd * p[k]
            else:
                mu[k] = b1 * mu[k] + (1 - b1) * gk
                nu[k] = b2 * nu[k] + (1 - b2) * gk * gk
                if nesterov:
                    mhat = b1 * mu[k] / (1 - b1 ** (t + 1)) + (1 - b1) * gk / (1 - b1**t)
                else:
                    mhat = mu[k] / (1 - b1**t)
                vhat = nu[k] / (1 - b2**t)
                u = mhat / (vhat.sqrt() + eps) + adam_wd * p[k]
            p[k] = p[k] - lr * u
        out.append({k: v.clone() for k, v in p.items()})
    return out


@pytest.mark.parametrize("nesterov", [True, False])
def test_optax_muon_matches_optax_formula(nesterov):
    params, grads = data({"w": (12, 6), "v": (6, 10), "b": (6,)})
    kw = dict(lr=0.05, beta=0.9, eps=1e-8, wd=0.1, b1=0.8, b2=0.99, adam_wd=0.01, nesterov=nesterov)
    ref = optax_muon_reference(params, grads, **kw)
    tx = mfx.optax_muon(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=nesterov, adam_b1=0.8, adam_b2=0.99,
                        adam_weight_decay=0.01, ns_dtype=F64)
    got = run(tx, params, grads)
    for step, (r, o) in enumerate(zip(ref, got)):
        for k in r:
            # optax normalises by ||X|| + eps, muonfx by max(||X||, eps): relative eps / ||X||
            torch.testing.assert_close(o[k], r[k], rtol=1e-7, atol=1e-9, msg=f"step {step} leaf {k}")
    if nesterov:  # and it is not mfx.muon's arithmetic: steps differ from the second one on
        plain = run(mfx.muon(lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=F64, eps=1e-8),
                    params.select("w", "v"), [g.select("w", "v") for g in grads])
        d0 = (got[0]["w"] - params["w"]) - (plain[0]["w"] - params["w"])
        d1 = (got[1]["w"] - got[0]["w"]) - (plain[1]["w"] - plain[0]["w"])
        assert d0.abs().max() < 1e-9 and d1.norm() > 0.05 * (plain[1]["w"] - plain[0]["w"]).norm()


def test_bias_corrected_momentum_and_nadam_formulas():
    g1, g2 = torch.tensor([1.0, -2.0], dtype=F64), torch.tensor([0.5, 4.0], dtype=F64)
    beta = 0.9
    tx = mfx.bias_corrected_momentum(beta, nesterov=True)
    s = tx.init(TensorDict({"x": g1}, []))
    _, s = tx.update(TensorDict({"x": g1}, []), s)
    out, s = tx.update(TensorDict({"x": g2}, []), s)
    m2 = beta * (1 - beta) * g1 + (1 - beta) * g2
    torch.testing.assert_close(out["x"], beta * m2 / (1 - beta**3) + (1 - beta) * g2 / (1 - beta**2), rtol=1e-14,
                               atol=0)
    assert s.count == 2
    with pytest.raises(ValueError, match="beta must be in"):
        mfx.bias_corrected_momentum(1.0)


# -- dion: adjust_lr=None ---------------------------------------------------------------


def test_adjust_lr_none_is_dions_no_shape_scale():
    """dion's Muon with adjust_lr=None: W <- W * (1 - lr * wd) - lr * NS(M), whatever the shape."""
    params, grads = data({"tall": (16, 4), "wide": (4, 16)}, steps=2)
    lr, wd, mu = 0.02, 0.1, 0.95
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    for g in grads:
        for k in p:
            m[k] = mu * m[k] + (1 - mu) * g[k]
            update = g[k] + mu * (m[k] - g[k])       # torch-style Nesterov lerp(g, m, mu)
            p[k] = p[k] * (1 - lr * wd) - lr * ns_reference(update, [KELLER] * 5, 1e-7)
    got = run(mfx.muon(lr=lr, weight_decay=wd, adjust_lr="none", ns_dtype=F64), params, grads)[-1]
    for k in p:
        torch.testing.assert_close(got[k], p[k], rtol=1e-6, atol=1e-9)  # + eps vs max(., eps)
    assert mfx.scale_by_shape("none").update(TensorDict({"w": torch.ones(9, 1)}, []), None)[0]["w"].max() == 1.0
    with pytest.raises(ValueError, match="'none'"):
        mfx.scale_by_shape("None")


# -- modded-nanogpt NorMuon -----------------------------------------------------------


def modded_normuon_reference(params, grads, lr, wd, momentum, beta2):
    """modded-nanogpt's NorMuon step for each matrix, as its code computes it."""
    p = {k: v.clone() for k, v in params.items()}
    mom = {k: torch.zeros_like(v) for k, v in p.items()}
    buf = {}
    out = []
    for g in grads:
        for k in p:
            rows, cols = p[k].shape
            mom[k] = torch.lerp(mom[k], g[k], 1 - momentum)
            x = torch.lerp(g[k], mom[k], momentum)
            # modded-nanogpt adds 1e-6 to the normaliser (muonfx floors it): a relative
            # 1e-6 / ||X|| apart, left out here so the rest is compared to rounding
            v = ns_reference(x, POLAR_EXPRESS, 0.0, safety=1.02)
            red = -1 if rows >= cols else -2
            v_mean = v.square().mean(dim=red, keepdim=True)
            buf[k] = torch.lerp(buf.get(k, torch.zeros_like(v_mean)), v_mean, 1 - beta2)
            step = buf[k].clamp_min(1e-10).rsqrt()
            v = v * step * (v.norm() / (v * step).norm())
            eff_lr = lr * max(1.0, rows / cols) ** 0.5
            eff_wd = wd * lr
            mask = (v * p[k]) >= 0
            p[k] = p[k] - p[k] * mask * eff_wd * eff_lr - v * eff_lr
        out.append({k: t.clone() for k, t in p.items()})
    return out


def test_modded_nanogpt_normuon_matches_its_formula():
    params, grads = data({"tall": (12, 4), "wide": (4, 10), "square": (6, 6)}, steps=3)
    lr, wd = 0.03, 0.5
    ref = modded_normuon_reference(params, grads, lr=lr, wd=wd, momentum=0.95, beta2=0.95)
    got = run(mfx.modded_nanogpt_normuon(lr=lr, weight_decay=wd, ns_dtype=F64), params, grads)
    for step, (r, o) in enumerate(zip(ref, got)):
        for k in r:
            torch.testing.assert_close(o[k], r[k], rtol=1e-7, atol=1e-9, msg=f"step {step} leaf {k}")
    # the wide matrix's statistics are per column, the others' per row
    state = mfx.modded_nanogpt_normuon().init(params)
    assert {k: tuple(v.shape) for k, v in state["row_normalize"].v.items()} == {
        "tall": (12,), "wide": (10,), "square": (6,)}
    # and mfx.normuon (rows always, plain decay by lr) computes something else
    other = run(mfx.normuon(lr=lr, weight_decay=wd, ns_coefficients="polar_express", ns_dtype=F64), params, grads)
    assert not torch.allclose(other[-1]["wide"], got[-1]["wide"], rtol=1e-3)
    with pytest.raises(ValueError, match="lr must be a number"):
        mfx.modded_nanogpt_normuon(lr=mfx.schedules.constant(0.02))
    with pytest.raises(ValueError, match="axis must be one of"):
        mfx.row_normalize(axis="columns")


# -- Moonlight's AdamW ---------------------------------------------------------------------


def test_moonlight_adamw_eps_before_bias_correction():
    """Moonlight's AdamW step: m, v EMAs; g = m / (eps + sqrt(v)); scale = bc1 / sqrt(bc2);
    W <- W * (1 - lr * wd) - lr / scale * g."""
    params, grads = data({"bias": (5,), "w": (6, 4)}, steps=3)
    lr, wd, (b1, b2), eps = 1e-3, 0.1, (0.9, 0.95), 1e-3   # a large eps makes the placement visible
    p = params["bias"].clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = torch.lerp(m, g["bias"], 1 - b1)
        v = torch.lerp(v, g["bias"].square(), 1 - b2)
        scale = (1 - b1**t) / (1 - b2**t) ** 0.5
        p = p * (1 - lr * wd) - lr / scale * (m / (eps + v.sqrt()))
    tx = mfx.moonlight(lr=lr, weight_decay=wd, betas=(b1, b2), adamw_eps=eps, adamw_eps_before_bias_correction=True,
                       ns_dtype=F64)
    got = run(tx, params, grads)[-1]
    torch.testing.assert_close(got["bias"], p, rtol=1e-12, atol=1e-15)
    default = run(mfx.moonlight(lr=lr, weight_decay=wd, betas=(b1, b2), adamw_eps=eps, ns_dtype=F64), params, grads)
    assert not torch.allclose(default[-1]["bias"], p, rtol=1e-9, atol=0)   # torch's AdamW places eps after
