"""Workers of tests/test_catalogue_fsdp.py: the catalogue's elementwise presets on a
``fully_shard``-ed transformer (gloo, CPU), against the same model in one process."""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402

import muonfx as mfx  # noqa: E402
from fsdp_workers import Net, full_params, lm_batches, rel_errors, shard_net, train_lm  # noqa: E402

#: preset -> hyperparameters: cautious_adamw and mars_adamw (gamma large enough that the
#: norm clip acts) sum over whole parameters through the seam; lion is purely elementwise;
#: schedule_free_adamw swaps the weights on eval()
PRESETS = {
    "lion": (mfx.lion, dict(lr=3e-3, weight_decay=0.1)),
    "cautious_adamw": (mfx.cautious_adamw, dict(lr=3e-3, weight_decay=0.01)),
    "mars_adamw": (mfx.mars_adamw, dict(lr=3e-3, weight_decay=0.01, gamma=0.5)),
    "schedule_free_adamw": (mfx.schedule_free_adamw, dict(lr=3e-3, warmup_steps=2)),
}


def task_presets(rank: int, world: int, steps: int = 6, rows_per_rank: int = 4) -> dict:
    batches = lm_batches(steps, rows_per_rank * world)
    out: dict = {}
    for name, (preset, hp) in PRESETS.items():
        torch.manual_seed(0)
        model = shard_net(Net())
        opt = mfx.TransformOptimizer(model.named_parameters(), preset, **hp)
        train_lm(model, opt, batches, rank, world)
        opt.eval()
        got = full_params(model)
        if rank == 0:
            torch.manual_seed(0)
            ref = Net()
            ref_opt = mfx.TransformOptimizer(ref.named_parameters(), preset, **hp)
            train_lm(ref, ref_opt, batches)
            ref_opt.eval()
            out[name] = rel_errors(full_params(ref), got)
    return out


def _dion2_groups(model):
    """Dion2 on the hidden matrices, AdamW on the rest (as Dion2's own param groups)."""
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if p.ndim == 2 and not n.startswith(("embed", "lm_head"))]
    rest = [(n, p) for n, p in named if (n, p) not in hidden]
    return mfx.TransformOptimizer([dict(params=hidden, tx=mfx.dion2, lr=0.02, fraction=0.3, ns_dtype=torch.float32),
                                   dict(params=rest, tx=mfx.adamw, lr=3e-3)], mfx.dion2)


def task_dion2(rank: int, world: int, steps: int = 6, rows_per_rank: int = 4) -> dict:
    """Dion2 on FSDP2: the top rows of each whole matrix, chosen on its owner rank."""
    batches = lm_batches(steps, rows_per_rank * world)
    torch.manual_seed(0)
    model = shard_net(Net())
    train_lm(model, _dion2_groups(model), batches, rank, world)
    got = full_params(model)
    out: dict = {}
    if rank == 0:
        torch.manual_seed(0)
        ref = Net()
        train_lm(ref, _dion2_groups(ref), batches)
        out["dion2"] = rel_errors(full_params(ref), got)
    return out


# ---------------------------------------------------------------------------
# 4 ranks: SOAP and Dion2 on FSDP2, HSDP and FSDP2 + TP (tests/test_catalogue_fsdp.py)
# ---------------------------------------------------------------------------

#: SOAP with a basis refresh every 2 steps (at steps 2 and 4 of 6), the 1-D parameters
#: preconditioned too (a 1-D factor through the exchange)
SOAP_HP = dict(lr=3e-3, weight_decay=0.01, precondition_frequency=2, precondition_1d=True)
LAYOUTS_4 = ("fsdp", "hsdp", "fsdp_tp")


def _res_layout_4(layout: str, world: int):
    """A ResMLP laid out as ``layout`` on 4 ranks, and (data part, parts) of this rank."""
    from fsdp_workers import ResMLP, _res_layout, cpu_mesh
    from torch.distributed.fsdp import fully_shard

    if layout != "fsdp":
        return _res_layout(layout, world)
    torch.manual_seed(0)
    model = ResMLP(h=30)
    for b in model.blocks:
        fully_shard(b, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return model, torch.distributed.get_rank(), world


def _soap(model):
    return mfx.TransformOptimizer(model.named_parameters(), mfx.soap, **SOAP_HP)


def _dion2_res(model):
    """Dion2 on the hidden matrices (every 2-D weight but the head's), AdamW on the rest."""
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if p.ndim == 2 and not n.startswith("head")]
    rest = [(n, p) for n, p in named if (n, p) not in hidden]
    return mfx.TransformOptimizer([dict(params=hidden, tx=mfx.dion2, lr=0.02, fraction=0.3, ns_dtype=torch.float32),
                                   dict(params=rest, tx=mfx.adamw, lr=3e-3)], mfx.dion2)


def _torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


MAKERS_4 = {"soap": _soap, "dion2": _dion2_res, "floor": _torch_adamw}


def task_layouts_4(rank: int, world: int, steps: int = 6, rows: int = 32) -> dict:
    """Per layout and optimizer (``floor``: torch's AdamW, the layout's own reduction
    order), per-parameter relative errors against one process after ``steps`` steps."""
    from fsdp_workers import ResMLP, _res_data, _train_res

    data = _res_data(steps, rows)
    out: dict = {}
    for layout in LAYOUTS_4:
        for name, make in MAKERS_4.items():
            model, part, parts = _res_layout_4(layout, world)
            _train_res(model, make(model), data, part, parts)
            got = full_params(model)
            if rank == 0:
                torch.manual_seed(0)
                ref = ResMLP(h=30)
                _train_res(ref, make(ref), data)
                out[layout, name] = rel_errors(full_params(ref), got)
    return out


def _state_full(opt) -> dict:
    from fsdp_workers import full
    return {(i, k): full(v) for i, (p, st) in enumerate(opt.state.items()) for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def _cloned(tree):
    """``tree`` with every tensor cloned (a DTensor as a DTensor)."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def task_soap_checkpoint(rank: int, world: int, steps: int = 6, cut: int = 3, rows: int = 32) -> dict:
    """SOAP under FSDP2: ``state_dict`` after ``cut`` steps, loaded into a fresh model and
    optimizer, which continue to ``steps``: against the uninterrupted run (bit for bit),
    and the state's layout (DTensors, the factors cut along their rows)."""
    from fsdp_workers import _res_data, _train_res

    data = _res_data(steps, rows)
    model, part, parts = _res_layout_4("fsdp", world)
    opt = _soap(model)
    _train_res(model, opt, data, part, parts)
    whole = full_params(model)
    whole_state = _state_full(opt)

    model, part, parts = _res_layout_4("fsdp", world)
    opt = _soap(model)
    _train_res(model, opt, data[:cut], part, parts)
    saved_model, saved_opt = _cloned(model.state_dict()), _cloned(opt.state_dict())
    layout = {f"{i}:{k}": (type(v).__name__, str(tuple(getattr(v, "placements", ()))), tuple(v.shape))
              for i, st in saved_opt["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    torch.manual_seed(5)
    model, part, parts = _res_layout_4("fsdp", world)
    model.load_state_dict(saved_model)
    opt = _soap(model)
    opt.load_state_dict(saved_opt)
    _train_res(model, opt, data[cut:], part, parts)
    resumed = full_params(model)
    resumed_state = _state_full(opt)
    return {"params": max((whole[n] - resumed[n]).abs().max().item() for n in whole),
            "state": max((whole_state[k] - resumed_state[k]).abs().max().item() for k in whole_state),
            "same_state_keys": sorted(map(str, whole_state)) == sorted(map(str, resumed_state)),
            "layout": layout}


def world_main_4(rank: int, world: int) -> dict:
    return {"layouts": task_layouts_4(rank, world), "checkpoint": task_soap_checkpoint(rank, world)}
