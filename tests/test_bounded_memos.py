"""What an optimizer keeps between steps is bounded: a new schedule object at every step
(one built transform each) and a new set of present parameters at every step of a
compiled group (one graph each) keep the most recent ones only, and train as before."""

from __future__ import annotations

import torch

import muonfx as mfx
from muonfx.optim.groups import GroupRecord
from muonfx.optim.step.compiled import CompiledSteps


def test_a_new_schedule_every_step_keeps_a_bounded_number_of_transforms(monkeypatch):
    monkeypatch.setattr(GroupRecord, "TRANSFORMS", 4)
    w = torch.nn.Parameter(torch.ones(3, 3))
    opt = mfx.TransformOptimizer([("w", w)], mfx.adamw, lr=1e-2)
    ref_w = torch.nn.Parameter(torch.ones(3, 3))
    ref = mfx.TransformOptimizer([("w", ref_w)], mfx.adamw, lr=1e-2)
    for step in range(12):
        opt.param_groups[0]["lr"] = (lambda s, v=1e-2: v)  # a new schedule object, the same value
        w.grad = ref_w.grad = torch.full((3, 3), 0.1 * (step + 1))
        opt.step()
        ref.step()
        assert len(opt.records[0].transforms) <= 4
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


def test_a_compiled_group_keeps_a_bounded_number_of_graphs(monkeypatch):
    monkeypatch.setattr(CompiledSteps, "GRAPHS", 2)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    ps = [torch.nn.Parameter(torch.ones(2, 2) * i) for i in range(4)]
    opt = mfx.TransformOptimizer([(f"p{i}", p) for i, p in enumerate(ps)], mfx.adamw, lr=1e-2).compile()
    for step in range(5):
        for i, p in enumerate(ps):  # a different parameter without a gradient at each step
            p.grad = None if i == step % 4 else torch.ones(2, 2)
        opt.step()
        assert opt.plan.groups[0].path == "compiled"
        assert len(opt.compiled_graphs) <= 2
