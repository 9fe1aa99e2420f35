"""The torch.optim adapter in the places a torch.optim.Optimizer has to work.

* parity: ``TransformOptimizer(..., mfx.adamw)`` against ``torch.optim.AdamW`` and
  ``mfx.MuonOptimizer(nesterov=True, ns_dtype=bfloat16)`` against ``torch.optim.Muon``,
  10 steps with an lr scheduler, identical hand-made gradients;
* lr schedulers (StepLR, CosineAnnealingLR, LambdaLR, OneCycleLR with cycle_momentum,
  SequentialLR): each step's update is exactly what a fresh functional transform built
  with the group's current ``lr`` (and ``momentum`` / ``betas``) computes;
* torch.optim conventions: ``step(closure)``, ``zero_grad``, step hooks, parameters
  without gradients, sparse gradients;
* adapter steps equal ``tx.update`` + ``mfx.apply_updates`` (hypothesis, bitwise);
* PyTorch Lightning ``Trainer.fit``, Hugging Face ``transformers.Trainer`` and a
  ``torch.compile``d model, all really run on CPU.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch import nn

import muonfx as mfx
from muonfx.testing import params_and_grads, random_tensor, seeds

STEPS = 10


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def hand_grads(params: list[torch.Tensor], step: int, seed: int = 0) -> list[torch.Tensor]:
    """The gradients of step ``step``: the same for every optimizer under comparison."""
    gen = torch.Generator().manual_seed(seed * 10_000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def clone_params(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes.items()]


# ---------------------------------------------------------------------------
# 5. parity through the adapter
# ---------------------------------------------------------------------------

# Measured (torch 2.13 CPU, identical gradients): max over params of
# max|p_mfx - p_torch| / max|p_torch| after 10 steps: AdamW 2.9e-7; Muon (bf16 Newton-Schulz)
# 2.9e-7 with weight decay 0.1, 1.8e-8 without: float32 rounding of algebraically equal
# arithmetic, which another CPU's vector width rounds a little differently. Tolerances
# ~17x, as tests/test_parity.py.
ADAMW_TOL = 5e-6
MUON_TOL = 5e-6

ADAMW_SHAPES = {"w": (16, 8), "b": (8,), "s": (), "conv": (4, 3, 3, 3)}
MUON_SHAPES = {"tall": (32, 8), "wide": (8, 24), "square": (16, 16)}


def run_pair(mine, theirs, mine_params, their_params, make_sched):
    s1, s2 = make_sched(mine), make_sched(theirs)
    lrs = []
    for step in range(STEPS):
        grads = hand_grads(mine_params, step)
        for p, q, g in zip(mine_params, their_params, grads):
            p.grad = g.clone()
            q.grad = g.clone()
        mine.step()
        theirs.step()
        lrs.append(mine.param_groups[0]["lr"])
        assert mine.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
        s1.step()
        s2.step()
    assert len(set(lrs)) > 1, "the scheduler did not change the lr"
    return max(rel_err(p.detach(), q.detach()) for p, q in zip(mine_params, their_params))


def test_adamw_parity_with_torch_under_scheduler():
    hp = dict(lr=3e-2, betas=(0.85, 0.99), eps=1e-8, weight_decay=0.1)
    mine_np = clone_params(ADAMW_SHAPES)
    theirs_np = clone_params(ADAMW_SHAPES)
    mine = mfx.TransformOptimizer(mine_np, mfx.adamw, **hp)
    theirs = torch.optim.AdamW([p for _, p in theirs_np], **hp)
    err = run_pair(mine, theirs, [p for _, p in mine_np], [p for _, p in theirs_np],
                   lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5))
    assert err < ADAMW_TOL, err


def test_muon_parity_with_torch_under_scheduler(wd=0.1):
    # one setting only: bf16 matmuls are slow on this CPU (~0.1 s per step); other
    # settings are covered by tests/test_parity.py on the functional path.
    mine_np = clone_params(MUON_SHAPES)
    theirs_np = clone_params(MUON_SHAPES)
    mine = mfx.MuonOptimizer(mine_np, lr=0.02, momentum=0.95, weight_decay=wd, nesterov=True,
                             ns_dtype=torch.bfloat16, ns_method="standard")
    theirs = torch.optim.Muon([p for _, p in theirs_np], lr=0.02, momentum=0.95, weight_decay=wd,
                              nesterov=True, adjust_lr_fn=None)
    err = run_pair(mine, theirs, [p for _, p in mine_np], [p for _, p in theirs_np],
                   lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-3))
    assert err < MUON_TOL, err


# ---------------------------------------------------------------------------
# 6. lr schedulers: the transform uses group["lr"] (and momentum / betas)
# ---------------------------------------------------------------------------

SCHED_SHAPES = {"a": (12, 8), "b": (8, 8)}


def _sched_factories():
    S = torch.optim.lr_scheduler
    return {
        "step": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
        "cosine": lambda o: S.CosineAnnealingLR(o, T_max=6, eta_min=1e-4),
        "lambda": lambda o: S.LambdaLR(o, lambda t: 1.0 / (1 + t)),
        "onecycle": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=8, cycle_momentum=True,
                                           base_momentum=0.8, max_momentum=0.95),
        "sequential": lambda o: S.SequentialLR(
            o, [S.LinearLR(o, start_factor=0.1, total_iters=3), S.ExponentialLR(o, gamma=0.8)], milestones=[3]),
    }


@pytest.mark.parametrize("sched_name", list(_sched_factories()))
@pytest.mark.parametrize("which", ["muon", "adamw"])
def test_schedulers_drive_the_transform(which, sched_name):
    if which == "muon":
        factory, hp, mom_key = mfx.muon, dict(lr=0.02, weight_decay=0.05), "momentum"
    else:
        factory, hp, mom_key = mfx.adamw, dict(lr=1e-2, weight_decay=0.05), "betas"
    named = clone_params(SCHED_SHAPES)
    params = [p for _, p in named]
    # momentum / betas not passed: the factory's defaults must be visible to OneCycleLR
    opt = mfx.TransformOptimizer(named, factory, **hp)
    assert mom_key in opt.defaults
    sched = _sched_factories()[sched_name](opt)
    seen_lr, seen_mom = [], []
    for step in range(6):
        group = opt.param_groups[0]
        lr, mom = group["lr"], group[mom_key]
        seen_lr.append(lr)
        seen_mom.append(mom)
        # what a fresh functional transform with these values does from the same state
        fresh = factory(lr=lr, weight_decay=hp["weight_decay"], **{mom_key: mom})
        p_td = TensorDict({n: p.detach().clone() for n, p in named}, [])
        grads = hand_grads(params, step, seed=1)
        g_td = TensorDict({n: g for (n, _), g in zip(named, grads)}, [])
        upd, _ = fresh.update(g_td, opt.transform_state(0).inner_state, p_td)
        expected = mfx.apply_updates(p_td, upd)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for n, p in named:
            # the adapter folds the final -lr into p += -lr * u (one rounding instead of
            # two), so the match is to float tolerance, not bitwise; a wrong lr or
            # momentum would be off by orders of magnitude more
            torch.testing.assert_close(p.detach(), expected[n], rtol=2e-6, atol=1e-7,
                                       msg=lambda m: f"{sched_name} step {step} {n}: {m}")
        sched.step()
    assert len(set(seen_lr)) > 2, seen_lr
    if sched_name == "onecycle":
        assert len(set(seen_mom)) > 2, seen_mom  # cycle_momentum really cycled momentum / beta1


def test_onecycle_cycles_momentum_of_muon_optimizer():
    named = clone_params(SCHED_SHAPES)
    opt = mfx.MuonOptimizer(named, lr=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=5)
    moms = []
    for step in range(4):
        for (_, p), g in zip(named, hand_grads([p for _, p in named], step)):
            p.grad = g
        moms.append(opt.param_groups[0]["momentum"])
        opt.step()
        assert opt.transform_state(0).hyperparams["momentum"] == moms[-1]  # the step used it
        sched.step()
    assert len(set(moms)) > 1


def test_hand_edited_lr_takes_effect():
    named = clone_params({"w": (8, 8)})
    (_, p), = named
    opt = mfx.TransformOptimizer(named, mfx.muon, lr=0.02)
    opt.param_groups[0]["lr"] = 0.0
    p.grad = torch.randn(8, 8)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert not torch.equal(p.detach(), before)


# ---------------------------------------------------------------------------
# 7. torch.optim conventions
# ---------------------------------------------------------------------------


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_step_closure_zero_grad_and_hooks():
    model = _mlp()
    opt = mfx.create_hybrid_optimizer(model)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    events = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: events.append(("pre", o is opt)))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: events.append(("post", o is opt)))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():  # step enables grad for the closure even inside no_grad
        loss = opt.step(closure)
    assert calls == [True]
    assert torch.is_tensor(loss) and loss.ndim == 0 and loss.requires_grad
    assert events == [("pre", True), ("post", True)]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert opt.step() is None  # no closure: returns None
    h1.remove()
    h2.remove()
    opt.step()
    assert len(events) == 4

    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    closure()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def _state_copy(opt, p):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}


@pytest.mark.parametrize("kind", ["muon", "adamw", "hybrid"])
def test_params_without_grad_are_untouched(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    if kind == "muon":
        opt = mfx.MuonOptimizer([(n, p) for n, p in model.named_parameters() if p.ndim == 2], weight_decay=0.1)
    elif kind == "adamw":
        opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw, lr=1e-2, weight_decay=0.1)
    else:
        opt = mfx.create_hybrid_optimizer(model, muon_weight_decay=0.1)
    params = [p for g in opt.param_groups for p in g["params"]]
    # a first full step so that there is non-zero state to protect
    for p, g in zip(params, hand_grads(params, 0)):
        p.grad = g
    opt.step()
    frozen = {id(params[0]), id(params[-1])}
    for step in range(1, 4):
        for p, g in zip(params, hand_grads(params, step)):
            p.grad = None if id(p) in frozen else g
        keep_p = {id(p): p.detach().clone() for p in params if id(p) in frozen}
        keep_s = {id(p): _state_copy(opt, p) for p in params if id(p) in frozen}
        moved = {id(p): p.detach().clone() for p in params if id(p) not in frozen}
        opt.step()
        for p in params:
            if id(p) in frozen:
                assert torch.equal(p.detach(), keep_p[id(p)])
                now = opt.state[p]
                assert now.keys() == keep_s[id(p)].keys()
                for k, v in now.items():
                    # every per-parameter tensor (momentum.mu, adam.mu, adam.nu) stays put;
                    # the step counters ("count", "adam.count") are shared by the group.
                    if torch.is_tensor(v):
                        assert torch.equal(v, keep_s[id(p)][k]), k
            else:
                assert not torch.equal(p.detach(), moved[id(p)])


def test_sparse_grad_to_muon_raises_and_changes_nothing():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6, sparse=True)
    lin = nn.Linear(6, 6, bias=False)
    head = nn.Linear(6, 4)
    opt = mfx.TransformOptimizer(
        [
            {"params": [("emb.weight", emb.weight), ("lin.weight", lin.weight)], "tx": mfx.muon, "lr": 0.02},
            {"params": list(head.named_parameters(prefix="head")), "tx": mfx.adamw, "lr": 1e-2},
        ],
        mfx.muon,
    )
    x = torch.randint(0, 10, (3, 4))
    head(lin(emb(x))).sum().backward()
    assert emb.weight.grad.layout == torch.sparse_coo
    params = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in params]
    state_before = [_state_copy(opt, p) for p in params]
    with pytest.raises(ValueError) as err:
        opt.step()
    assert "emb.weight" in str(err.value) and "AdamW" in str(err.value)
    for p, b, s in zip(params, before, state_before):
        assert torch.equal(p.detach(), b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, s[k]) if torch.is_tensor(v) else v == s[k]

    # MuonOptimizer itself
    emb2 = nn.Embedding(10, 6, sparse=True)
    mopt = mfx.MuonOptimizer(emb2.named_parameters(prefix="tok"), lr=0.02)
    emb2(x).sum().backward()
    w = emb2.weight.detach().clone()
    with pytest.raises(ValueError, match=r"(?s)tok\.weight.*AdamW"):
        mopt.step()
    assert torch.equal(emb2.weight.detach(), w)


def test_sparse_embedding_trains_in_hybrid_optimizer():
    def build(sparse):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(10, 6, sparse=sparse), nn.Linear(6, 6), nn.Linear(6, 4))
        return m, mfx.create_hybrid_optimizer(m, adamw_lr=1e-2)

    (ms, os_), (md, od) = build(True), build(False)
    for step in range(3):
        x = torch.randint(0, 10, (3, 4), generator=torch.Generator().manual_seed(step))
        for m, o in ((ms, os_), (md, od)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        assert ms[0].weight.grad.layout == torch.sparse_coo
    for (n, a), b in zip(ms.named_parameters(), md.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    torch.manual_seed(0)
    assert not torch.equal(ms[0].weight, nn.Embedding(10, 6).weight)


# ---------------------------------------------------------------------------
# 8. adapter == tx.update + apply_updates (hypothesis)
# ---------------------------------------------------------------------------

PREBUILT = {
    "sgd_momentum": lambda: mfx.chain(mfx.momentum(0.9, nesterov=True), mfx.scale_by_learning_rate(0.05)),
    "adamw": lambda: mfx.adamw(lr=1e-2, weight_decay=0.1),
    "muon_adamw": lambda: mfx.muon_adamw(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
    "clipped_adam": lambda: mfx.chain(mfx.clip_by_global_norm(1.0), mfx.scale_by_adam(), mfx.scale(-1e-2)),
    # momentum's output *is* its new state: the scale after it must not overwrite it in place
    "momentum_then_scale": lambda: mfx.chain(mfx.momentum(0.9), mfx.scale(-0.1)),
    "finite_accumulated": lambda: mfx.apply_if_finite(mfx.accumulate(mfx.adamw(lr=1e-2), 2), 3),
}


@settings(max_examples=15, deadline=None)
@given(pg=params_and_grads(max_leaves=4, max_ndim=3),
       name=st.sampled_from(sorted(PREBUILT)), seed=seeds())
def test_adapter_equals_functional_update(pg, name, seed):
    params_td, grads_td = pg
    tx = PREBUILT[name]()
    keys = [k if isinstance(k, tuple) else (k,) for k in params_td.keys(True, True)]
    named = [(".".join(k), nn.Parameter(params_td.get(k).clone())) for k in keys]
    opt = mfx.TransformOptimizer(named, tx)  # pre-built: group lr is a multiplier, 1.0

    ref_params = params_td.clone()
    state = tx.init(ref_params)
    umax: dict = {}
    for step in range(3):
        if step == 0:
            grads = grads_td.clone()
        else:
            grads = TensorDict(
                {k: random_tensor(grads_td.get(k).shape, grads_td.get(k).dtype, seed + 7919 * step + i)
                 for i, k in enumerate(keys)}, [])
        updates, state = tx.update(grads, state, ref_params)
        for k in keys:
            umax[k] = max(umax.get(k, 0.0), updates.get(k).abs().max().item() if updates.get(k).numel() else 0.0)
        ref_params = mfx.apply_updates(ref_params, updates)
        for (n, p), k in zip(named, keys):
            p.grad = grads.get(k).clone()
        opt.step()
    for (n, p), k in zip(named, keys):
        assert p.dtype == ref_params.get(k).dtype
        # same function to float tolerance: the adapter folds a final scale into p += s * u,
        # which skips rounding s * u to the update's dtype; that rounding is at most an
        # ulp of the largest update, once per step (3 steps, with slack)
        ref = ref_params.get(k)
        atol = max(1e-5, 4 * torch.finfo(ref.dtype).eps * umax[k])
        rtol = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float64: 1e-7}.get(ref.dtype, 1.3e-6)
        torch.testing.assert_close(p.detach(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


def test_prebuilt_lr_multiplier_scales_the_update():
    tx = mfx.chain(mfx.momentum(0.9), mfx.scale(-0.1))
    named = clone_params({"w": (4, 4)})
    (_, p), = named
    p0 = p.detach().clone()
    opt = mfx.TransformOptimizer(named, tx, lr=0.5)
    p.grad = torch.ones(4, 4)
    opt.step()
    torch.testing.assert_close(p.detach(), p0 - 0.5 * 0.1 * 0.1 * torch.ones(4, 4))  # 0.5 * 0.1 * (1-0.9)*g


# ---------------------------------------------------------------------------
# 4. integrations that really run
# ---------------------------------------------------------------------------


def test_lightning_trainer_fit(tmp_path):
    lightning = pytest.importorskip("lightning")
    L = lightning.pytorch

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
            self.lrs = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = mfx.create_hybrid_optimizer(self.net, muon_lr=0.02, adamw_lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = Module()
    before = [p.detach().clone() for p in module.net.parameters()]
    trainer = L.Trainer(
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    assert trainer.global_step == 4
    opt = trainer.optimizers[0]
    assert isinstance(opt, mfx.TransformOptimizer)
    assert all(not torch.equal(b, p) for b, p in zip(before, module.net.parameters()))
    assert module.lrs == [0.02, 0.01, 0.005, 0.0025]  # the scheduler stepped every step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 / 16)
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-2 / 16)
    assert opt.state_dict()["state"][0]["count"] == 4


def test_hf_transformers_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(config)  # randomly initialised, nothing downloaded

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            gen = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 64, (16, 16), generator=gen)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    opt = mfx.create_hybrid_optimizer(model, muon_lr=0.02, adamw_lr=3e-3)
    muon_names = opt.param_groups[0]["param_names"]
    assert any("c_attn.weight" in n for n in muon_names)
    assert "transformer.wte.weight" in opt.param_groups[1]["param_names"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    args_kw = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    import inspect
    if "use_cpu" in inspect.signature(TrainingArguments).parameters:
        args_kw["use_cpu"] = True
    else:  # older transformers
        args_kw["no_cuda"] = True
    args = TrainingArguments(**args_kw)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.global_step == 3
    assert trainer.optimizer is opt or getattr(trainer.optimizer, "optimizer", None) is opt
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) == len(before), set(before) - set(changed)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 / 4)
    assert opt.state_dict()["state"][0]["count"] == 3


def test_torch_compiled_model_trains():
    # backend="aot_eager": dynamo traces the model and AOTAutograd builds the joint
    # forward/backward graph (so the gradients the optimizer sees come from a traced
    # backward), but nothing is code-generated; inductor would add C++ compilation
    # time on CPU without testing anything more about the optimizer.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend="aot_eager")
    opt = mfx.create_hybrid_optimizer(model, muon_lr=0.02, adamw_lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = x[:, :4].sin()
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_other_learning_rates_follow_lr_under_a_scheduler():
    """muon_adamw's adamw_lr follows the scheduled lr (ratio to the lr at creation),
    so one scheduler drives both halves and lr=0 freezes everything."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, lr=0.02, adamw_lr=1e-3,
                                 adamw_weight_decay=0.1, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    hp = opt.transform_state().hyperparams
    assert hp["lr"] == pytest.approx(0.02 * 0.25)  # the values used by the last step
    assert hp["adamw_lr"] == pytest.approx(1e-3 * 0.25)
    assert opt.param_groups[0]["adamw_lr"] == 1e-3  # the group keeps the base value
    # lr = 0 with zero grads changes nothing, AdamW half included (decay is multiplied by lr)
    before = [p.detach().clone() for p in model.parameters()]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_embeddings_go_to_adamw_by_module_type_whatever_their_name():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(10, 8)      # a name the key patterns do not know
            self.mix = nn.Linear(8, 8)

    for build in (lambda m: mfx.create_hybrid_optimizer(m), lambda m: mfx.FSDPMuonOptimizer(m)):
        opt = build(Model())
        groups = {tuple(g["param_names"]) for g in opt.param_groups}
        assert groups == {("mix.weight",), ("tok.weight", "mix.bias")}, groups
