"""The transform laws of :func:`muonfx.testing.check_transform`: what a transform owes
its callers, checked on the transform alone (the adapter's laws are in
:mod:`.adapter_laws`, the compiled one in :mod:`.compiled_law`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from tensordict import TensorDictBase

from .. import tree
from ..combine import chain as _chain, masked as _masked
from ..core import build as _build
from ..core import identity as _identity
from ..core import apply_updates as _apply_updates, key_str
from ..wrappers import accumulate as _accumulate, inject_hyperparams as _inject_hyperparams
from .compare import kind as _kind, snapshot as _snapshot, td_leaves as _td_leaves, tensor_paths as _tensor_paths
from .compare import tensor_str as _tensor_str, tree_diff as _tree_diff

__all__ = ["TRANSFORM_LAWS"]


class _Fail(Exception):
    """Raised inside a law's hypothesis test; carries the description of what broke."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.example: Any = None


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
    # A schedule is evaluated by inject_hyperparams and passed as a number (to the factory,
    # or at each update to a late-bound factory's transform: muonfx.hyperparams.late_bound),
    # so the inner state may legitimately lack the schedule's own step counter: then only
    # the updates are compared.
    scheduled = any(callable(v) and n not in cfg.static_args for n, v in hp.items())
    _same_runs(label, ref, _run(injected, params, grads, cfg.steps, label),
               None if scheduled else (lambda s: s.inner_state), cfg, other="factory(**hyperparams)")


def _law_leafwise(tx, params, grads, cfg: _Config) -> None:
    """A transform declared leafwise, run on the first half of the keys and on the rest
    (each piece with its share of the state, :func:`muonfx.tree.restrict`, merged
    back after the step as the adapter does), computes what it computes on the whole tree."""
    keys = [(k,) if isinstance(k, str) else tuple(k) for k in params.keys(include_nested=True, leaves_only=True)]
    half = len(keys) // 2
    pieces = [keys[:half], keys[half:]]  # one leaf: the empty piece and the leaf

    def sub(td, ks):
        return _build(ks, [td.get(k) for k in ks])

    def named(ks):
        return "the leaves [" + ", ".join(key_str(k) for k in ks) + "]"

    state = _init(tx, params, "init")
    for ks in pieces:
        d = _tree_diff(_init(tx, sub(params, ks), f"init on {named(ks)}"), tree.restrict(state, set(ks)), "state",
                       cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"init on {named(ks)} alone differs from init on the whole tree restricted to them: {d}")
    split = state
    for i, g in enumerate(_grad_seq(grads, cfg.steps)):
        out, state = _update(tx, g, state, params, f"step {i}")
        merged = split
        for ks in pieces:
            o, s = _update(tx, sub(g, ks), tree.restrict(split, set(ks)), sub(params, ks), f"step {i} on {named(ks)}")
            d = _tree_diff(o, sub(out, ks), "updates", cfg.mode, cfg.rtol, cfg.atol)
            if d:
                raise _Fail(f"step {i}: on {named(ks)} alone tx gave other updates than on the whole tree: {d}. "
                            "Does an update depend on other leaves (a global norm, a count of leaves)?")
            d = _tree_diff(s, tree.restrict(state, set(ks)), "state", cfg.mode, cfg.rtol, cfg.atol)
            if d:
                raise _Fail(f"step {i}: on {named(ks)} alone tx left another state than on the whole tree "
                            f"(restricted to them, scalars included): {d}")
            merged = tree.merge(merged, s)
        split = merged
        d = _tree_diff(split, state, "state", cfg.mode, cfg.rtol, cfg.atol)
        if d:
            raise _Fail(f"step {i}: the pieces' states merged (muonfx.tree.merge) differ from the whole "
                        f"tree's state: {d}. Key per-leaf state by the parameters' keys.")




#: the transform laws, by name, in the order they are checked
TRANSFORM_LAWS: dict[str, Callable[..., None]] = {
    "purity": _law_purity,
    "eager_state": _law_eager_state,
    "dtype_preservation": _law_dtype,
    "zero_gradient": _law_zero_gradient,
    "chain_identity": _law_chain_identity,
    "masked_identity": _law_masked_identity,
    "accumulate_k1": _law_accumulate,
    "inject_hyperparams": _law_inject,
    "leafwise": _law_leafwise,
}
