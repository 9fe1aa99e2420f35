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
