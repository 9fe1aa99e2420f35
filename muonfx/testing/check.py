"""``check_transform``: the conformance laws for any muonfx transform (see :mod:`muonfx.testing`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from tensordict import TensorDictBase

from ..core import GradientTransformation, is_leafwise
from .adapter_laws import ADAPTER_LAWS
from .compare import tensor_str as _tensor_str, td_leaves as _td_leaves
from .compiled_law import COMPILED_RTOL, _compiled_report, law_compiled
from .laws import TRANSFORM_LAWS, _Config, _Fail
from .strategies import params_and_grads

__all__ = ["LAWS", "OPT_IN_LAWS", "ADAPTER_LAW_NAMES", "COMPILED_RTOL", "ConformanceError", "check_transform"]


#: The laws :func:`check_transform` knows, in the order it checks them: the transform
#: laws (:mod:`.laws`), the adapter laws (:mod:`.adapter_laws`, reported as the
#: adapter's), the compiled law (:mod:`.compiled_law`, opt-in).
LAWS: tuple[str, ...] = (*TRANSFORM_LAWS, *ADAPTER_LAWS, "compiled")

#: The adapter laws: what :class:`muonfx.TransformOptimizer` owes a transform.
ADAPTER_LAW_NAMES: tuple[str, ...] = tuple(ADAPTER_LAWS)

#: The laws checked only when asked for by name (``laws=[..., "compiled"]``): each
#: example compiles the optimizer step from scratch (seconds with inductor).
OPT_IN_LAWS: tuple[str, ...] = ("compiled",)

_LAW_FNS: dict[str, Callable[..., None]] = {**TRANSFORM_LAWS, **ADAPTER_LAWS, "compiled": law_compiled}


class ConformanceError(AssertionError):
    """A transform broke one of :func:`check_transform`'s laws.

    Attributes:
        law: the name of the broken law (one of :data:`LAWS`).
        adapter: whether it is an adapter law (:data:`ADAPTER_LAW_NAMES`): then the
            failure is reported as the adapter's (:class:`muonfx.TransformOptimizer`
            running the transform), not as the transform's own.
        expectation: what the law asks of a transform.
        detail: what went wrong on the minimal example (step, key, values).
        example: the minimal failing ``(params, grads)`` pair hypothesis found (after
            shrinking), or ``None``; rerun your transform on it to debug.
        report: ``{law: "ok" | "skipped: ..." | "FAILED"}`` for the laws checked so far.
    """

    def __init__(self, law: str, expectation: str, detail: str, example: Any = None,
                 report: dict[str, str] | None = None, message: str | None = None) -> None:
        self.law = law
        self.adapter = law in ADAPTER_LAWS
        self.expectation = expectation
        self.detail = detail
        self.example = example
        self.report = dict(report or {})
        super().__init__(message if message is not None else f"law {law!r} broken: {detail}")


class _BadStrategy(Exception):
    pass



def _expectation(law: str, cfg: _Config) -> str:
    ex = cfg.exactly
    return {
        "purity": "update(updates, state, params) must not modify its inputs (nor init its params), "
                  f"and two calls with the same inputs must return the same updates and state ({ex})",
        "adapter_loop": "mfx.TransformOptimizer running tx (it writes the new state into the old state "
                        f"buffers and adds the updates to the parameters in place) must compute {ex} what the "
                        "functional loop computes (update, then apply_updates)",
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
                    "(muonfx.tree.restrict), scalars included",
        "idle_parameter": f"tx is declared leafwise: in mfx.TransformOptimizer, a parameter without a gradient "
                          f"in the first of {cfg.steps + 1} steps must end {ex} where it ends in an optimizer of "
                          "its own that skips that step (its value and the state_dict entries both hold: counts "
                          "kept per parameter, muonfx.counts.Counts), and the other parameters where they end "
                          "without it",
        "compiled": f"in mfx.TransformOptimizer compiled with torch.compile (backend={cfg.backend!r}), "
                    f"{cfg.steps + 2} steps must end where the eager optimizer "
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
    * ``leafwise`` (only for a transform declared leafwise, :func:`muonfx.leafwise`):
      ``init`` and ``update`` on the first half of the keys and on the rest (each piece
      with its share of the state, :func:`muonfx.tree.restrict`, merged back with
      :func:`~muonfx.tree.merge` after each step) equal the whole tree's: the same
      updates, the same per-leaf state and the same scalars (step counts);

    The adapter laws (:data:`ADAPTER_LAW_NAMES`; a failure is reported as the adapter's,
    ``err.adapter``: muonfx's own fault, or information the transform keeps outside its
    state, which only the adapter's in-place write-back reveals):

    * ``adapter_loop``: :class:`muonfx.TransformOptimizer` running ``tx`` (the new state
      written into the old buffers, ``p += u`` in place) computes what the functional
      loop computes;
    * ``state_dict_roundtrip``: ``steps`` steps of :class:`muonfx.TransformOptimizer` with
      ``tx``, ``state_dict()`` through ``torch.save`` / ``torch.load(weights_only=True)``
      into a fresh optimizer, one more step: the same parameters and state as the
      uninterrupted run;
    * ``idle_parameter`` (only for a transform declared leafwise): in
      :class:`muonfx.TransformOptimizer`, a parameter whose ``grad`` is None in the first
      of ``steps + 1`` steps ends (its value and the ``state_dict()`` entries both hold)
      where it ends in an optimizer of its own that skips that step, and the other
      parameters where they end without it (counts kept per parameter:
      :class:`muonfx.counts.Counts`).

    And the compiled law:

    * ``compiled`` (only when asked for, ``laws=[..., "compiled"]``: every example compiles
      the step, seconds each with inductor): in :class:`muonfx.TransformOptimizer` compiled
      with ``torch.compile(backend=backend)`` (``opt.compile``), its first steps as one
      graph and, from step ``steps`` on, with a batch budget of one byte (a leafwise
      transform that does matrix work then runs in pieces, one graph per parameter, as on
      a model larger than :func:`muonfx.linalg.batch_bytes`), ``steps + 2`` steps end
      where the eager optimizer ends: every step's parameters within ``rtol`` (default
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
            (f"adapter law {law!r} broken (mfx.TransformOptimizer running your transform).\n"
             if law in ADAPTER_LAWS else f"law {law!r} broken.\n")
            + f"  expected: {expectation}\n"
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
