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
