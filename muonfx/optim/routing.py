"""Where the Muon optimizers send each parameter, and why; and the guard against a "Muon"
optimizer in which no parameter reaches Newton-Schulz.

A run whose parameters arrive flattened (FSDP1-style 1-D flat parameters), or whose
every matrix is named like an embedding or a head, would otherwise give every parameter
AdamW under Muon's name. :func:`check_muon_reached` raises :class:`NoMuonError` naming
why; ``allow_no_muon=True`` (on :class:`muonfx.MuonOptimizer`,
:func:`muonfx.create_hybrid_optimizer`, :class:`muonfx.FSDPMuonOptimizer`) allows it.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from ..presets.standard import ADAMW_KEY_PATTERN

__all__ = ["NoMuonError", "Route", "rule_of", "check_muon_reached", "FLAT_NUMEL"]

#: a 1-D parameter at least this large, in a model with no matrix, reads as a flattened one
FLAT_NUMEL = 4096

#: ``(name, shape, "muon" | "adamw", the rule that sent it there)``
Route = tuple[str, tuple[int, ...], str, str]


class NoMuonError(ValueError):
    """A Muon optimizer in which no parameter gets Muon (Newton-Schulz); the message says why."""


def rule_of(name: str, p: torch.Tensor, route: Hashable, embedding: bool = False, custom: bool = False) -> str:
    """The rule behind ``route`` for parameter ``name``: ``"0-D/1-D"``, ``"nn.Embedding
    module"``, ``"name matches an embedding/head pattern"``, ``"labels function"`` or
    ``"matrix"``.

    Example::

        >>> import torch
        >>> from muonfx.optim.routing import rule_of
        >>> rule_of("lm_head.weight", torch.zeros(4, 4), "adamw")
        "name 'lm_head' matches an embedding/head pattern"
    """
    if custom:
        return "labels function"
    if route == "muon":
        return "matrix"
    if p.ndim < 2:
        return "0-D/1-D"
    if embedding:
        return "nn.Embedding module"
    m = ADAMW_KEY_PATTERN.search(name)
    if m:
        return f"name {m.group(2)!r} matches an embedding/head pattern"
    return "given without a name" if name.startswith("param") else "other"


def routes(named: Sequence[tuple[str, torch.Tensor]], label: Callable[[str, torch.Tensor], Hashable],
           embedding_ids: set[int] = frozenset(), custom: bool = False) -> list[Route]:
    """The route and rule of every ``(name, parameter)``."""
    out = []
    for n, p in named:
        r = label(n, p)
        out.append((n, tuple(p.shape), str(r), rule_of(n, p, r, id(p) in embedding_ids, custom)))
    return out


def _few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def check_muon_reached(where: str, routed: Sequence[Route], allow: bool) -> None:
    """:class:`NoMuonError` when no parameter of ``routed`` goes to Muon (unless ``allow``),
    naming why: the parameters are flattened (1-D, one of at least :data:`FLAT_NUMEL`
    elements), no parameter is at least 2-D, or every matrix was sent to AdamW by a rule.

    Example::

        >>> from muonfx.optim.routing import check_muon_reached, NoMuonError
        >>> try:
        ...     check_muon_reached("MuonOptimizer", [("flat", (12288,), "adamw", "0-D/1-D")], allow=False)
        ... except NoMuonError as e:
        ...     print(str(e)[:72])
        MuonOptimizer: no parameter gets Muon: the parameters arrive flattened (
    """
    if allow or not routed or any(r == "muon" for _, _, r, _ in routed):
        return
    hint = ("; pass allow_no_muon=True if an optimizer without any Muon parameter is what you mean")
    matrices = [(n, s, rule) for n, s, _, rule in routed if len(s) >= 2]
    if not matrices:
        flat = [f"{n!r} {s}" for n, s, _, _ in routed if len(s) == 1 and s[0] >= FLAT_NUMEL]
        if flat:
            why = (f"the parameters arrive flattened (1-D: {_few(flat)}), as FSDP1's flat parameters or a "
                   "flattened state do, so every parameter would get AdamW under Muon's name. Give the "
                   "optimizer the model's own parameters (FSDP2's fully_shard keeps their shapes), not flat ones")
        else:
            why = (f"no parameter is at least 2-D ({_few([f'{n!r} {s}' for n, s, _, _ in routed])}); Muon "
                   "orthogonalizes matrices. Use mfx.adamw for such a model")
        raise NoMuonError(f"{where}: no parameter gets Muon: {why}{hint}")
    shown = [f"{n!r} {s} ({rule})" for n, s, rule in matrices]
    raise NoMuonError(f"{where}: no parameter gets Muon: every matrix matched an embedding/head rule and goes "
                      f"to AdamW: {_few(shown)}. Rename them or pass labels=... (create_hybrid_optimizer) to "
                      f"route hidden matrices to Muon{hint}")


def format_routes(routed: Sequence[Route]) -> str:
    """One line per route: ``muon  <- matrix: 'h.0.w' (8, 8)``, grouped by route and rule.

    Example::

        >>> from muonfx.optim.routing import format_routes
        >>> print(format_routes([("w", (8, 8), "muon", "matrix"), ("b", (8,), "adamw", "0-D/1-D")]))
        routing: muon: 1 parameter ('w' by matrix); adamw: 1 parameter ('b' by 0-D/1-D)
    """
    by: dict[str, list[str]] = {}
    for n, _, r, rule in routed:
        by.setdefault(r, []).append(f"{n!r} by {rule}")
    parts = [f"{r}: {len(v)} parameter{'s' if len(v) != 1 else ''} ({_few(v)})" for r, v in by.items()]
    return "routing: " + "; ".join(parts)
