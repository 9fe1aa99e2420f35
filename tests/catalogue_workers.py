"""Workers of tests/test_catalogue_fsdp.py: the catalogue's presets on a ``fully_shard``-ed
transformer (gloo, CPU, 2 ranks), and SOAP and Dion2 on a ResMLP laid out as FSDP2, HSDP
and FSDP2 + TP (4 ranks), against the same model in one process."""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402

import muonfx as mfx  # noqa: E402
from fsdp_workers import Net, full_params, lm_batches, rel_errors, shard_net, train_lm  # noqa: E402

#: preset -> hyperparameters: cautious_adamw and mars_adamw (gamma large enough that the
#: norm clip acts) sum over whole parameters through the seam; schedule_free_adamw swaps
#: the weights on eval(); lion, adopt and laprop run the plan's lowerings on the local
#: shards (elementwise)
PRESETS = {
    "lion": (mfx.lion, dict(lr=3e-3, weight_decay=0.1)),
    "cautious_adamw": (mfx.cautious_adamw, dict(lr=3e-3, weight_decay=0.01)),
    "mars_adamw": (mfx.mars_adamw, dict(lr=3e-3, weight_decay=0.01, gamma=0.5)),
    "schedule_free_adamw": (mfx.schedule_free_adamw, dict(lr=3e-3, warmup_steps=2)),
    "adopt": (mfx.adopt, dict(lr=3e-3, weight_decay=0.01)),
    "laprop": (mfx.laprop, dict(lr=3e-3, weight_decay=0.01)),
}


def task_presets(rank: int, world: int, steps: int = 6, rows_per_rank: int = 4) -> dict:
    batches = lm_batches(steps, rows_per_rank * world)
    out: dict = {"paths": {}}
    for name, (preset, hp) in PRESETS.items():
        torch.manual_seed(0)
        model = shard_net(Net())
        opt = mfx.TransformOptimizer(model.named_parameters(), preset, **hp)
        train_lm(model, opt, batches, rank, world)
        out["paths"][name] = {g.path for g in opt.plan.groups}
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

#: SOAP with a basis refresh every 2 steps (at steps 2 and 4 of 6). Factors of 9 x 9 and
#: less only: each is then of full rank from the first gradient (32 rows), so its
#: eigenbasis is well defined; a factor with a null space (the long side of a rectangular
#: gradient, a 1-D parameter's) has a basis there that rounding alone picks, and Adam's
#: division amplifies the gradient's last-bit differences there to O(1e-2)
SOAP_HP = dict(lr=3e-3, weight_decay=0.01, precondition_frequency=2, max_precond_dim=9)
LAYOUTS_4 = ("fsdp", "hsdp", "fsdp_tp")


def _layout_4(layout: str, world: int):
    """A ResMLP with 9 inputs laid out as ``layout`` on 4 ranks (``fsdp``: FSDP2 over the
    4; ``hsdp``: 2 x 2 replicate x shard; ``fsdp_tp``: 2 x 2, tensor parallel inside,
    FSDP2 across), and (data part, parts) of this rank."""
    from fsdp_workers import ResMLP, fsdp_tp_2x2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ResMLP(d_in=9, h=30)
    if layout == "fsdp_tp":
        return fsdp_tp_2x2(model, world)
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.distributed.get_rank(), world


def _data_4(steps: int, rows: int, seed: int = 6) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 9, generator=g), torch.randn(rows, 12, generator=g)) for _ in range(steps)]


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


def _train_chunked(model, opt, data, parts: int) -> None:
    """One process, each step's gradient summed over ``parts`` chunks of the batch (as the
    data-parallel ranks' gradients are averaged): the floor of the comparison, the
    optimizer's answer to the gradient's last bits alone."""
    import torch.nn.functional as F

    for x, y in data:
        for xc, yc in zip(x.chunk(parts), y.chunk(parts)):
            (F.mse_loss(model(xc), yc) / parts).backward()
        opt.step()
        opt.zero_grad()


def task_layouts_4(rank: int, world: int, steps: int = 6, rows: int = 32) -> dict:
    """Per layout and optimizer, per-parameter relative errors against one process after
    ``steps`` steps: ``(layout, name)`` with each rank's share of the batch, ``(layout,
    name, "same")`` with the whole batch on every rank (the gradients are then one
    process's where no tensor parallelism reorders sums); ``("one", name, parts)``: one
    process with gradients summed over ``parts`` chunks (the floor); ``floor`` is torch's
    AdamW on the layout."""
    from fsdp_workers import ResMLP, _train_res

    data = _data_4(steps, rows)
    out: dict = {}

    def ref(make):
        torch.manual_seed(0)
        model = ResMLP(d_in=9, h=30)
        return model, make(model)

    refs = {}
    if rank == 0:
        for name, make in MAKERS_4.items():
            model, opt = ref(make)
            _train_res(model, opt, data)
            refs[name] = full_params(model)
            for parts in (2, 4):
                model, opt = ref(make)
                _train_chunked(model, opt, data, parts)
                out["one", name, parts] = rel_errors(refs[name], full_params(model))
    for layout in LAYOUTS_4:
        for name, make in MAKERS_4.items():
            for same in (False, True) if name == "soap" else (False,):
                model, part, parts = _layout_4(layout, world)
                _train_res(model, make(model), data, part, 1 if same else parts)
                got = full_params(model)
                if rank == 0:
                    out[(layout, name, "same") if same else (layout, name)] = rel_errors(refs[name], got)
    return out


def _state_full(opt) -> dict:
    from fsdp_workers import full
    return {(i, k): full(v) for i, (p, st) in enumerate(opt.state.items()) for k, v in st.items()
            if isinstance(v, torch.Tensor)}


def _cloned(tree):
    """``tree`` with every tensor cloned (a DTensor as a DTensor)."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def task_soap_checkpoint(rank: int, world: int, path: str, steps: int = 6, cut: int = 3, rows: int = 32) -> dict:
    """SOAP under FSDP2: ``state_dict`` after ``cut`` steps, loaded into a fresh model and
    optimizer, which continue to ``steps``: against the uninterrupted run (bit for bit),
    and the state's layout (DTensors, the factors cut along their rows); the same through
    ``torch.distributed.checkpoint`` (saved under ``path``)."""
    from fsdp_workers import _train_res, load_checkpoint
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    data = _data_4(steps, rows)
    model, part, parts = _layout_4("fsdp", world)
    opt = _soap(model)
    _train_res(model, opt, data, part, parts)
    whole = full_params(model)
    whole_state = _state_full(opt)

    model, part, parts = _layout_4("fsdp", world)
    opt = _soap(model)
    _train_res(model, opt, data[:cut], part, parts)
    saved_model, saved_opt = _cloned(model.state_dict()), _cloned(opt.state_dict())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    layout = {f"{i}:{k}": (type(v).__name__, str(tuple(getattr(v, "placements", ()))), tuple(v.shape))
              for i, st in saved_opt["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    torch.manual_seed(5)
    model, part, parts = _layout_4("fsdp", world)
    model.load_state_dict(saved_model)
    opt = _soap(model)
    opt.load_state_dict(saved_opt)
    _train_res(model, opt, data[cut:], part, parts)
    resumed = full_params(model)
    resumed_state = _state_full(opt)
    torch.manual_seed(6)
    model, part, parts = _layout_4("fsdp", world)
    opt = _soap(model)
    load_checkpoint(model, opt, path)
    _train_res(model, opt, data[cut:], part, parts)
    by_dcp, by_dcp_state = full_params(model), _state_full(opt)
    return {"params": max((whole[n] - resumed[n]).abs().max().item() for n in whole),
            "dcp_params": max((whole[n] - by_dcp[n]).abs().max().item() for n in whole),
            "dcp_state": max((whole_state[k] - by_dcp_state[k]).abs().max().item() for k in whole_state),
            "state": max((whole_state[k] - resumed_state[k]).abs().max().item() for k in whole_state),
            "same_state_keys": sorted(map(str, whole_state)) == sorted(map(str, resumed_state)),
            "layout": layout}


#: leaf -> (shape, placements on the 2 x 2 mesh) of the functional check
SOAP_LEAVES = {
    "rows_cols": ((10, 6), "S0 S1"),     # cut on both dims (2-D tensor parallel style)
    "hsdp": ((7, 5), "R S0"),            # replicate x shard, uneven rows
    "cols": ((6, 9), "S1 R"),            # column-cut (row-wise tensor parallel)
    "bias": ((8,), "S0 R"),              # a 1-D factor (precondition_1d)
    "conv": ((4, 3, 2, 2), "S0 S0"),     # 4-D, merged dims, cut twice along dim 0
    "wide": ((3, 40), "R S1"),           # 40 > max_precond_dim: a one-sided basis
    "huge": ((30, 30), "S0 S1"),         # no factor at all: elementwise on the shards
}


def task_soap_functional(rank: int, world: int, steps: int = 5) -> dict:
    """``scale_by_soap`` on DTensors of several placements against the same gradients in
    one process, every step's update and the final state (factors, bases, moments)."""
    from tensordict import TensorDict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import muonfx.distributed as mdist
    from fsdp_workers import full

    mdist.install()
    mesh = init_device_mesh("cpu", (2, world // 2))
    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    g = torch.Generator().manual_seed(3)
    grads = [{k: torch.randn(shape, generator=g) for k, (shape, _) in SOAP_LEAVES.items()} for _ in range(steps)]
    out: dict = {}
    for hp in (dict(precondition_frequency=2, precondition_1d=True, max_precond_dim=20, merge_dims=True),
               dict(precondition_frequency=1, max_precond_dim=20, normalize_grads=True)):
        tx = mfx.scale_by_soap(**hp)
        place = {k: [kinds[p] for p in pls.split()] for k, (_, pls) in SOAP_LEAVES.items()}

        def dist_td(d):
            return TensorDict({k: distribute_tensor(v, mesh, place[k]) for k, v in d.items()}, [])

        st_d, st_p = tx.init(dist_td(grads[0])), tx.init(TensorDict(dict(grads[0]), []))
        worst = 0.0
        for gr in grads:
            od, st_d = tx.update(dist_td(gr), st_d)
            op, st_p = tx.update(TensorDict(dict(gr), []), st_p)
            for k in SOAP_LEAVES:
                worst = max(worst, (full(od[k]) - op[k]).abs().max().item())
        state = 0.0
        for field in ("mu", "nu", "factors", "bases"):
            td_d, td_p = getattr(st_d, field), getattr(st_p, field)
            for k in td_p.keys(include_nested=True, leaves_only=True):
                state = max(state, (full(td_d.get(k)) - td_p.get(k)).abs().max().item())
        out[str(sorted(hp))] = {"updates": worst, "state": state,
                                "placements": {str(k): str(tuple(st_d.factors.get(k).placements))
                                               for k in st_d.factors.keys(include_nested=True, leaves_only=True)}}
    return out


def world_main_4(rank: int, world: int, path: str) -> dict:
    return {"layouts": task_layouts_4(rank, world), "checkpoint": task_soap_checkpoint(rank, world, path),
            "functional": task_soap_functional(rank, world)}
