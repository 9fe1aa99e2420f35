"""The torch.optim adapter: any muonfx transform as a real ``torch.optim.Optimizer``.

The adapter is a thin shell around the one data path: it builds TensorDicts of
gradients and parameters, calls the group's transform (made with
:func:`muonfx.inject_hyperparams`, so ``param_groups`` hyperparameters are read at
every step), and adds the updates to the parameters in place.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Union

import torch

from .base import (GradientTransformation, Key, aligned, build, defer_scale, donating, final_scales,
                   folding_final_scale, foreach, give_final, key_str, protect_state, take_final, tree_tensors)
from .state_tree import flatten_per_param, merge, restrict, unflatten_per_param, write_back
from .wrappers import InjectHyperparamsState, inject_hyperparams, signature

__all__ = ["TransformOptimizer", "lr_multiplier"]

TxOrFactory = Union[GradientTransformation, Callable[..., GradientTransformation]]

_SPARSE_HINT = (
    "Muon and the other matrix transforms need dense gradients. Use "
    "nn.Embedding(..., sparse=False), or route this parameter to AdamW: "
    "mfx.create_hybrid_optimizer(model, ...) does so for embeddings, or pass it in a "
    "param group {'params': [...], 'tx': mfx.adamw, 'sparse_grad': 'densify'} "
    "(its sparse gradient is then densified before the AdamW step)."
)


def lr_multiplier(tx: GradientTransformation) -> Callable[..., GradientTransformation]:
    """A factory ``(lr=1.0) -> tx`` whose output is multiplied by ``lr``.

    :class:`TransformOptimizer` uses it for pre-built transforms, so that
    ``group["lr"]`` (and any lr scheduler) scales the whole update: ``out = lr * tx(u)``.
    With ``lr == 1`` the update is exactly ``tx``'s.
    """

    def with_lr(lr: float = 1.0) -> GradientTransformation:
        def update_fn(updates, state, params=None):
            last = take_final(update_fn)
            if last:
                give_final(tx.update)
            out, state = tx.update(updates, state, params)
            if lr == 1.0:
                return out, state
            if last:  # the adapter folds lr into its p += lr * u
                defer_scale(list(out.values(include_nested=True, leaves_only=True)), float(lr))
                return out, state
            protect_state(state)  # the output may be part of the state (plain momentum)
            keys = [k if isinstance(k, tuple) else (k,) for k in out.keys(include_nested=True, leaves_only=True)]
            return build(keys, foreach("mul", [out.get(k) for k in keys], float(lr), reuse=True)), state

        return GradientTransformation(tx.init, update_fn)

    return with_lr


class _Stepped:
    """A group's new state from a compiled step, which has already updated the parameters."""

    def __init__(self, state: Any) -> None:
        self.state = state


_ADAPTER_KEYS = frozenset({"params", "param_names", "name", "sparse_grad", "initial_lr"})


def _factory_defaults(factory: Callable[..., Any]) -> dict[str, Any]:
    """The factory's keyword defaults that can live in ``param_groups`` (and be saved)."""
    out = {}
    for name, p in signature(factory).parameters.items():
        if p.default is not inspect.Parameter.empty and _serialisable(p.default):
            out[name] = p.default
    return out


def _check_known(factory: Callable[..., Any], given: dict[str, Any], what: str) -> None:
    sig = signature(factory)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    unknown = sorted(n for n in given if n not in sig.parameters and n not in _ADAPTER_KEYS)
    if unknown:
        raise TypeError(
            f"{what} {unknown} are not arguments of {getattr(factory, '__name__', factory)!r}; "
            f"it takes {list(sig.parameters)}"
        )


def _serialisable(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
        return True
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (tuple, list)):
        return all(_serialisable(x) for x in v)
    return False


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

    Parameters whose ``grad`` is None are left exactly as they are and their
    per-parameter state tensors (``momentum.mu``, ``adam.mu``, ...) do not move; step
    counters (``count``, ``adam.count``) are shared by the group and keep counting.
    ``state_dict()`` is torch's format with the transform's state flattened per
    parameter (``"momentum.mu"``, ``"adam.nu"``, ``"count"``); it loads with
    ``torch.load(..., weights_only=True)``.

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw, lr=1e-3)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, params: Iterable[Any], tx: TxOrFactory, **hyperparams: Any) -> None:
        self._default_tx = tx
        self._group_factories: list[Callable[..., GradientTransformation]] = []
        self._group_keys: list[list[Key]] = []
        self._base_lrs: list[float | None] = []
        self._tx_states: list[Any] = []
        self._stepped: list[bool] = []  # per group: has it made its first (eager) step?
        self._compile_kwargs: dict[str, Any] | None = None
        self._compiled: dict[Any, Callable[..., Any]] = {}
        #: reuse the previous state's buffers in place after the first step (set False
        #: to allocate fresh state every step, e.g. to keep references to old state)
        self.donate_buffers = True
        #: also let the transforms compute the update in the gradient buffers (p.grad then
        #: holds garbage after step(); zero_grad(set_to_none=True) discards it). With Muon
        #: the step's extra memory is then one same-shape group's, not a copy of the model.
        self.donate_grads = False
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts, not a Tensor")
        params = list(params)
        if not params:
            raise ValueError("TransformOptimizer got an empty parameter list")
        default_factory = lr_multiplier(tx) if isinstance(tx, GradientTransformation) else tx
        if not callable(default_factory):
            raise TypeError(f"tx must be a GradientTransformation or a factory returning one, got {type(tx).__name__}")
        self._default_factory = default_factory
        _check_known(default_factory, hyperparams, "hyperparameters")
        # Like torch.optim's own optimizers, ``defaults`` holds every hyperparameter of
        # the default transform (OneCycleLR's cycle_momentum looks for "momentum" or
        # "betas" there), the ones given here overriding the factory's defaults.
        defaults = {**_factory_defaults(default_factory), **hyperparams}
        super().__init__(params, defaults)

    # -- groups -------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (and create its transform state eagerly).

        A group may carry its own ``"tx"`` (factory or transform); its keys must be
        arguments of that factory (or ``params``, ``param_names``, ``name``,
        ``sparse_grad``); missing ones take the factory's defaults.
        """
        own = "tx" in param_group
        tx = param_group.pop("tx", self._default_tx)
        factory = self._default_factory if not own else (
            lr_multiplier(tx) if isinstance(tx, GradientTransformation) else tx)
        if not callable(factory):
            raise TypeError(f"tx must be a GradientTransformation or a factory returning one, got {type(tx).__name__}")
        _check_known(factory, {k: v for k, v in param_group.items() if k not in _ADAPTER_KEYS}, "param group keys")
        if own:
            for name, value in _factory_defaults(factory).items():
                param_group.setdefault(name, value)
        given = set(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if own:
            # torch filled in the default transform's hyperparameters; drop the ones this
            # group's transform does not take, so param_groups show what really runs
            sig = signature(factory).parameters
            for name in [n for n in group if n not in given and n not in sig and n not in _ADAPTER_KEYS]:
                del group[name]
        start = sum(len(g["params"]) for g in self.param_groups[:-1])
        names = group.get("param_names") or [f"param{start + i}" for i in range(len(group["params"]))]
        keys = [tuple(str(n).split(".")) for n in names]
        self._group_factories.append(factory)
        self._group_keys.append(keys)
        lr0 = group.get("lr")
        self._base_lrs.append(float(lr0) if isinstance(lr0, (int, float, torch.Tensor)) else None)
        try:
            if len(set(keys)) != len(keys):
                raise ValueError(f"duplicate parameter names in a param group: {names}")
            if any(type(p).__name__ == "DTensor" for p in group["params"]):
                from .distributed import check_params

                self._dtensor_ref = check_params(names, group["params"], getattr(self, "_dtensor_ref", None))
            with torch.no_grad():
                state = self._transform(len(self.param_groups) - 1).init(build(keys, list(group["params"])))
        except Exception:
            # leave the optimizer as it was before this call
            self.param_groups.pop()
            self._group_factories.pop()
            self._group_keys.pop()
            self._base_lrs.pop()
            raise
        self._tx_states.append(state)
        self._stepped.append(False)
        self._sync_torch_state(len(self.param_groups) - 1)

    def _hparams(self, gi: int) -> dict[str, Any]:
        """The group's hyperparameters as the transform sees them.

        Other learning rates of a factory (``adamw_lr`` of ``mfx.muon_adamw``, any
        ``*_lr``) follow ``lr``: they are multiplied by ``lr / lr_at_creation``, so a
        scheduler (or DCP's lr=0 initialisation step) drives every part of the update.
        """
        group = self.param_groups[gi]
        sig = signature(self._group_factories[gi])
        hp = {n: group[n] for n in sig.parameters if n in group}
        base = self._base_lrs[gi]
        if "lr" in hp and isinstance(base, (int, float)) and base != 0:
            ratio = float(hp["lr"]) / base
            if ratio != 1.0:
                for n, v in hp.items():
                    if n.endswith("_lr") and isinstance(v, (int, float)) and not isinstance(v, bool):
                        hp[n] = v * ratio
        return hp

    def _transform(self, gi: int, hp: dict[str, Any] | None = None) -> GradientTransformation:
        return inject_hyperparams(self._group_factories[gi])(**(self._hparams(gi) if hp is None else hp))

    def transform_state(self, group: int = 0) -> Any:
        """The functional state of a param group's transform (an InjectHyperparamsState)."""
        return self._tx_states[group]

    def _name(self, gi: int, i: int) -> str:
        return key_str(self._group_keys[gi][i])

    def _sync_torch_state(self, gi: int) -> None:
        """Mirror the functional state into ``self.state`` (per parameter, same tensors)."""
        keys = self._group_keys[gi]
        flat = flatten_per_param(self._tx_states[gi], keys)
        for p, k in zip(self.param_groups[gi]["params"], keys):
            self.state[p] = flat[k]

    # -- stepping -----------------------------------------------------------

    def _grads(self, gi: int) -> tuple[list[int], list[torch.Tensor]]:
        group = self.param_groups[gi]
        idx, grads = [], []
        for i, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                if group.get("sparse_grad", "error") == "densify":
                    g = g.to_dense()
                else:
                    raise ValueError(f"parameter {self._name(gi, i)!r} has a sparse gradient ({g.layout}). {_SPARSE_HINT}")
            if g.is_complex():
                raise TypeError(f"parameter {self._name(gi, i)!r} has a complex gradient; muonfx takes real tensors only")
            idx.append(i)
            grads.append(g)
        return idx, grads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; runs ``closure`` (with grad enabled) first and returns its loss.

        All groups' updates are computed before any parameter changes, so an error
        (a sparse gradient, a NaN schedule) leaves every parameter and state untouched.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = [self._grads(gi) for gi in range(len(self.param_groups))]
        results = []
        for gi, (idx, grads) in enumerate(plans):
            if not idx:
                results.append(None)
            elif self._compile_kwargs is not None and self._stepped[gi]:
                results.append(_Stepped(self._compiled_step(gi, idx, grads)))  # updates in place as it goes
            else:
                results.append(self._group_update(gi, idx, grads))
        for gi, res in enumerate(results):
            if res is None:
                continue
            if isinstance(res, _Stepped):  # a compiled step: parameters already updated
                self._tx_states[gi] = res.state
                self._sync_torch_state(gi)
                continue
            params, updates, scales, new_state = res
            # p += s * u, one pass per parameter; s is the final scalar factor (the -lr of
            # scale_by_learning_rate) that the transform deferred to this step, else 1
            by_scale: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for p, u, s in zip(params, updates, scales):
                ps, us = by_scale.setdefault(s, ([], []))
                ps.append(p)
                us.append(u)
            for s, (ps, us) in by_scale.items():
                if s == 1.0:
                    foreach("add_", ps, us)
                else:
                    foreach("add_", ps, us, alpha=s)
            self._tx_states[gi] = new_state
            self._stepped[gi] = True
            self._sync_torch_state(gi)
        return loss

    def _group_inputs(self, gi: int, idx: list[int]):
        """The group's keys and parameters with gradients, its state carrying the current
        hyperparameters, those hyperparameters, and the sub-state of those parameters."""
        keys_all = self._group_keys[gi]
        keys = [keys_all[i] for i in idx]
        params = [self.param_groups[gi]["params"][i] for i in idx]
        state: InjectHyperparamsState = self._tx_states[gi]
        hp = self._hparams(gi)
        state = state._replace(hyperparams={n: hp[n] for n in state.hyperparams if n in hp})
        partial = len(idx) != len(keys_all)
        sub = restrict(state, set(keys)) if partial else state
        return keys, params, state, hp, partial, sub

    def _group_update(self, gi: int, idx: list[int], grads: list[torch.Tensor]):
        keys, params, state, hp, partial, sub = self._group_inputs(gi, idx)
        update = self._update_fn(gi, state, hp)
        # After a group's first successful step (which surfaces structural errors with
        # nothing changed), the old state is donated: transforms overwrite its buffers
        # instead of allocating a fresh copy of every tensor each step.
        if self._stepped[gi] and self.donate_buffers and self._compile_kwargs is None:
            ctx = donating(list(tree_tensors(sub)) + (list(grads) if self.donate_grads else []))
        else:
            ctx = contextlib.nullcontext()
        # Eager steps let a final scalar multiply (the learning rate) be folded into the
        # parameter update instead of costing a pass of its own.
        fold = folding_final_scale(update) if self._compile_kwargs is None else contextlib.nullcontext()
        with ctx, fold:
            upd, new_sub = update(build(keys, grads), sub, build(keys, params))
            updates = aligned(upd, keys, "updates returned by the transform", against="parameters")
            scales = final_scales(updates)
        new_state = merge(state, new_sub) if partial else new_sub
        return params, updates, scales, new_state

    def _update_fn(self, gi: int, state: InjectHyperparamsState, hp: dict[str, Any]) -> Callable[..., Any]:
        return self._transform(gi, hp).update

    def _compiled_step(self, gi: int, idx: list[int], grads: list[torch.Tensor]) -> Any:
        """One group's step as one compiled function that writes the new state into the
        old buffers and adds the update to the parameters: inductor fuses the whole
        elementwise chain and stores into the existing tensors (no fresh copies)."""
        keys, params, state, hp, partial, sub = self._group_inputs(gi, idx)
        # Injected hyperparameters reach the update through the state, so one compiled
        # function serves every value; only a change of a static one (a string, a
        # bool, a dtype) builds and compiles a new one.
        static = tuple(sorted((n, repr(v)) for n, v in hp.items() if n not in state.hyperparams))
        donate = self.donate_buffers  # False: the new state gets fresh tensors, old ones stay intact
        fn = self._compiled.get((gi, static, donate))
        if fn is None:
            update = self._transform(gi, hp).update

            def step_in_place(grads_td, sub, params_td, plist, keys):
                upd, new_sub = update(grads_td, sub, params_td)
                if donate:
                    new_sub = write_back(sub, new_sub)
                for p, u in zip(plist, aligned(upd, keys, "updates returned by the transform", against="parameters")):
                    p.add_(u)
                return new_sub

            fn = self._compiled[(gi, static, donate)] = torch.compile(step_in_place, **self._compile_kwargs)
        new_sub = fn(build(keys, grads), sub, build(keys, params), params, keys)
        return merge(state, new_sub) if partial else new_sub

    def compile(self, **compile_kwargs: Any) -> "TransformOptimizer":
        """Run each group's step through ``torch.compile`` (after its first, eager step).

        The compiled function computes the update, writes the new state into the old
        buffers and adds the update to the parameters, so inductor fuses the
        elementwise chain into a few kernels that store into the existing tensors.
        Groups are then updated one after another (an error in a later group's step
        leaves earlier groups stepped); the first step of each group stays eager and
        surfaces structural errors with nothing changed.

        Defaults: ``dynamic=True`` (hyperparameters, step counts and shapes are
        symbolic, so changing lr, momentum or weight decay between steps, by hand or by
        a scheduler, recompiles nothing) and ``fullgraph=True`` (muonfx's transforms
        trace without graph breaks). Other keywords go to ``torch.compile`` (e.g.
        ``backend``, ``mode``). Returns ``self``.

        Example::

            >>> import torch, muonfx as mfx
            >>> model = torch.nn.Linear(4, 4)
            >>> opt = mfx.TransformOptimizer(model.named_parameters(), mfx.adamw).compile(backend="eager")
        """
        self._compile_kwargs = {"dynamic": True, "fullgraph": True, **compile_kwargs}
        self._compiled = {}
        return self

    # -- checkpoints ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format: ``{"state": {index: {name: tensor | number}}, "param_groups": [...]}``.

        Group entries that cannot be saved with ``weights_only=True`` (e.g. a schedule
        function given as a hyperparameter) are left out.
        """
        for gi in range(len(self.param_groups)):
            self._sync_torch_state(gi)
        sd = super().state_dict()
        sd["param_groups"] = [{k: v for k, v in g.items() if _serialisable(v)} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; on any mismatch (other transform,
        other model) raise ``ValueError`` saying what differs and change nothing."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("optimizer state_dict must have 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}")
        new_states = []
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            ids = list(saved["params"])
            if len(ids) != len(group["params"]):
                raise ValueError(
                    f"param group {gi}: state_dict has {len(ids)} parameters, this optimizer has {len(group['params'])}"
                )
            names = saved.get("param_names")
            mine = group.get("param_names")
            if names is not None and mine is not None and list(names) != list(mine):
                diff = [(a, b) for a, b in zip(names, mine) if a != b][:5]
                raise ValueError(f"param group {gi}: parameter names differ (saved, current): {diff}")
            keys = self._group_keys[gi]
            flat = {k: dict(state_dict["state"].get(pid, {})) for k, pid in zip(keys, ids)}
            names_map = {k: key_str(k) for k in keys}
            new_states.append(unflatten_per_param(self._tx_states[gi], keys, flat, names_map))
        # everything checked: now change things
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    group[k] = v
            hp = self._hparams(gi)
            self._tx_states[gi] = new_states[gi]._replace(
                hyperparams={n: hp[n] for n in new_states[gi].hyperparams if n in hp})
            self._sync_torch_state(gi)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
