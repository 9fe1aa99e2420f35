"""Lion, ADOPT, LaProp, C-AdamW, MARS-AdamW, MARS-Muon and Schedule-Free AdamW against
their references.

Each preset runs 20 steps through :class:`muonfx.TransformOptimizer` and through the
functional ``tx.update`` loop, next to its reference on the same parameters and gradients:

* Lion: ``lion_pytorch.Lion`` (the ``lion-pytorch`` package, pinned in the ``dev`` extra);
* Schedule-Free AdamW: ``schedulefree.AdamWScheduleFreeReference`` (``schedulefree``, pinned
  likewise), its ``eval()``/``train()`` swap and checkpoints in either mode included;
* ADOPT, LaProp, C-AdamW and MARS have no package: their references are written below as
  plain PyTorch loops from the authors' code, each naming the file (and commit) it follows.

Tolerances come from measured floors (max |p - p_ref| / max |p_ref| over the run): see the
constants. The shared laws run in the test catalogues (``PUBLIC`` of tests/test_conformance.py,
``DECLARED``/``PRESETS`` of tests/test_leafwise.py, ...).
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

import muonfx as mfx

from helpers import one_intra_op_thread  # noqa: F401  (autouse: one thread in this module)

lion_pytorch = pytest.importorskip("lion_pytorch")  # in the dev extra: CI runs this module

STEPS = 20
SHAPES = {"w": (6, 5), "b": (5,), "e": (2, 3, 4)}
# float32 against the float32 reference: rounding of algebraically equal arithmetic in
# another order (p * (1 - lr * wd) - lr * u against p - lr * (u + wd * p), a bias correction
# folded into one factor or two). Measured below (AMD EPYC, torch 2.13 CPU), worst preset
# 2.4e-7 over 20 steps; tolerance ~4x, within the 1e-6 asked of a port.
F32_TOL = 1e-6
# the same in float64: measured <= 4e-16
F64_TOL = 1e-13


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def random_problem(shapes: dict, dtype: torch.dtype, seed: int = 0):
    """``(start, grads)``: parameters and ``STEPS`` gradients of ``shapes``, drawn in float64."""
    gen = torch.Generator().manual_seed(seed)
    start = {k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for k, s in shapes.items()}
             for _ in range(STEPS)]
    return start, grads


def make_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return random_problem(SHAPES, dtype)[0]


def make_grads(dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    return random_problem(SHAPES, dtype, seed=1)[1]


def run_torch_style(make_opt, dtype: torch.dtype, problem=None) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of a torch.optim-style optimizer ``make_opt(named_params)`` on
    ``problem`` (``(start, grads)``; by default :data:`SHAPES`' at seeds 0 and 1)."""
    start, all_grads = problem or (make_params(dtype), make_grads(dtype))
    params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = make_opt(list(params.items()))
    for grads in all_grads:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def run_functional(tx: mfx.GradientTransformation, dtype: torch.dtype, problem=None) -> dict[str, torch.Tensor]:
    start, all_grads = problem or (make_params(dtype), make_grads(dtype))
    params = TensorDict({k: v.clone() for k, v in start.items()}, [])
    state = tx.init(params)
    for grads in all_grads:
        updates, state = tx.update(TensorDict(grads, []), state, params)
        params = mfx.apply_updates(params, updates)
    return {k: params[k] for k in start}


def assert_three_ways(name, make_ref, preset, hp, ours, problem, tol) -> None:
    """The reference, ``TransformOptimizer(params, preset, **hp, **ours)`` and the
    functional ``preset(**hp, **ours).update`` loop agree within ``tol``, and the
    parameters moved."""
    dtype = next(iter(problem[0].values())).dtype
    ref = run_torch_style(lambda ps: make_ref([p for _, p in ps], **hp), dtype, problem)
    got = run_torch_style(lambda ps: mfx.TransformOptimizer(ps, preset, **hp, **ours), dtype, problem)
    functional = run_functional(preset(**hp, **ours), dtype, problem)
    for k, start in problem[0].items():
        assert rel_err(ref[k], start) > 1e-3, f"{name}: {k} did not move"
        for how, a in (("TransformOptimizer", got[k]), ("tx.update", functional[k])):
            assert rel_err(a, ref[k]) <= tol, f"{name} ({how}, {k}, {dtype}): {rel_err(a, ref[k]):.2e}"


# ---------------------------------------------------------------------------
# the references without a package, written from the authors' code
# ---------------------------------------------------------------------------


class PerParameter(torch.optim.Optimizer):
    """The frame of the references below: ``update(p, state, group)`` per parameter with a
    gradient, ``state`` empty at first (their arithmetic is each one's own)."""

    def __init__(self, params, **defaults):
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, self.state[p], group)


class RefADOPT(PerParameter):
    """ADOPT as the authors' ``adopt.py`` (iShohei220/adopt, the ``clip_lambda`` form of
    ``_single_tensor_adopt``; the form timm and optax.contrib port) computes it, with
    ``decouple=False`` (an L2 term added to the gradient, the authors' default) or
    ``decouple=True`` (``p -= lr * wd * p``, skipped on the first step)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, weight_decay=0.0, decouple=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decouple=decouple)

    def update(self, p, st, group):
        (b1, b2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        if not st:
            st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        grad = p.grad
        if wd != 0 and not group["decouple"]:
            grad = grad.add(p, alpha=wd)
        if st["step"] == 0:
            st["exp_avg_sq"].addcmul_(grad, grad)
            st["step"] += 1
            return
        if wd != 0 and group["decouple"]:
            p.add_(p, alpha=-lr * wd)
        normed = grad.div(torch.clamp(st["exp_avg_sq"].sqrt(), eps))
        clip = st["step"] ** 0.25
        normed.clamp_(-clip, clip)
        st["exp_avg"].lerp_(normed, 1 - b1)
        p.add_(st["exp_avg"], alpha=-lr)
        st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        st["step"] += 1


class RefLaProp(PerParameter):
    """LaProp as the authors' ``laprop.py`` (Z-T-WANG/LaProp-Optimizer, commit ff5efc0;
    ``amsgrad=False, centered=False``) computes it: the lr folded into the momentum, its
    bias correction an EMA of the lr."""

    def __init__(self, params, lr=4e-4, betas=(0.9, 0.999), eps=1e-15):
        super().__init__(params, lr=lr, betas=betas, eps=eps)

    def update(self, p, st, group):
        (b1, b2), lr, grad = group["betas"], group["lr"], p.grad
        if not st:
            st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), lr1=0.0, lr2=0.0)
        st["step"] += 1
        st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        st["lr1"] = st["lr1"] * b1 + (1 - b1) * lr
        st["lr2"] = st["lr2"] * b2 + (1 - b2)
        denom = st["exp_avg_sq"].div(st["lr2"]).sqrt_().add_(group["eps"])
        st["exp_avg"].mul_(b1).add_(grad / denom, alpha=(1 - b1) * lr)
        p.add_(st["exp_avg"], alpha=-1 / (st["lr1"] / lr))


class RefCAdamW(PerParameter):
    """C-AdamW as the authors' C-Optim ``AdamW`` (kyleliang919/C-Optim, ``c_adamw.py``,
    ``correct_bias=True``) computes it: decay first, epsilon on the uncorrected ``sqrt(v)``,
    ``mask * numel / (sum(mask) + 1)`` on the first moment."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def update(self, p, st, group):
        b1, b2 = group["betas"]
        if not st:
            st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        grad, m, v = p.grad, st["exp_avg"], st["exp_avg_sq"]
        st["step"] += 1
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        m.mul_(b1).add_(grad, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        denom = v.sqrt().add_(group["eps"])
        step_size = group["lr"] * math.sqrt(1.0 - b2 ** st["step"]) / (1.0 - b1 ** st["step"])
        mask = (m * grad > 0).to(grad.dtype)
        mask = mask * (mask.numel() / (mask.sum() + 1))
        p.add_((m * mask) / denom, alpha=-step_size)


class RefMARS(PerParameter):
    """MARS-AdamW as AGI-Arena/MARS's ``MARS/optimizers/mars.py`` (commit 20c60c1;
    ``mars_type="mars-adamw"``, ``is_approx=True``, ``amsgrad=False``,
    ``optimize_1d=True``) computes it."""

    def __init__(self, params, lr=3e-3, betas=(0.95, 0.99), eps=1e-8, weight_decay=0.0, gamma=0.025):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, gamma=gamma)

    def update(self, p, st, group):
        (b1, b2), lr, wd, gamma, grad = group["betas"], group["lr"], group["weight_decay"], group["gamma"], p.grad
        if not st:
            st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), last_grad=torch.zeros_like(p))
        st["step"] += 1
        c = (grad - st["last_grad"]).mul(gamma * (b1 / (1.0 - b1))).add(grad)
        c_norm = torch.norm(c)
        if c_norm > 1.0:
            c = c / c_norm
        st["exp_avg"].mul_(b1).add_(c, alpha=1.0 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(c, c, value=1.0 - b2)
        bc1, bc2 = 1.0 - b1 ** st["step"], 1.0 - b2 ** st["step"]
        denom = st["exp_avg_sq"].sqrt().mul(1 / math.sqrt(bc2)).add(group["eps"]).mul(bc1)
        p.add_(-lr * torch.mul(p, wd).add(st["exp_avg"].div(denom)))
        st["last_grad"] = grad


# name -> (preset, its hyperparameters, the reference optimizer built on named params)
CASES = {
    "lion": (mfx.lion, dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
             lion_pytorch.Lion),
    "adopt": (mfx.adopt, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
              RefADOPT),
    "adopt_decoupled_no_decay": (mfx.adopt, dict(lr=1e-2, decouple=True),
                                 RefADOPT),
    "laprop": (mfx.laprop, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-15),
               RefLaProp),
    "cautious_adamw": (mfx.cautious_adamw, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1),
                       RefCAdamW),
    "mars_adamw": (mfx.mars_adamw, dict(lr=1e-2, betas=(0.95, 0.99), eps=1e-8, weight_decay=0.1, gamma=0.025),
                   RefMARS),
    # gamma large enough that the norm clip acts on some steps
    "mars_adamw_clipped": (mfx.mars_adamw, dict(lr=1e-2, gamma=0.5),
                           RefMARS),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_reference(name: str, dtype: torch.dtype) -> None:
    preset, hp, make_ref = CASES[name]
    problem = (make_params(dtype), make_grads(dtype))
    assert_three_ways(name, make_ref, preset, hp, {}, problem, F32_TOL if dtype == torch.float32 else F64_TOL)


def test_mars_clip_acts() -> None:
    """The clipped case above exercises the norm clip (else it would test nothing more)."""
    tx = mfx.mars_correction(gamma=0.5, beta=0.95, max_norm=1.0)
    g = TensorDict(make_grads(torch.float32)[0], [])
    out, _ = tx.update(g, tx.init(g))
    assert max(out[k].norm().item() for k in SHAPES) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mars_gamma_zero_is_the_base_optimizer_bit_for_bit(dtype: torch.dtype) -> None:
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    base = run_functional(mfx.adamw(**hp), dtype)
    mars = run_functional(mfx.mars_adamw(**hp, gamma=0.0, max_norm=None), dtype)
    adapted = run_torch_style(lambda ps: mfx.TransformOptimizer(ps, mfx.mars_adamw, **hp, gamma=0.0,
                                                                max_norm=None, fused=False), dtype)
    # (the adapter's plan runs groups built with mfx.adamw and mfx.mars_adamw through torch's
    # fused AdamW kernel, a different rounding: the functional adamw is the base the chain is
    # equal to; the lowered MARS-AdamW at gamma=0 is the lowered AdamW)
    lowered = run_torch_style(lambda ps: mfx.TransformOptimizer(ps, mfx.mars_adamw, **hp, gamma=0.0,
                                                                max_norm=None), dtype)
    fused_adamw = run_torch_style(lambda ps: mfx.TransformOptimizer(ps, mfx.adamw, **hp), dtype)
    for k in SHAPES:
        assert torch.equal(mars[k], base[k]), k
        assert torch.equal(adapted[k], base[k]), k
        assert torch.equal(lowered[k], fused_adamw[k]), k
        assert not torch.equal(lowered[k], make_params(dtype)[k]), k  # the parameters moved


def test_mars_muon_gamma_zero_is_muon_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    params = TensorDict({"w": torch.randn(8, 6, generator=gen), "x": torch.randn(2, 4, 5, generator=gen)}, [])
    outs = []
    for tx in (mfx.muon(lr=0.02, weight_decay=0.1), mfx.mars_muon(lr=0.02, weight_decay=0.1, gamma=0.0)):
        p, s = params.clone(), tx.init(params)
        for i in range(5):
            g = p.apply(lambda t: torch.sin(t * (i + 1)))
            u, s = tx.update(g, s, p)
            p = mfx.apply_updates(p, u)
        outs.append(p)
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in ("w", "x"))
    # and gamma > 0 changes the direction
    tx = mfx.mars_muon(lr=0.02, gamma=0.1)
    s = tx.init(params)
    u1, s = tx.update(params, s, params)
    u2, _ = tx.update(params.apply(torch.cos), s, params)
    ref = mfx.muon(lr=0.02)
    rs = ref.init(params)
    _, rs = ref.update(params, rs, params)
    r2, _ = ref.update(params.apply(torch.cos), rs, params)
    assert not torch.allclose(u2["w"], r2["w"])


def test_cautious_masks_and_rescales() -> None:
    g = TensorDict({"w": torch.tensor([[1.0, -2.0], [3.0, 4.0]])}, [])
    inner = mfx.scale(1.0)  # the update is the gradient: every element agrees
    out, _ = mfx.cautious(inner).update(g, mfx.cautious(inner).init(g))
    torch.testing.assert_close(out["w"], g["w"] * 4 / 5)
    flip = TensorDict({"w": torch.tensor([[1.0, 2.0], [-3.0, 4.0]])}, [])  # 2 of 4 agree with g
    tx = mfx.cautious(mfx.identity())
    out, _ = tx.update(g, tx.init(g))
    # identity's update is g itself: all agree; a transform whose output is ``flip``:
    flip_tx = mfx.GradientTransformation(lambda p: mfx.EmptyState(), lambda u, s, p=None: (flip.clone(), s))
    out, _ = mfx.cautious(flip_tx).update(g, mfx.EmptyState())
    torch.testing.assert_close(out["w"], torch.tensor([[1.0, 0.0], [0.0, 4.0]]) * 4 / 3)
    assert mfx.is_leafwise(mfx.cautious(mfx.scale_by_adam()))
    assert not mfx.is_leafwise(mfx.cautious(mfx.clip_by_global_norm(1.0)))


def test_adopt_first_step_leaves_parameters() -> None:
    tx = mfx.adopt(lr=1.0, weight_decay=0.1)
    p = TensorDict({"w": torch.randn(3, 3)}, [])
    u, s = tx.update(p.apply(torch.sin), tx.init(p), p)
    assert torch.equal(u["w"], torch.zeros(3, 3))
    assert s["adopt"].count == 1
    torch.testing.assert_close(s["adopt"].nu["w"], (torch.sin(p["w"]) + 0.1 * p["w"]) ** 2)


@pytest.mark.parametrize("bad, match", [
    (lambda: mfx.lion(betas=(0.9,)), "betas"),
    (lambda: mfx.scale_by_lion(b1=1.5), "b1"),
    (lambda: mfx.adopt(eps=-1.0), "eps"),
    (lambda: mfx.scale_by_adopt(clip=3), "clip"),
    (lambda: mfx.laprop(lr=float("nan")), "lr"),
    (lambda: mfx.mars_correction(gamma=float("inf")), "gamma"),
    (lambda: mfx.mars_adamw(max_norm=-1.0), "max_norm"),
])
def test_bad_hyperparameters_are_refused_by_name(bad, match) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        bad()


def test_mismatched_state_is_refused_naming_the_parameter() -> None:
    tx = mfx.scale_by_lion()
    s = tx.init(TensorDict({"w": torch.zeros(2)}, []))
    with pytest.raises(ValueError, match="v"):
        tx.update(TensorDict({"v": torch.zeros(2)}, []), s)


def test_cli_lists_the_presets() -> None:
    from muonfx.cli.optimizers import optimizer_names

    assert {"lion", "adopt", "laprop", "cautious_adamw", "mars_adamw", "mars_muon",
            "schedule_free_adamw", "dion2", "soap"} <= set(optimizer_names())


# ---------------------------------------------------------------------------
# Schedule-Free
# ---------------------------------------------------------------------------

schedulefree = pytest.importorskip("schedulefree")  # in the dev extra: CI runs these

SF_CASES = {
    "warmup_decay": dict(lr=1e-2, weight_decay=0.1, warmup_steps=5),
    "betas_r": dict(lr=1e-2, betas=(0.8, 0.99), r=0.5, weight_lr_power=1.0),
}


def run_schedule_free(make_opt, dtype: torch.dtype, steps: int = STEPS):
    """Train ``steps`` steps; return the training weights, the evaluation weights (after
    ``opt.eval()``) and the training weights again (after ``opt.train()``)."""
    params = {k: torch.nn.Parameter(v) for k, v in make_params(dtype).items()}
    opt = make_opt(list(params.items()))
    opt.train()
    for grads in make_grads(dtype)[:steps]:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    y = {k: p.detach().clone() for k, p in params.items()}
    opt.eval()
    x = {k: p.detach().clone() for k, p in params.items()}
    opt.train()
    return y, x, {k: p.detach().clone() for k, p in params.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(SF_CASES))
def test_schedule_free_parity_with_the_reference(case: str, dtype: torch.dtype, capsys) -> None:
    """``schedulefree.AdamWScheduleFreeReference`` (schedulefree 1.4.1): the training point
    ``y`` after 20 steps, the average ``x`` after ``eval()``, ``y`` again after ``train()``.
    Measured: <= 2.7e-7 in float32, 2.5e-16 in float64."""
    hp = SF_CASES[case]
    ref = run_schedule_free(lambda ps: schedulefree.AdamWScheduleFreeReference([p for _, p in ps], **hp), dtype)
    got = run_schedule_free(lambda ps: mfx.TransformOptimizer(ps, mfx.schedule_free_adamw, **hp), dtype)
    functional = run_functional(mfx.schedule_free_adamw(**hp), dtype)
    tol = F32_TOL if dtype == torch.float32 else F64_TOL
    for k in SHAPES:
        assert rel_err(ref[1][k], ref[0][k]) > 1e-4, "x and y must differ for the swap to be tested"
        for what, a, b in (("y", got[0], ref[0]), ("x", got[1], ref[1]), ("y again", got[2], ref[2]),
                           ("y (tx.update)", functional, ref[0])):
            assert rel_err(a[k], b[k]) <= tol, f"{case} {what} {k}: {rel_err(a[k], b[k]):.2e}"


def test_schedule_free_checkpoints_keep_both_and_resume_in_either_mode(tmp_path) -> None:
    hp = SF_CASES["warmup_decay"]
    make = lambda ps: mfx.TransformOptimizer(ps, mfx.schedule_free_adamw, **hp)  # noqa: E731
    whole = run_schedule_free(make, torch.float32)
    for mode in ("train", "eval"):
        params = {k: torch.nn.Parameter(v) for k, v in make_params(torch.float32).items()}
        opt = make(list(params.items()))
        grads = make_grads(torch.float32)
        for g in grads[:7]:
            for k, p in params.items():
                p.grad = g[k].clone()
            opt.step()
        getattr(opt, mode)()
        torch.save({"model": {k: p.detach() for k, p in params.items()}, "opt": opt.state_dict()}, tmp_path / "c.pt")
        saved = torch.load(tmp_path / "c.pt", weights_only=True)
        fresh = {k: torch.nn.Parameter(saved["model"][k].clone()) for k in SHAPES}
        opt2 = make(list(fresh.items()))
        opt2.load_state_dict(saved["opt"])
        if mode == "eval":  # the checkpoint holds x in the model, z and x in the optimizer
            with pytest.raises(RuntimeError, match="opt.train"):
                for k, p in fresh.items():
                    p.grad = grads[7][k].clone()
                opt2.step()
            assert all(torch.equal(fresh[k], saved["model"][k]) for k in SHAPES)  # the refused step changed nothing
        opt2.train()
        for g in grads[7:]:
            for k, p in fresh.items():
                p.grad = g[k].clone()
            opt2.step()
        for k in SHAPES:
            assert torch.equal(fresh[k].detach(), whole[0][k]), (mode, k)
        opt2.eval()
        assert all(torch.equal(fresh[k].detach(), whole[1][k]) for k in SHAPES), mode


def test_schedule_free_wraps_muon_and_eval_train_are_noops_elsewhere() -> None:
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Linear(6, 4, bias=False)
    opt = mfx.TransformOptimizer(model.named_parameters(), lambda lr=0.02: mfx.schedule_free(mfx.muon(lr=lr)))
    for _ in range(3):
        model.weight.grad = torch.randn(4, 6, generator=gen)
        opt.step()
    y = model.weight.detach().clone()
    x = opt.eval() and model.weight.detach().clone()
    assert not torch.equal(x, y)
    opt.train()
    assert torch.equal(model.weight.detach(), y)
    plain = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw)
    plain.eval()
    assert torch.equal(model.weight.detach(), y)


# ---------------------------------------------------------------------------
# Dion2
# ---------------------------------------------------------------------------


def dion_ns(g: torch.Tensor, eps: float) -> torch.Tensor:
    """microsoft/dion's ``zeropower_via_newtonschulz5`` (commit 429d309's ``dion/muon.py``),
    in the input's dtype instead of bfloat16."""
    x = g.mT if g.size(-2) > g.size(-1) else g
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in mfx.transforms.dion2.DION_COEFFICIENTS:
        A = x @ x.mT
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


class RefDion2(PerParameter):
    """Dion2 as microsoft/dion's ``dion/dion2.py`` (commit 429d309; one process, where its
    two row selections agree) computes it for 2-D matrices: ``M += G``; the
    ``ceil(fraction * rows)`` rows of largest L1 norm orthogonalised (Newton-Schulz in the
    parameters' dtype here, where Dion casts to bfloat16); ``M[rows] *= ef_decay``;
    ``X *= 1 - lr * wd``; ``X[rows] -= lr * sqrt(rows / cols) * U``."""

    def __init__(self, params, lr=0.01, fraction=0.25, ef_decay=0.95, weight_decay=0.01, eps=1e-7):
        super().__init__(params, lr=lr, fraction=fraction, ef_decay=ef_decay, weight_decay=weight_decay, eps=eps)

    def update(self, p, st, group):
        lr = group["lr"]
        m = st.setdefault("momentum", torch.zeros_like(p))
        m.add_(p.grad)
        k = max(1, math.ceil(group["fraction"] * m.size(-2)))
        _, idx = torch.topk(m.norm(p=1, dim=-1), k, dim=-1, sorted=False)
        u = dion_ns(m.index_select(-2, idx), group["eps"])
        m.index_copy_(-2, idx, m.index_select(-2, idx) * group["ef_decay"])
        p.mul_(1 - lr * group["weight_decay"])
        p.index_add_(-2, idx, -lr * math.sqrt(p.size(-2) / p.size(-1)) * u)


DION_SHAPES = {"tall": (16, 8), "wide": (6, 20), "square": (9, 9)}
# float32 Newton-Schulz products in another order (see the test): measured 6.8e-7 on this
# CPU; another CPU's float32 kernels round the products differently: tolerance ~3x
DION2_F32_TOL = 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_dion2_parity_with_the_reference(dtype: torch.dtype) -> None:
    """20 steps, tall, wide and square matrices. Measured: 6.8e-7 in float32 (tall), 3.4e-16
    in float64: Newton-Schulz on the submatrix there, on the zero-padded matrix here (the
    same polynomial, its float32 products rounded in another order and amplified by the
    iteration, as for Muon in tests/test_parity.py); float32 tolerance DION2_F32_TOL."""
    problem = random_problem(DION_SHAPES, dtype, seed=7)
    eps = 1e-7 if dtype == torch.float32 else 0.0  # Dion adds eps to the norm, muonfx floors it at eps
    hp = dict(lr=0.02, fraction=0.3, ef_decay=0.9, weight_decay=0.05, eps=eps)
    assert_three_ways("dion2", RefDion2, mfx.dion2, hp, dict(ns_dtype=dtype), problem,
                      DION2_F32_TOL if dtype == torch.float32 else F64_TOL)


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.3, 1.0])
def test_dion2_updates_exactly_ceil_fraction_rows(fraction: float) -> None:
    gen = torch.Generator().manual_seed(8)
    g = TensorDict({"w": torch.randn(10, 7, generator=gen), "stack": torch.randn(3, 6, 5, generator=gen),
                    "conv": torch.randn(12, 2, 3, 3, generator=gen)}, [])
    tx = mfx.scale_by_dion2(fraction)
    state = tx.init(g)
    for _ in range(3):
        out, new_state = tx.update(g, state)
        rows = {"w": (out["w"] != 0).any(-1).sum().item(),
                "stack": (out["stack"] != 0).any(-1).sum(-1).tolist(),
                "conv": (out["conv"].reshape(12, -1) != 0).any(-1).sum().item()}
        assert rows == {"w": math.ceil(fraction * 10), "stack": [math.ceil(fraction * 6)] * 3,
                        "conv": math.ceil(fraction * 12)}
        # error feedback: the taken rows of M + g decayed, the others kept
        taken = (out["w"] != 0).any(-1)
        expect = state.mu["w"] + g["w"]
        torch.testing.assert_close(new_state.mu["w"][taken], 0.95 * expect[taken])
        assert torch.equal(new_state.mu["w"][~taken], expect[~taken])
        state = new_state


def test_dion2_refuses_bad_settings() -> None:
    for bad, match in ((lambda: mfx.scale_by_dion2(0.0), "fraction"), (lambda: mfx.scale_by_dion2(1.5), "fraction"),
                       (lambda: mfx.scale_by_dion2(ef_decay=2.0), "ef_decay"),
                       (lambda: mfx.dion2(adjust_lr="spectral"), "adjust_lr")):
        with pytest.raises(ValueError, match=match):
            bad()
    with pytest.raises(ValueError, match="'b'"):
        tx = mfx.scale_by_dion2()
        tx.update(TensorDict({"b": torch.ones(3)}, []), tx.init(TensorDict({"b": torch.ones(3)}, [])))


# ---------------------------------------------------------------------------
# SOAP
# ---------------------------------------------------------------------------


class RefSOAP(torch.optim.Optimizer):
    """SOAP as the authors' ``soap.py`` (nikhilvyas/SOAP at f42d296, whose weight decay has
    the fixed sign; ``data_format="channels_first"``, ``correct_bias=True``,
    ``weight_decay=0`` here: the reference decays after the update and skips the first step)
    computes it, written out from that file: the factors' eigenbases by ``eigh`` at the first
    step, by one power iteration and QR every ``precondition_frequency`` steps (float32)."""

    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), eps=1e-8, precondition_frequency=10,
                 max_precond_dim=10000, merge_dims=False, precondition_1d=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, freq=precondition_frequency,
                                      max_dim=max_precond_dim, merge=merge_dims, p1d=precondition_1d))

    @staticmethod
    def _merge(shape, max_dim):
        new, cur = [], 1
        for sh in shape:
            if cur * sh > max_dim:
                if cur > 1:
                    new.append(cur)
                    cur = sh
                else:
                    new.append(sh)
                    cur = 1
            else:
                cur *= sh
        if cur > 1 or not new:
            new.append(cur)
        return new

    def _view(self, t, group):
        return t.reshape(self._merge(t.shape, group["max_dim"])) if group["merge"] and t.dim() > 1 else t

    def _project(self, x, st, group, back=False):
        shape = x.shape
        x = self._view(x, group)
        for q in st["Q"]:
            if q is None:
                x = x.permute(list(range(1, x.dim())) + [0])
            else:
                x = torch.tensordot(x, q, dims=[[0], [1 if back else 0]])
        return x.reshape(shape)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st, grad = self.state[p], p.grad
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(grad), exp_avg_sq=torch.zeros_like(grad))
                    gv = self._view(grad, group)
                    if grad.dim() == 1:
                        on = [group["p1d"] and grad.shape[0] <= group["max_dim"]]
                    else:
                        on = [sh <= group["max_dim"] for sh in gv.shape]
                    st["GG"] = [torch.zeros(sh, sh, dtype=grad.dtype) if o else None for sh, o in zip(gv.shape, on)]
                    st["Q"] = None
                    self._precondition(grad, st, group)
                    continue
                gp = self._project(grad, st, group)
                st["step"] += 1
                st["exp_avg"].mul_(b1).add_(gp, alpha=1.0 - b1)
                st["exp_avg_sq"].mul_(b2).add_(gp.square(), alpha=1.0 - b2)
                denom = st["exp_avg_sq"].sqrt().add_(group["eps"])
                step_size = group["lr"] * (1.0 - b2 ** st["step"]) ** 0.5 / (1.0 - b1 ** st["step"])
                p.add_(self._project(st["exp_avg"] / denom, st, group, back=True), alpha=-step_size)
                self._precondition(grad, st, group)

    def _precondition(self, grad, st, group):
        if st["Q"] is not None:
            st["exp_avg"] = self._project(st["exp_avg"], st, group, back=True)
        gv = self._view(grad, group)
        b2 = group["betas"][1]
        for i, gg in enumerate(st["GG"]):
            if gg is not None:
                dims = [d for d in range(gv.dim()) if d != i]
                gg.lerp_(torch.tensordot(gv, gv, dims=[dims, dims]), 1 - b2)
        if st["Q"] is None:
            st["Q"] = []
            for gg in st["GG"]:
                if gg is None:
                    st["Q"].append(None)
                    continue
                _, q = torch.linalg.eigh(gg.float() + 1e-30 * torch.eye(gg.shape[0]))
                st["Q"].append(torch.flip(q, [1]).to(gg.dtype))
        if st["step"] > 0 and st["step"] % group["freq"] == 0:
            v = self._view(st["exp_avg_sq"], group)
            new_q = []
            for i, (gg, q) in enumerate(zip(st["GG"], st["Q"])):
                if gg is None:
                    new_q.append(None)
                    continue
                m, o = gg.float(), q.float()
                order = torch.argsort(torch.diag(o.T @ m @ o), descending=True)
                v = v.index_select(i, order)
                new_q.append(torch.linalg.qr(m @ o[:, order])[0].to(gg.dtype))
            st["exp_avg_sq"] = v.reshape(st["exp_avg_sq"].shape)
            st["Q"] = new_q
        if st["step"] > 0:
            st["exp_avg"] = self._project(st["exp_avg"], st, group)


SOAP_CASES = {
    # two-sided, a basis refreshed every 3 steps; a bias and a 3-D tensor (one factor per dim)
    "two_sided": (dict(lr=1e-2, betas=(0.9, 0.95), precondition_frequency=3), {"w": (6, 5), "b": (5,), "e": (2, 3, 4)}),
    # a side over max_precond_dim keeps the identity; merged dims; 1-D preconditioned
    "one_sided_merged": (dict(lr=1e-2, precondition_frequency=4, max_precond_dim=7, merge_dims=True,
                              precondition_1d=True), {"w": (12, 5), "c": (4, 2, 3, 2), "b": (6,)}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(SOAP_CASES))
def test_soap_parity_with_the_reference(case: str, dtype: torch.dtype) -> None:
    """20 steps. Both compute the bases in float32 from bitwise equal factors, so the
    difference is the rounding of the Adam arithmetic: measured 5.3e-8 (float32) and
    1.4e-16 (float64) for the chain (``tx.update``); ``TransformOptimizer`` runs the plan's
    lowering (the first moment's round trip through the original space as one product
    with ``Q^T Q``, tests/test_fused_soap.py): 1.1e-7 and 1.4e-16."""
    hp, shapes = SOAP_CASES[case]
    assert_three_ways(f"soap {case}", RefSOAP, mfx.soap, hp, dict(weight_decay=0.0),
                      random_problem(shapes, dtype, seed=11), F32_TOL if dtype == torch.float32 else F64_TOL)
