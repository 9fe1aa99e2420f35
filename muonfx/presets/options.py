"""The Muon option set, defined once and forwarded by every builder that runs Muon.

:class:`MuonOptions` lists Muon's options with :func:`muonfx.muon`'s defaults and
builds Muon's named chain from them. Every builder that runs Muon
(:func:`~muonfx.muon`, :func:`~muonfx.muon_adamw`, the recipes,
:func:`~muonfx.presets.predecessor.fsdp_muon`, :class:`~muonfx.MuonOptimizer`,
:func:`~muonfx.create_hybrid_optimizer`, :class:`~muonfx.FSDPMuonOptimizer`) takes them
through :func:`takes_muon_options`, which writes them into the builder's signature. A
new option is therefore added in one place, here, and reaches every builder, the
``param_groups`` of :class:`~muonfx.TransformOptimizer` (which reads a factory's
hyperparameters from ``inspect.signature``), lr schedulers and checkpoints.

``eps`` is the Newton-Schulz normalisation floor everywhere the Muon options appear
(torch.optim.Muon's meaning); AdamW's epsilon is ``adamw_eps`` in the hybrids and
NorMuon's row-normalisation epsilon is ``row_eps``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping, TypeVar

import torch

from ..core import Dims, GradientTransformation
from ..hyperparams import Slot, check_args, check_float_dtype
from ..linalg import CoefficientSpec
from ..schedules import ScalarOrSchedule
from ..transforms import decoupled_decay, momentum as _momentum, newton_schulz, scale_by_learning_rate, scale_by_shape

__all__ = ["MuonOptions", "takes_muon_options", "muon_options_of", "insert_step", "MeaningChangedWarning",
           "warn_meaning_changed"]

F = TypeVar("F", bound=Callable[..., Any])


class MeaningChangedWarning(UserWarning):
    """An argument that an earlier API read one way and muonfx reads another: the
    predecessor ``muon_fsdp`` (e.g. ``FSDPMuonOptimizer(beta2=0.99)``) or an earlier
    muonfx (``moonlight(eps=)``, once Adam's epsilon). Raised once per call site by
    Python's default warning filter; silence it with
    ``warnings.filterwarnings("ignore", category=mfx.MeaningChangedWarning)``."""

Steps = dict[str, GradientTransformation]


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """Muon's options, with :func:`muonfx.muon`'s defaults (Keller Jordan's Muon).

    Attributes:
        lr: learning rate, a number or a schedule ``step -> lr``.
        momentum: EMA momentum coefficient (:func:`~muonfx.momentum`'s ``beta``).
        nesterov: Nesterov momentum (torch.optim.Muon's form).
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: Newton-Schulz coefficients: ``"keller"``, ``"you"``,
            ``"polar_express"``, ``"cubic"``, one ``(a, b, c)`` triple or a sequence.
        weight_decay: decoupled weight decay, ``W <- W - lr * wd * W``.
        adjust_lr: shape scale of the orthogonalised update: ``"original"`` (``None``
            means the same, as in torch), ``"match_rms_adamw"``, ``"spectral"`` or
            ``"none"`` (scale 1, what dion's ``adjust_lr=None`` means).
        eps: floor of the Newton-Schulz normaliser, ``X <- G / max(||G||_F, eps)``
            (torch.optim.Muon's ``eps``).
        ns_dtype: Newton-Schulz compute dtype; ``None``: the device's default
            (bfloat16 on CUDA and on CPUs with native bf16 matmul, float32 elsewhere;
            :func:`muonfx.linalg.ns_dtype_for`).
        ns_method: ``"standard"`` (default: torch.optim.Muon's iteration), ``"gram"``,
            ``"spectral"`` or ``"auto"`` (the fastest form for the shape, dtype and
            device that keeps about bf16's accuracy, :func:`muonfx.linalg.auto_method`;
            see :func:`~muonfx.newton_schulz` and ``docs/evidence.md``).
        mu_dtype: dtype of the momentum buffer (``None``: the parameter's).
        dims: per-parameter matrix views (:class:`~muonfx.MatrixView`) for Newton-Schulz
            and the shape scale: a mapping dotted name -> view or a callable
            ``(name, tensor) -> view | None``; ``None``: the default view
            (:func:`muonfx.core.default_view`).

    :meth:`steps` is Muon's named chain built from them; ``muon(**opts)`` is
    ``named_chain(*MuonOptions(**opts).steps().items())``.

    Example::

        >>> import muonfx as mfx
        >>> opts = mfx.MuonOptions(lr=0.01, weight_decay=0.1)
        >>> list(opts.steps())
        ['momentum', 'orthogonalize', 'scale_by_shape', 'weight_decay', 'lr']
        >>> tx = mfx.muon(**opts.kwargs())           # the same options, forwarded
    """

    lr: ScalarOrSchedule = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: CoefficientSpec = "keller"
    weight_decay: float = 0.0
    adjust_lr: str | None = "original"
    eps: float = 1e-7
    ns_dtype: torch.dtype | None = None
    ns_method: str = "standard"
    mu_dtype: torch.dtype | None = None
    dims: Dims = None

    def __post_init__(self) -> None:
        # the shared rules (muonfx.hyperparams), under the options' own names
        check_args(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, eps=self.eps)
        check_float_dtype("ns_dtype", self.ns_dtype)
        check_float_dtype("mu_dtype", self.mu_dtype)
        if not isinstance(self.nesterov, bool):  # 'yes' or 1 would silently read as True
            raise TypeError(f"hyperparameter 'nesterov' is {self.nesterov!r}; it must be True or False")

    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments (``muon(**opts.kwargs())``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def orthogonalize(self) -> GradientTransformation:
        """``newton_schulz(ns_steps, ns_coefficients, eps, ns_dtype, method=ns_method)``."""
        return newton_schulz(self.ns_steps, self.ns_coefficients, eps=self.eps, dtype=self.ns_dtype,
                             method=self.ns_method, dims=self.dims)

    def shape_scale(self) -> GradientTransformation:
        """``scale_by_shape(adjust_lr)`` (``None`` is ``"original"``)."""
        return scale_by_shape("original" if self.adjust_lr is None else self.adjust_lr, dims=self.dims)

    def steps(self) -> Steps:
        """Muon's named chain, step name -> transform, in order::

            "momentum"       momentum(momentum, nesterov, mu_dtype)
            "orthogonalize"  newton_schulz(ns_steps, ns_coefficients, eps, ns_dtype, ns_method)
            "scale_by_shape" scale_by_shape(adjust_lr)
            "weight_decay"   decoupled_decay(weight_decay)
            "lr"             scale_by_learning_rate(lr)

        Recipes replace or insert steps (see :func:`insert_step`); the names are the
        state's keys (``state["momentum"].mu``) and the checkpoints'.
        """
        return {
            "momentum": _momentum(self.momentum, nesterov=self.nesterov, mu_dtype=self.mu_dtype),
            "orthogonalize": self.orthogonalize(),
            "scale_by_shape": self.shape_scale(),
            "weight_decay": decoupled_decay(self.weight_decay),
            "lr": scale_by_learning_rate(self.lr),
        }


_FIELDS = {f.name: f for f in dataclasses.fields(MuonOptions)}


def insert_step(steps: Steps, after: str, name: str, tx: GradientTransformation) -> Steps:
    """``steps`` with ``name: tx`` placed right after the step ``after``.

    Example::

        >>> import muonfx as mfx
        >>> from muonfx.presets.options import insert_step
        >>> steps = insert_step(mfx.MuonOptions().steps(), "orthogonalize", "row_normalize", mfx.row_normalize())
        >>> list(steps)
        ['momentum', 'orthogonalize', 'row_normalize', 'scale_by_shape', 'weight_decay', 'lr']
    """
    if after not in steps or name in steps:
        raise ValueError(f"insert_step: no step {after!r} or already a step {name!r} in {list(steps)}")
    out: Steps = {}
    for k, v in steps.items():
        out[k] = v
        if k == after:
            out[name] = tx
    return out


def takes_muon_options(
    *,
    defaults: Mapping[str, Any] | None = None,
    rename: Mapping[str, str] | None = None,
    exclude: Iterable[str] = (),
    positional: bool = False,
    legacy_order: Iterable[str] = (),
    legacy_name: str = "",
    changed: Mapping[str, str] | None = None,
    other_orders: Mapping[str, Iterable[str]] | None = None,
) -> Callable[[F], F]:
    """Decorator: give a builder declared as ``f(<own params>, **options)`` the Muon options.

    The decorated function's signature (what ``inspect.signature``, ``help`` and
    :class:`~muonfx.TransformOptimizer` see) becomes::

        f(<own positional-or-keyword params>, lr, *, momentum, ..., mu_dtype, <own keyword-only params>)

    with every :class:`MuonOptions` field as an explicit parameter: ``defaults``
    overrides some defaults (e.g. ``{"weight_decay": 0.1}``), ``rename`` gives some
    another public name (``{"lr": "muon_lr"}``), ``exclude`` leaves some out. The first
    option is positional-or-keyword, the others keyword-only (all of them with
    ``positional=True``). A call is bound against that signature (so unknown or
    repeated arguments raise ``TypeError`` as for any function), defaults are filled in,
    and ``f`` receives every option under its field name in ``**options``.

    ``legacy_order`` names (by their names here) the parameters an older API
    (``legacy_name``, e.g. ``"muon_fsdp.MuonOptimizer"``) took by position after the
    ones that are still positional here: a call with too many positional arguments then raises a
    ``TypeError`` that says which keyword each extra argument must become. ``other_orders``
    adds other APIs' orders, ``{api name: parameter names}`` (``torch.optim.Muon``'s for
    :class:`~muonfx.MuonOptimizer`): the message then gives each reading.

    ``changed`` names (by their public names) the keywords this builder once took with
    another meaning, each with a note saying what it means now and which keyword took
    over the old meaning: passing one with a value other than its default warns
    (:class:`MeaningChangedWarning`, once per call site by Python's default filter), so that code
    written for the old meaning does not silently change what it computes.

    Example::

        >>> import inspect, muonfx as mfx
        >>> from muonfx.presets.options import takes_muon_options
        >>> @takes_muon_options(defaults={"weight_decay": 0.1})
        ... def my_muon(*, clip=1.0, **options):
        ...     return mfx.chain(mfx.clip_by_global_norm(clip), mfx.muon(**options))
        >>> sig = inspect.signature(my_muon)
        >>> sig.parameters["weight_decay"].default, list(sig.parameters)[-1]
        (0.1, 'clip')
    """
    defaults = dict(defaults or {})
    rename = dict(rename or {})
    changed = dict(changed or {})
    exclude = set(exclude)
    for what, names in (("defaults", defaults), ("rename", rename), ("exclude", exclude)):
        unknown = sorted(set(names) - set(_FIELDS))
        if unknown:
            raise TypeError(f"takes_muon_options: {what} names {unknown}, which are not Muon options "
                            f"({list(_FIELDS)})")
    public = {name: rename.get(name, name) for name in _FIELDS if name not in exclude}

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn)
        P = inspect.Parameter
        own = list(sig.parameters.values())
        if [p.kind for p in own].count(P.VAR_KEYWORD) != 1 or any(p.kind is P.VAR_POSITIONAL for p in own):
            raise TypeError(f"takes_muon_options: {fn.__qualname__} must take the options as **kwargs "
                            "(and no *args)")
        clash = sorted(set(public.values()) & {p.name for p in own})
        if clash:
            raise TypeError(f"takes_muon_options: {fn.__qualname__} has parameters {clash} named like Muon options")
        lead = [p for p in own if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        trail = [p for p in own if p.kind is P.KEYWORD_ONLY]
        options = [
            P(pub, P.POSITIONAL_OR_KEYWORD if positional or i == 0 else P.KEYWORD_ONLY,
              default=defaults.get(name, _FIELDS[name].default), annotation=_FIELDS[name].type)
            for i, (name, pub) in enumerate(public.items())
        ]
        full = sig.replace(parameters=lead + options + trail)
        field_of = {pub: name for name, pub in public.items()}
        leading = [p.name for p in lead]
        n_positional = len([p for p in full.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)])
        orders = [(name, list(order)) for name, order in ({legacy_name: legacy_order} if legacy_order else {}).items()]
        orders += [(name, list(order)) for name, order in (other_orders or {}).items()]

        @functools.wraps(fn)
        def with_options(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = full.bind(*args, **kwargs)
            except TypeError as e:
                extra = args[n_positional:]
                fits = [(name, order) for name, order in orders if len(extra) <= len(order)]
                if extra and fits:
                    names = [p.name for p in full.parameters.values()][:n_positional]
                    names = names[1:] if names and names[0] == "self" else names
                    took = "; ".join(f"{name} took {', '.join(order[:len(extra)])} next" for name, order in fits)
                    fix = " or ".join(", ".join(f"{k}={v!r}" for k, v in zip(order, extra)) +
                                      (f" ({name}'s order)" if len(fits) > 1 else "") for name, order in fits)
                    raise TypeError(
                        f"{fn.__qualname__}() takes only {', '.join(names)} by position. {took}; "
                        "here they are keyword-only, so that no argument silently changes meaning. Pass them by "
                        f"keyword: {fix}") from None
                raise TypeError(f"{fn.__qualname__}() {e}") from None
            if changed:
                warn_meaning_changed(with_options, kwargs, stacklevel=2)
            bound.apply_defaults()
            given = bound.arguments
            return fn(*[given[n] for n in leading],
                      **{n: v for n, v in given.items() if n not in field_of and n not in leading},
                      **{field_of[n]: v for n, v in given.items() if n in field_of})

        with_options.__signature__ = full  # type: ignore[attr-defined]
        with_options.__muon_options__ = dict(public)  # type: ignore[attr-defined]
        with_options.__meaning_changed__ = dict(changed)  # type: ignore[attr-defined]
        return with_options  # type: ignore[return-value]

    return decorate


def warn_meaning_changed(builder: Callable[..., Any], given: Mapping[str, Any], stacklevel: int | None = None) -> None:
    """Warn (:class:`MeaningChangedWarning`) for each keyword of ``given`` that
    ``builder`` (made by :func:`takes_muon_options` with ``changed=``) once read with
    another meaning, where its value is not the default.

    The builder does so itself for the arguments of a call; a :class:`muonfx.hyperparams.Slot`
    (a late-bound number, :func:`muonfx.hyperparams.late_bound`) has no value there, so
    :class:`muonfx.TransformOptimizer`, which gives the builder slots for those, warns by
    this for the values of a new param group. ``stacklevel`` as ``warnings.warn``'s,
    counted from the caller of this function; ``None``: the first caller outside muonfx
    and torch.

    Example::

        >>> import warnings, muonfx as mfx
        >>> from muonfx.presets.options import warn_meaning_changed
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_meaning_changed(mfx.normuon, {"eps": 1e-8, "lr": 0.1})
        >>> [w.category.__name__ for w in caught]
        ['MeaningChangedWarning']
    """
    notes = getattr(builder, "__meaning_changed__", None)
    if not notes:
        return
    params = inspect.signature(builder).parameters
    for name, note in notes.items():
        value = given.get(name, params[name].default)
        if type(value) is not Slot and value != params[name].default:
            warnings.warn(f"{builder.__qualname__}({name}={value!r}): {note}", MeaningChangedWarning,
                          stacklevel=_outside() if stacklevel is None else stacklevel + 1)


_OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["muonfx"], torch))


def _outside() -> int:
    """``warnings.warn``'s stacklevel (called from :func:`warn_meaning_changed`) of the
    first frame outside muonfx and torch: the user's line."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return level


def muon_options_of(builder: Callable[..., Any]) -> dict[str, str]:
    """``{option field: parameter name}`` of a builder made by :func:`takes_muon_options`
    (``{}`` for any other callable; a class is looked up through its ``__init__``).

    Example::

        >>> import muonfx as mfx
        >>> from muonfx.presets.options import muon_options_of
        >>> muon_options_of(mfx.create_hybrid_optimizer)["lr"]
        'muon_lr'
    """
    fn = builder.__init__ if inspect.isclass(builder) else builder
    return dict(getattr(fn, "__muon_options__", {}))
