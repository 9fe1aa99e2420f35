"""Fused elementwise operations: :func:`foreach`, ``torch._foreach_*`` on aligned lists of
tensors, and its spelling for traced code (:func:`_traced_foreach`).

DTensor leaves run on their local shards (:mod:`muonfx._compat.dtensor`), plain tensors as
they are.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ._compat.dtensor import dtensor_class, rewrap_all, shards

__all__ = ["foreach"]


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
        >>> from muonfx.ops import foreach
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
        sub = [shards(lst, cls, idx) if isinstance(lst, (list, tuple)) else lst for lst in lists]
        res = fn(*sub, **kwargs)
        if not inplace:
            res = rewrap_all(res, [first[i] for i in idx]) if want else res
            for i, r in zip(idx, res):
                out[i] = r
    return out

