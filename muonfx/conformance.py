"""``check_transform``: the conformance laws for any muonfx transform (see :mod:`muonfx.testing`).

Kept apart from the strategies so both modules stay short; import it from
``muonfx.testing``.
"""

from __future__ import annotations

import io
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from tensordict import TensorDictBase

from .base import GradientTransformation, apply_updates as _apply_updates, build as _build, identity as _identity, key_str
from .base import is_leafwise
from .combine import chain as _chain, masked as _masked
from .linalg.batching import set_batch_bytes
from ._strategies import params_and_grads
from .state_tree import merge as _merge, restrict as _restrict
from .wrappers import InjectHyperparamsState as _InjectHyperparamsState
from .wrappers import accumulate as _accumulate, inject_hyperparams as _inject_hyperparams

__all__ = ["LAWS", "OPT_IN_LAWS", "COMPILED_RTOL", "ConformanceError", "check_transform"]


# ---------------------------------------------------------------------------
# check_transform: a conformance check for your own transforms
# ---------------------------------------------------------------------------

#: The laws :func:`check_transform` knows, in the order it checks them.
LAWS: tuple[str, ...] = (
    "purity",
    "eager_state",
    "dtype_preservation",
    "zero_gradient",
    "chain_identity",
    "masked_identity",
    "accumulate_k1",
    "inject_hyperparams",
    "state_dict_roundtrip",
    "leafwise",
    "idle_parameter",
    "compiled",
)

#: The laws checked only when asked for by name (``laws=[..., "compiled"]``): each
#: example compiles the optimizer step from scratch (seconds with inductor).
OPT_IN_LAWS: tuple[str, ...] = ("compiled",)

#: The compiled law's default tolerance, relative to how far the eager run moved each
#: parameter: inductor reorders float sums and fuses roundings away, which moved float32
#: parameters by less than 1e-5 of their steps with the elementwise public transforms and
#: by up to 5e-5 with the Muon family (float32 Newton-Schulz amplifies a reordering on an
#: ill-conditioned matrix; ``docs/testing.md``); the miscompilations the law is there to
#: catch moved parameters by 5 % to 100 % of their steps.
COMPILED_RTOL = 1e-4


class ConformanceError(AssertionError):
    """A transform broke one of :func:`check_transform`'s laws.

    Attributes:
        law: the name of the broken law (one of :data:`LAWS`).
        expectation: what the law asks of a transform.
        detail: what went wrong on the minimal example (step, key, values).
        example: the minimal failing ``(params, grads)`` pair hypothesis found (after
            shrinking), or ``None``; rerun your transform on it to debug.
        report: ``{law: "ok" | "skipped: ..." | "FAILED"}`` for the laws checked so far.
    """

    def __init__(self, law: str, expectation: str, detail: str, example: Any = None,
                 report: dict[str, str] | None = None, message: str | None = None) -> None:
        self.law = law
        self.expectation = expectation
        self.detail = detail
        self.example = example
        self.report = dict(report or {})
        super().__init__(message if message is not None else f"law {law!r} broken: {detail}")


class _Fail(Exception):
    """Raised inside a law's hypothesis test; carries the description of what broke."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.example: Any = None


class _BadStrategy(Exception):
    pass


# -- trees: snapshots, comparisons --------------------------------------------------


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _snapshot(obj: Any) -> Any:
    """A copy of a state/updates tree with every tensor cloned (other leaves shared)."""
    if isinstance(obj, (TensorDictBase, torch.Tensor)):
        return obj.clone()
    if _is_namedtuple(obj):
        return type(obj)(*(_snapshot(v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_snapshot(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    return obj


def _td_leaves(td: TensorDictBase) -> dict[str, Any]:
    return {key_str(k): v for k, v in td.items(include_nested=True, leaves_only=True)}


def _kind(x: Any) -> str:
    if isinstance(x, TensorDictBase):
        return "a TensorDict"
    if isinstance(x, torch.Tensor):
        return f"a {_tensor_str(x)} tensor"
    return f"a {type(x).__name__}"


def _tensor_str(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _values_differ(a: torch.Tensor, b: torch.Tensor, mode: str, rtol: float, atol: float) -> str | None:
    """``None`` if equal under ``mode``, else a short description of the difference."""
    if a.numel() == 0:
        return None
    if mode == "bitwise" and a.is_floating_point():
        view = _INT_VIEW.get(a.element_size())
        if view is not None and torch.equal(a.contiguous().view(view), b.contiguous().view(view)):
            return None
    elif not a.is_floating_point() and not a.is_complex():
        if torch.equal(a, b):
            return None
    elif mode == "close" and (rtol or atol):
        if bool(torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True).all()):
            return None
    else:  # exact: equal values, NaNs in the same places (-0.0 == 0.0)
        nan_a, nan_b = a.isnan(), b.isnan()
        if torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)):
            return None
    if a.is_floating_point():
        da, db = a.double(), b.double()
        both_nan = da.isnan() & db.isnan()
        bad = ~((da == db) | both_nan)
        if mode == "bitwise":
            bad = bad | ((da == db) & (torch.signbit(da) != torch.signbit(db)))
        diff = (da - db).abs().masked_fill(both_nan, 0).nan_to_num(nan=float("inf"))
        return (f"{int(bad.sum())} of {a.numel()} values differ (largest difference "
                f"{diff.max().item():.3g})")
    return f"{int((a != b).sum())} of {a.numel()} values differ"


def _tree_diff(a: Any, b: Any, path: str, mode: str = "exact", rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """The first difference between two trees, or ``None``.

    ``mode``: ``"structure"`` (containers, keys, tensor shapes/dtypes, scalar types),
    ``"exact"`` (also values; NaN equals NaN), ``"close"`` (values within rtol/atol)
    or ``"bitwise"`` (bit patterns).
    """
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        if not (isinstance(a, TensorDictBase) and isinstance(b, TensorDictBase)):
            return f"{path}: {_kind(a)} vs {_kind(b)}"
        la, lb = _td_leaves(a), _td_leaves(b)
        if set(la) != set(lb):
            return (f"{path}: TensorDict keys differ (only in the first: {sorted(set(la) - set(lb))}, "
                    f"only in the second: {sorted(set(lb) - set(la))})")
        if tuple(a.batch_size) != tuple(b.batch_size):
            return f"{path}: batch size {list(a.batch_size)} vs {list(b.batch_size)}"
        for k in la:
            d = _tree_diff(la[k], lb[k], f"{path}[{k}]", mode, rtol, atol)
            if d:
                return d
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {_kind(a)} vs {_kind(b)}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {_tensor_str(a)} vs {_tensor_str(b)}"
        if mode == "structure":
            return None
        d = _values_differ(a, b, mode, rtol, atol)
        return f"{path}: {d}" if d else None
    if type(a) is not type(b):
        return f"{path}: {_kind(a)} vs {_kind(b)}"
    if _is_namedtuple(a):
        for f, x, y in zip(a._fields, a, b):
            d = _tree_diff(x, y, f"{path}.{f}", mode, rtol, atol)
            if d:
                return d
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"{path}: a {type(a).__name__} of length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _tree_diff(x, y, f"{path}[{i}]", mode, rtol, atol)
            if d:
                return d
        return None
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{path}: dict keys {list(a)} vs {list(b)}"
        for k in a:
            d = _tree_diff(a[k], b[k], f"{path}[{k!r}]", mode, rtol, atol)
            if d:
                return d
        return None
    if mode == "structure" or not isinstance(a, _PLAIN):
        return None  # scalars: only their type is structure; other objects are not compared
    if isinstance(a, float) and mode == "close" and (rtol or atol):
        same = math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or (math.isnan(a) and math.isnan(b))
    elif isinstance(a, float):
        same = a == b or (math.isnan(a) and math.isnan(b))
    else:
        same = a == b
    return None if same else f"{path}: {a!r} vs {b!r}"


def _tensor_paths(node: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, TensorDictBase):
        for k, v in _td_leaves(node).items():
            yield f"{path}[{k}]", v
    elif isinstance(node, torch.Tensor):
        yield path, node
    elif _is_namedtuple(node):
        for f, v in zip(node._fields, node):
            yield from _tensor_paths(v, f"{path}.{f}")
    elif isinstance(node, (tuple, list)):
        for i, v in enumerate(node):
            yield from _tensor_paths(v, f"{path}[{i}]")
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _tensor_paths(v, f"{path}[{k!r}]")


# -- calling the transform ----------------------------------------------------------

def _hint(td: TensorDictBase) -> str:
    """A hint for errors on inputs with 0-D/1-D leaves (matrix transforms reject them)."""
    if any(t.ndim < 2 for t in _td_leaves(td).values() if isinstance(t, torch.Tensor)):
        return (" (if the transform takes only some leaves, e.g. matrices, pass matrices_only=True "
                "or a params= strategy that draws only those)")
    return ""


def _call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except _Fail:
        raise
    except Exception as e:  # the transform's own error: report it under this law
        raise _Fail(f"{what} raised {type(e).__name__}: {e}") from e


def _update(tx: Any, g: TensorDictBase, state: Any, params: TensorDictBase, what: str) -> tuple[Any, Any]:
    try:
        res = tx.update(g, state, params)
    except Exception as e:
        raise _Fail(f"{what}: update raised {type(e).__name__}: {e}{_hint(g)}") from e
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], TensorDictBase)):
        raise _Fail(f"{what}: update must return (updates: TensorDict, state), got {_kind(res)}")
    return res


def _init(tx: Any, params: TensorDictBase, what: str) -> Any:
    try:
        return tx.init(params)
    except Exception as e:
        raise _Fail(f"{what}: init raised {type(e).__name__}: {e}{_hint(params)}") from e


def _grad_seq(grads: TensorDictBase, n: int) -> list[TensorDictBase]:
    """``n`` different gradients from one draw (sign flips and halvings), new tensors each call."""
    return [grads.apply(lambda t, i=i: (t * ((-0.5) ** i)).to(t.dtype)) for i in range(n)]


def _run(tx: Any, params: TensorDictBase, grads: TensorDictBase, steps: int, label: str) -> tuple[list, list]:
    """Updates and states of ``steps`` updates of ``tx`` (params fixed, fresh tensors)."""
    params = params.clone()
    state = _init(tx, params, label)
    outs, states = [], []
    for i, g in enumerate(_grad_seq(grads, steps)):
        out, state = _update(tx, g, state, params, f"{label}, step {i}")
        outs.append(out)
        states.append(state)
    return outs, states


class _Config(NamedTuple):
    steps: int
    rtol: float
    atol: float
    factory: Any
    hyperparams: dict
    static_args: tuple
    zero_grad_exact: bool
    backend: Any = "inductor"  # a torch.compile backend: a name or a callable
    #: per example of the compiled law: whether its step ran compiled (False: the
    #: compiler could not take it and the adapter stepped eagerly)
    compiled_runs: list | None = None

    @property
    def mode(self) -> str:
        return "close" if (self.rtol or self.atol) else "exact"

    @property
    def exactly(self) -> str:
        return f"within rtol={self.rtol}, atol={self.atol}" if self.mode == "close" else "exactly"


def _same_runs(label: str, ref: tuple[list, list], got: tuple[list, list], pick: Callable[[Any], Any] | None,
               cfg: _Config, other: str = "tx") -> None:
    """Equal updates (and, unless ``pick`` is None, equal states) at every step."""
    for i, (o_ref, o, s_ref, s) in enumerate(zip(ref[0], got[0], ref[1], got[1])):
        d = _tree_diff(o, o_ref, "updates", cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"step {i}: {label} gave other updates than {other}: {d}")
        if pick is None:
            continue
        try:
            inner = pick(s)
        except Exception as e:
            raise _Fail(f"step {i}: {label} returned an unexpected state ({type(e).__name__}: {e})") from e
        d = _tree_diff(inner, s_ref, "state", cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"step {i}: the state of {other} inside {label} differs from {other}'s own: {d}")


# -- the laws -----------------------------------------------------------------------


def _law_purity(tx, params, grads, cfg: _Config) -> None:
    p_snap = _snapshot(params)
    state = _init(tx, params, "init")
    d = _tree_diff(params, p_snap, "params", "bitwise")
    if d:
        raise _Fail(f"init modified params in place: {d}")
    for i, g in enumerate(_grad_seq(grads, cfg.steps)):
        g_snap, s_snap, p_snap = _snapshot(g), _snapshot(state), _snapshot(params)
        out, new_state = _update(tx, g, state, params, f"step {i}")
        for name, now, before in (("updates", g, g_snap), ("state", state, s_snap), ("params", params, p_snap)):
            d = _tree_diff(now, before, name, "bitwise")
            if d:
                raise _Fail(f"step {i}: update modified its input {name} in place: {d}")
        out2, new_state2 = _update(tx, g, state, params, f"step {i} (called again)")
        for name, first, second in (("updates", out, out2), ("state", new_state, new_state2)):
            d = _tree_diff(second, first, name, cfg.mode, cfg.rtol, cfg.atol)
            if d:
                raise _Fail(
                    f"step {i}: calling update twice with the same (updates, state, params) returned "
                    f"different {name}: {d}. Does the transform keep state outside its state "
                    "(a closure, an attribute, a global) or use unseeded randomness?")
        state = new_state
    _adapter_matches_loop(tx, params, grads, cfg)


def _adapter_matches_loop(tx, params, grads, cfg: _Config) -> None:
    """Through :class:`muonfx.TransformOptimizer` (the executor writes the new state into
    the old buffers and ``p += u`` in place) the run equals the functional loop."""
    from .optim import TransformOptimizer

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
                    "did not create?")
    d = _tree_diff(opt.transform_state(0).inner_state, state, "state", cfg.mode, cfg.rtol, cfg.atol)
    if d:
        raise _Fail(f"through mfx.TransformOptimizer the state differs from the functional loop's: {d}")


def _law_eager_state(tx, params, grads, cfg: _Config) -> None:
    s1 = _init(tx, params, "init")
    s2 = _init(tx, params, "init (called again)")
    d = _tree_diff(s2, s1, "state", "structure")
    if d:
        raise _Fail(f"two calls of init(params) built states of different structure: {d}")
    state = s1
    for i, g in enumerate(_grad_seq(grads, cfg.steps)):
        _, state = _update(tx, g, state, params, f"step {i}")
        d = _tree_diff(s1, state, "state", "structure")
        if d:
            raise _Fail(f"the state after update {i + 1} is not shaped like init's (init first, then "
                        f"after the update): {d}. Create every buffer in init (zeros), not on first use.")


def _law_dtype(tx, params, grads, cfg: _Config) -> None:
    state = _init(tx, params, "init")
    for i, g in enumerate(_grad_seq(grads, cfg.steps)):
        out, state = _update(tx, g, state, params, f"step {i}")
        lo, lg = _td_leaves(out), _td_leaves(g)
        if set(lo) != set(lg):
            raise _Fail(f"step {i}: the updates' keys changed (missing {sorted(set(lg) - set(lo))}, "
                        f"extra {sorted(set(lo) - set(lg))})")
        for k, v in lg.items():
            o = lo[k]
            if not isinstance(o, torch.Tensor) or o.dtype != v.dtype or o.shape != v.shape:
                raise _Fail(f"step {i}: updates[{k}] came out as {_kind(o)} for an input "
                            f"{_tensor_str(v)} (updates must keep each leaf's dtype and shape)")
        new = _td_leaves(_call(f"step {i}: apply_updates(params, updates)", _apply_updates, params, out))
        for k, p in _td_leaves(params).items():
            n = new[k]
            if n.dtype != p.dtype or n.shape != p.shape:
                raise _Fail(f"step {i}: apply_updates turned params[{k}] {_tensor_str(p)} into {_tensor_str(n)}")


def _law_zero_gradient(tx, params, grads, cfg: _Config) -> None:
    state = _init(tx, params, "init")
    nonfinite_at_init = {p for p, t in _tensor_paths(state, "state")
                         if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())}
    for i in range(cfg.steps):
        zeros = grads.apply(torch.zeros_like)
        out, state = _update(tx, zeros, state, params, f"step {i} (zero gradient)")
        for k, v in _td_leaves(out).items():
            if not isinstance(v, torch.Tensor):
                continue
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise _Fail(f"step {i}: the update of a zero gradient has {int(v.isnan().sum())} NaN and "
                            f"{int(v.isinf().sum())} Inf values in updates[{k}] ({_tensor_str(v)}); "
                            "guard divisions by a norm or a second moment with an eps or a clamp")
            if cfg.zero_grad_exact and bool((v != 0).any()):
                raise _Fail(f"step {i}: the update of a zero gradient is not zero: updates[{k}] has "
                            f"{int((v != 0).sum())} nonzero values (largest |u| {v.abs().max().item():.3g})")
        for path, t in _tensor_paths(state, "state"):
            if path in nonfinite_at_init or not t.is_floating_point():
                continue
            if not bool(torch.isfinite(t).all()):
                raise _Fail(f"step {i}: after a zero gradient {path} has {int(t.isnan().sum())} NaN and "
                            f"{int(t.isinf().sum())} Inf values")


def _law_chain_identity(tx, params, grads, cfg: _Config) -> None:
    ref = _run(tx, params, grads, cfg.steps, "tx")
    for label, wrapped, pick in (
        ("chain(identity(), tx)", _chain(_identity(), tx), lambda s: s[1]),
        ("chain(tx, identity())", _chain(tx, _identity()), lambda s: s[0]),
    ):
        _same_runs(label, ref, _run(wrapped, params, grads, cfg.steps, label), pick, cfg)


def _law_masked_identity(tx, params, grads, cfg: _Config) -> None:
    label = "masked(tx, all False)"
    none = _masked(tx, lambda key, t: False)
    try:
        outs, _ = _run(none, params, grads, cfg.steps, label)
    except _Fail as f:
        raise _Fail(f"{f.detail} (with an all-False mask tx.init and tx.update get an empty "
                    "TensorDict, as inside partition or masked when no leaf is selected)") from f.__cause__
    for i, (o, g) in enumerate(zip(outs, _grad_seq(grads, cfg.steps))):
        d = _tree_diff(o, g, "updates", "bitwise")
        if d:
            raise _Fail(f"step {i}: {label} changed the updates: {d}")
    label = "masked(tx, all True)"
    ref = _run(tx, params, grads, cfg.steps, "tx")
    _same_runs(label, ref, _run(_masked(tx, lambda key, t: True), params, grads, cfg.steps, label),
               lambda s: s.inner_state, cfg)


def _law_accumulate(tx, params, grads, cfg: _Config) -> None:
    label = "accumulate(tx, 1)"
    ref = _run(tx, params, grads, cfg.steps, "tx")
    _same_runs(label, ref, _run(_accumulate(tx, 1), params, grads, cfg.steps, label),
               lambda s: s.inner_state, cfg)


def _law_inject(tx, params, grads, cfg: _Config) -> None:
    hp = cfg.hyperparams
    plain = _call("factory(**hyperparams)", lambda: cfg.factory(**hp))
    injected = _call("inject_hyperparams(factory)(**hyperparams)",
                     lambda: _inject_hyperparams(cfg.factory, cfg.static_args)(**hp))
    label = "inject_hyperparams(factory)(**hyperparams)"
    ref = _run(plain, params, grads, cfg.steps, "factory(**hyperparams)")
    # A schedule is evaluated by inject_hyperparams and passed to the factory as a number,
    # so the inner state may legitimately lack the schedule's own step counter: then only
    # the updates are compared.
    scheduled = any(callable(v) and n not in cfg.static_args for n, v in hp.items())
    _same_runs(label, ref, _run(injected, params, grads, cfg.steps, label),
               None if scheduled else (lambda s: s.inner_state), cfg, other="factory(**hyperparams)")


def _law_state_dict(tx, params, grads, cfg: _Config) -> None:
    from .optim import TransformOptimizer

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


def _law_leafwise(tx, params, grads, cfg: _Config) -> None:
    """A transform declared leafwise, run on the first half of the keys and on the rest
    (each piece with its share of the state, :func:`muonfx.state_tree.restrict`, merged
    back after the step as the executor does), computes what it computes on the whole tree."""
    keys = [(k,) if isinstance(k, str) else tuple(k) for k in params.keys(include_nested=True, leaves_only=True)]
    half = len(keys) // 2
    pieces = [keys[:half], keys[half:]]  # one leaf: the empty piece and the leaf

    def sub(td, ks):
        return _build(ks, [td.get(k) for k in ks])

    def named(ks):
        return "the leaves [" + ", ".join(key_str(k) for k in ks) + "]"

    state = _init(tx, params, "init")
    for ks in pieces:
        d = _tree_diff(_init(tx, sub(params, ks), f"init on {named(ks)}"), _restrict(state, set(ks)), "state",
                       cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"init on {named(ks)} alone differs from init on the whole tree restricted to them: {d}")
    split = state
    for i, g in enumerate(_grad_seq(grads, cfg.steps)):
        out, state = _update(tx, g, state, params, f"step {i}")
        merged = split
        for ks in pieces:
            o, s = _update(tx, sub(g, ks), _restrict(split, set(ks)), sub(params, ks), f"step {i} on {named(ks)}")
            d = _tree_diff(o, sub(out, ks), "updates", cfg.mode, cfg.rtol, cfg.atol)
            if d:
                raise _Fail(f"step {i}: on {named(ks)} alone tx gave other updates than on the whole tree: {d}. "
                            "Does an update depend on other leaves (a global norm, a count of leaves)?")
            d = _tree_diff(s, _restrict(state, set(ks)), "state", cfg.mode, cfg.rtol, cfg.atol)
            if d:
                raise _Fail(f"step {i}: on {named(ks)} alone tx left another state than on the whole tree "
                            f"(restricted to them, scalars included): {d}")
            merged = _merge(merged, s)
        split = merged
        d = _tree_diff(split, state, "state", cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"step {i}: the pieces' states merged (muonfx.state_tree.merge) differ from the whole "
                        f"tree's state: {d}. Key per-leaf state by the parameters' keys.")


def _law_idle(tx, params, grads, cfg: _Config) -> None:
    """In the adapter, a leaf without a gradient in the first step (``p.grad is None``)
    moves and keeps state as it does in an optimizer of its own that skips that step;
    the other leaves as they do without it (a leafwise transform's parameters are
    independent)."""
    from .optim import TransformOptimizer

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


def _low_precision_rtol(tensors: Iterable[torch.Tensor]) -> float:
    """Four roundings of the narrowest 16-bit floating dtype among ``tensors`` (bf16:
    0.031, fp16: 0.0039); 0 without one. Eager PyTorch rounds every intermediate to the
    tensor's dtype where inductor computes a fused chain in float32 and rounds once, and
    a reduction over the leaves (a global norm) carries that into every other leaf."""
    eps = [torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point() and torch.finfo(t.dtype).bits <= 16]
    return 4 * max(eps) if eps else 0.0


def _law_compiled(tx, params, grads, cfg: _Config) -> None:
    """``steps + 2`` steps of mfx.TransformOptimizer compiled by ``cfg.backend`` (the first
    step of a compiled optimizer is always eager) end where the eager optimizer ends."""
    from .optim import TransformOptimizer

    names = list(_td_leaves(params))
    start = [t.detach().clone() for t in _td_leaves(params).values()]
    seq = [[gl[n] for n in names] for gl in map(_td_leaves, _grad_seq(grads, cfg.steps + 2))]

    def run(backend: Any) -> tuple[list[list[torch.Tensor]], Any]:
        what = "eager run" if backend is None else f"compiled run (backend={backend!r})"
        torch._dynamo.reset()  # every example compiles afresh (dynamo's recompile limit)
        ps = [torch.nn.Parameter(v.clone(), requires_grad=v.is_floating_point()) for v in start]
        opt = _call(f"{what}: TransformOptimizer(named params, tx)", TransformOptimizer, list(zip(names, ps)), tx)
        if backend is not None:
            _call(f"{what}: opt.compile(backend={backend!r})", lambda: opt.compile(backend=backend))
        out = []
        for i, gs in enumerate(seq):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            _call(f"{what}, step {i}: opt.step()", opt.step)
            out.append([p.detach().clone() for p in ps])
        return out, opt

    eager, opt_e = run(None)
    # the compiled run with a batch budget of one byte: its first compiled step is one
    # graph, the later ones run a leafwise transform in pieces (one graph per parameter),
    # as a model larger than the budget does (``Executor.pieces``)
    saved = {k: set_batch_bytes(1, k) for k in {t.device.type for t in start} or {"cpu"}}
    try:
        compiled, opt_c = run(cfg.backend)
    finally:
        for k, v in saved.items():
            set_batch_bytes(v, k)
    cfg.compiled_runs.append(not opt_c.executor._fell_back)
    if opt_c.executor._fell_back:
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
                    f"step {i} (the first compiled step is step 1): params[{name}] differ between the "
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


def _drop_hyperparams(node: Any) -> Any:
    """``node`` with every ``InjectHyperparamsState.hyperparams`` replaced by ``None``."""
    if isinstance(node, _InjectHyperparamsState):
        return node._replace(hyperparams=None, inner_state=_drop_hyperparams(node.inner_state))
    if _is_namedtuple(node):
        return type(node)(*(_drop_hyperparams(v) for v in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_drop_hyperparams(v) for v in node)
    if isinstance(node, dict):
        return {k: _drop_hyperparams(v) for k, v in node.items()}
    return node


_LAW_FNS: dict[str, Callable[..., None]] = {
    "purity": _law_purity,
    "eager_state": _law_eager_state,
    "dtype_preservation": _law_dtype,
    "zero_gradient": _law_zero_gradient,
    "chain_identity": _law_chain_identity,
    "masked_identity": _law_masked_identity,
    "accumulate_k1": _law_accumulate,
    "inject_hyperparams": _law_inject,
    "state_dict_roundtrip": _law_state_dict,
    "leafwise": _law_leafwise,
    "idle_parameter": _law_idle,
    "compiled": _law_compiled,
}


def _expectation(law: str, cfg: _Config) -> str:
    ex = cfg.exactly
    return {
        "purity": "update(updates, state, params) must not modify its inputs (nor init its params), "
                  f"two calls with the same inputs must return the same updates and state ({ex}), "
                  "and mfx.TransformOptimizer must compute what the functional loop computes",
        "eager_state": "init(params) must build the whole state: after every update the state has "
                       "init's structure (containers, NamedTuple fields, keys, tensor shapes and "
                       "dtypes, scalar types), and two inits build the same structure",
        "dtype_preservation": "update must return updates with its input's keys, shapes and dtypes, "
                              "and apply_updates(params, updates) must keep every parameter's dtype",
        "zero_gradient": "zero gradients must give finite updates and state (no NaN or Inf)"
                         + (", and exactly zero updates" if cfg.zero_grad_exact else ""),
        "chain_identity": f"chain(identity(), tx) and chain(tx, identity()) must compute {ex} what tx does",
        "masked_identity": "masked(tx, all False) must return its updates unchanged (tx sees an empty "
                           f"TensorDict) and masked(tx, all True) must compute {ex} what tx does",
        "accumulate_k1": f"accumulate(tx, every_k=1) must compute {ex} what tx does",
        "inject_hyperparams": "inject_hyperparams(factory)(**hyperparams) must compute "
                              f"{ex} what factory(**hyperparams) does",
        "state_dict_roundtrip": f"in mfx.TransformOptimizer, saving state_dict() after {cfg.steps} steps "
                                "(torch.save, then torch.load(weights_only=True)) and loading it into "
                                f"a fresh optimizer must continue {ex} like the uninterrupted run",
        "leafwise": "tx is declared leafwise (mfx.leafwise): run on the first half of the leaves and on the "
                    f"rest, each with its share of the state, it must compute {ex} what it computes on the "
                    "whole tree: the same updates, and per piece the whole tree's state restricted to it "
                    "(muonfx.state_tree.restrict), scalars included",
        "idle_parameter": f"tx is declared leafwise: in mfx.TransformOptimizer, a parameter without a gradient "
                          f"in the first of {cfg.steps + 1} steps must end {ex} where it ends in an optimizer of "
                          "its own that skips that step (its value and the state_dict entries both hold), and "
                          "the other parameters where they end without it",
        "compiled": f"in mfx.TransformOptimizer compiled with torch.compile (backend={cfg.backend!r}), "
                    f"{cfg.steps + 2} steps (the first one eager) must end where the eager optimizer "
                    f"ends, parameters and state, within compile rounding (rtol={cfg.rtol or COMPILED_RTOL:g} "
                    "of how far each parameter moved, at least four roundings of a 16-bit dtype in the "
                    "tree, plus two roundings of the value)",
    }[law]


def _describe(example: Any) -> str:
    if example is None:
        return "    (not available)"
    params, grads = example
    lp = _td_leaves(params)
    lg = _td_leaves(grads)
    width = max((len(k) for k in lp), default=0)

    def amax(t):
        return f"{t.detach().abs().max().item():.3g}" if t.numel() else "-"

    lines = [f"  params and grads ({len(lp)} {'leaf' if len(lp) == 1 else 'leaves'}):"]
    for k, p in lp.items():
        g = lg.get(k)
        gs = amax(g) if isinstance(g, torch.Tensor) else "?"
        lines.append(f"    {k:<{width}}  {_tensor_str(p):<18} |params| max {amax(p)}, |grads| max {gs}")
    if not lp:
        lines.append("    (no leaves)")
    return "\n".join(lines)


def _unpack(pg: Any) -> tuple[TensorDictBase, TensorDictBase]:
    if not (isinstance(pg, (tuple, list)) and len(pg) == 2 and all(isinstance(x, TensorDictBase) for x in pg)):
        raise _BadStrategy(f"check_transform: params= must be a strategy of (params, grads) TensorDict "
                           f"pairs (e.g. muonfx.testing.params_and_grads()), it drew {type(pg).__name__}")
    return pg[0], pg[1]


def _find_fail(exc: BaseException) -> _Fail | None:
    if isinstance(exc, _Fail):
        return exc
    for sub in getattr(exc, "exceptions", ()) or ():
        f = _find_fail(sub)
        if f is not None:
            return f
    return None


def _run_law(name: str, tx: Any, cfg: _Config, strategy: Any, hyp: Any) -> tuple[_Fail, str] | None:
    """Run one law as a hypothesis test; the shrunk failure (with its example), or None."""
    body = _LAW_FNS[name]

    def law(pg):
        params, grads = _unpack(pg)
        try:
            body(tx, params, grads, cfg)
        except _Fail as f:
            f.example = (params, grads)
            raise
        except Exception as e:  # our own checks tripping over an odd result
            f = _Fail(f"{type(e).__name__}: {e}")
            f.example = (params, grads)
            raise f from e

    law.__name__ = law.__qualname__ = f"check_transform_{name}"
    test = hyp(given(strategy)(law))
    try:
        test()
    except _BadStrategy as e:
        raise TypeError(str(e)) from None
    except _Fail as f:
        return f, ""
    except Flaky as e:
        f = _find_fail(e)
        note = ("hypothesis saw this fail, then pass when it replayed the same example: the results "
                "depend on something besides the inputs (hidden state, randomness, timing)")
        if f is None:
            f = _Fail(f"{type(e).__name__}: {e}")
        return f, note
    return None


def check_transform(
    tx: GradientTransformation | None = None,
    *,
    factory: Callable[..., GradientTransformation] | None = None,
    hyperparams: Mapping[str, Any] | None = None,
    static_args: tuple[str, ...] = (),
    params: st.SearchStrategy | None = None,
    matrices_only: bool | None = None,
    laws: Iterable[str] | None = None,
    steps: int = 2,
    max_examples: int = 20,
    zero_grad_exact: bool = False,
    rtol: float = 0.0,
    atol: float = 0.0,
    derandomize: bool = False,
    backend: Any = "inductor",
) -> dict[str, str]:
    """Check that a transform obeys muonfx's contract; raise :class:`ConformanceError` if not.

    Each law runs as a hypothesis test over random ``(params, grads)`` (keys, nesting,
    shapes, dtypes); on the first broken law the error names the law, says what it
    expects and what happened, and shows the minimal (shrunk) example's keys, dtypes
    and shapes (also available as ``err.example``). The laws, in order (:data:`LAWS`):

    * ``purity``: ``update`` does not modify ``updates``, ``state`` or ``params``
      (bit for bit; nor does ``init`` modify ``params``), and calling it twice with
      the same inputs gives the same updates and state;
    * ``eager_state``: ``init`` builds the full state: after every update the state has
      the same structure (containers, fields, keys, tensor shapes and dtypes, scalar
      types) as after ``init``, and two ``init`` calls agree;
    * ``dtype_preservation``: updates keep each leaf's keys, shape and dtype, and
      ``apply_updates`` keeps the parameters' dtypes;
    * ``zero_gradient``: zero gradients give finite updates and state (and exactly zero
      updates with ``zero_grad_exact=True``);
    * ``chain_identity``: ``chain(identity(), tx)`` and ``chain(tx, identity())`` equal ``tx``;
    * ``masked_identity``: ``masked(tx, all False)`` is the identity (``tx`` then gets an
      empty TensorDict) and ``masked(tx, all True)`` equals ``tx``;
    * ``accumulate_k1``: ``accumulate(tx, 1)`` equals ``tx``;
    * ``inject_hyperparams`` (only with ``factory=`` and ``hyperparams=``):
      ``inject_hyperparams(factory, static_args)(**hyperparams)`` equals ``factory(**hyperparams)``;
    * ``state_dict_roundtrip``: ``steps`` steps of :class:`muonfx.TransformOptimizer` with
      ``tx``, ``state_dict()`` through ``torch.save`` / ``torch.load(weights_only=True)``
      into a fresh optimizer, one more step: the same parameters and state as the
      uninterrupted run;
    * ``leafwise`` (only for a transform declared leafwise, :func:`muonfx.leafwise`):
      ``init`` and ``update`` on the first half of the keys and on the rest (each piece
      with its share of the state, :func:`muonfx.state_tree.restrict`, merged back with
      :func:`~muonfx.state_tree.merge` after each step) equal the whole tree's: the same
      updates, the same per-leaf state and the same scalars (step counters);
    * ``idle_parameter`` (only for a transform declared leafwise): in
      :class:`muonfx.TransformOptimizer`, a parameter whose ``grad`` is None in the first
      of ``steps + 1`` steps ends (its value and the ``state_dict()`` entries both hold)
      where it ends in an optimizer of its own that skips that step, and the other
      parameters where they end without it.
    * ``compiled`` (only when asked for, ``laws=[..., "compiled"]``: every example compiles
      the step, seconds each with inductor): in :class:`muonfx.TransformOptimizer` compiled
      with ``torch.compile(backend=backend)`` (``opt.compile``; its first step is eager)
      and a batch budget of one byte (its first compiled step is one graph, the later
      ones run a leafwise transform in pieces, one graph per parameter, as on a model
      larger than :func:`muonfx.linalg.batch_bytes`), ``steps + 2`` steps end where the
      eager optimizer ends: every step's parameters within ``rtol`` (default
      :data:`COMPILED_RTOL`, 1e-4; where the example has a 16-bit leaf, at least four
      roundings of that dtype for every leaf: eager PyTorch rounds every intermediate
      where inductor rounds a fused chain once, and a global norm carries that into the
      other leaves) of how far the eager run has moved each parameter, plus two roundings
      of its value, and the final state within ``rtol`` of each buffer's size per step.
      This catches a compiler that computes the update differently from eager PyTorch
      (inductor has: ``min``/``max`` of a traced float on torch 2.10/2.11, a fused state
      write-back); a transform that computes below its parameters' precision needs
      ``rtol`` at that precision (``0.1`` for bf16 Newton-Schulz on float32 parameters:
      measured 1e-2 to 5e-2 of the step). Examples the compiler cannot take step eagerly
      (correct, not compared) and the report says how many. Not shrunk: the first failing
      example is shown. Draw float32 parameters for the tightest check.

    "Equals" (every law but ``compiled``, which has its own tolerance above) compares
    updates and states over ``steps`` updates with ``torch.equal``
    (NaN equal to NaN), or within ``rtol``/``atol`` when given (for transforms whose
    reductions are not deterministic).

    Args:
        tx: the transform; with ``factory`` and ``hyperparams`` it defaults to
            ``factory(**hyperparams)``.
        factory, hyperparams, static_args: enable the ``inject_hyperparams`` law.
        params: a strategy of ``(params, grads)`` pairs; defaults to
            :func:`params_and_grads` (0-D to 4-D leaves), or its matrices (2-D to 4-D)
            with ``matrices_only=True``.
        matrices_only: ``None`` (default) learns the transform's domain: if one update
            of a 0-D or a 1-D leaf raises ``ValueError`` while a 2-D leaf goes through
            (Muon, Newton-Schulz and the other matrix-only transforms refuse vectors by
            name), only matrices are drawn and the report's ``"domain"`` entry says why.
            ``True`` draws matrices only, ``False`` every rank (no probe).
        laws: the laws to check (default: all that apply).
        steps: updates per run.
        max_examples: hypothesis examples per law.
        derandomize: use a fixed hypothesis seed (reproducible, e.g. in CI).
        backend: the ``torch.compile`` backend of the ``compiled`` law (a name or a
            callable; default ``"inductor"``, what ``opt.compile()`` uses).

    Returns:
        ``{law: "ok" | "skipped: <why>"}`` for every law in :data:`LAWS`, plus
        ``"domain": "matrices only: ..."`` when the check restricted itself to matrices.

    The hypothesis settings (no deadline, no example database, ``too_slow`` health
    check off) apply to these checks only.

    Example::

        >>> import torch, muonfx as mfx
        >>> from muonfx.testing import check_transform
        >>> report = check_transform(mfx.momentum(0.9), max_examples=3, derandomize=True,
        ...                          laws=["purity", "eager_state", "dtype_preservation"])
        >>> report["purity"], report["state_dict_roundtrip"]
        ('ok', 'skipped: not requested')
    """
    has_inject = factory is not None and hyperparams is not None
    if (factory is None) != (hyperparams is None):
        raise TypeError("check_transform: pass factory= and hyperparams= together")
    if has_inject and not callable(factory):
        raise TypeError(f"check_transform: factory must be callable, got {type(factory).__name__}")
    hp = dict(hyperparams or {})
    if tx is None:
        if not has_inject:
            raise TypeError("check_transform needs a transform (tx) or factory= and hyperparams=")
        tx = factory(**hp)
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"check_transform: tx must be a GradientTransformation, got {type(tx).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"check_transform: steps must be an int >= 1, got {steps!r}")
    if not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"check_transform: max_examples must be an int >= 1, got {max_examples!r}")
    if rtol < 0 or atol < 0:
        raise ValueError(f"check_transform: rtol and atol must be >= 0, got {rtol}, {atol}")
    if not (isinstance(backend, str) and backend) and not callable(backend):
        raise TypeError(f"check_transform: backend must be a torch.compile backend (a name such as "
                        f"'inductor', or a callable), got {backend!r}")
    if laws is None:
        selected = [law for law in LAWS
                    if (law != "inject_hyperparams" or has_inject) and law not in OPT_IN_LAWS]
    else:
        selected = [laws] if isinstance(laws, str) else list(laws)
        unknown = [law for law in selected if law not in LAWS]
        if unknown:
            raise ValueError(f"check_transform: unknown laws {unknown}; the laws are {list(LAWS)}")
        if "inject_hyperparams" in selected and not has_inject:
            raise ValueError("check_transform: the inject_hyperparams law needs factory= and hyperparams=")
    domain = None
    if params is None:
        if matrices_only is None:
            domain = _matrix_domain(tx)
        params = params_and_grads(min_ndim=2) if matrices_only or domain else params_and_grads()
    elif matrices_only:
        raise TypeError("check_transform: pass either params= or matrices_only=True, not both")
    cfg = _Config(steps, float(rtol), float(atol), factory, hp, tuple(static_args), zero_grad_exact, backend, [])
    suppress = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
    if hasattr(HealthCheck, "nested_given"):  # check_transform called from a @given test
        suppress.append(HealthCheck.nested_given)
    # no "explain" phase: it reruns the failing example hundreds of times to annotate
    # hypothesis' own report, which check_transform replaces with its own
    hyp = settings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
                   suppress_health_check=suppress, report_multiple_bugs=False, print_blob=False,
                   phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    # the compiled law compiles twice per example: no shrinking (dozens of compilations)
    hyp_compiled = settings(hyp, phases=[Phase.explicit, Phase.reuse, Phase.generate])
    report: dict[str, str] = {}
    for law in LAWS:
        if law not in selected:
            if law == "inject_hyperparams" and not has_inject and laws is None:
                report[law] = "skipped: pass factory= and hyperparams= to check it"
            elif law in OPT_IN_LAWS and laws is None:
                report[law] = f"skipped: not requested (it compiles every example: laws=[..., {law!r}])"
            else:
                report[law] = "skipped: not requested"
            continue
        if law in ("leafwise", "idle_parameter") and not is_leafwise(tx):
            report[law] = "skipped: not declared leafwise"
            continue
        failure = _run_law(law, tx, cfg, params, hyp_compiled if law == "compiled" else hyp)
        if failure is None:
            report[law] = "ok" if law != "compiled" else _compiled_report(cfg)
            continue
        fail, note = failure
        report[law] = "FAILED"
        expectation = _expectation(law, cfg)
        message = (
            f"law {law!r} broken.\n"
            f"  expected: {expectation}\n"
            f"  got:      {fail.detail}\n"
            + (f"  note:     {note}\n" if note else "")
            + "minimal failing example (shrunk by hypothesis; the tensors are in err.example):\n"
            + _describe(fail.example)
            + ("\nlaws passed before it: " + ", ".join(k for k, v in report.items() if v == "ok")
               if any(v == "ok" for v in report.values()) else "")
        )
        if domain:
            report["domain"] = domain
        err = ConformanceError(law, expectation, fail.detail, fail.example, report, message)
        raise err from fail.__cause__
    if domain:
        report["domain"] = domain
    return report


def _compiled_report(cfg: _Config) -> str:
    """The compiled law's report entry: ``"ok"``, or how many examples stepped eagerly."""
    n, eager = len(cfg.compiled_runs), cfg.compiled_runs.count(False)
    if n and eager == n:
        return (f"skipped: torch.compile could not take this transform in any of the {n} examples; "
                "mfx.TransformOptimizer steps it eagerly (see the muonfx log for why)")
    if eager:
        return f"ok ({eager} of {n} examples stepped eagerly: torch.compile could not take them)"
    return "ok"


def _matrix_domain(tx: GradientTransformation) -> str | None:
    """``"matrices only: ..."`` if ``tx`` refuses 0-D or 1-D leaves with a ``ValueError``
    (one init and update of a one-leaf TensorDict) but takes a 2-D one; else ``None``."""
    from tensordict import TensorDict

    def refusal(shape: tuple[int, ...]) -> ValueError | None:
        leaf = TensorDict({"probe": torch.linspace(-1.0, 1.0, math.prod(shape)).reshape(shape)}, [])
        try:
            tx.update(leaf.clone(), tx.init(leaf), leaf)
        except ValueError as e:
            return e
        return None

    refused = [(shape, e) for shape in ((), (4,)) if (e := refusal(shape)) is not None]
    if not refused or refusal((4, 3)) is not None:
        return None
    shape, e = refused[0]
    return (f"matrices only (2-D to 4-D leaves): the transform refuses {len(shape)}-D leaves "
            f"(ValueError: {str(e).splitlines()[0][:160]})")
