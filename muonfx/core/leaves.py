"""Keys and leaves: the dotted name of a key, the leaf checks every transform runs, and
:func:`apply_updates`.

A TensorDict's nested keys are tuples of strings (:data:`Key`), shown to users as dotted
names (``"layers.0.weight"``). :func:`leaves` and :func:`aligned` hand a transform its
tensors after the checks that name the key of a bad leaf.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .._compat.tensordict import Key, build, td_items

__all__ = ["Key", "key_str", "leaves", "aligned", "check_keys", "check_like", "apply_updates", "zeros_like_leaves"]


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
        >>> from muonfx.core import check_like
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


def zeros_like_leaves(keys: Sequence[Key], tensors: Sequence[torch.Tensor],
                      dtype: torch.dtype | None = None) -> TensorDict:
    """A TensorDict of zeros shaped like ``tensors`` (in ``dtype``, else each tensor's own),
    keyed by ``keys``: the usual initial state buffer of a transform (moments, momentum).

    Example::

        >>> import torch
        >>> from muonfx.core import zeros_like_leaves
        >>> zeros_like_leaves([("w",)], [torch.ones(2)])["w"].tolist()
        [0.0, 0.0]
    """
    return build(keys, [torch.zeros_like(t, dtype=dtype or t.dtype) for t in tensors])

