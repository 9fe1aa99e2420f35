"""The compiled law of :func:`muonfx.testing.check_transform` (opt-in): the transform,
run by :class:`muonfx.TransformOptimizer` compiled by ``torch.compile``, trains as eagerly."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..linalg.batching import set_batch_bytes
from .compare import tensor_paths as _tensor_paths, tensor_str as _tensor_str, td_leaves as _td_leaves
from .compare import values_differ as _values_differ
from .laws import _call, _Config, _Fail, _grad_seq

__all__ = ["COMPILED_RTOL", "law_compiled"]

#: The compiled law's default tolerance, relative to how far the eager run moved each
#: parameter: inductor reorders float sums and fuses roundings away, which moved float32
#: parameters by less than 1e-5 of their steps with the elementwise public transforms and
#: by up to 5e-5 with the Muon family (float32 Newton-Schulz amplifies a reordering on an
#: ill-conditioned matrix; ``docs/testing.md``); the miscompilations the law is there to
#: catch moved parameters by 5 % to 100 % of their steps.
COMPILED_RTOL = 1e-4



def _low_precision_rtol(tensors: Iterable[torch.Tensor]) -> float:
    """Four roundings of the narrowest 16-bit floating dtype among ``tensors`` (bf16:
    0.031, fp16: 0.0039); 0 without one. Eager PyTorch rounds every intermediate to the
    tensor's dtype where inductor computes a fused chain in float32 and rounds once, and
    a reduction over the leaves (a global norm) carries that into every other leaf."""
    eps = [torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point() and torch.finfo(t.dtype).bits <= 16]
    return 4 * max(eps) if eps else 0.0


def law_compiled(tx, params, grads, cfg: _Config) -> None:
    """``steps + 2`` steps of mfx.TransformOptimizer compiled by ``cfg.backend`` end where
    the eager optimizer ends; from step ``steps`` on with a batch budget of one byte."""
    from ..optim import TransformOptimizer

    names = list(_td_leaves(params))
    start = [t.detach().clone() for t in _td_leaves(params).values()]
    seq = [[gl[n] for n in names] for gl in map(_td_leaves, _grad_seq(grads, cfg.steps + 2))]
    kinds = {t.device.type for t in start} or {"cpu"}

    def run(backend: Any) -> tuple[list[list[torch.Tensor]], Any, bool]:
        what = "eager run" if backend is None else f"compiled run (backend={backend!r})"
        torch._dynamo.reset()  # every example compiles afresh (dynamo's recompile limit)
        ps = [torch.nn.Parameter(v.clone(), requires_grad=v.is_floating_point()) for v in start]
        opt = _call(f"{what}: TransformOptimizer(named params, tx)", TransformOptimizer, list(zip(names, ps)), tx)
        if backend is not None:
            _call(f"{what}: opt.compile(backend={backend!r})", lambda: opt.compile(backend=backend))
        else:
            opt.param_groups[0]["compile"] = False
        out, compiled = [], True
        saved: dict = {}
        try:
            for i, gs in enumerate(seq):
                if i == cfg.steps:
                    # a batch budget of one byte from here: a leafwise transform that does matrix
                    # work runs in pieces (one graph per parameter), as on a model larger than
                    # the budget (muonfx.optim.step.pieces)
                    saved = {k: set_batch_bytes(1, k) for k in kinds}
                    opt.replan()
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
                _call(f"{what}, step {i}: opt.step()", opt.step)
                compiled = compiled and bool(opt.plan.compiled)
                out.append([p.detach().clone() for p in ps])
        finally:
            for k, v in saved.items():
                set_batch_bytes(v, k)
        return out, opt, compiled

    eager, opt_e, _ = run(None)
    compiled, opt_c, ran = run(cfg.backend)
    cfg.compiled_runs.append(ran)
    if not ran:
        # the compiler could not take it: the adapter stepped eagerly (correct, and what
        # the report says); there is no compiled result to compare
        return
    rtol = max(cfg.rtol or COMPILED_RTOL, _low_precision_rtol(start))
    # |compiled - eager| <= atol + rtol * (how far the eager run has moved the leaf so
    # far: its largest move, summed over the steps) + two roundings of the value
    moved = [0.0] * len(names)
    prev = start
    for i, (e_step, c_step) in enumerate(zip(eager, compiled)):
        for j, (name, e, c) in enumerate(zip(names, e_step, c_step)):
            if not e.is_floating_point() or not e.numel():
                continue
            moved[j] += float((e.double() - prev[j].double()).abs().nan_to_num(nan=0.0).max())
            d = _values_differ(c, e, "close", 2 * torch.finfo(e.dtype).eps, cfg.atol + rtol * moved[j])
            if d:
                raise _Fail(
                    f"step {i}: params[{name}] differ between the "
                    f"compiled and the eager optimizer beyond compile rounding: {d}, allowed "
                    f"rtol={rtol:g} of the {moved[j]:.3g} the eager run moved this leaf. "
                    "Random numbers drawn inside update differ under the compiler; otherwise the "
                    "compiler computes your update differently from eager PyTorch: compare the two "
                    "runs step by step, and pass rtol= if the transform computes in a lower "
                    "precision than its parameters (Newton-Schulz in bf16 on float32 parameters: rtol=0.1)")
        prev = e_step
    pe = dict(_tensor_paths(opt_e.transform_state(0), "state"))
    pc = dict(_tensor_paths(opt_c.transform_state(0), "state"))
    for path, e in pe.items():
        c = pc.get(path)
        if c is None or c.shape != e.shape or c.dtype != e.dtype:
            raise _Fail(f"after {len(seq)} steps the compiled optimizer's state differs in structure from "
                        f"the eager one's at {path}: {None if c is None else _tensor_str(c)} vs {_tensor_str(e)}")
        if not e.is_floating_point() or not e.numel():
            d = _values_differ(c, e, "exact", 0.0, 0.0)
        else:  # rtol of the buffer's size per step, and two roundings of the value
            scale = float(e.double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())
            d = _values_differ(c, e, "close", 2 * torch.finfo(e.dtype).eps, cfg.atol + rtol * scale * len(seq))
        if d:
            raise _Fail(f"after {len(seq)} steps the compiled optimizer's state differs from the eager one's "
                        f"beyond compile rounding: {path}: {d}")


def _compiled_report(cfg: _Config) -> str:
    """The compiled law's report entry: ``"ok"``, or how many examples stepped eagerly."""
    n, eager = len(cfg.compiled_runs), cfg.compiled_runs.count(False)
    if n and eager == n:
        return (f"skipped: torch.compile could not take this transform in any of the {n} examples; "
                "mfx.TransformOptimizer steps it eagerly (see the muonfx log for why)")
    if eager:
        return f"ok ({eager} of {n} examples stepped eagerly: torch.compile could not take them)"
    return "ok"


