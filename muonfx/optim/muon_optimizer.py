"""The optimizer classes users of torch.optim.Muon and the predecessor muon_fsdp know,
as thin builders on :class:`muonfx.TransformOptimizer`."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

import torch

from ..logs import say_once
from ..presets import adamw, default_muon_labels, muon
from ..presets.options import MeaningChangedWarning, takes_muon_options
from .optimizer import TransformOptimizer
from .qk_clip import QKClip, unclipped
from .routing import check_muon_reached, rule_of

__all__ = ["MuonOptimizer", "create_hybrid_optimizer", "model_labels", "MeaningChangedWarning"]


def _embedding_ids(model: torch.nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            for p in m.parameters(recurse=False)}


def model_labels(model: torch.nn.Module) -> Callable[[str, torch.Tensor], Hashable]:
    """A label function for ``model``: ``"adamw"`` for the parameters of its
    ``nn.Embedding``/``nn.EmbeddingBag`` modules (whatever their names), otherwise
    :func:`muonfx.default_muon_labels` (0-D/1-D tensors and embedding/head names)."""
    embedding_params = _embedding_ids(model)

    def labels(name: str, p: torch.Tensor) -> Hashable:
        return "adamw" if id(p) in embedding_params else default_muon_labels(name, p)

    return labels


#: The defaults of :class:`MuonOptimizer`'s AdamW fallback (:func:`create_hybrid_optimizer`'s).
ADAMW_FALLBACK = dict(adamw_lr=1e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.01)

def _adamw_group(params: list, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> dict:
    return dict(params=params, tx=adamw, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                sparse_grad="densify")


def _tensor(item: Any) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item


def _label(item: Any) -> str:
    """Where a given parameter goes: by :func:`muonfx.default_muon_labels` when it has a
    name (0-D/1-D tensors, embedding and head names to AdamW), by its ndim when it has none."""
    if isinstance(item, tuple):
        return default_muon_labels(*item)
    return "adamw" if item.ndim < 2 else "muon"


def _items(params: list) -> list:
    """What ``params`` (a list, or a list of param-group dicts) holds, group after group."""
    groups = [g.get("params", []) for g in params] if params and isinstance(params[0], dict) else [params]
    return [x for g in groups for x in ([g] if isinstance(g, torch.Tensor) else list(g))]


def _tensors(params: list) -> list:
    """The tensors of :func:`_items`, in the order given."""
    return [_tensor(x) for x in _items(params)]


def _without_names(params: list) -> bool:
    """True when ``params`` (a list, or a list of param-group dicts) holds plain tensors
    only: no ``(name, tensor)`` pairs."""
    items = _items(params)
    return bool(items) and all(isinstance(x, torch.Tensor) for x in items)


#: torch.optim.Muon's parameters after ``params, lr``, in its order (keyword-only here)
TORCH_MUON_ORDER = ("weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
#: torch.optim.Muon's ``adjust_lr_fn`` values (the same names and meaning as ``adjust_lr``'s)
TORCH_ADJUST_LR_FN = ("original", "match_rms_adamw")


def _from_adjust_lr_fn(value: Any, adjust_lr: Any) -> str:
    """``adjust_lr`` for torch.optim.Muon's ``adjust_lr_fn`` (refused unless it is one of
    torch's values, or where ``adjust_lr`` says otherwise)."""
    if value not in TORCH_ADJUST_LR_FN:
        raise ValueError(f"MuonOptimizer: adjust_lr_fn={value!r}; torch.optim.Muon's values are "
                         f"{list(TORCH_ADJUST_LR_FN)} (or None). muonfx's other scales (\"spectral\", \"none\") "
                         "are adjust_lr's")
    if adjust_lr not in (None, "original", value):
        raise ValueError(f"MuonOptimizer: adjust_lr_fn={value!r} and adjust_lr={adjust_lr!r} disagree; adjust_lr_fn "
                         "is torch.optim.Muon's name of adjust_lr: give one of them")
    return value


def _few(names: list[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


class MuonOptimizer(TransformOptimizer):
    """Muon as a ``torch.optim.Optimizer`` (the predecessor's signature and defaults),
    with an AdamW fallback for the parameters Muon does not take.

    ``MuonOptimizer(params, lr=0.02, *, momentum=0.95, nesterov=False, ns_steps=5,
    ns_coefficients="keller", weight_decay=0.0, adjust_lr="original", eps=1e-7,
    ns_dtype=None, ns_method="standard", mu_dtype=None, strict=False, adamw_lr=1e-3,
    adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.01)``.

    ``params`` is what the predecessor took (``model.parameters()``,
    ``model.named_parameters()``, param-group dicts) or the model itself. The matrices
    (2-D, 3-D stacks, conv weights) get :func:`muonfx.muon` with the Muon options
    (:class:`~muonfx.MuonOptions`, ``eps`` the Newton-Schulz floor), each a param-group
    hyperparameter read at every step. The rest goes to a second param group (a third,
    fourth, ... for param-group dicts) running AdamW with ``adamw_lr``, ``adamw_betas``,
    ``adamw_eps`` and ``adamw_weight_decay`` (:func:`create_hybrid_optimizer`'s defaults):

    * given named parameters (``model.named_parameters()``, ``(name, tensor)`` pairs):
      those :func:`muonfx.default_muon_labels` sends to AdamW: 0-D/1-D tensors and
      embeddings and an output head found by name (:data:`muonfx.ADAMW_KEY_PATTERN`);
    * given plain parameters (``model.parameters()``): the 0-D/1-D ones (biases, norm
      weights). Without names every matrix gets Muon, embeddings and a head included:
      the split's log line says so, and how to route them;
    * given a model (an ``nn.Module``): its trainable parameters split as
      :func:`create_hybrid_optimizer` splits them (:func:`model_labels`): 0-D/1-D
      tensors, the parameters of ``nn.Embedding``/``nn.EmbeddingBag`` modules (so an
      output head tied to the embedding too) and parameters named like embeddings or an
      output head (:data:`muonfx.ADAMW_KEY_PATTERN`: ``lm_head``, ``head``, ``wte``, ...).

    The split is logged once on the ``muonfx`` logger (at WARNING the first time in a
    process). ``strict=True`` keeps the fallback off: every parameter must then be a
    matrix, and a 0-D/1-D one raises ``ValueError``. Note the predecessor's
    ``nesterov=False`` default (torch.optim.Muon and ``mfx.muon`` use ``True``). The
    predecessor gave 0-D/1-D parameters momentum SGD at Muon's lr and embeddings Muon.

    A ``MuonOptimizer`` in which no parameter gets Muon (every parameter flattened to
    1-D, none at least 2-D, or every matrix an embedding or a head) raises
    :class:`~muonfx.optim.routing.NoMuonError` saying why; ``allow_no_muon=True``
    allows it. :attr:`routing` lists each parameter's route and the rule behind it.
    ``qk_clip`` takes a :class:`muonfx.QKClip` (see :class:`muonfx.TransformOptimizer`).

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        >>> opt = mfx.MuonOptimizer(model.parameters(), lr=0.02, momentum=0.95, weight_decay=0.01)
        >>> [len(g["params"]) for g in opt.param_groups]        # Muon: 2 weights; AdamW: 2 biases
        [2, 2]
    """

    @takes_muon_options(defaults={"nesterov": False}, legacy_order=("momentum", "weight_decay", "nesterov", "ns_steps"),
                        legacy_name="muon_fsdp.MuonOptimizer", other_orders={"torch.optim.Muon": TORCH_MUON_ORDER})
    def __init__(
        self,
        params: Iterable[Any] | torch.nn.Module,
        *,
        strict: bool = False,
        adamw_lr: float = ADAMW_FALLBACK["adamw_lr"],
        adamw_betas: tuple[float, float] = ADAMW_FALLBACK["adamw_betas"],
        adamw_eps: float = ADAMW_FALLBACK["adamw_eps"],
        adamw_weight_decay: float = ADAMW_FALLBACK["adamw_weight_decay"],
        adjust_lr_fn: str | None = None,
        qk_clip: QKClip | None = None,
        allow_no_muon: bool = False,
        **muon_options: Any,
    ) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"MuonOptimizer: strict must be True or False, got {strict!r}")
        if adjust_lr_fn is not None:
            muon_options["adjust_lr"] = _from_adjust_lr_fn(adjust_lr_fn, muon_options["adjust_lr"])
        fallback = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        unnamed = False
        if not isinstance(params, (torch.nn.Module, torch.Tensor)):
            params = list(params)
            unnamed = not strict and _without_names(params)
        if isinstance(params, torch.nn.Module):
            groups, fallbacks = self._split_model(params, strict, fallback)
        elif strict or isinstance(params, torch.Tensor):
            groups, fallbacks = params if isinstance(params, torch.Tensor) else list(params), []
        else:
            groups, fallbacks = self._split_params(params, fallback)
        fallback_groups = [gi for gi, g in enumerate(groups) if any(g is f for f in fallbacks)]
        super().__init__(groups, muon, qk_clip=qk_clip, **muon_options)
        embedding = _embedding_ids(params) if isinstance(params, torch.nn.Module) else set()
        #: where each parameter went and by which rule (:mod:`muonfx.optim.routing`)
        self.routing = [(self._name(gi, i), tuple(p.shape), "adamw" if gi in fallback_groups else "muon",
                         rule_of(self._name(gi, i), p, "adamw" if gi in fallback_groups else "muon",
                                 id(p) in embedding))
                        for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        check_muon_reached("MuonOptimizer", self.routing, allow_no_muon)
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.ndim < 2 and unclipped(self.records[gi].factory) is muon:
                    raise ValueError(
                        f"MuonOptimizer: parameter {self._name(gi, i)!r} has shape {tuple(p.shape)}; Muon "
                        "needs matrices (strict=True). Leave strict off to give 0-D/1-D parameters (biases, "
                        "norms) AdamW, or use mfx.create_hybrid_optimizer(model, ...)."
                    )
        muon_count = sum(len(g["params"]) for gi, g in enumerate(self.param_groups) if gi not in fallback_groups)
        # a parameter given with a name is shown by it, one without by its place in what was given
        place = {id(t): i for i, t in enumerate(_tensors(params))} if unnamed else {}
        moved = [(f"#{place[id(p)] + 1}" if unnamed else repr(self._name(gi, i)), tuple(p.shape))
                 for gi in fallback_groups for i, p in enumerate(self.param_groups[gi]["params"])]
        if moved or unnamed:
            say_once("MuonOptimizer split", self._split_line(muon_count, moved, unnamed, adamw_lr))

    @staticmethod
    def _split_line(muon_count: int, moved: list[tuple[str, tuple]], unnamed: bool, adamw_lr: float) -> str:
        """The one log line that says which parameters went where (and, for parameters
        given without names, how to send embeddings and the head to AdamW)."""
        line = f"muonfx: MuonOptimizer: Muon for {muon_count} matri{'x' if muon_count == 1 else 'ces'}"
        if moved:
            which = _few([f"{n} {s}" for n, s in moved])
            if unnamed:
                what = f"{len(moved)} 0-D/1-D parameter{'s' if len(moved) > 1 else ''} ({which} of those given)"
            else:
                what = f"{len(moved)} other parameter{'s' if len(moved) > 1 else ''} ({which})"
            line += f", AdamW (lr {adamw_lr:g}) for {what} (strict=True: Muon alone, and 0-D/1-D parameters refused)"
        if unnamed:
            line += ("; parameters without names cannot be routed, so embeddings and an output head get Muon too: "
                     "pass model.named_parameters() or the model itself, or use mfx.create_hybrid_optimizer(model)")
        return line

    @staticmethod
    def _split_model(model: torch.nn.Module, strict: bool, fallback: dict) -> tuple[list[dict], list[dict]]:
        """``(param groups, the AdamW fallback groups among them)``."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if strict:
            return [dict(params=named)], []
        label = model_labels(model)
        muon_part = [(n, p) for n, p in named if label(n, p) == "muon"]
        other = [_adamw_group([(n, p) for n, p in named if label(n, p) != "muon"], **fallback)]
        if not other[0]["params"]:
            other = []
        return ([dict(params=muon_part)] if muon_part else []) + other, other

    @staticmethod
    def _split_params(params: Iterable[Any], fallback: dict) -> tuple[list[Any], list[dict]]:
        """``(param groups, the AdamW fallback groups among them)``."""
        items = list(params)
        given = [dict(g) for g in items] if items and isinstance(items[0], dict) else [dict(params=items)]
        for g in given:
            ps = g.get("params")
            g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps) if isinstance(ps, Iterable) else ps
        def splits(g: dict) -> bool:
            ps = g["params"]
            return ("tx" not in g and isinstance(ps, list) and all(isinstance(_tensor(x), torch.Tensor) for x in ps)
                    and any(_label(x) == "adamw" for x in ps))
        if not any(splits(g) for g in given):
            return items, []  # nothing to split (or TransformOptimizer's error to raise)
        labels = [[_label(x) for x in g["params"]] if splits(g) else None for g in given]
        # parameters keep what they were given with: names where they had them, none where
        # they had none (torch's optimizers load each other's state dicts either way)
        groups: list[dict] = []
        fallbacks: list[dict] = []
        for g, lbl in zip(given, labels):
            if lbl is None:
                groups.append(g)
                continue
            matrices = [x for x, to in zip(g["params"], lbl) if to == "muon"]
            if matrices:
                groups.append({**g, "params": matrices})
            fallbacks.append(_adamw_group([x for x, to in zip(g["params"], lbl) if to == "adamw"], **fallback))
            groups.append(fallbacks[-1])
        return groups, fallbacks


@takes_muon_options(rename={"lr": "muon_lr", "momentum": "muon_momentum", "weight_decay": "muon_weight_decay"},
                    legacy_order=("adamw_lr", "muon_weight_decay", "adamw_weight_decay"),
                    legacy_name="muon_fsdp's create_hybrid_optimizer")
def create_hybrid_optimizer(
    model: torch.nn.Module,
    *,
    adamw_lr: float = 1e-3,
    adamw_weight_decay: float = 0.01,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    labels: Callable[[str, torch.Tensor], Hashable] | None = None,
    qk_clip: QKClip | None = None,
    allow_no_muon: bool = False,
    **muon_options: Any,
) -> TransformOptimizer:
    """One optimizer: Muon for hidden matrices, AdamW for embeddings, head, biases, norms.

    Parameters are split with ``labels(name, param) -> "muon" | "adamw"`` (default:
    parameters of ``nn.Embedding``/``nn.EmbeddingBag`` modules, then
    :func:`muonfx.default_muon_labels` by name and ndim) into two param groups of ONE
    :class:`TransformOptimizer`, so one lr scheduler drives both (each group keeps
    its own base lr) and one ``state_dict`` holds everything. The Muon group takes
    every option of :func:`muonfx.muon` (:class:`~muonfx.MuonOptions`), with ``lr``,
    ``momentum`` and ``weight_decay`` named ``muon_lr``, ``muon_momentum`` and
    ``muon_weight_decay`` here; ``eps`` is the Newton-Schulz floor. The AdamW group takes
    ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` (Adam's epsilon) and
    ``adamw_weight_decay``, and accepts sparse gradients (``nn.Embedding(sparse=True)``)
    by densifying them. Frozen parameters (``requires_grad=False``) are left out.
    A model in which no parameter gets Muon raises
    :class:`~muonfx.optim.routing.NoMuonError` naming why (flattened 1-D parameters, no
    parameter at least 2-D, every matrix sent to AdamW by an embedding/head rule), unless
    ``allow_no_muon=True``; the optimizer's ``routing`` lists each parameter's route
    and rule. ``qk_clip`` takes a :class:`muonfx.QKClip` (QK-clip, "MuonClip").

    Example::

        >>> import torch, muonfx as mfx
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
        >>> opt = mfx.create_hybrid_optimizer(model, muon_lr=0.02, adamw_lr=1e-3)
        >>> [len(g["params"]) for g in opt.param_groups]
        [2, 3]
    """
    label_fn = labels or model_labels(model)
    groups: dict[str, list] = {"muon": [], "adamw": []}
    embedding = _embedding_ids(model)
    routing = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lbl = label_fn(name, p)
        routing.append((name, tuple(p.shape), str(lbl), rule_of(name, p, lbl, id(p) in embedding, labels is not None)))
        if lbl not in groups:
            raise ValueError(f"create_hybrid_optimizer: label {lbl!r} for parameter {name!r}; use 'muon' or 'adamw'")
        if lbl == "muon" and p.ndim < 2:
            raise ValueError(f"create_hybrid_optimizer: parameter {name!r} ({p.ndim}-D) cannot use Muon")
        groups[lbl].append((name, p))
    param_groups = []
    if groups["muon"]:
        param_groups.append(dict(params=groups["muon"], tx=muon, **muon_options))
    if groups["adamw"]:
        param_groups.append(dict(
            params=groups["adamw"], tx=adamw, lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
            weight_decay=adamw_weight_decay, sparse_grad="densify",
        ))
    if not param_groups:
        raise ValueError("create_hybrid_optimizer: the model has no trainable parameters")
    check_muon_reached("create_hybrid_optimizer", routing, allow_no_muon)
    opt = TransformOptimizer(param_groups, muon, qk_clip=qk_clip)
    opt.routing = routing
    return opt
