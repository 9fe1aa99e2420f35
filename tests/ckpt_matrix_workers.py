"""Workers for ``tests/test_checkpoint_matrix.py``: checkpoints across layouts.

One model, one optimizer and one data stream in every layout:

* the model is :class:`fsdp_workers.ResMLP` (``inp`` 9 x 7, two blocks of ``up`` 30 x 9
  and ``down`` 9 x 30, ``head`` 12 x 9) in float64, so that the layouts' different
  reduction orders stay far under the comparison's tolerance. Its matrices (``inp``,
  ``up``, ``down``) take Muon and its biases, norms and head AdamW
  (:func:`muonfx.create_hybrid_optimizer`); under FSDP2 at 4 ranks ``inp``'s 9 rows
  split 3 + 3 + 3 + 0 (an empty shard) and ``up``'s 30 rows 8 + 8 + 8 + 6; under
  FSDP2 + TP ``up`` is colwise and ``down`` rowwise over ``tp``, and ``up``'s 15 rows per
  ``tp`` rank are cut 8 + 7 again over ``dp``;
* the data of step ``s`` is drawn from a generator seeded with ``s``: the same global batch
  whatever the layout and whatever step a run starts at; each data-parallel rank takes its
  equal chunk of it (FSDP2 averages gradients, so every layout computes the full-batch
  mean gradient).

Layouts (:data:`LAYOUTS`): ``fsdp4`` (FSDP2 over 4 ranks), ``fsdp2`` (FSDP2 over 2),
``plain`` (one process, no DTensor), ``hsdp`` (a 2 x 2 replicate x shard mesh),
``fsdp_tp`` (tensor parallel inside, FSDP2 across: dp 2 x tp 2).

A checkpoint is saved and loaded the documented ways (``docs/fsdp.md``): sharded, with
``torch.distributed.checkpoint`` and ``get_state_dict`` / ``set_state_dict``
(:func:`save`, :func:`load`); or whole, ``get_state_dict(..., full_state_dict=True,
cpu_offload=True)`` written by rank 0 with ``torch.save`` and read by every rank with
``torch.load(weights_only=True)`` into ``set_state_dict(..., full_state_dict=True)``
(:func:`save_full`, :func:`load_full`).
"""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import muonfx as mfx  # noqa: E402
from fsdp_workers import ResMLP, _tp, full, full_params  # noqa: E402

LAYOUTS = ("fsdp4", "fsdp2", "plain", "hsdp", "fsdp_tp")
#: ranks each layout runs on
WORLD = {"fsdp4": 4, "fsdp2": 2, "plain": 1, "hsdp": 4, "fsdp_tp": 4}
STEPS = 6  # the uninterrupted run
SAVE_AT = 3  # the FSDP2 W=4 checkpoint the other layouts continue from
BACK_AT = 4  # the other layouts' checkpoints FSDP2 W=4 continues from
ROWS = 16  # the global batch: divisible by 1, 2 and 4
DTYPE = torch.float64
H = 30


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (it depends on nothing else)."""
    g = torch.Generator().manual_seed(7000 + step)
    return (torch.randn(ROWS, 7, generator=g, dtype=DTYPE), torch.randn(ROWS, 12, generator=g, dtype=DTYPE))


def build(layout: str, seed: int = 0):
    """``(model, part, parts)``: the model laid out as ``layout`` (initialised from
    ``seed``), and which chunk of the global batch this rank takes."""
    torch.manual_seed(seed)
    model = ResMLP(h=H).to(DTYPE)
    if layout == "plain":
        return model, 0, 1
    world = dist.get_world_size()
    if world != WORLD[layout]:
        raise ValueError(f"layout {layout!r} runs on {WORLD[layout]} ranks, not {world}")
    if layout in ("fsdp4", "fsdp2"):
        mesh = init_device_mesh("cpu", (world,))
        part, parts = dist.get_rank(), world
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        part, parts = dist.get_rank(), world
    elif layout == "fsdp_tp":
        full_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            _tp(b, full_mesh["tp"])
        mesh = full_mesh["dp"]
        part, parts = mesh.get_local_rank(), 2
    else:
        raise ValueError(layout)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, part, parts


def make_opt(model) -> mfx.TransformOptimizer:
    return mfx.create_hybrid_optimizer(model, muon_lr=0.02, muon_weight_decay=0.01, adamw_lr=3e-3,
                                       ns_dtype=DTYPE)


def train(model, opt, steps: range, part: int, parts: int) -> None:
    for s in steps:
        x, y = batch(s)
        x, y = x.chunk(parts)[part], y.chunk(parts)[part]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def opt_state(model, opt) -> dict:
    """``{"param:entry": full tensor or number}`` of the optimizer's per-parameter state."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}:{k}": (full(v) if isinstance(v, torch.Tensor) else v)
            for p, st in opt.state.items() for k, v in st.items()}


def counts(model, opt) -> dict:
    """``{"param:entry": step count}`` of the per-parameter counts (as plain ints)."""
    return {k: int(v) for k, v in opt_state(model, opt).items() if k.rsplit(":", 1)[1].split(".")[-1] == "count"}


def state_layout(model, opt) -> dict:
    """For each tensor entry of the optimizer state: does it have its parameter's
    placements and local shape (``True`` for a plain model's plain tensors)?"""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                if isinstance(p, DTensor):
                    ok = (isinstance(v, DTensor) and tuple(v.placements) == tuple(p.placements)
                          and v.device_mesh == p.device_mesh and v.to_local().shape == p.to_local().shape)
                else:
                    ok = not isinstance(v, DTensor) and v.shape == p.shape
                out[f"{names[id(p)]}:{k}"] = ok
    return out


def save(model, opt, path: str, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=no_dist)


def load(model, opt, path: str, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_full(model, opt, path: str, no_dist: bool = False) -> None:
    """The whole model and optimizer state in one file, written by rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # cpu_offload=True: the full tensors on rank 0 only (it needs a process group)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=not no_dist))
    if no_dist or dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, path + ".tmp")
        os.replace(path + ".tmp", path)
    if not no_dist:
        dist.barrier()


def load_full(model, opt, path: str, no_dist: bool = False) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = torch.load(path, weights_only=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))


def run(layout: str, *, load_from: str | None = None, load_whole: bool = False, start: int = 0,
        save_to: str | None = None, save_whole_to: str | None = None, save_at: int | None = None,
        stop: int = STEPS) -> dict:
    """Build ``layout`` (from another seed when it loads: the load must overwrite
    everything), load ``load_from`` (a checkpoint of step ``start``: sharded, or a full
    state dict's file with ``load_whole``), train to ``save_at`` and save ``save_to``
    (sharded) and ``save_whole_to`` (a full state dict), train on to ``stop``. Returns
    full tensors and counts: ``loaded`` (params, state, counts and whether the state has
    the parameters' layout, right after the load), ``saved`` (params, state, counts at the
    save) and ``final`` (params and counts at ``stop``)."""
    no_dist = layout == "plain"
    model, part, parts = build(layout, seed=123 if load_from else 0)
    opt = make_opt(model)
    out: dict = {}
    step = 0
    if load_from is not None:
        with warnings.catch_warnings():
            if no_dist:
                warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
            (load_full if load_whole else load)(model, opt, load_from, no_dist=no_dist)
        step = start
        out["loaded"] = {"params": full_params(model), "state": opt_state(model, opt),
                         "counts": counts(model, opt), "layout": state_layout(model, opt)}
    if save_to is not None or save_whole_to is not None:
        train(model, opt, range(step, save_at), part, parts)
        step = save_at
        with warnings.catch_warnings():
            if no_dist:
                warnings.simplefilter("ignore")
            if save_to is not None:
                save(model, opt, save_to, no_dist=no_dist)
            if save_whole_to is not None:
                save_full(model, opt, save_whole_to, no_dist=no_dist)
        out["saved"] = {"params": full_params(model), "state": opt_state(model, opt), "counts": counts(model, opt)}
    train(model, opt, range(step, stop), part, parts)
    out["final"] = {"params": full_params(model), "counts": counts(model, opt)}
    return out


def world_main(rank: int, world: int, jobs: list[tuple[str, dict]]) -> dict:
    """Run ``jobs`` (``(name, kwargs of run)``) in order on every rank; ``{name: result}``
    (and ``"seconds"``: each job's wall time)."""
    out: dict = {"seconds": {}}
    for name, kwargs in jobs:
        start = time.perf_counter()
        out[name] = run(**kwargs)
        dist.barrier()
        out["seconds"][name] = time.perf_counter() - start
    return out
