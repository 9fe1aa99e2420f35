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

import sys
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

Key = tuple[str, ...]

__all__ = [
    "GradientTransformation",
    "LeafwiseTransformation",
    "leafwise",
    "is_leafwise",
    "leafwise_if",
    "EmptyState",
    "identity",
    "apply_updates",
    "key_str",
    "leaves",
    "aligned",
    "build",
    "check_keys",
    "check_like",
    "foreach",
    "td_items",
    "is_dtensor",
    "local",
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


class LeafwiseTransformation(GradientTransformation):
    """A :class:`GradientTransformation` declared *leafwise* by :func:`leafwise`: the
    same ``(init, update)`` pair, the same tuple, and a statement about what it computes."""

    __slots__ = ()


def leafwise(tx: GradientTransformation) -> GradientTransformation:
    """Declare that ``tx`` treats the leaves of the tree independently.

    A transform is leafwise when, for every leaf ``k``, the update and the new state of
    ``k`` depend only on ``k``'s update, state and parameter, and on scalars that every
    leaf shares and advances alike (step counters, injected hyperparameters). Then the
    update of any split of the tree, merged, is the update of the whole tree:

        update(u, s, p)[k] == update(u[K], s[K], p[K])[k]   for every subset K holding k

    Elementwise transforms are leafwise; so are per-matrix ones (Newton-Schulz, per-row
    statistics: each matrix is a leaf, or a stack of independent matrices), and
    combinators of leafwise transforms (:func:`muonfx.chain`, :func:`muonfx.partition`,
    :func:`muonfx.masked`, ...), which declare themselves so. A transform that reduces
    over several leaves (a global norm, a finite check over all updates) is not.

    The declaration changes nothing about what ``tx`` computes. It lets whoever runs
    the transform split a large tree: the adapter's executor runs a leafwise group in
    pieces of bounded size (each piece computed and written before the next), so a
    step's extra memory is bounded by the piece, not by the model.
    :func:`muonfx.testing.check_transform` checks a declaration (law ``leafwise``).
    Undeclared transforms (your own, by default) always run on the whole tree.

    Example::

        >>> import muonfx as mfx
        >>> from muonfx.base import GradientTransformation
        >>> double = GradientTransformation(lambda p: (), lambda u, s, p=None: (u.apply(lambda t: 2 * t), s))
        >>> mfx.is_leafwise(double), mfx.is_leafwise(mfx.leafwise(double))
        (False, True)
        >>> mfx.is_leafwise(mfx.chain(mfx.leafwise(double), mfx.scale(0.5)))
        True
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"leafwise takes a GradientTransformation, got {type(tx).__name__}")
    return tx if isinstance(tx, LeafwiseTransformation) else LeafwiseTransformation(tx.init, tx.update)


def is_leafwise(tx: Any) -> bool:
    """Whether ``tx`` is declared leafwise (see :func:`leafwise`)."""
    return isinstance(tx, LeafwiseTransformation)


def leafwise_if(tx: GradientTransformation, *inner: GradientTransformation) -> GradientTransformation:
    """``tx`` declared leafwise when every transform in ``inner`` is (for combinators)."""
    return leafwise(tx) if all(isinstance(t, LeafwiseTransformation) for t in inner) else tx


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged (the unit of :func:`chain`)."""

    def init_fn(params):
        return EmptyState()

    def update_fn(updates, state, params=None):
        return updates, state

    return LeafwiseTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# keys and leaves
# ---------------------------------------------------------------------------


def key_str(key: Key | str) -> str:
    """The user-facing dotted name of a (possibly nested) TensorDict key."""
    return key if isinstance(key, str) else ".".join(key)


def _as_key(key: Key | str) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


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
    if what == "updates":
        if not t.is_floating_point():
            raise TypeError(
                f"updates leaf {key_str(key)!r} has dtype {t.dtype}; gradients and updates must be "
                "floating point (an integer or bool gradient cannot be optimized)"
            )
        if t.is_meta:
            raise ValueError(
                f"updates leaf {key_str(key)!r} is on the meta device (it holds no data); "
                "materialize the model (e.g. model.to_empty(device=...)) before stepping"
            )


def leaves(td: TensorDictBase, what: str = "updates") -> tuple[list[Key], list[torch.Tensor]]:
    """Keys and tensors of every leaf of ``td``, in its order, after validation.

    Raises ``TypeError`` naming the key for sparse, complex or non-tensor leaves, and,
    when ``what`` is ``"updates"``, for integer or bool leaves.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"{what} must be a tensordict.TensorDict, got {type(td).__name__}")
    keys, tensors = td_items(td)
    for k, v in zip(keys, tensors):
        # the checks inline: this runs for every leaf of every transform of every step
        # (is_floating_point is False for complex, integer and bool tensors; a meta-device
        # update is refused where it meets the state or the parameters, see aligned())
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or not v.is_floating_point():
            _check_leaf(k, v, what)
    return keys, tensors


def check_keys(expected: Iterable[Key], td: TensorDictBase, what: str, against: str = "updates") -> None:
    """Raise ``ValueError`` naming missing and extra keys if ``td``'s leaves differ from ``expected``."""
    exp = {(k,) if type(k) is str else tuple(k) for k in expected}
    got = {(k,) if type(k) is str else tuple(k) for k in td.keys(include_nested=True, leaves_only=True)}
    if exp != got:
        missing = sorted(key_str(k) for k in exp - got)
        extra = sorted(key_str(k) for k in got - exp)
        raise ValueError(
            f"{what} does not match the {against}: missing keys {missing}, extra keys {extra}"
        )


def aligned(td: TensorDictBase | None, keys: Sequence[Key], what: str, against: str = "updates",
            like: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The leaves of ``td`` in the order of ``keys`` (checking that the key sets agree).

    With ``like`` (the tensors of ``against``, in the order of ``keys``), each leaf must
    also have the shape and device of its ``like`` tensor: ``ValueError`` naming the key
    otherwise (a ``(4, 1)`` gradient would broadcast against a ``(4, 4)`` parameter).
    """
    if td is None:
        raise ValueError(f"{what} are required by this transform: pass params=... to update()")
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"{what} must be a tensordict.TensorDict, got {type(td).__name__}")
    have, out = td_items(td)
    if have != keys:
        if len(have) != len(keys) or set(have) != set(keys):
            check_keys(keys, td, what, against)
        by_key = dict(zip(have, out))
        out = [by_key[k] for k in keys]
    if like is not None and ([o.shape for o in out] != [u.shape for u in like]
                             or [o.device for o in out] != [u.device for u in like]):
        for k, o, u in zip(keys, out, like):
            if o.shape != u.shape or o.device != u.device:
                check_like(k, u, o, against, what)
    return out


def check_like(key: Key, u: torch.Tensor, ref: torch.Tensor, what: str = "updates", ref_what: str = "params") -> None:
    """``ValueError`` naming ``key`` unless ``u`` has the shape and device of ``ref``.

    Example::

        >>> import torch
        >>> from muonfx.base import check_like
        >>> try:
        ...     check_like(("w",), torch.ones(4, 1), torch.ones(4, 4))
        ... except ValueError as e:
        ...     print(e)
        updates leaf 'w' has shape (4, 1), but params has (4, 4) there (no broadcasting)
    """
    if u.shape != ref.shape:
        raise ValueError(f"{what} leaf {key_str(key)!r} has shape {tuple(u.shape)}, but {ref_what} has "
                         f"{tuple(ref.shape)} there (no broadcasting)")
    if u.device != ref.device:
        hint = " (it holds no data)" if u.is_meta else ""
        raise ValueError(f"{what} leaf {key_str(key)!r} is on {u.device}{hint}, but {ref_what} is on {ref.device} there")


_EMPTY = torch.Size([])


def _fast_nodes() -> bool:
    """Whether a TensorDict node can be made as this module makes it: the attributes
    ``TensorDict._new_unsafe`` gives a fresh, unlocked TensorDict, set directly (no
    per-node Python call). Checked once, against the tensordict installed."""
    try:
        made = TensorDict._new_unsafe({"x": torch.zeros(())}, batch_size=_EMPTY, nested=False)
    except Exception:  # noqa: BLE001 - another tensordict: its own constructor then
        return False
    return set(made.__dict__) == {"_tensordict", "_device", "_batch_size", "_td_dim_names"} and \
        type(made._tensordict) is dict


_FAST = _fast_nodes()
_new = object.__new__
_SELF = object()  # where build() keeps a nested dict's node while it makes the parents


def _node(d: dict) -> TensorDict:
    """A TensorDict (batch size ``[]``, no device) holding the dict ``d`` of leaves and
    child nodes as it is (no per-key validation)."""
    if not _FAST:
        return TensorDict._new_unsafe(d, batch_size=_EMPTY, nested=False)
    td = _new(TensorDict)
    td.__dict__.update(_tensordict=d, _device=None, _batch_size=_EMPTY, _td_dim_names=None)
    return td


def td_items(td: TensorDictBase) -> tuple[list[Key], list[Any]]:
    """Keys (tuples) and values of every leaf of ``td``, in its order, unchecked.

    A plain TensorDict's nested dicts are walked directly, depth first in insertion
    order (what ``td.items(include_nested=True, leaves_only=True)`` yields), with no
    Python call per leaf; other TensorDict types (and traced code) go through ``items``.
    """
    if type(td) is not TensorDict or torch.compiler.is_compiling():
        return [((k,) if type(k) is str else tuple(k)) for k in td.keys(include_nested=True, leaves_only=True)], \
            list(td.values(include_nested=True, leaves_only=True))
    keys: list[Key] = []
    vals: list[Any] = []
    stack = [((), iter(td._tensordict.items()))]
    tensor = torch.Tensor
    while stack:
        prefix, it = stack[-1]
        for k, v in it:
            if type(v) is TensorDict:
                stack.append((prefix + (k,), iter(v._tensordict.items())))
                break
            if not isinstance(v, tensor) and isinstance(v, TensorDictBase):
                # a lazy stack, a tensorclass: tensordict's own walk
                ks, vs = td_items(v)
                keys.extend([prefix + (k,) + kk for kk in ks])
                vals.extend(vs)
                continue
            keys.append(prefix + (k,))
            vals.append(v)
        else:
            stack.pop()
    return keys, vals


def build(keys: Sequence[Key], tensors: Sequence[torch.Tensor]) -> TensorDict:
    """A new TensorDict (batch size ``[]``) with ``tensors`` at the (nested) ``keys``.

    Tensors at distinct keys go in as they are, nested nodes made at the first key under
    them (the order of ``TensorDict(dict(zip(keys, tensors)), batch_size=[])``), with no
    Python call per key; anything else (numbers, repeated keys, traced code) goes
    through TensorDict's own constructor and its checks.
    """
    if torch.compiler.is_compiling():
        return TensorDict(dict(zip(keys, tensors)), batch_size=[])
    root: dict = {}
    nodes = [root]
    flat = True
    for k, t in zip(keys, tensors):
        if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
            return TensorDict(dict(zip(keys, tensors)), batch_size=[])
        if len(k) == 1:
            if k[0] in root:
                return TensorDict(dict(zip(keys, tensors)), batch_size=[])
            root[k[0]] = t
            continue
        flat = False
        d = root
        for part in k[:-1]:
            child = d.get(part)
            if child is None:
                child = d[part] = {}
                nodes.append(child)
            elif type(child) is not dict:
                return TensorDict(dict(zip(keys, tensors)), batch_size=[])
            d = child
        if k[-1] in d:
            return TensorDict(dict(zip(keys, tensors)), batch_size=[])
        d[k[-1]] = t
    if flat or not _FAST:
        if not flat:
            for d in reversed(nodes):  # children were made after their parents: make them first
                for name, v in d.items():
                    if type(v) is dict:
                        d[name] = _node(v)
        return _node(root)
    td = None
    for d in reversed(nodes):  # (_node, inline: no Python call per node)
        for name, v in d.items():
            if type(v) is dict:
                d[name] = v[_SELF]
        td = _new(TensorDict)
        td.__dict__.update(_tensordict=d, _device=None, _batch_size=_EMPTY, _td_dim_names=None)
        if d is not root:
            d[_SELF] = td
    for d in nodes[1:]:
        del d[_SELF]
    return td


# ---------------------------------------------------------------------------
# fused elementwise operations
# ---------------------------------------------------------------------------


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` once that module is loaded, else None (no
    tensor can be a DTensor then): muonfx never imports it to find out."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 / tensor-parallel shard): the one test, by
    ``isinstance``, of every module below :mod:`muonfx.distributed`.

    Example::

        >>> import torch
        >>> from muonfx.base import is_dtensor
        >>> is_dtensor(torch.zeros(2))
        False
    """
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """A DTensor's local shard (the tensor itself for anything else)."""
    cls = dtensor_class()
    if cls is None or not isinstance(t, cls):
        return t
    return t._local_tensor if not torch.is_grad_enabled() else t.to_local()


_FAST_REWRAP = [True]


def _dtensor_new(cls: type) -> Any:
    """How to make a DTensor of class ``cls`` from ``(local, spec, requires_grad=...)``:
    eagerly its ``__new__`` alone (``DTensor.__init__`` only marks the constructor for
    export, behind wrappers that cost seven Python calls per tensor), traced the class."""
    if torch.compiler.is_compiling():
        return lambda c, local_t, spec, requires_grad: c(local_t, spec, requires_grad=requires_grad)
    return cls.__new__


def rewrap_all(locals_: Sequence[torch.Tensor], likes: Sequence[Any]) -> list[Any]:
    """Each ``locals_[i]`` as a DTensor placed like ``likes[i]``: with that one's own spec
    where the shard has its shape, strides and dtype (the constructor: one call, where
    ``from_local`` makes dozens), else through ``from_local``."""
    if not likes:
        return []
    cls = type(likes[0])
    new = _dtensor_new(cls) if _FAST_REWRAP[0] else None
    out = []
    for loc, like in zip(locals_, likes):
        mine = like._local_tensor
        if new is not None and type(like) is cls and loc.shape == mine.shape and loc.dtype == mine.dtype \
                and loc.stride() == mine.stride():
            try:
                out.append(new(cls, loc, like._spec, requires_grad=False))
                continue
            except TypeError:  # a torch whose DTensor constructor takes other arguments
                _FAST_REWRAP[0] = False
                new = None
        out.append(type(like).from_local(loc, like.device_mesh, like.placements, run_check=False,
                                         shape=like.shape, stride=like.stride()))
    return out


#: the spec of ``t.reshape(1, a, b)`` for a 2-D DTensor ``t`` (:func:`dtensor_stack_views`), by
#: ``t``'s mesh (held, so its ``id`` stays its own), placements, shape, strides and dtype: DTensor's own view rule
#: runs once per distinct layout, not once per parameter and step
_STACK_SPECS: dict[tuple, tuple[Any, Any]] = {}


def dtensor_stack_views(ts: Sequence[torch.Tensor], dims: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Each 2-D DTensor ``ts[i]`` (``dims[i]`` = ``(a, b)``) viewed as a ``[1, a, b]``
    stack: its shard's view wrapped with a spec that DTensor's own view rule computes once
    per layout (that rule is many Python calls per tensor, at every step), where the view
    is the shard's own. Call with gradients off (an optimizer step)."""
    out = []
    new = _dtensor_new(type(ts[0])) if ts and _FAST_REWRAP[0] else None
    for t, (a, b) in zip(ts, dims):
        spec = t._spec
        key = (id(spec.mesh), spec.placements, t.shape, t.stride(), t.dtype)
        hit = _STACK_SPECS.get(key)
        if hit is None or hit[0] is not spec.mesh:
            view = t.reshape(1, a, b)
            if view._local_tensor.shape == (1, *t._local_tensor.shape):
                _STACK_SPECS[key] = (spec.mesh, view._spec)
            # else: a layout whose view is not the shard's own: DTensor's rule each time
            out.append(view)
            continue
        if new is not None:
            try:
                out.append(new(type(t), t._local_tensor.unsqueeze(0), hit[1], requires_grad=False))
                continue
            except TypeError:  # a torch whose DTensor constructor takes other arguments
                _FAST_REWRAP[0] = False
                new = None
        out.append(t.reshape(1, a, b))
    return out


def unstack_like(outs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each ``[k, a, b]`` result of a matrix stack back in the shape of its ``g``; a
    2-D DTensor's is its shard's view wrapped with ``g``'s own spec (see :func:`rewrap_all`)."""
    cls = dtensor_class()
    if cls is None or torch.is_grad_enabled():
        return [o if o.shape == g.shape else o.reshape(g.shape) for o, g in zip(outs, gs)]
    res: list = []
    fast = []  # (position, shard view, g): rewrapped together
    for o, g in zip(outs, gs):
        if o.shape == g.shape:
            res.append(o)
        elif isinstance(o, cls) and isinstance(g, cls) and g.ndim == 2 and \
                o._local_tensor.shape == (1, *g._local_tensor.shape):
            fast.append((len(res), o._local_tensor.view(g._local_tensor.shape), g))
            res.append(None)
        else:
            res.append(o.reshape(g.shape))
    if fast:
        for (i, _, _), r in zip(fast, rewrap_all([f[1] for f in fast], [f[2] for f in fast])):
            res[i] = r
    return res


def _traced_foreach(op: str, lists: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """:func:`foreach` as the compiler sees it: per-tensor ops, scalars by arithmetic.

    The compiler generates its own fused loops, so nothing is lost by spelling a foreach
    op per tensor; and a float hyperparameter that reaches ``_foreach_*`` (or a scalar
    ``alpha=``/``value=``/lerp weight) is specialised into the graph, which would mean one
    recompilation per learning rate. Written as ``a + (b - a) * w``, ``a + b * alpha``,
    ``a + t1 * t2 * value``, it stays a symbolic input. The same maths as eager, to
    float rounding.
    """
    base = op.rstrip("_")
    inplace = op.endswith("_")
    n = len(lists[0])
    args = [lst if isinstance(lst, (list, tuple)) else [lst] * n for lst in lists]
    out = []
    for i in range(n):
        a = args[0][i]
        rest = [x[i] for x in args[1:]]
        if base == "ema":
            # beta * m + (1 - beta) * g as g + (m - g) * beta: ``1 - beta`` would be Python
            # arithmetic on the scalar, which torch 2.10 / 2.11 specialise
            b, beta = rest
            r = b + (a - b) * beta
        elif base == "neg_mul":
            # the scalar reaches the graph as a multiplication's operand, negated after:
            # ``-s`` would be Python arithmetic on it, which torch 2.10 / 2.11 specialise
            r = torch.mul(a, rest[0]).neg()
        elif base == "lerp":
            b, w = rest
            r = torch.lerp(a, b, w) if isinstance(w, torch.Tensor) else a + (b - a) * w
        elif base == "add" and "alpha" in kwargs:
            r = a + rest[0] * kwargs["alpha"]
        elif base == "addcmul":
            r = a + rest[0] * rest[1] * kwargs.get("value", 1)
        elif base == "addcdiv":
            r = a + rest[0] / rest[1] * kwargs.get("value", 1)
        else:
            r = getattr(torch, base)(a, *rest, **kwargs)
        if inplace:
            a.copy_(r)
            r = a
        out.append(r)
    return out


def foreach(op: str, *lists: Sequence[Any], **kwargs: Any) -> list[torch.Tensor]:
    """Call ``torch._foreach_<op>`` on aligned lists; returns the results as a list.

    Arguments that are not lists of tensors (scalars, scalar lists) are passed
    through. For an in-place op (``op`` ending in ``_``) the first list is returned;
    use those only on tensors the caller created in the same update (transforms never
    write into their inputs).

    DTensor leaves (FSDP2 shards) run on their local shards as plain tensors and are
    wrapped back with the same placements: every op here is elementwise, so the shard
    is all it needs, and no DTensor sharding rule (which differ between torch
    versions) is involved. Lists mixing DTensors and plain tensors are split by kind.

    ``op="neg_mul"`` with a scalar ``s`` gives ``-s * u`` (eagerly one multiplication
    by ``-s``); ``op="ema"`` with lists ``m``, ``g`` and a scalar ``beta`` gives
    ``beta * m + (1 - beta) * g`` (eagerly ``lerp(m, g, 1 - beta)``). Traced, ``s`` and
    ``beta`` themselves reach the graph (see :func:`_traced_foreach`): arithmetic on them
    in Python would make torch 2.10 / 2.11 recompile the graph for every new value.

    Example::

        >>> import torch
        >>> from muonfx.base import foreach
        >>> foreach("lerp", [torch.zeros(2)], [torch.ones(2)], 0.25)[0].tolist()
        [0.25, 0.25]
    """
    first = lists[0]
    n = len(first)
    if n == 0:
        return []
    if torch.compiler.is_compiling():
        return _traced_foreach(op, lists, kwargs)
    if op == "neg_mul":  # -s * u: one multiplication by -s eagerly
        s = lists[1]
        op, lists = "mul", (first, [-v for v in s] if isinstance(s, list) else -s)
    elif op == "ema":  # beta * m + (1 - beta) * g: lerp(m, g, 1 - beta) eagerly
        op, lists = "lerp", (first, lists[1], 1.0 - lists[2])
    fn = getattr(torch, "_foreach_" + op)
    inplace = op.endswith("_")
    cls = dtensor_class()
    dt = [isinstance(t, cls) for t in first] if cls is not None else ()
    if True not in dt:
        res = fn(*lists, **kwargs)
        return list(first) if inplace else list(res)
    out = list(first) if inplace else [None] * n
    for want in (False, True):
        idx = [i for i in range(n) if dt[i] is want]
        if not idx:
            continue
        if want and not torch.is_grad_enabled():  # the shards themselves (local() inline)
            sub = [[lst[i]._local_tensor if isinstance(lst[i], cls) else lst[i] for i in idx]
                   if isinstance(lst, (list, tuple)) else lst for lst in lists]
        else:
            sub = [[local(lst[i]) for i in idx] if isinstance(lst, (list, tuple)) else lst for lst in lists]
        res = fn(*sub, **kwargs)
        if not inplace:
            res = rewrap_all(res, [first[i] for i in idx]) if want else res
            for i, r in zip(idx, res):
                out[i] = r
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
    for k, p, u in zip(keys, ps, us):  # all checked before anything is computed
        if not isinstance(u, torch.Tensor) or u.layout != torch.strided or not u.is_floating_point() or u.is_meta:
            _check_leaf(k, u, "updates")
        if u.shape != p.shape or u.device != p.device:
            check_like(k, u, p)
    return build(keys, [(p + u).to(p.dtype) for p, u in zip(ps, us)])
