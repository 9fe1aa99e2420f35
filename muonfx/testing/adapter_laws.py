"""The adapter laws of :func:`muonfx.testing.check_transform`: what
:class:`muonfx.TransformOptimizer` owes a transform that obeys the transform laws (it
computes what the functional loop computes, checkpoints resume it, a parameter without
a gradient does not step). A broken adapter law is reported as the adapter's: muonfx's
own fault, or information the transform keeps outside its state, which only the
adapter's write-back into the old buffers reveals."""

from __future__ import annotations

import io

import torch

from ..core import apply_updates as _apply_updates, build as _build
from .compare import drop_hyperparams as _drop_hyperparams, snapshot as _snapshot, td_leaves as _td_leaves
from .compare import tree_diff as _tree_diff
from .laws import _call, _Config, _Fail, _grad_seq, _init, _update

__all__ = ["ADAPTER_LAWS"]


def _law_adapter_loop(tx, params, grads, cfg: _Config) -> None:
    """Through :class:`muonfx.TransformOptimizer` (the adapter writes the new state into
    the old buffers and ``p += u`` in place) the run equals the functional loop."""
    from ..optim import TransformOptimizer

    names = list(_td_leaves(params))
    ps = [torch.nn.Parameter(v.detach().clone(), requires_grad=v.is_floating_point())
          for v in _td_leaves(params).values()]
    opt = _call("TransformOptimizer(named params, tx)", TransformOptimizer, list(zip(names, ps)), tx)
    # the loop sees its TensorDicts with the adapter's leaf order (a reduction over the
    # leaves then adds in the same order)
    keys = [tuple(n.split(".")) for n in names]
    loop_params = _build(keys, [p.detach().clone() for p in ps])
    state = _init(tx, loop_params, "init")
    for i, g in enumerate(_grad_seq(grads, cfg.steps)):
        gl = _td_leaves(g)
        out, state = _update(tx, _build(keys, [gl[n] for n in names]), state, loop_params, f"step {i}")
        loop_params = _apply_updates(loop_params, out)
        for n, p in zip(names, ps):
            p.grad = gl[n].clone()
        _call(f"step {i}: opt.step()", opt.step)
        ll, ol = _td_leaves(loop_params), _td_leaves(out)
        for n, p in zip(names, ps):
            # within tolerance: relative to the size of the step, not of the parameter
            u = ol[n]
            scale = float(u.detach().abs().max()) if u.numel() and u.is_floating_point() else 0.0
            d = _tree_diff(p.detach(), ll[n], f"params[{n}]", cfg.mode, cfg.rtol, cfg.atol + cfg.rtol * scale)
            if d:
                raise _Fail(
                    f"step {i}: through mfx.TransformOptimizer the parameters moved differently from "
                    f"the functional loop (update, then apply_updates): {d}. The adapter writes the new "
                    "state into the old state buffers: does update keep information outside the state "
                    "it returns (a Python attribute on a tensor, a closure), or write into a tensor it "
                    "did not create? If it does neither, the adapter is at fault: please report it with this "
                    "example")
    d = _tree_diff(opt.transform_state(0).inner_state, state, "state", cfg.mode, cfg.rtol, cfg.atol)
    if d:
        raise _Fail(f"through mfx.TransformOptimizer the state differs from the functional loop's: {d} (the "
                    "adapter's write-back, or information the transform keeps outside its state)")


def _law_state_dict(tx, params, grads, cfg: _Config) -> None:
    from ..optim import TransformOptimizer

    names = list(_td_leaves(params))
    start = [t.detach().clone() for t in _td_leaves(params).values()]
    seq = [[gl[n] for n in names] for gl in map(_td_leaves, _grad_seq(grads, cfg.steps + 1))]

    def optimizer(values, what):
        ps = [torch.nn.Parameter(v.clone(), requires_grad=v.is_floating_point()) for v in values]
        return ps, _call(f"TransformOptimizer(named params, tx) ({what})", TransformOptimizer,
                         list(zip(names, ps)), tx)

    def step(opt, ps, gs, what):
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        _call(f"{what}: opt.step()", opt.step)

    ps_a, opt_a = optimizer(start, "uninterrupted run")
    for i in range(cfg.steps):
        step(opt_a, ps_a, seq[i], f"uninterrupted run, step {i}")
    saved_params = [p.detach().clone() for p in ps_a]
    saved_state = _snapshot(opt_a.transform_state(0))
    buf = io.BytesIO()
    _call(f"after {cfg.steps} steps, torch.save(opt.state_dict())", lambda: torch.save(opt_a.state_dict(), buf))
    step(opt_a, ps_a, seq[cfg.steps], f"uninterrupted run, step {cfg.steps}")
    buf.seek(0)
    loaded = _call("torch.load(state_dict, weights_only=True)", lambda: torch.load(buf, weights_only=True))
    ps_b, opt_b = optimizer(saved_params, "fresh optimizer")
    _call("fresh optimizer: load_state_dict(the loaded state_dict)", opt_b.load_state_dict, loaded)
    # The hyperparameters of inject_hyperparams states are not per-parameter state: the
    # adapter's own come back from param_groups, and every update recomputes them; the
    # comparison after the next step below covers them.
    d = _tree_diff(_drop_hyperparams(opt_b.transform_state(0)), _drop_hyperparams(saved_state), "state",
                   cfg.mode, cfg.rtol, cfg.atol)
    if d:
        raise _Fail(f"the state loaded from state_dict() differs from the state that was saved: {d}")
    step(opt_b, ps_b, seq[cfg.steps], f"resumed run, step {cfg.steps}")
    for name, a, b in zip(names, ps_a, ps_b):
        d = _tree_diff(b.detach(), a.detach(), f"params[{name}]", cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"step {cfg.steps} after loading the checkpoint moved the parameters differently "
                        f"from the uninterrupted run: {d}. The transform depends on something that "
                        "state_dict() does not save (a Python attribute, a closure, state not keyed "
                        "by parameter)")
    d = _tree_diff(opt_b.transform_state(0), opt_a.transform_state(0), "state", cfg.mode, cfg.rtol, cfg.atol)
    if d:
        raise _Fail(f"step {cfg.steps} after loading the checkpoint left another state than the "
                    f"uninterrupted run: {d}")


def _law_idle(tx, params, grads, cfg: _Config) -> None:
    """In the adapter, a leaf without a gradient in the first step (``p.grad is None``)
    moves and keeps state as it does in an optimizer of its own that skips that step;
    the other leaves as they do without it (a leafwise transform's parameters are
    independent)."""
    from ..optim import TransformOptimizer

    leaves = _td_leaves(params)
    names = list(leaves)
    if not names:
        return
    values = list(leaves.values())
    seq = [[gl[n] for n in names] for gl in map(_td_leaves, _grad_seq(grads, cfg.steps + 1))]

    def run(idx: list[int], what: str, skip_first: bool, idle_first: int | None = None):
        ps = [torch.nn.Parameter(values[i].detach().clone(), requires_grad=values[i].is_floating_point())
              for i in idx]
        opt = _call(f"TransformOptimizer(named params, tx) ({what})", TransformOptimizer,
                    [(names[i], p) for i, p in zip(idx, ps)], tx)
        for t, gs in enumerate(seq):
            if skip_first and t == 0:
                continue
            for i, p in zip(idx, ps):
                p.grad = None if (t == 0 and i == idle_first) else gs[i].clone()
            _call(f"{what}: opt.step() {t}", opt.step)
        entries = opt.state_dict()["state"]
        return {names[i]: (p.detach(), entries.get(j, {})) for j, (i, p) in enumerate(zip(idx, ps))}

    together = run(list(range(len(names))), f"every leaf, {names[0]!r} without a gradient in step 0",
                   False, idle_first=0)
    alone = run([0], f"{names[0]!r} alone, from step 1", True)
    if len(names) > 1:
        alone |= run(list(range(1, len(names))), "the other leaves alone", False)
    for name in names:
        (p_t, st_t), (p_a, st_a) = together[name], alone[name]
        idle = name == names[0]
        # the entries both hold: a scalar of a subtree without parameters (a partition
        # branch that is empty in one of the optimizers) goes to every parameter there
        both = [k for k in st_t if k in st_a]
        d = _tree_diff(p_t, p_a, f"params[{name}]", cfg.mode, cfg.rtol, cfg.atol) or _tree_diff(
            {k: st_t[k] for k in both}, {k: st_a[k] for k in both}, f"state_dict state of {name!r}",
            cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(
                (f"the leaf without a gradient in step 0 ended elsewhere than in an optimizer of its own that "
                 f"skipped that step: {d}" if idle else
                 f"leaf {name!r} ended elsewhere than in an optimizer without the leaf {names[0]!r}: {d}")
                + ". The adapter attributes state to a parameter by its key (or a key under it, as "
                "blockwise's blocks) and keeps a parameter's step counters apart; state it cannot "
                "attribute moves for a parameter that did not step")




#: the adapter laws, by name, in the order they are checked
ADAPTER_LAWS = {
    "adapter_loop": _law_adapter_loop,
    "state_dict_roundtrip": _law_state_dict,
    "idle_parameter": _law_idle,
}
