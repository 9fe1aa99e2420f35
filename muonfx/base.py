"""The core types of muonfx and the TensorDict helpers every transform uses.

A *transform* is a pair of pure functions (:class:`GradientTransformation`):

* ``init(params) -> state`` builds the transform's state, eagerly and completely;
* ``update(updates, state, params=None) -> (new_updates, new_state)`` maps a
  TensorDict of updates (gradients, at the start of a chain) to new updates.

``params`` and ``updates`` are :class:`tensordict.TensorDict` s keyed like
``TensorDict.from_module(model)``: nested keys are tuples of strings, shown to users
as dotted names (``"layers.0.weight"``). ``update`` never mutates its inputs.

This module sits at the bottom of the import graph: it imports only torch and
tensordict.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

Key = tuple[str, ...]

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "identity",
    "apply_updates",
    "key_str",
    "leaves",
    "aligned",
    "build",
    "check_keys",
    "foreach",
    "scaled_div",
    "donating",
    "protect",
    "mark_fresh",
    "protect_state",
    "may_overwrite",
    "tree_tensors",
    "folding_final_scale",
    "take_final",
    "give_final",
    "defer_scale",
    "final_scales",
]


class GradientTransformation(NamedTuple):
    """A pure optimizer transform: ``(init, update)``.

    ``init(params: TensorDict) -> state``
        Creates the full state eagerly. State holds only tensors, TensorDicts and
        numbers (typically a NamedTuple of them), and has the same structure on every
        rank and at every step.

    ``update(updates: TensorDict, state, params: TensorDict | None = None) -> (TensorDict, state)``
        Returns new updates and the new state. It never mutates ``updates``,
        ``state`` or ``params``.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> params = TensorDict({"w": torch.ones(2, 2)}, [])
        >>> tx = mfx.chain(mfx.momentum(0.9), mfx.scale_by_learning_rate(0.1))
        >>> state = tx.init(params)
        >>> updates, state = tx.update(params.clone(), state, params)
        >>> round(mfx.apply_updates(params, updates)["w"][0, 0].item(), 6)
        0.99
    """

    init: Callable[[TensorDictBase], Any]
    update: Callable[..., tuple[TensorDictBase, Any]]


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged (the unit of :func:`chain`)."""

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        return updates, state

    return GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# keys and leaves
# ---------------------------------------------------------------------------


def key_str(key: Key | str) -> str:
    """The user-facing dotted name of a (possibly nested) TensorDict key."""
    return key if isinstance(key, str) else ".".join(key)


def _as_key(key: Key | str) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _items(td: TensorDictBase) -> list[tuple[Key, Any]]:
    return [(_as_key(k), v) for k, v in td.items(include_nested=True, leaves_only=True)]


def _check_leaf(key: Key, t: Any, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} leaf {key_str(key)!r} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise TypeError(
            f"{what} leaf {key_str(key)!r} has layout {t.layout} (a sparse gradient?); muonfx "
            "transforms need dense tensors. Route this parameter to a transform that takes "
            "dense gradients (e.g. nn.Embedding(sparse=False) with AdamW via mfx.partition "
            "or mfx.muon_adamw), or call .to_dense() on it first."
        )
    if t.is_complex():
        raise TypeError(
            f"{what} leaf {key_str(key)!r} is complex ({t.dtype}); muonfx transforms take real "
            "tensors only. Optimize torch.view_as_real(param) instead."
        )


def leaves(td: TensorDictBase, what: str = "updates") -> tuple[list[Key], list[torch.Tensor]]:
    """Keys and tensors of every leaf of ``td``, in its order, after validation.

    Raises ``TypeError`` naming the key for sparse, complex or non-tensor leaves.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"{what} must be a tensordict.TensorDict, got {type(td).__name__}")
    keys, tensors = [], []
    for k, v in _items(td):
        _check_leaf(k, v, what)
        keys.append(k)
        tensors.append(v)
    return keys, tensors


def check_keys(expected: Iterable[Key], td: TensorDictBase, what: str, against: str = "updates") -> None:
    """Raise ``ValueError`` naming missing and extra keys if ``td``'s leaves differ from ``expected``."""
    exp = set(_as_key(k) for k in expected)
    got = set(_as_key(k) for k in td.keys(include_nested=True, leaves_only=True))
    if exp != got:
        missing = sorted(key_str(k) for k in exp - got)
        extra = sorted(key_str(k) for k in got - exp)
        raise ValueError(
            f"{what} does not match the {against}: missing keys {missing}, extra keys {extra}"
        )


def aligned(td: TensorDictBase | None, keys: Sequence[Key], what: str, against: str = "updates") -> list[torch.Tensor]:
    """The leaves of ``td`` in the order of ``keys`` (checking that the key sets agree)."""
    if td is None:
        raise ValueError(f"{what} are required by this transform: pass params=... to update()")
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"{what} must be a tensordict.TensorDict, got {type(td).__name__}")
    check_keys(keys, td, what, against)
    return [td.get(k) for k in keys]


def tree_tensors(node: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state tree (NamedTuples, tuples, lists, dicts, TensorDicts)."""
    if isinstance(node, TensorDictBase):
        yield from node.values(include_nested=True, leaves_only=True)
    elif isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from tree_tensors(v)
    elif isinstance(node, (tuple, list)):
        for v in node:
            yield from tree_tensors(v)


def build(keys: Sequence[Key], tensors: Sequence[torch.Tensor]) -> TensorDict:
    """A new TensorDict (batch size ``[]``) with ``tensors`` at the (nested) ``keys``."""
    return TensorDict(dict(zip(keys, tensors)), batch_size=[])


# ---------------------------------------------------------------------------
# fused elementwise operations
# ---------------------------------------------------------------------------


def _kind(t: torch.Tensor) -> type:
    return type(t) if type(t) is not torch.nn.Parameter else torch.Tensor


class _Donation(threading.local):
    """Tensors that ops declaring ``reuse=True`` may overwrite (see :func:`donating`)."""

    writable: dict[int, weakref.ref] | None = None


_DONATION = _Donation()


@contextlib.contextmanager
def donating(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Let the transforms called inside overwrite ``tensors`` instead of allocating.

    Adapters donate the previous step's state, which they discard after the update.
    Inside the block, :func:`foreach` calls made with ``reuse=True`` run in place when
    every tensor of their first list is donated or was freshly made by an earlier op in
    the block (intermediate results); :func:`protect` takes tensors back out (combinators
    protect every tensor of a new state before the next transform runs). Outside such a
    block nothing is ever overwritten, so ``update`` stays pure for direct callers.
    """
    prev = _DONATION.writable
    _DONATION.writable = {id(t): weakref.ref(t) for t in tensors}
    try:
        yield
    finally:
        _DONATION.writable = prev


def protect(tensors: Iterable[torch.Tensor]) -> None:
    """Make ``tensors`` read-only for the rest of the current :func:`donating` block."""
    w = _DONATION.writable
    if w:
        for t in tensors:
            w.pop(id(t), None)


def protect_state(state: Any) -> None:
    """:func:`protect` every tensor of a state (cheap no-op outside :func:`donating`)."""
    if _DONATION.writable:
        protect(tree_tensors(state))


def mark_fresh(tensors: Iterable[torch.Tensor]) -> None:
    """Declare ``tensors`` new intermediates that later ops may overwrite (inside :func:`donating`)."""
    w = _DONATION.writable
    if w is not None:
        for t in tensors:
            w[id(t)] = weakref.ref(t)


def _is_writable(t: torch.Tensor) -> bool:
    ref = _DONATION.writable.get(id(t))  # type: ignore[union-attr]
    return ref is not None and ref() is t


_REUSE_DTYPES = (torch.float32, torch.float64)


def may_overwrite(t: torch.Tensor) -> bool:
    """True inside :func:`donating` when ``t`` may be overwritten with a result of its dtype."""
    return _DONATION.writable is not None and t.dtype in _REUSE_DTYPES and _is_writable(t)


def _may_reuse(lists: Sequence[Any]) -> bool:
    if _DONATION.writable is None:
        return False
    first = lists[0]
    # Only float32/float64 run in place: torch's in-place bf16/fp16 ops with a Python
    # scalar round the scalar to the tensor's dtype first (out of place they do not),
    # so reuse there would change results.
    if not all(t.dtype in _REUSE_DTYPES and _is_writable(t) for t in first):
        return False
    for other in lists[1:]:  # in place must not change the result dtype
        if isinstance(other, (list, tuple)) and other and isinstance(other[0], torch.Tensor):
            if any(o.dtype != f.dtype for o, f in zip(other, first)):
                return False
    return True


def _fits_into(into: Sequence[torch.Tensor] | None, first: Sequence[torch.Tensor], owned: bool) -> bool:
    """True when each result may be written into ``into`` with torch's ``out=`` form.

    Only plain CPU float32/float64 tensors of the result's shape and dtype qualify:
    there a fresh allocation costs page faults (several passes over the memory), while
    CUDA's caching allocator makes allocation free and ``_foreach`` kernels are fused.
    ``owned=False`` tensors must also be writable in the current :func:`donating` block.
    """
    if into is None or len(into) != len(first):
        return False
    if not owned and _DONATION.writable is None:
        return False
    for t, f in zip(into, first):
        if (type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype not in _REUSE_DTYPES
                or t.dtype != f.dtype or t.shape != f.shape or (not owned and not _is_writable(t))):
            return False
    return True


def _pick(arg: Any, i: int) -> Any:
    return arg[i] if isinstance(arg, (list, tuple)) else arg


def foreach(op: str, *lists: Sequence[Any], reuse: bool = False, into: Sequence[torch.Tensor] | None = None,
            owned: bool = False, **kwargs: Any) -> list[torch.Tensor]:
    """Call ``torch._foreach_<op>`` on aligned lists, grouped by tensor kind.

    torch's fused ``_foreach`` kernels take lists of one kind: plain tensors and
    DTensors cannot be mixed in one call, so the leaves are grouped by type and the
    results put back in order. Arguments that are not lists of tensors (scalars,
    scalar lists) are passed through unchanged. For in-place ops (``op`` ending in
    ``_``) the first list is returned; use them only on tensors the caller created.

    ``reuse=True`` says the caller no longer needs the first list's old values: inside
    a :func:`donating` block the op then runs in place when allowed.

    ``into`` names tensors (one per result) whose old values the caller no longer
    needs, such as a buffer the op reads itself (``foreach("div", m, d, into=d)``
    computes ``m / d`` into ``d``) or gradients after their last use. Results are
    written there with torch's ``out=`` form when that pays (plain CPU float tensors
    of the result's shape and dtype, see :func:`_fits_into`) and the tensors may be
    overwritten: ``owned=True`` says the caller made them in this update; otherwise
    they must be donated or fresh in the current :func:`donating` block. When not
    used, the op allocates as usual: the values are the same either way.
    """
    first = lists[0]
    n = len(first)
    if n == 0:
        return []
    if not op.endswith("_") and _fits_into(into, first, owned):
        fn = getattr(torch, op)
        out = [fn(*[_pick(lst, i) for lst in lists], out=into[i], **kwargs) for i in range(n)]
        mark_fresh(out)
        return out
    inplace = op.endswith("_")
    if reuse and not inplace and _may_reuse(lists):
        op, inplace = op + "_", True
    fn = getattr(torch, "_foreach_" + op)
    kinds = [_kind(t) for t in first]
    if all(k is kinds[0] for k in kinds):
        res = fn(*lists, **kwargs)
        out = list(first) if inplace else list(res)
    else:
        out = list(first) if inplace else [None] * n
        for kind in dict.fromkeys(kinds):
            idx = [i for i in range(n) if kinds[i] is kind]
            sub = [
                [lst[i] for i in idx] if isinstance(lst, (list, tuple)) else lst for lst in lists
            ]
            res = fn(*sub, **kwargs)
            if not inplace:
                for i, r in zip(idx, res):
                    out[i] = r
    if not inplace:
        mark_fresh(out)
    return out


def scaled_div(num: Sequence[torch.Tensor], den: Sequence[torch.Tensor], scale: float,
               overwrite_den: bool = False) -> list[torch.Tensor]:
    """``scale * num / den`` per leaf.

    ``overwrite_den=True`` says the caller made ``den`` in this update and no longer
    needs it: on the CPU the result is then written into it in one pass
    (``addcdiv`` of a 0-d zero, the scale folded in), instead of a division into fresh
    memory and a second pass for the scale.
    """
    if not num:
        return []
    if overwrite_den and _fits_into(den, num, owned=True):
        zero = torch.zeros((), dtype=den[0].dtype)
        out = [torch.addcdiv(zero, n, d, value=scale, out=d) for n, d in zip(num, den)]
        mark_fresh(out)
        return out
    out = foreach("div", num, den)
    if scale != 1.0:
        foreach("mul_", out, scale)
    return out


# ---------------------------------------------------------------------------
# folding the final scalar multiply into the apply step
# ---------------------------------------------------------------------------


class _Final(threading.local):
    """Which update function produces the adapter's final output (see :func:`folding_final_scale`)."""

    target: Callable[..., Any] | None = None
    scales: dict[int, tuple[weakref.ref, float]] | None = None


_FINAL = _Final()


@contextlib.contextmanager
def folding_final_scale(update_fn: Callable[..., Any]) -> Iterator[None]:
    """Adapter side: let a scalar multiply that ends ``update_fn``'s output be deferred.

    Inside the block, a scaling transform that is provably the last operation on the
    output (handed the token by :func:`take_final` / :func:`give_final` through aware
    combinators) returns its input unchanged and records its factor instead; the
    adapter reads the factors with :func:`final_scales` and applies
    ``p += factor * u`` in one pass. Outside such a block, or for transforms reached
    through a combinator that does not pass the token on, nothing is deferred.
    """
    prev = (_FINAL.target, _FINAL.scales)
    _FINAL.target, _FINAL.scales = update_fn, {}
    try:
        yield
    finally:
        _FINAL.target, _FINAL.scales = prev


def take_final(update_fn: Callable[..., Any]) -> bool:
    """True when ``update_fn``'s output is the adapter's final output (the token is consumed)."""
    if _FINAL.target is not update_fn or update_fn is None:
        return False
    _FINAL.target = None
    return _FINAL.scales is not None


def give_final(update_fn: Callable[..., Any]) -> None:
    """Combinator side: the next call of ``update_fn`` produces the final output."""
    _FINAL.target = update_fn


def defer_scale(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """Record that the final output ``tensors`` are to be multiplied by ``factor``
    (on top of a factor already deferred for them)."""
    scales = _FINAL.scales
    assert scales is not None, "defer_scale outside folding_final_scale"
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        rec = scales.get(id(t))
        prior = rec[1] if rec is not None and rec[0]() is t else 1.0
        scales[id(t)] = (weakref.ref(t), prior * factor)


def final_scales(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Adapter side: the deferred factor of each final output tensor (1.0 when none)."""
    scales = _FINAL.scales or {}
    out = []
    for t in tensors:
        rec = scales.get(id(t))
        out.append(rec[1] if rec is not None and rec[0]() is t else 1.0)
    return out


# ---------------------------------------------------------------------------
# applying updates
# ---------------------------------------------------------------------------


def apply_updates(params: TensorDictBase, updates: TensorDictBase) -> TensorDict:
    """New parameters ``p + u``, each cast back to the parameter's own dtype.

    Formula: ``p_new = (p + u).to(p.dtype)``. Neither input is modified.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"w": torch.ones(2, dtype=torch.bfloat16)}, [])
        >>> u = TensorDict({"w": torch.full((2,), 0.5)}, [])
        >>> mfx.apply_updates(p, u)["w"].dtype
        torch.bfloat16
    """
    keys, ps = leaves(params, "params")
    us = aligned(updates, keys, "updates", against="params")
    return build(keys, [(p + u).to(p.dtype) for p, u in zip(ps, us)])
