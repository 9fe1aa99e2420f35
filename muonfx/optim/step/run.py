"""The runner: one step by its plan, computed in full before anything is written.

1. **plan**: the present parameters (those with a gradient) and the static
   hyperparameters of every group select a :class:`~.plan.StepPlan` (built once, kept
   while they stay; :mod:`.plan`).
2. **compute**: every eager group's pure update (its first piece, for a group in pieces)
   is computed from its state, the state of the present parameters only where some have
   no gradient (:func:`muonfx.tree.restrict`). Nothing is written: an error (a bad
   hyperparameter or schedule value, a parameter the transform refuses, the transform's
   own exception) ends the step here and changes nothing.
3. **compiled**: the compiled groups' graph runs (it writes its groups in place); its
   hyperparameters are checked first, and a compiler failure happens before it runs.
4. **commit**: each eager group's new state is written into its old buffers and its
   updates added to its parameters (:func:`.writeback.commit`); then the groups in
   pieces write their first piece and compute and write the rest, one by one
   (:mod:`.pieces`).

A step that stops once something was written (an error of a transform in a later piece,
a compiled piece's tracing, a ``KeyboardInterrupt`` between two writes) keeps each
written group's state and counts with its parameters and says exactly what moved
(:func:`.pieces.stops_part_way`); a Ctrl-C inside one write waits for it
(:class:`.pieces.held_interrupts`).

The extra arguments of a step (``opt.step(**extra_args)``, see
:mod:`muonfx.core.contract`) reach every group's transform, whole, in pieces and in the
compiled graph (as its inputs); the fused kernels take none and ignore them. The
settings the plan captured (:class:`~.plan.Settings`) go with them, as the extra
argument ``matrix_settings``: nothing is written to a module while a step runs.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch
from tensordict import TensorDictBase
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ... import tree
from ...core import build, key_str, td_items
from ...distributed.stats import CommStats
from ...counts import Counts, by_count
from ...hyperparams import check_group_values
from ...linalg.settings import EXTRA_ARG
from ...wrappers import hyperparam_values
from ..groups import GroupRecord, GroupWork, gather, static_key
from .compiled import CompiledSteps
from .pieces import finish_all, held_interrupts, interrupted_keeps, merged, partial, stops_part_way
from .plan import GroupPlan, Settings, StepPlan, checked, group_plan
from .writeback import commit

__all__ = ["Runner"]


def _updates(upd: Any, keys: tuple, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The update tensors of ``upd`` in the order of ``keys``, checked against the
    parameters (a TensorDict, a tensor per key and no other, each of its parameter's shape)."""
    if not isinstance(upd, TensorDictBase):
        raise TypeError(f"the transform returned updates of type {type(upd).__name__}, not a TensorDict")
    ks, us = td_items(upd)
    if ks != list(keys):
        have = dict(zip(ks, us))
        for k in keys:
            if not isinstance(have.get(k), torch.Tensor):
                raise ValueError(f"the transform returned no update tensor for parameter {key_str(k)!r}")
        if len(have) != len(keys):
            raise ValueError("the transform returned updates for keys that are not parameters of this group")
        us = [have[k] for k in keys]
    if [u.shape for u in us] != [p.shape for p in params]:
        for k, u, p in zip(keys, us, params):
            if not isinstance(u, torch.Tensor):
                raise ValueError(f"the transform returned no update tensor for parameter {key_str(k)!r}")
            if u.shape != p.shape:
                raise ValueError(f"the transform's update for parameter {key_str(k)!r} has shape "
                                 f"{tuple(u.shape)}, the parameter {tuple(p.shape)}")
    return us


class _Group:
    """One group's share of a running step: its plan, record, work and state."""

    def __init__(self, plan: GroupPlan, rec: GroupRecord, work: GroupWork, extra: dict) -> None:
        self.plan, self.rec, self.work, self.extra = plan, rec, work, extra
        self.full = rec.current_state(work.hp)
        self.state = tree.restrict(self.full, plan.keys) if plan.partial else self.full
        #: a fused kernel that computes and writes piece by piece (``kernel.pieces``) and
        #: this step's checked hyperparameter values, where the group runs one
        self.kernel: Any = None
        self.vals: dict = {}

    def compute(self, positions: tuple | None = None, state: Any = None) -> tuple[Any, Any]:
        """The updates and new state of the group (or of the parameters at ``positions``
        of its present ones, from ``state``): nothing is written. With a piecewise
        kernel: what its ``write`` takes, and the state it writes."""
        g, w = self.plan, self.work
        if positions is None:
            keys, grads, params, state = g.keys, w.grads, w.params, self.state
        else:
            keys = tuple([g.keys[j] for j in positions])
            grads, params = [w.grads[j] for j in positions], [w.params[j] for j in positions]
        if self.kernel is not None:
            return self.kernel.compute(keys, grads, params, state, self.vals, self.extra, self.plan.memo), state
        upd, new = g.transform.update(build(keys, grads), state, build(keys, params), **self.extra)
        return _updates(upd, keys, params), new

    def write(self, old: Any, new: Any, params: list[torch.Tensor], us: Any, positions: tuple | None = None) -> Any:
        """Write what :meth:`compute` gave (into ``old``'s buffers and ``params``); return
        the state that holds it."""
        if self.kernel is not None:
            keys = self.plan.keys if positions is None else tuple([self.plan.keys[j] for j in positions])
            return self.kernel.write(old, us, params, keys, self.vals)
        return commit(old, new, params, us)

    def finish(self, kept: Any) -> None:
        """The group's state after the step: ``kept`` (of the present parameters) in it."""
        self.rec.state = tree.merge(self.full, kept) if self.plan.partial else kept

    def names(self, positions) -> list[str]:
        return [key_str(self.plan.keys[j]) for j in positions]


class Runner:
    """Runs an optimizer's steps by its plans (see the module doc); owned by
    :class:`muonfx.TransformOptimizer`.

    Attributes:
        compile_kwargs: the keywords of ``torch.compile`` for the compiled groups
            (:meth:`muonfx.TransformOptimizer.compile`; default ``dynamic=True,
            fullgraph=True``).
        compiled: the compiled graphs (:class:`~.compiled.CompiledSteps`).
        last: the plan of the last step.
        comm_stats: the optimizer's own counters of the DTensor matrix exchange
            (:class:`muonfx.distributed.CommStats`; its plans' settings carry it).
        agreed_ns_dtype: the Newton-Schulz dtype the ranks of a DTensor step agreed on
            where none is pinned and their devices' defaults differ (nodes of different CPU
            generations; :func:`muonfx.optim.agreement.agree_settings`), else None.
    """

    #: plans kept per optimizer (the least recently used goes first)
    PLANS = 16

    def __init__(self) -> None:
        self.compile_kwargs: dict[str, Any] = {"dynamic": True, "fullgraph": True}
        self.agreed_ns_dtype: torch.dtype | None = None
        self.compiled = CompiledSteps()
        self.plans: OrderedDict[tuple, StepPlan] = OrderedDict()
        self.last: StepPlan | None = None
        self.comm_stats = CommStats()
        #: the dry runs of whole groups, shared by their plans (see plan.checked)
        self._checks: dict[tuple, tuple] = {}
        #: per param group, what its fused kernel keeps between steps, shared by its plans
        self._memos: dict[int, dict] = {}

    def forget(self) -> None:
        """Drop every plan (the next step builds a new one, reading the settings again)."""
        self.plans.clear()
        self._checks.clear()
        self._memos.clear()

    # -- plans -----------------------------------------------------------------

    @staticmethod
    def key(param_groups: list[dict], works: list[GroupWork | None]) -> tuple:
        """What selects a plan: per group with a gradient, the present positions, the
        static hyperparameters, the ``"compile"`` setting and every parameter's shape,
        dtype and device."""
        out = []
        for gi, (group, w) in enumerate(zip(param_groups, works)):
            if w is None:
                continue
            sig = tuple([(p.shape, p.dtype, p.device) for p in group["params"]])
            out.append((gi, tuple(w.idx), static_key(w.hp), group.get("compile"), group.get("fused"),
                        id(w.record.factory), sig))
        return tuple(out)

    def plan(self, records: list[GroupRecord], param_groups: list[dict], works: list[GroupWork | None],
             extra: dict | None = None) -> StepPlan:
        """The plan of a step with these gradients (built, or the one kept); the dry runs
        of a new plan's groups see the step's extra arguments ``extra`` (as fake tensors)."""
        key = self.key(param_groups, works)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        devices = {p.device.type for group in param_groups for p in group["params"]}
        settings = Settings.capture(devices, self.comm_stats)
        if settings.ns_dtype is None and self.agreed_ns_dtype is not None:  # the ranks' rule (agreement)
            settings = dataclasses.replace(settings, ns_dtype=self.agreed_ns_dtype)
        groups = []
        for gi, (rec, group, w) in enumerate(zip(records, param_groups, works)):
            if w is None:
                continue
            tx = rec.transform(w.hp)
            keys = [rec.keys[i] for i in w.idx]
            params_all = list(group["params"])
            check_key = (gi, static_key(w.hp), tuple([(p.shape, p.dtype, p.device) for p in params_all]),
                         settings)

            def check(tx=tx, rec=rec, w=w, params_all=params_all, check_key=check_key):
                if check_key not in self._checks:
                    if len(self._checks) >= 4 * self.PLANS:
                        self._checks.clear()
                    self._checks[check_key] = checked(tx, rec.keys, params_all, rec.current_state(w.hp),
                                                      settings, extra)
                return self._checks[check_key]

            groups.append(group_plan(gi, keys, w.idx, w.params, params_all, tx, group.get("compile"),
                                     settings, (gi, static_key(w.hp)) in self.compiled.failed, check,
                                     rec.factory, w.hp, group.get("fused"), self._memos.setdefault(gi, {})))
        sources = tuple((rec.names, list(group["params"])) for rec, group in zip(records, param_groups))
        plan = StepPlan(key, tuple(groups), settings, sources)
        self.plans[key] = plan
        while len(self.plans) > self.PLANS:
            self.plans.popitem(last=False)
        return plan

    def preview(self, records: list[GroupRecord], param_groups: list[dict]) -> StepPlan:
        """The plan of a step in which every parameter has a gradient (nothing runs)."""
        works = [GroupWork(rec, rec.hyperparams(group), list(range(len(group["params"]))), list(group["params"]),
                           list(group["params"])) for rec, group in zip(records, param_groups)]
        return self.plan(records, param_groups, works)

    # -- a step ------------------------------------------------------------------

    def step(self, records: list[GroupRecord], param_groups: list[dict], works: list | None = None,
             extra: dict | None = None) -> None:
        """One step of every group with a gradient (see the module doc). ``works``: each
        group's gradients already gathered and checked (:func:`muonfx.optim.groups.gather`,
        None for a group without any), as the ranks of a DTensor step agree on them;
        ``extra``: the step's extra arguments, passed to every group's transform."""
        if extra and EXTRA_ARG in extra:
            raise ValueError(f"step(): the extra argument {EXTRA_ARG!r} is the plan's own (its settings); "
                             "name yours otherwise")
        if works is None:
            works = [gather(rec, group) for rec, group in zip(records, param_groups)]
        if all(w is None for w in works):
            return
        plan = self.plan(records, param_groups, works, extra)
        self.last = plan
        if not self._run(plan, records, works, param_groups, {**(extra or {}), EXTRA_ARG: plan.settings}):
            # the compiled graph did not run (the compiler failed, or this torch would
            # recompile it): nothing was written; the step again, by the plan that steps
            # those groups eagerly
            self._settings_events(param_groups)
            self.forget()
            plan = self.last = self.plan(records, param_groups, works, extra)
            if not self._run(plan, records, works, param_groups, {**(extra or {}), EXTRA_ARG: plan.settings}):
                raise RuntimeError("muonfx: the eager plan of a step tried to compile it")

    def _run(self, plan: StepPlan, records: list[GroupRecord], works: list, param_groups: list[dict],
             extra: dict) -> bool:
        """Run ``plan``; False where its compiled graph could not be built (nothing written)."""
        groups = [_Group(g, records[g.index], works[g.index], extra) for g in plan.groups]
        compiled = [x for x in groups if x.plan.path == "compiled"]
        if compiled and is_in_torch_dispatch_mode():
            compiled = []  # dynamo skips frames under a dispatch mode (a memory counter): eager
        eager = [x for x in groups if not any(x is c for c in compiled)]
        # compute: nothing is written until every eager group (the first piece of a group
        # in pieces) has its update, and every fused group its checked hyperparameters
        results: dict[int, Any] = {}
        splits: dict[int, list] = {}
        fused: list[tuple[_Group, dict]] = []
        for x in eager:
            k = x.plan.kernel
            if k is not None and x.plan.path == "fused":
                if k.ready(x.state, x.work.params, x.work.grads, x.plan.keys, x.plan.memo) is None:
                    vals = k.check(x.rec.factory, x.work.hp, x.state)
                    if not getattr(k, "pieces", False):
                        fused.append((x, vals))
                        continue
                    x.kernel, x.vals = k, vals  # computed and written below, as an eager group
            if x.plan.pieces is None:
                results[x.plan.index] = x.compute()
            else:
                subs = splits[x.plan.index] = tree.split(x.state, [[x.plan.keys[j] for j in pc] for pc in x.plan.pieces])
                results[x.plan.index] = x.compute(x.plan.pieces[0], subs[0])
        if compiled:
            for x in compiled:  # what the graphs' tracing would raise, raised now, as eagerly
                _check_hyperparameters(x)
        written: list[tuple] = []  # (group, positions) written so far: named where the step stops part-way
        with stops_part_way(groups, written):
            if compiled:
                whole = [x for x in compiled if x.plan.pieces is None]
                if whole and not self._compiled(whole, param_groups, extra, written):
                    return False
                for x in compiled:
                    if x.plan.pieces is not None:
                        self._compiled_pieces(x, param_groups, written)
            for x, vals in fused:  # the kernel writes the parameters and the state in place
                with held_interrupts():
                    written.append((x, range(len(x.plan.keys))))
                    x.finish(x.plan.kernel.step(x.state, vals, x.work.params, x.work.grads, x.plan.keys,
                                                x.plan.memo))
            for x in eager:
                if x.plan.pieces is None and x.plan.index in results:
                    us, new = results.pop(x.plan.index)
                    with held_interrupts(), torch.no_grad():
                        x.finish(x.write(x.state, new, x.work.params, us))
                        written.append((x, range(len(x.plan.keys))))
                    del us, new
            for x in eager:
                if x.plan.pieces is not None:
                    # the first piece handed over in a list: the callee holds its only reference
                    # and lets it go once written (an argument passed as it is stays alive until
                    # the call returns once a PEP 523 frame hook, dynamo's, has run in the process)
                    self._eager_pieces(x, splits[x.plan.index], [results.pop(x.plan.index)], written)
        self._settings_events(param_groups)
        return True

    def _settings_events(self, param_groups: list[dict]) -> None:
        """Apply the compile settings the compiled graphs turned off (see CompiledSteps)."""
        if self.compiled.off:
            for gi in sorted(self.compiled.off):
                param_groups[gi]["compile"] = False
            self.compiled.off.clear()
            self.forget()

    def _compiled(self, whole: list[_Group], param_groups: list[dict], extra: dict, written: list[tuple]) -> bool:
        """The compiled groups run whole, in one graph; False (nothing written) where it
        could not be built. The graph has written every group: each takes its new state
        (counts included) even where an interrupt lands while the first ones take theirs."""
        key = ("whole",) + tuple((x.plan.index, x.plan.positions, static_key(x.work.hp), id(x.rec.factory))
                                 for x in whole)
        with held_interrupts(key in self.compiled.graphs):  # not while it compiles
            new = self.compiled.run(key, [(x.rec.factory, list(x.plan.keys)) for x in whole],
                                    [x.work.hp for x in whole], [x.work.grads for x in whole],
                                    [x.work.params for x in whole], [x.state for x in whole], self.compile_kwargs,
                                    [(x.plan.index, x.work.hp) for x in whole], extra)
            if new is None:
                return False
            written += [(x, range(len(x.plan.keys))) for x in whole]
            finish_all(list(zip(whole, new)))
        return True

    def _compiled_pieces(self, x: _Group, param_groups: list[dict], written: list[tuple]) -> None:
        """A compiled group in pieces: one graph per piece, each written before the next;
        a piece whose graph cannot be built and the rest run eagerly."""
        g = x.plan
        subs = tree.split(x.state, [[g.keys[j] for j in pc] for pc in g.pieces])
        kept: list = []
        eager = False
        with interrupted_keeps(x, kept, written):
            self._compiled_piece_loop(x, g, subs, kept, eager, written)
        x.finish(merged(x.state, kept))

    def _compiled_piece_loop(self, x: _Group, g: GroupPlan, subs: list, kept: list, eager: bool,
                             written: list[tuple]) -> None:
        for n, pc in enumerate(g.pieces):
            keys = [g.keys[j] for j in pc]
            grads, params = [x.work.grads[j] for j in pc], [x.work.params[j] for j in pc]
            key = ("piece", g.index, tuple(g.positions[j] for j in pc), static_key(x.work.hp), id(x.rec.factory))
            with held_interrupts(eager or key in self.compiled.graphs):  # not while it compiles
                try:
                    new = None
                    if not eager:
                        out = self.compiled.run(key, [(x.rec.factory, keys)], [x.work.hp], [grads], [params],
                                                [subs[n]], self.compile_kwargs, [(g.index, x.work.hp)], x.extra)
                        if out is None:
                            eager = True  # this graph cannot be built: this piece on, eagerly
                        else:
                            new = out[0]
                    if new is None:
                        us, state = x.compute(pc, subs[n])
                        with torch.no_grad():
                            new = commit(subs[n], state, params, us)
                except Exception as e:
                    if not written:
                        raise  # nothing written by this step
                    partial(x, kept, n, written, e)
                kept.append(new)
                written.append((x, pc))

    def _eager_pieces(self, x: _Group, subs: list, head: list, written: list[tuple]) -> None:
        """An eager group in pieces: the first piece (computed before anything was
        written, handed over in the list ``head``) written, then each other piece computed
        and written."""
        g = x.plan
        kept: list = []
        with interrupted_keeps(x, kept, written):
            for n, pc in enumerate(g.pieces):
                params = [x.work.params[j] for j in pc]
                try:
                    us, new = head.pop() if n == 0 else x.compute(pc, subs[n])
                except Exception as e:
                    partial(x, kept, n, written, e)
                with held_interrupts(), torch.no_grad():
                    kept.append(x.write(subs[n], new, params, us, pc))
                    written.append((x, pc))
                del us, new
        x.finish(merged(x.state, kept))


def _check_hyperparameters(x: _Group) -> None:
    """The group's hyperparameter values, checked as its compiled graph's tracing would
    check them (at each of the present parameters' counts), eagerly: raised before any
    graph runs, so a step with a bad value changes nothing."""
    hp = x.work.hp
    check_group_values(hp)
    count = getattr(x.state, "count", None)
    counts = [t for t, _ in by_count(count, list(x.plan.keys))] if isinstance(count, Counts) else [0]
    for t in counts:
        hyperparam_values(hp, t)

