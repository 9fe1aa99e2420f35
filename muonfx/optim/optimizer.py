"""``TransformOptimizer``: any muonfx transform as a real ``torch.optim.Optimizer``.

A thin shell: it keeps one :class:`~muonfx.optim.groups.GroupRecord` per param group
and hands each step to its :class:`~muonfx.optim.step.Runner`, which runs it by a
:class:`~muonfx.optim.step.StepPlan`; checkpoints go through :mod:`muonfx.optim.checkpoint`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from .._compat.dtensor import is_dtensor
from ..core import key_str
from ..hyperparams import late_bound_names
from ..presets.options import warn_meaning_changed
from ..wrappers import signature
from . import checkpoint
from .qk_clip import QKClip
from .groups import ADAPTER_KEYS, GroupRecord, TxOrFactory, as_factory, check_known, factory_defaults
from .step import Runner, StepPlan
from .step.compiled import CompiledSteps
from .step.tune import tune as _tune

__all__ = ["TransformOptimizer"]

class TransformOptimizer(torch.optim.Optimizer):
    """Run a muonfx transform as a ``torch.optim.Optimizer``.

    Args:
        params: ``model.named_parameters()`` (names become the TensorDict keys, so
            masks and label functions see ``"layers.0.weight"``), plain parameters,
            or param-group dicts. A group may carry its own ``"tx"`` and any
            hyperparameters; ``"sparse_grad": "densify"`` lets a group accept sparse
            gradients by densifying them.
        tx: a transform *factory* such as ``mfx.muon`` / ``mfx.adamw`` (or your own
            function returning a transform), or a pre-built transform. With a factory
            the hyperparameters are its keyword arguments; with a pre-built transform
            ``lr`` is a multiplier of its output (default 1.0).
        **hyperparams: defaults for every group (``lr``, ``weight_decay``, ``momentum``,
            ``betas``, ...). They live in ``param_groups`` and are read at every step, so
            lr schedulers and hand edits take effect.
        qk_clip: a :class:`muonfx.QKClip` (QK-clip, Kimi K2's "MuonClip"): the groups
            holding its layout's weights end their chain with :func:`muonfx.qk_clip`, and
            every step passes them the recorder's statistics and resets it.

    A step computes exactly what the functional loop computes (``update`` then
    ``apply_updates``), for any transform, yours included; then it writes the new state
    into the old state buffers and adds the updates to the parameters in place. If
    anything raises during a step, every parameter, state tensor and param group is
    left as it was. Parameters whose ``grad`` is None are left exactly as they are and
    none of their state moves, step counters included: counters are per parameter, as
    torch's ``state[p]["step"]`` (AdamW's bias correction for a parameter that skips
    steps is torch's). Hyperparameters are checked by the rules of
    :mod:`muonfx.hyperparams` when the optimizer is built, at every step and when a
    checkpoint is loaded; the error names the hyperparameter (and the group).

    ``state_dict()`` is torch's format with the transform's state flattened per
    parameter (``"momentum.mu"``, ``"adam.nu"``, ``"count"``); it loads with
    ``torch.load(..., weights_only=True)``.

    How a step runs (eager, fused or compiled, whole or in pieces, which Newton-Schulz
    dtype, form and products) is decided by rules, once per set of present parameters and
    static hyperparameters, in a plan you can print (:attr:`plan`); no timing decides
    anything, so a resumed run takes the same path. Nothing is compiled unless asked: each
    param group has a ``"compile"`` entry, ``None`` (the rule: not compiled), ``True`` or
    ``False`` (:meth:`compile`, :meth:`tune`, or by hand), saved in the ``state_dict``.
    A group built with :func:`muonfx.adamw` runs torch's fused AdamW kernel
    (``torch._fused_adamw_``, bit for bit ``torch.optim.AdamW(fused=True)``); an optional
    ``"fused"`` entry, as torch's, turns that off (``False``: the chain, transform by
    transform) or requires it (``True``).

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw, lr=1e-3)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, params: Iterable[Any], tx: TxOrFactory, *, qk_clip: QKClip | None = None,
                 **hyperparams: Any) -> None:
        if qk_clip is not None and not isinstance(qk_clip, QKClip):
            raise TypeError(f"qk_clip must be a muonfx.QKClip, got {type(qk_clip).__name__}")
        #: the QK-clip option (:class:`muonfx.QKClip`), or None
        self.qk_clip = qk_clip
        self._default_tx = tx
        self._default_factory = as_factory(tx)
        #: one record per param group (factory, keys, functional state)
        self.records: list[GroupRecord] = []
        self._runner = Runner()
        self._dtensor_ref = None
        self._torch_state: dict | None = None
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts, not a Tensor")
        params = list(params)
        if not params:
            raise ValueError("TransformOptimizer got an empty parameter list")
        check_known(self._default_factory, hyperparams, "hyperparameters")
        # Like torch.optim's own optimizers, ``defaults`` holds every hyperparameter of
        # the default transform (OneCycleLR's cycle_momentum looks for "momentum" or
        # "betas" there), the ones given here overriding the factory's defaults.
        super().__init__(params, {**factory_defaults(self._default_factory), "compile": None, **hyperparams})
        if qk_clip is not None:
            qk_clip.check_params({n for rec in self.records for n in rec.names})

    # ``opt.state`` is torch's per-parameter view of the functional state, built when read
    @property
    def state(self) -> dict:  # type: ignore[override]
        if self._torch_state is None:
            self._torch_state = checkpoint.torch_state(self.records, self.param_groups)
        return self._torch_state

    @state.setter
    def state(self, value: dict) -> None:  # torch.optim.Optimizer.__init__ assigns it
        self._torch_state = None

    # -- groups -------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (and create its transform state eagerly).

        A group may carry its own ``"tx"`` (factory or transform); its keys must be
        arguments of that factory (or ``params``, ``param_names``, ``name``,
        ``sparse_grad``); missing ones take the factory's defaults.
        """
        own = "tx" in param_group
        factory = as_factory(param_group.pop("tx")) if own else self._default_factory
        check_known(factory, {k: v for k, v in param_group.items() if k not in ADAPTER_KEYS}, "param group keys")
        if own:
            for name, value in factory_defaults(factory).items():
                param_group.setdefault(name, value)
        given = set(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            if own:
                # torch filled in the default transform's hyperparameters; drop the ones this
                # group's transform does not take, so param_groups show what really runs
                sig = signature(factory).parameters
                for name in [n for n in group if n not in given and n not in sig and n not in ADAPTER_KEYS]:
                    del group[name]
            start = sum(len(g["params"]) for g in self.param_groups[:-1])
            names = group.get("param_names") or [f"param{start + i}" for i in range(len(group["params"]))]
            if any([is_dtensor(p) for p in group["params"]]):
                from ..distributed import check_params

                self._dtensor_ref = check_params(names, group["params"], self._dtensor_ref)
            if self.qk_clip is not None:
                factory = self.qk_clip.follow(factory, [str(n) for n in names])
            rec = GroupRecord.create(factory, names, group)
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was before this call
            raise
        self.records.append(rec)
        # the late-bound numbers reach the factory as slots: what it would warn of, said here
        warn_meaning_changed(factory, {n: group[n] for n in late_bound_names(factory) if n in group})
        self._torch_state = None
        if hasattr(self, "_runner"):
            self._runner.forget()

    def transform_state(self, group: int = 0) -> Any:
        """The functional state of a param group's transform (an InjectHyperparamsState)."""
        return self.records[group].state

    def _name(self, gi: int, i: int) -> str:
        return key_str(self.records[gi].keys[i])

    # -- stepping -----------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **extra_args: Any) -> Any:
        """One optimizer step; runs ``closure`` (with grad enabled) first and returns its loss.

        ``extra_args`` (keywords) reach every group's transform as the extra arguments of
        its update (``tx.update(updates, state, params, **extra_args)``, see
        :mod:`muonfx.core.contract`): a transform of your own that takes ``**extra_args``
        reads them (``opt.step(attn_logit_max=m)``), the others never see them. With
        ``qk_clip`` the recorder's statistics go as ``qk_logit_max`` (unless given here),
        and the recorder is reset after the step.

        Every group's update is computed before anything is written, so an error (a
        sparse gradient, a NaN learning rate or schedule value, a parameter the
        transform cannot take) leaves every parameter, state tensor and param group
        exactly as it was. On DTensor parameters the ranks first agree on the step's
        rank-local checks in one all-reduce (:func:`muonfx.optim.agreement.agreed_work`):
        an error on one rank raises on every rank before the step's other collectives,
        and so does a parameter with a gradient on some ranks and ``grad=None`` on others
        (:class:`~muonfx.optim.agreement.GradientsDiffer`).
        A group too large for one piece is checked before its first
        piece is written (:mod:`muonfx.optim.step.pieces`); only an error a transform of
        your own raises in a later piece ends the step part-way, with
        :class:`~muonfx.optim.PartialStepError` naming the parameters stepped. A compiled
        group in pieces traces each piece when it comes to it: an error of your transform
        there, after other groups were written, raises it too. A ``KeyboardInterrupt``
        between two groups' or pieces' writes goes on as it is, with a note naming the
        parameters stepped; each keeps its state and counts with it. A Ctrl-C inside one
        group's or piece's write is held until that write is whole (a second one goes at
        once).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.qk_clip is not None:  # the step's statistics, reduced over the ranks
            extra_args = {**self.qk_clip.extra_args(), **extra_args}
        works = None
        if self._dtensor_ref is not None:  # ranks agree on rank-local errors before any collective
            from ..distributed.agree import step_group

            agreement = step_group(self._dtensor_ref)
            if agreement is not None:
                from .agreement import agree_settings, agreed_work

                agree_settings(self.records, self.param_groups, *agreement, self._runner)  # what ranks share, first
                works = agreed_work(self.records, self.param_groups, *agreement)
        self._torch_state = None
        self._runner.step(self.records, self.param_groups, works, extra_args)
        if self.qk_clip is not None:  # a step that ran (or that apply_if_finite skipped) used them
            self.qk_clip.recorder.reset()
        return loss

    @torch.no_grad()
    def eval(self) -> "TransformOptimizer":
        """Put the evaluation weights into the parameters, for the groups whose transform
        has one (:func:`muonfx.schedule_free`: the average ``x``); a no-op for the others
        and for a group already in eval mode. Call it before evaluating or saving the model
        for use, :meth:`train` before the next step (as the ``schedulefree`` package asks).

        Example::

            >>> import torch, muonfx as mfx
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = mfx.TransformOptimizer(model.named_parameters(), mfx.schedule_free_adamw, lr=1e-2)
            >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
            >>> _ = opt.eval()      # model holds x: evaluate here
            >>> _ = opt.train()     # model holds y again: train on
        """
        return self._swap(train=False)

    @torch.no_grad()
    def train(self) -> "TransformOptimizer":
        """Put the training weights back into the parameters (:meth:`eval`'s inverse:
        :func:`muonfx.schedule_free`'s ``y``); a no-op where there is nothing to swap."""
        return self._swap(train=True)

    def _swap(self, train: bool) -> "TransformOptimizer":
        from ..transforms.schedule_free import swap_values

        for rec, group in zip(self.records, self.param_groups):
            state, values = swap_values(rec.state, dict(zip(rec.keys, group["params"])), train)
            for key, p in zip(rec.keys, group["params"]):
                if key in values:
                    p.copy_(values[key])
            rec.state = state
        self._torch_state = None
        return self

    @property
    def plan(self) -> StepPlan:
        """How steps run: the plan of the last step, or (before the first) of a step in
        which every parameter has a gradient. ``print(opt.plan)`` shows each group's
        path, pieces and settings, and what its transform does with each parameter."""
        plan = self._runner.last if self._runner.last is not None else \
            self._runner.preview(self.records, self.param_groups)
        routing = getattr(self, "routing", None)
        return dataclasses.replace(plan, routing=tuple(routing)) if routing else plan

    @property
    def compiled_graphs(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The compiled step graphs this optimizer holds, least recently used first (at
        most :attr:`CompiledSteps.GRAPHS <muonfx.optim.step.compiled.CompiledSteps.GRAPHS>`):
        per graph its kind, ``"whole"`` (the compiled groups stepped whole, in one graph)
        or ``"piece"`` (one piece of a group in pieces), and the param groups it steps.
        Empty until a compiled step ran (:meth:`compile`)."""
        return tuple((k[0], tuple(e[0] for e in k[1:]) if k[0] == "whole" else (k[1],))
                     for k in self._runner.compiled.graphs)

    @property
    def comm_stats(self) -> Any:
        """This optimizer's own counters of the DTensor matrix exchange
        (:class:`muonfx.distributed.CommStats`: bytes, all-to-alls, buckets, plans, matrices
        orthogonalised by its steps; ``.reset()``); what every exchange of the process
        counted is :func:`muonfx.distributed.comm_stats`."""
        return self._runner.comm_stats

    def replan(self) -> None:
        """Build the plans anew at the next step, reading the process settings again
        (:func:`muonfx.linalg.set_default_ns_dtype`, :func:`muonfx.linalg.set_batch_bytes`,
        :func:`muonfx.linalg.triton_ns.set_enabled`): a plan holds the settings it was
        built with."""
        self._runner.forget()
        self._runner.last = None

    def compile(self, **compile_kwargs: Any) -> "TransformOptimizer":
        """Run every group's step as one ``torch.compile`` graph (its ``"compile"`` setting
        ``True``), from the next step on.

        The graph computes the same pure update, writes the new state into the old
        buffers and adds the updates to the parameters; errors of a transform are raised
        while it is traced, before it runs, so a raising step changes nothing. Defaults:
        ``dynamic=True`` (changing lr, momentum or weight decay, by hand or by a
        scheduler, recompiles nothing on torch 2.13, and changing lr or momentum nothing
        on 2.10 and 2.11 either; there a change of the others recompiles once and the
        group steps eagerly from then on, see :class:`~muonfx.optim.step.compiled.CompiledSteps`)
        and ``fullgraph=True``. Other keywords go to ``torch.compile`` (e.g. ``backend``,
        ``mode``). Where the compiler fails the group steps eagerly and the ``muonfx``
        logger says so once. Returns ``self``.

        Example::

            >>> import torch, muonfx as mfx
            >>> model = torch.nn.Linear(4, 4)
            >>> opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw).compile(backend="eager")
            >>> [g["compile"] for g in opt.param_groups]
            [True]
        """
        self._runner.compile_kwargs = {"dynamic": True, "fullgraph": True, **compile_kwargs}
        self._runner.compiled = CompiledSteps()
        self.defaults["compile"] = True  # a group added later is compiled too
        for group in self.param_groups:
            group["compile"] = True
        self.replan()
        return self

    def tune(self, rounds: int = 3) -> dict[str, Any]:
        """Time eager and compiled steps on the current gradients and keep the faster in
        every compilable group's ``"compile"`` setting (saved in the ``state_dict``, so a
        resumed run follows it). The parameters and the state are restored after every
        timed step: training goes on as if ``tune`` had not run. Returns the fastest
        times and the choice (see :func:`muonfx.optim.step.tune.tune`)."""
        return _tune(self, rounds)

    # -- checkpoints ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format: ``{"state": {index: {name: tensor | number}}, "param_groups": [...]}``.

        Group entries that cannot be saved with ``weights_only=True`` (e.g. a schedule
        function given as a hyperparameter) are left out.
        """
        self._torch_state = None
        sd = super().state_dict()
        sd["param_groups"] = checkpoint.param_groups_for_saving(sd["param_groups"])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; on any mismatch (other transform,
        other model, a hyperparameter that breaks the rules of :mod:`muonfx.hyperparams`
        or does not build the group's transform) raise ``ValueError`` naming the group
        and what differs, and change nothing: every group is checked before any is
        changed. As torch's, it loads between optimizers built with and without parameter
        names, both ways (a group without names takes the saved ones), and the pre-hooks
        get a shallow copy of ``state_dict`` (what they replace is not the caller's)."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        checkpoint.load(self.records, self.param_groups, state_dict)
        self._torch_state = None
        self.replan()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- copies ---------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` keep: the param groups, the records (the
        transforms' states; built transforms and compiled graphs are rebuilt on use) and
        the compile keywords."""
        return {"defaults": self.defaults, "param_groups": self.param_groups, "records": self.records,
                "_default_tx": self._default_tx, "_default_factory": self._default_factory,
                "_dtensor_ref": self._dtensor_ref, "qk_clip": self.qk_clip,
                "routing": getattr(self, "routing", None), "compile_kwargs": self._runner.compile_kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        kwargs = state.pop("compile_kwargs", None)
        state.setdefault("qk_clip", None)  # (a copy pickled before the option existed)
        super().__setstate__(state)
        self._torch_state = None
        self._runner = Runner()
        if kwargs is not None:
            self._runner.compile_kwargs = kwargs
