"""What the matrix step does with each parameter, before training: :func:`describe`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..core import Dims, MatrixView, view_of
from ..linalg.batching import batch_bytes
from .layout import largest, lifted, stack_layout
from .plan import ExchangePlan, plan_exchange

__all__ = ["describe", "Description"]


@dataclass
class Description:
    """The rows of :func:`describe` (one dict per parameter) and the plan they come
    from; ``str()`` prints them as a table."""

    rows: list[dict[str, Any]]
    plan: ExchangePlan | None = None
    world: int = 1
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        cols = ["parameter", "shape", "placements", "route", "matrix view", "Newton-Schulz", "sent/step"]
        table = [[str(r.get(c, "")) for c in cols] for r in self.rows]
        widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
        line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
        out = [line(cols), line(["-" * w for w in widths])] + [line(t) for t in table]
        return "\n".join(out + self.notes)


def _stack_placements(t: torch.Tensor, view: MatrixView) -> list:
    """``t``'s placements on its ``[k, m, n]`` stack by ``view``: a cut of a dim that is
    the batch, the rows or the columns alone becomes a cut of stack dim 0, 1 or 2; a cut of
    a dim flattened with others is ``None`` (the view needs a redistribution)."""
    from .layout import placement_key

    batch, rows, cols = view.split(t.ndim)
    where = {side[0]: i for i, side in enumerate((batch, rows, cols)) if len(side) == 1}
    out = []
    for pl in t.placements:
        key = placement_key(pl)
        if key[0] == "R":
            out.append(key)
        elif key[1] in where:
            out.append((key[0], where[key[1]], *key[2:]))
        else:
            out.append(None)
    return out


def _named(source: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, torch.optim.Optimizer):
        records = getattr(source, "records", None)
        out = []
        for gi, g in enumerate(source.param_groups):
            names = g.get("param_names")
            if names is None and records is not None:
                names = [".".join(k) for k in records[gi].keys]
            names = names or [f"param{gi}.{i}" for i in range(len(g["params"]))]
            out.extend(zip(names, g["params"]))
        return out
    if isinstance(source, torch.nn.Module):
        return list(source.named_parameters())
    return [(n, p) for n, p in source]


def describe(source: torch.optim.Optimizer | torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
             labels: Callable[[str, torch.Tensor], str] | None = None,
             dtype: torch.dtype = torch.bfloat16, dims: Dims = None) -> Description:
    """Per parameter: its placements, its route, how matrix transforms read it (which dims
    are the batch, which the matrix) and where its Newton-Schulz runs, with the bytes the
    exchange sends for it per step over all ranks. Pure: no communication, so it can run
    on one rank, before training.

    ``source`` is an optimizer, a module or ``(name, tensor)`` pairs. ``labels(name,
    tensor)`` routes each parameter (``"muon"``: a matrix transform reads it); the default
    is :func:`muonfx.default_muon_labels`, the routing of :func:`muonfx.muon_adamw`.
    ``dtype`` is the exchange's (Newton-Schulz's compute dtype where it is narrower than
    the gradients': bf16 by default on GPUs); bytes scale with its size.
    The owners are those of one exchange over every matrix routed to Muon (the step's
    own plan when one group holds them all). ``dims`` overrides the matrix views as
    :func:`muonfx.newton_schulz`'s does (:class:`muonfx.MatrixView`). Print the result
    for a table.

    Example::

        >>> import torch, muonfx as mfx
        >>> from muonfx.distributed import describe
        >>> experts = torch.nn.Parameter(torch.zeros(8, 16, 32))      # [E, m, n]
        >>> d = describe([("moe.experts", experts), ("moe.router", torch.zeros(8, 16))])
        >>> d.rows[0]["matrix view"]
        'batch dim 0 (8) of 16x32 matrices (dims 1 x 2)'
    """
    from ..presets import default_muon_labels

    label = labels or default_muon_labels
    named = _named(source)
    # an optimizer that says where it sent each parameter (MuonOptimizer, create_hybrid_optimizer,
    # FSDPMuonOptimizer: ``routing``) is described by that, with the rule behind each route
    said = {n: (r, rule) for n, _, r, rule in getattr(source, "routing", None) or ()} if labels is None else {}
    if said:
        label = lambda n, p: said[n][0] if n in said else default_muon_labels(n, p)  # noqa: E731
    rows: list[dict[str, Any]] = []
    stacks, where = [], []  # (layout, ranks) of each DTensor matrix, and its row
    device_type = "cpu"
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    onto = largest([p.device_mesh for n, p in named if type(p).__name__ == "DTensor" and p.ndim >= 2
                    and label(n, p) == "muon"])
    for name, p in named:
        row: dict[str, Any] = {"parameter": name, "shape": tuple(p.shape)}
        is_dt = type(p).__name__ == "DTensor"
        if is_dt:
            names = p.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(p.device_mesh.ndim))
            row["placements"] = ", ".join(f"{n}:{pl}" for n, pl in zip(names, p.placements))
        else:
            row["placements"] = "plain tensor"
        route = label(name, p)
        row["route"] = route + (f" ({said[name][1]})" if name in said else "")
        if route != "muon" or p.ndim < 2:
            row["matrix view"] = "-"
            row["Newton-Schulz"] = "none (elementwise on local shards)" if is_dt else "none"
            rows.append(row)
            continue
        view = view_of(dims, name, p)
        row["matrix view"] = view.describe(tuple(p.shape))
        stack_shape = view.shape(tuple(p.shape))
        if not is_dt:
            row["Newton-Schulz"] = "on every rank that holds it" if world > 1 else "here"
            rows.append(row)
            continue
        keys = _stack_placements(p, view)
        if any(k is None for k in keys):
            row["Newton-Schulz"] = "its matrix view cuts a flattened dim: redistributed by DTensor first"
            rows.append(row)
            continue
        mesh, keys = lifted(p.device_mesh, keys, onto)
        device_type = mesh.device_type
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        world = max(world, max(ranks) + 1)
        stacks.append((stack_layout(stack_shape, tuple(mesh.mesh.shape), keys), ranks))
        where.append(len(rows))
        rows.append(row)
    plan = None
    if stacks:
        elsize = torch.empty((), dtype=dtype).element_size()
        budget = batch_bytes(device_type)
        plan = plan_exchange([lay for lay, _ in stacks], [r for _, r in stacks], world, elsize, budget)
        per_stack: dict[int, list] = {}
        for mp in plan.matrices:
            per_stack.setdefault(mp.stack, []).append(mp)
        for si, ri in enumerate(where):
            mps = per_stack.get(si, [])
            local = [mp for mp in mps if mp.bucket < 0]
            moved = [mp for mp in mps if mp.bucket >= 0]
            parts = []
            if local:
                parts.append(f"{len(local)} where held whole (rank{'s' if len({mp.owner for mp in local}) > 1 else ''} "
                             f"{_ranks_str(mp.owner for mp in local)}), no communication")
            if moved:
                parts.append(f"{len(moved)} on owner rank{'s' if len({mp.owner for mp in moved}) > 1 else ''} "
                             f"{_ranks_str(mp.owner for mp in moved)}, pieces from rank(s) "
                             f"{_ranks_str(p.rank for mp in moved for p in mp.sources) or '-'}")
            rows[ri]["Newton-Schulz"] = "; ".join(parts) or "nothing (empty)"
            sent = sum(p.numel for mp in moved for p in mp.sources) + sum(p.numel for mp in moved for p in mp.targets)
            rows[ri]["sent/step"] = _bytes(sent * elsize)
    notes = []
    if plan is not None:
        sent = plan.bytes_sent()
        notes.append(f"\n{len(plan.matrices)} matrices over {world} ranks, {plan.buckets} bucket(s) of all-to-alls; "
                     f"bytes sent per rank per step ({str(dtype).replace('torch.', '')}): "
                     f"{', '.join(_bytes(b) for b in sent)}")
    return Description(rows, plan, world, notes)


def _ranks_str(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
