"""The step plan: how a step runs, decided once, by rules, and shown to the user.

A :class:`StepPlan` is built for a set of present parameters (those with a gradient)
and static hyperparameters (anything but numbers: dtypes, modes, schedules), and for the
parameters' shapes, dtypes and devices; it is kept while those stay, and replaced, never
changed, when one changes (or on an event: a compile that fails, a tuning the user asked
for, a compile setting of a group). The same inputs give the same plan, also after a
resume: no timing decides anything. Per param group it holds:

* the group's transform (built once per set of static hyperparameters);
* the path, by rules (:func:`choose_path`):

  - ``"compiled"`` (one ``torch.compile`` graph does the step, write-back included)
    only where the user asks for it: the group's ``"compile"`` setting ``True``, set by
    :meth:`~muonfx.TransformOptimizer.compile`, :meth:`~muonfx.TransformOptimizer.tune`
    or by hand (a compile costs a minute or more before the first step; nothing is
    compiled by default);
  - ``"fused"``: the group's chain computes an arithmetic torch has a fused kernel for,
    and that kernel runs it on the group's own state (:mod:`.fused`: a group built
    with :func:`muonfx.adamw` runs ``torch._fused_adamw_``, bit for bit
    ``torch.optim.AdamW(fused=True)``; one built with :func:`muonfx.muon` runs its
    elementwise links in foreach passes around its Newton-Schulz, torch.optim.Muon's
    arithmetic, whole or in pieces: :mod:`.fused_muon`; one built with
    :func:`muonfx.adopt`, :func:`muonfx.laprop`, :func:`muonfx.cautious_adamw` or
    :func:`muonfx.mars_adamw` its links in in-place foreach passes: :mod:`.fused_adam_family`);
  - ``"eager"``: the chain, transform by transform, otherwise;
* the pieces: a group whose present parameters hold more bytes than the batch budget
  (:func:`muonfx.linalg.batch_bytes`) and whose transform is leafwise
  (:func:`muonfx.leafwise`) is computed and written piece by piece (eagerly always;
  compiled when its transform does matrix work, whose batches one graph would hold at
  once), after a dry run on fake tensors has found every error that depends on shapes,
  dtypes and kinds (:mod:`.dryrun`);
* the settings read once, when the plan is built, and passed to each of its steps
  (:class:`Settings`: the default Newton-Schulz dtype, the batch budgets, the symmetric
  Triton kernels).

How the settings reach the kernels: as a value, never through a module. The plan's
:class:`Settings` (a :class:`muonfx.linalg.MatrixSettings`) is the extra argument
``matrix_settings`` of every group's update (:mod:`muonfx.core.contract`), which the
combinators and wrappers pass down to :func:`muonfx.newton_schulz`; it hands the dtype
and the Triton switch to :class:`muonfx.linalg.NewtonSchulz` and the batch budget to
:func:`muonfx.seam.map_matrices` (and so to the DTensor exchange). A value passed at run
time rather than bound when the group's transform is built, so one transform serves every
plan (a group's transforms are built once per set of static hyperparameters, whatever the
settings), a compiled graph takes it as an input, and no setting is held in a module
while a step runs: two optimizers stepping in two threads each compute with their own.
The process-level setters (:func:`muonfx.linalg.set_default_ns_dtype`,
:func:`muonfx.linalg.set_batch_bytes`, :func:`muonfx.linalg.triton_ns.set_enabled`, the
environment variables) are the defaults a new plan reads.

``print(opt.plan)`` shows all of it, parameter by parameter (where each goes, which dims
are the matrix and which the batch, the Newton-Schulz dtype, form and products).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..._compat.dtensor import is_dtensor
from ...core import GradientTransformation, Key, is_leafwise
from ...linalg import triton_ns
from ...linalg.settings import EXTRA_ARG, MatrixSettings
from .dryrun import DryRun, dry_run
from . import fused_adam_family  # noqa: F401  (registers the catalogue's Adam-like lowerings)
from . import fused_muon  # noqa: F401  (registers Muon's lowering)
from . import fused_schedule_free  # noqa: F401  (registers Schedule-Free AdamW's lowering)
from . import fused_soap  # noqa: F401  (registers SOAP's lowering)
from .fused import KERNELS, lowering
from .pieces import plan_pieces

__all__ = ["Settings", "GroupPlan", "StepPlan"]

#: The process settings a plan reads once, when it is built (:meth:`MatrixSettings.capture`
#: over the device types of its parameters), and passes to each of its steps (see the
#: module doc): a change between steps reaches a running optimizer through its next plan
#: (a new set of present parameters, :meth:`~muonfx.TransformOptimizer.replan`).
Settings = MatrixSettings


@dataclass(frozen=True)
class GroupPlan:
    """How one param group steps.

    Attributes:
        index: the param group's index.
        keys: the keys of the parameters that step (those with a gradient).
        positions: their places in the param group.
        transform: the group's transform for its static hyperparameters.
        path: ``"compiled"``, ``"fused"`` or ``"eager"``.
        why: the rule or setting that chose the path.
        pieces: ``None`` (whole) or the pieces, each a tuple of places in ``keys``.
        nbytes: the bytes of the parameters that step.
        partial: whether some parameters of the group have no gradient.
        devices: the device types of the parameters.
        dtensor: whether some parameter is a DTensor.
        kernel: the fused kernel of a ``"fused"`` group (:mod:`.fused`), else None.
        memo: what the kernel keeps between steps (the group's, shared by its plans).
    """

    index: int
    keys: tuple
    positions: tuple
    transform: GradientTransformation = field(compare=False)
    path: str
    why: str
    pieces: tuple | None
    nbytes: int
    partial: bool
    devices: tuple
    dtensor: bool
    kernel: Any = field(compare=False, default=None)
    #: what a fused kernel keeps between steps (its reading of the group's buffers:
    #: :mod:`.fused`; SOAP's Gram matrices: :mod:`.fused_soap`), one dict per param group
    #: that the group's plans share (the runner's), so a kept value is kept once; it holds
    #: the plan's batch budget of the group's device (``"budget"``, bytes: the runs of
    #: :mod:`.fused_foreach`)
    memo: dict = field(compare=False, default_factory=dict, repr=False)


@dataclass(frozen=True)
class StepPlan:
    """How a step runs, group by group (see the module doc); printable."""

    key: tuple
    groups: tuple
    settings: Settings
    #: names and parameters of every param group (for the description)
    sources: tuple = field(compare=False, default=())
    #: where the optimizer sent each parameter: ``(name, shape, route, rule)`` (for the description)
    routing: tuple = field(compare=False, default=())

    @property
    def compiled(self) -> tuple:
        """The groups that run compiled."""
        return tuple(g for g in self.groups if g.path == "compiled")

    def __str__(self) -> str:
        return describe(self)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _view(p: torch.Tensor, seen: DryRun) -> str:
    """The matrix view the transform read ``p`` by (:class:`muonfx.MatrixView`): an
    overridden one as the dry run saw it, else the default."""
    from ...core import default_view

    given = next((m.view for m in seen.matrices if m.view is not None), None)
    if given is not None:
        return given[0].describe(given[1]) + ", given by dims="
    view = default_view(p.ndim)
    return "-" if view is None else view.describe(tuple(p.shape))


def parameter_rows(plan: StepPlan, group: GroupPlan) -> list[list[str]]:
    """One row per parameter of ``group``: name, shape, what its transform does with it
    (elementwise, or the matrix view and the Newton-Schulz dtype, form and products), by
    a dry run of the transform on that parameter alone (fake tensors, no data)."""
    names, params = plan.sources[group.index]
    rows = []
    for j, pos in enumerate(group.positions):
        p = params[pos]
        what = "elementwise"
        if group.path == "fused" and not getattr(group.kernel, "pieces", False):
            what = "elementwise, in the fused kernel" + (f" (sharded {tuple(p.placements)})" if is_dtensor(p) else "")
        elif is_dtensor(p):
            what = f"sharded {tuple(p.placements)}"
        else:
            try:
                seen: DryRun = dry_run(group.transform, [group.keys[j]], [p], None, {EXTRA_ARG: plan.settings})
            except Exception as e:  # noqa: BLE001 - a transform that needs data to run: say so
                seen, what = None, f"(not known without data: {type(e).__name__})"
            if seen is not None and seen.matrices:
                routes = sorted({m.compute(p.device) for m in seen.matrices})
                what = f"{_view(p, seen)}: " + "; ".join(f"{d} {m}, {pr} products" for d, m, pr in routes)
        piece = "-"
        if group.pieces is not None:
            piece = str(next(i for i, pc in enumerate(group.pieces) if j in pc))
        rows.append([names[pos], str(tuple(p.shape)), str(p.dtype).removeprefix("torch."), str(p.device), piece, what])
    return rows


def describe(plan: StepPlan, parameters: bool = True) -> str:
    """The plan as text: settings, one line per group, and (``parameters``) a table of
    its parameters (:func:`parameter_rows`)."""
    s = plan.settings
    lines = ["muonfx step plan",
             f"  settings: default Newton-Schulz dtype {'the device default' if s.ns_dtype is None else s.ns_dtype}, "
             f"batch budget {', '.join(f'{d} {_fmt_bytes(n)}' for d, n in s.batch_bytes) or '-'}, "
             f"Triton products {'asked for' if s.triton else 'off (torch products)'}"]
    for g in plan.groups:
        pieces = "whole" if g.pieces is None else f"{len(g.pieces)} pieces"
        present = f"{len(g.keys)} parameters" + (" (others have no gradient)" if g.partial else "")
        lines.append(f"  group {g.index}: {present}, {_fmt_bytes(g.nbytes)}, {g.path} ({g.why}), {pieces}")
        if parameters and plan.sources:
            rows = parameter_rows(plan, g)
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
            for r in rows:
                lines.append("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if plan.routing:
        from ..routing import format_routes

        lines.append("  " + format_routes(plan.routing))
    if not plan.groups:
        lines.append("  (no parameter has a gradient)")
    return "\n".join(lines)


def choose_path(index: int, setting: Any, params_all: list[torch.Tensor], partial: bool, dtensor: bool,
                devices: tuple, failed: bool, fused: str = "") -> tuple[str, str]:
    """``(path, why)`` of a group by its ``"compile"`` setting and the rules (module doc):
    compiled where asked (and possible), fused where ``fused`` names the kernel that
    computes the group's chain, eager otherwise."""
    if setting is True:
        if dtensor:
            why = "DTensor parameters are not compiled"
        elif failed:
            why = "torch.compile failed on it"
        elif any(d not in ("cpu", "cuda") for d in devices):
            why = "parameters on " + ", ".join(sorted(set(devices))) + " are not compiled"
        else:
            return "compiled", "compile=True"
        if fused:
            return "fused", f"{fused}; {why}"
        return "eager", why
    if fused:
        return "fused", fused
    if setting is False:
        return "eager", "compile=False"
    return "eager", "the chain (compiled only when asked: opt.compile())"


def group_plan(index: int, keys: list[Key], positions: list[int], params: list[torch.Tensor],
               params_all: list[torch.Tensor], transform: GradientTransformation, setting: Any,
               settings: Settings, failed: bool, check: Any, factory: Any = None,
               hp: dict | None = None, fused_setting: Any = None, memo: dict | None = None) -> GroupPlan:
    """The plan of one group (see the module doc): its path by :func:`choose_path` (a
    fused kernel by :func:`.fused.lowering` of the group's ``factory`` and hyperparameters
    ``hp``, unless its ``"fused"`` setting is ``False``; ``True`` requires one), its
    pieces by :func:`plan_pieces` under the settings' budget, checked by ``check()``: the
    dry run of the whole group (see :func:`checked`). ``memo``: what its kernel keeps
    between steps (a new dict where None)."""
    dtensor = any([is_dtensor(p) for p in params_all])
    devices = tuple(sorted({p.device.type for p in params_all}))
    partial = len(positions) != len(params_all)
    if not (fused_setting is None or fused_setting is True or fused_setting is False):
        raise ValueError(f"param group {index}: 'fused' is {fused_setting!r}; it must be None (the rule), True "
                         "(require a fused kernel) or False (run the chain)")
    if not (setting is None or setting is True or setting is False):
        raise ValueError(f"param group {index}: 'compile' is {setting!r}; it must be None (the rule: not "
                         "compiled), True (compile the group's step) or False")
    kernel, fused = (None, "fused=False") if fused_setting is False or factory is None else \
        lowering(factory, hp or {}, params_all)
    if fused_setting is True and kernel is None:
        lowered = ", ".join(f"mfx.{f.__name__}" for f in KERNELS)
        raise ValueError(f"param group {index}: 'fused' is True but no fused kernel computes its chain "
                         f"({fused or 'only groups built with ' + lowered + ' have one'})")
    path, why = choose_path(index, setting, params_all, partial, dtensor, devices, failed, fused if kernel else "")
    if fused_setting is False and path == "eager" and setting is None:
        why = "fused=False"
    nbytes = sum([p.numel() * p.element_size() for p in params])
    pieces = None
    memo = {} if memo is None else memo
    if len(devices) == 1:
        memo["budget"] = settings.budget(devices[0])  # the runs of a kernel that steps whole
    if path == "fused" and not getattr(kernel, "pieces", False):  # in place (temporaries of at most the budget)
        return GroupPlan(index, tuple(keys), tuple(positions), transform, path, why, None, nbytes, partial, devices,
                         dtensor, kernel, memo)
    if not dtensor and is_leafwise(transform) and len(devices) == 1:
        pieces = plan_pieces(params, settings.budget(devices[0]))
    if pieces is not None or (path == "compiled" and settings.triton):
        seen, error = check()
        if isinstance(error, (ValueError, TypeError)):
            raise error  # an error of the group's parameters: raised before anything is written
        if seen is None and pieces is not None:  # the transform needs data to run: whole, not checked
            pieces, why = None, f"{why}; whole: a dry run could not check it ({type(error).__name__})"
        if seen is not None:
            if path == "compiled" and pieces is not None and not seen.matrices:
                pieces = None  # elementwise work alone: one graph stores it in place
            if path == "compiled" and settings.triton:
                _check_triton(seen, devices[0] if devices else "cpu")
    return GroupPlan(index, tuple(keys), tuple(positions), transform, path, why, pieces, nbytes, partial, devices,
                     dtensor, kernel if path == "fused" else None, memo)


def checked(transform: GradientTransformation, keys: list[Key], params: list[torch.Tensor], state: Any,
            settings: Settings, extra: dict | None = None) -> tuple[DryRun | None, BaseException | None]:
    """The dry run of a whole group (every parameter, its whole state): ``(what it saw,
    None)``, or ``(None, the error)``. The plans of every set of present parameters share
    it (a leafwise transform's errors are each parameter's own), so a model whose present
    parameters change from step to step (experts without tokens) runs it once. ``extra``:
    the extra arguments of the step that builds the plan (with ``settings``)."""
    try:
        return dry_run(transform, keys, params, state, {**(extra or {}), EXTRA_ARG: settings}), None
    except Exception as e:  # noqa: BLE001 - kept and judged by group_plan
        return None, e


def _check_triton(seen: DryRun, device_type: str) -> None:
    """Check the symmetric Triton kernels on the matrix shapes of a compiled group before
    its graph is traced (a graph cannot check them: it keeps the shapes checked before)."""
    from ...linalg.newton_schulz import NewtonSchulz

    device = torch.device(device_type) if device_type != "cuda" else torch.device("cuda", torch.cuda.current_device())
    for m in seen.matrices:
        fn = getattr(m.fn, "ns", m.fn)
        if not isinstance(fn, NewtonSchulz):
            continue
        cdtype, method, restart = fn._choose(m.rows, m.cols, m.dtype, device)
        if cdtype in (torch.bfloat16, torch.float16) and method in ("standard", "gram") and triton_ns.runs_on(device):
            triton_ns.verify(m.rows, m.cols, cdtype, device, restart, method == "gram", fn.schedule.steps)

