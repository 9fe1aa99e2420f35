"""``--save`` / ``--resume``: one file holding everything a run needs to continue exactly.

The file (``torch.save``; loads with ``weights_only=True``) holds full, unsharded
model and optimizer state dicts made with ``torch.distributed.checkpoint.state_dict``
(parameters keyed by name), so a checkpoint written under ``--fsdp`` resumes on
one process and the other way round, plus the LR scheduler, the step, the data
generator's and torch's RNG states, the loss history and the run's settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "save_checkpoint", "load_checkpoint", "restore"]

FORMAT = "muonfx-train/1"


def _options(rt, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=rt.fsdp, **kw)


def save_checkpoint(path: str | os.PathLike, rt, model, opt, sched, step: int, gen: torch.Generator,
                    history: dict, settings: dict, corpus_sha256: str) -> None:
    """Collective under ``--fsdp`` (every rank calls it); rank 0 writes the file."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt, options=_options(rt))
    if not rt.is_main:
        return
    ckpt = {
        "format": FORMAT, "step": step, "model": msd, "optimizer": osd, "scheduler": sched.state_dict(),
        "data_rng": gen.get_state(), "torch_rng": torch.get_rng_state(), "history": history,
        "settings": settings, "corpus_sha256": corpus_sha256,
    }
    if torch.cuda.is_available() and rt.device.type == "cuda":
        ckpt["cuda_rng"] = torch.cuda.get_rng_state(rt.device)
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is not a muonfx train checkpoint (made by 'muonfx train --save')")
    return ckpt


def restore(ckpt: dict, rt, model, opt, sched, gen: torch.Generator) -> int:
    """Load ``ckpt`` into the freshly built model/optimizer/scheduler; return the step."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                   options=_options(rt))
    lambdas = [dict(f.__dict__) for f in getattr(sched, "lr_lambdas", [])]
    sched.load_state_dict(ckpt["scheduler"])
    for f, d in zip(getattr(sched, "lr_lambdas", []), lambdas):
        f.__dict__.update(d)  # keep this run's schedule length (--steps may be longer now)
    gen.set_state(ckpt["data_rng"])
    torch.set_rng_state(ckpt["torch_rng"])
    if "cuda_rng" in ckpt and rt.device.type == "cuda":
        torch.cuda.set_rng_state(ckpt["cuda_rng"], rt.device)
    return int(ckpt["step"])
