"""``--save`` / ``--resume``: one file holding everything a run needs to continue exactly.

The file (``torch.save``; loads with ``weights_only=True``) holds full, unsharded
model and optimizer state dicts made with ``torch.distributed.checkpoint.state_dict``
(parameters keyed by name), so a checkpoint written under ``--fsdp`` resumes on
one process and the other way round, plus the LR scheduler, the step, the data
generator's and torch's RNG states, the loss history and the run's settings.

Every file carries a SHA-256 checksum of its content (:func:`content_sha256`: every
tensor's dtype, shape and bytes and every other value, in a fixed order), which
:func:`load_checkpoint` verifies, together with the layout of the dict, before
anything is restored: a damaged or hand-edited file is a :class:`CheckpointError`
naming what is wrong, never a half-restored run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "CheckpointError", "content_sha256", "save_problem", "save_checkpoint", "load_checkpoint",
           "restore"]

FORMAT = "muonfx-train/2"  # /2: with the "sha256" checksum

#: the keys of a checkpoint and the type each value must have
_LAYOUT: dict[str, type | tuple[type, ...]] = {
    "format": str, "step": int, "model": dict, "optimizer": dict, "scheduler": dict, "data_rng": torch.Tensor,
    "torch_rng": torch.Tensor, "history": dict, "settings": dict, "corpus_sha256": str, "sha256": str,
}


class CheckpointError(ValueError):
    """A file that ``--resume`` cannot use (not a checkpoint, damaged, or inconsistent), or a
    checkpoint that ``--save`` could not write (a full disk)."""


def _feed(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            _feed(h, k)
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def content_sha256(ckpt: dict) -> str:
    """SHA-256 of everything in ``ckpt`` but its ``"sha256"`` entry (tensors by dtype, shape
    and bytes; other values by type and ``repr``; dict entries in a fixed order)."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in ckpt.items() if k != "sha256"})
    return h.hexdigest()


def _options(rt, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=rt.fsdp, **kw)


def save_problem(path: str | os.PathLike) -> str | None:
    """Why ``--save path`` could not be written, found before training (one line), else None.

    Does what :func:`save_checkpoint` will do to the folder: creates it (with its parents)
    and writes, then removes, a file beside ``path``.

    Example::

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> save_problem(os.path.join(d, "runs", "ck.pt")) is None
        True
        >>> save_problem(d).endswith("is a folder; give a file path, e.g. " + os.path.join(d, "checkpoint.pt"))
        True
    """
    path = Path(path)
    if path.is_dir():
        return f"--save {path} is a folder; give a file path, e.g. {path / 'checkpoint.pt'}"
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"--save {path}: {blocker} is a file, not a folder; choose another path"
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    try:
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(probe, "xb"):
            pass
        probe.unlink()
    except OSError as e:
        return f"--save {path}: cannot write there ({e.strerror or type(e).__name__}); choose another path"
    return None


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
    ckpt["sha256"] = content_sha256(ckpt)
    write_atomically(path, lambda f: torch.save(ckpt, f))


def write_atomically(path: str | os.PathLike, write: Any) -> None:
    """``write(file)`` into a new file of a unique name created exclusively beside
    ``path`` (never following a planted link, never overwriting another file), then
    renamed to ``path``: a reader sees the old file or the whole new one. Where the
    write fails (a full disk) the partial file is removed and :class:`CheckpointError`
    says so in one line; ``path`` is left as it was.

    Example::

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> write_atomically(os.path.join(d, "x.bin"), lambda f: f.write(b"ok"))
        >>> open(os.path.join(d, "x.bin"), "rb").read(), sorted(os.listdir(d))
        (b'ok', ['x.bin'])
    """
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent if path.parent != Path("") else ".", prefix=f".{path.name[:40]}.",
                               suffix=".tmp")  # O_CREAT | O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write {path} ({e.strerror or type(e).__name__}); nothing was "
                                  "written there") from None
        raise


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a ``--save`` file, verify its checksum and layout; raise :class:`CheckpointError` (one line)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, truncated, or damaged where torch.load notices
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read it ({type(e).__name__}: {first[:200]}); the file is damaged or not "
                              "a muonfx checkpoint") from None
    if not isinstance(ckpt, dict) or not str(ckpt.get("format", "")).startswith("muonfx-train/"):
        raise CheckpointError("not a muonfx train checkpoint (made by 'muonfx train --save')")
    if ckpt["format"] != FORMAT:
        raise CheckpointError(f"format {ckpt['format']!r}, this muonfx reads {FORMAT!r} (checkpoints with a "
                              "checksum); re-create it with this version")
    missing = [k for k in _LAYOUT if k not in ckpt]
    if missing:
        raise CheckpointError(f"the checkpoint has no {', '.join(repr(k) for k in missing)} entry")
    if not isinstance(ckpt["sha256"], str) or content_sha256(ckpt) != ckpt["sha256"]:
        raise CheckpointError("checksum mismatch: the file was damaged or changed after it was written")
    for k, typ in _LAYOUT.items():
        v = ckpt[k]
        if not isinstance(v, typ) or isinstance(v, bool) and typ is int:
            raise CheckpointError(f"the checkpoint's {k!r} entry is a {type(v).__name__}, "
                                  f"expected {getattr(typ, '__name__', typ)}")
    if ckpt["step"] < 1:
        raise CheckpointError(f"the checkpoint's step is {ckpt['step']}; expected at least 1")
    for k in ("train", "val"):
        if not isinstance(ckpt["history"].get(k), list):
            raise CheckpointError(f"the checkpoint's history has no {k!r} list")
    return ckpt


def restore(ckpt: dict, rt, model, opt, sched, gen: torch.Generator) -> int:
    """Load ``ckpt`` into the freshly built model/optimizer/scheduler; return the step.

    A state that does not fit the model or optimizer raises :class:`CheckpointError`
    (the run is not started, so nothing half-restored is ever trained)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    names = set(model.state_dict())
    missing, unexpected = sorted(names - set(ckpt["model"])), sorted(set(ckpt["model"]) - names)
    if missing or unexpected:
        raise CheckpointError(f"its model state does not fit this run's model: "
                              f"{f'missing {missing[:3]}' if missing else ''}"
                              f"{'; ' if missing and unexpected else ''}"
                              f"{f'unexpected {unexpected[:3]}' if unexpected else ''}")
    try:
        set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                       options=_options(rt))
        lambdas = [dict(f.__dict__) for f in getattr(sched, "lr_lambdas", [])]
        sched.load_state_dict(ckpt["scheduler"])
        for f, d in zip(getattr(sched, "lr_lambdas", []), lambdas):
            f.__dict__.update(d)  # keep this run's schedule length (--steps may be longer now)
        gen.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["torch_rng"])
    except Exception as e:
        text = " ".join(str(e).split())  # one line
        raise CheckpointError(f"its state does not fit this run: {type(e).__name__}: "
                              f"{text[:300] + ('...' if len(text) > 300 else '')}") from None
    if "cuda_rng" in ckpt and rt.device.type == "cuda":
        torch.cuda.set_rng_state(ckpt["cuda_rng"], rt.device)
    return int(ckpt["step"])
