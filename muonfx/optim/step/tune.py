"""Measured tuning, only when a user asks: :meth:`muonfx.TransformOptimizer.tune`.

Nothing is measured by default: the step plan chooses by rules. ``opt.tune()`` times
eager and compiled steps on the current gradients, restoring the parameters and the
state after each (so the training is as if it had not run), and records the faster in
every compilable group's ``"compile"`` setting: the ``state_dict`` saves it, a resumed
run follows it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDictBase

from ... import tree
from ...core import build, td_items
from ...logs import log
from .writeback import commit

__all__ = ["tune", "MARGIN"]

#: the compiled step is kept when its fastest time is below this fraction of eager's
MARGIN = 0.97


def _clone(state: Any) -> Any:
    """A copy of ``state`` with every tensor cloned."""
    leaves, spec = tree.flatten(state)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf.clone())
        elif isinstance(leaf, TensorDictBase):
            ks, vs = td_items(leaf)
            out.append(build(ks, [v.clone() for v in vs]))
        else:
            out.append(leaf)
    return tree.unflatten(out, spec)


def _sync(devices: set) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def tune(opt: Any, rounds: int = 3) -> dict[str, Any]:
    """Time eager and compiled steps of ``opt`` on its current gradients; keep the faster.

    Every group that can run compiled (no DTensor parameters, on the CPU or a GPU) is
    stepped eagerly and compiled in turn (the first compiled step compiles, untimed),
    ``rounds`` timed steps each, alternating; after every step the parameters and the
    state are put back. Only those groups step (the runner is called with their work
    alone: the other groups, a DTensor group among them, do not move), and no step hook
    of the optimizer runs (a hook that keeps an average of the weights sees no trial step). The compiled path is kept when its fastest step is below
    :data:`MARGIN` of eager's fastest. Returns ``{"eager": s, "compiled": s, "compile":
    bool, "groups": [indices]}`` and sets those groups' ``"compile"`` to the choice.
    """
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"tune: rounds must be an int >= 1, got {rounds!r}")
    with torch.no_grad():
        plan = opt._runner.preview(opt.records, opt.param_groups)
        groups = [g.index for g in plan.groups if not g.dtensor and all(d in ("cpu", "cuda") for d in g.devices)]
        if not any(p.grad is not None for gi in groups for p in opt.param_groups[gi]["params"]):
            raise ValueError("tune() times steps on the current gradients: call it after backward(), when the "
                             "parameters have gradients")
        params = [p for gi in groups for p in opt.param_groups[gi]["params"]]
        devices = {p.device for p in params}
        saved_params = [p.detach().clone() for p in params]
        saved_states = [_clone(opt.records[gi].state) for gi in groups]
        settings = [opt.param_groups[gi].get("compile") for gi in groups]

        def restore() -> None:
            for p, s in zip(params, saved_params):
                p.copy_(s)
            for gi, s in zip(groups, saved_states):
                rec = opt.records[gi]
                rec.state = commit(rec.state, _clone(s))
            opt._torch_state = None

        from ..groups import gather

        def timed(compiled: bool) -> float:
            for gi in groups:
                opt.param_groups[gi]["compile"] = compiled
            works = [gather(rec, g) if gi in groups else None
                     for gi, (rec, g) in enumerate(zip(opt.records, opt.param_groups))]
            _sync(devices)
            t0 = time.perf_counter()
            opt._runner.step(opt.records, opt.param_groups, works)  # the timed groups only, no hooks
            _sync(devices)
            took = time.perf_counter() - t0
            restore()
            return took

        try:
            timed(False)
            timed(True)  # compiles (untimed)
            eager, compiled = [], []
            for _ in range(rounds):
                eager.append(timed(False))
                compiled.append(timed(True))
        except BaseException:
            for gi, s in zip(groups, settings):
                opt.param_groups[gi]["compile"] = s
            restore()
            raise
        choice = min(compiled) < MARGIN * min(eager)
        failed = any(gi in {f for f, _ in opt._runner.compiled.failed} for gi in groups)
        choice = choice and not failed
        for gi in groups:
            opt.param_groups[gi]["compile"] = choice
        opt._runner.forget()
    log.info("muonfx: tune(): eager step %.1f ms, compiled %.1f ms (fastest of %d each): %s for param group(s) %s",
             1e3 * min(eager), 1e3 * min(compiled), rounds, "compiled" if choice else "eager",
             ", ".join(map(str, groups)))
    return {"eager": min(eager), "compiled": min(compiled), "compile": choice, "groups": groups}
