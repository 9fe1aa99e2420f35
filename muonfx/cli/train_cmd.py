"""``muonfx train``: settings -> corpus -> one run (or two with ``--compare``) -> summary."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from .args import RUN_KEYS, check_settings, resolve, validate
from .checkpoint import CheckpointError, load_checkpoint
from .corpus import load_corpus
from .progress import format_rate
from .report import compare_runs, plot_losses, write_json
from .runtime import setup, teardown
from .train import train_run

__all__ = ["run_train", "train_command", "UsageError", "warmup_note"]


class UsageError(Exception):
    """A bad option: shown as one line, exit status 2."""


def _versions() -> dict:
    import tensordict

    from .. import __version__

    return {"muonfx": __version__, "torch": torch.__version__, "tensordict": tensordict.__version__,
            "python": platform.python_version()}


def warmup_note(warmup: int, steps: int) -> str | None:
    """A warning when the lr warm-up does not fit the run, else None.

    Example::

        >>> print(warmup_note(20, 5))
        note: --warmup 20 is not shorter than --steps 5: the learning rate climbs for the whole run and never reaches its peak (pass --warmup 1, or more --steps)
        >>> warmup_note(20, 600) is None
        True
    """
    if warmup >= steps > 0:
        return (f"note: --warmup {warmup} is not shorter than --steps {steps}: the learning rate climbs for the whole "
                f"run and never reaches its peak (pass --warmup {max(1, steps // 10)}, or more --steps)")
    return None


def prepare(args) -> dict | None:
    """Resolve the settings (from ``--resume``'s checkpoint and the defaults) and check
    them; return the checkpoint, if any. Raises UsageError."""
    ckpt = None
    if args.resume:
        if not Path(args.resume).exists():
            raise UsageError(f"--resume {args.resume}: no such file")
        try:
            ckpt = load_checkpoint(args.resume)
        except CheckpointError as e:  # not a checkpoint, a damaged or a hand-edited one
            raise UsageError(f"--resume {args.resume}: {e}") from None
        saved = ckpt["settings"]
        err = check_settings(saved)
        if err:
            raise UsageError(f"--resume {args.resume}: {err}")
        for k in RUN_KEYS:
            given = getattr(args, k, None)
            if given is not None and k in saved and given != saved[k]:
                raise UsageError(f"--resume: the checkpoint was trained with --{k.replace('_', '-')} {saved[k]}, "
                                 f"not {given}; drop the option or pass the same value")
        resolve(args, saved)
    else:
        resolve(args)
    err = validate(args)
    if err:
        raise UsageError(err)
    if ckpt is not None and ckpt["step"] >= args.steps:
        raise UsageError(f"--resume: the checkpoint is at step {ckpt['step']}, already at --steps {args.steps}; "
                         "pass a larger --steps to train on")
    return ckpt


def run_train(args, argv: list[str], prog: str = "muonfx train") -> int:
    args.prog = prog  # the command the messages name (examples/train_gpt.py runs this too)
    ckpt = prepare(args)
    rt = setup(args.device, args.fsdp, args.threads, args.amp)
    completed = False
    try:
        corpus = load_corpus(args.cache_dir, use_cache=not args.no_cache)
        if ckpt is not None and ckpt["corpus_sha256"] != corpus.sha256:
            raise UsageError("--resume: the checkpoint was trained on another corpus (another Python's stdlib: "
                             f"sha256 {ckpt['corpus_sha256'][:12]}..., here {corpus.sha256[:12]}...)")
        if rt.is_main:
            src = "cached" if corpus.from_cache else "built"
            print(f"corpus: {corpus.files} stdlib files, {corpus.chars:,} chars, vocab {corpus.vocab_size}, "
                  f"sha256 {corpus.sha256[:16]} ({src}); train {corpus.split:,} / val {len(corpus.val):,} tokens",
                  flush=True)
            note = warmup_note(args.warmup, args.steps)
            if note:
                print(note, flush=True)
        runs = {args.optimizer: train_run(args, args.optimizer, corpus, rt, args.lr, ckpt, then=args.compare)}
        if args.compare:
            runs[args.compare] = train_run(args, args.compare, corpus, rt, None)
        completed = True  # every rank trained; what follows is rank 0's own writing
        if not rt.is_main:
            return 0
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = args.optimizer + (f"-vs-{args.compare}" if args.compare else "")
        out = Path(args.out or Path("runs") / f"{stamp}-{name}")
        settings = {k: getattr(args, k) for k in ("optimizer", "compare", "model", "steps", "lr", "adamw_lr",
                                                   "weight_decay", "batch_size", "context", "warmup", "grad_clip",
                                                   "seed", "eval_every", "eval_batches", "amp", "stop_at",
                                                   "ns_method")}
        summary = {
            "command": " ".join([prog, shlex.join(argv[1:] if argv[:1] == ["train"] else argv)]).strip(),
            "versions": _versions(), "settings": settings,
            "device": str(rt.device), "threads": torch.get_num_threads(),
            "fsdp": {"world": rt.world, "backend": rt.backend} if rt.fsdp else None,
            "corpus": corpus.info(), "runs": runs,
        }
        files = [out / "summary.json"]
        note = ""
        if args.compare:
            summary["comparison"] = cmp = compare_runs(runs, args.compare)
            title = (f"{args.model} GPT on the Python stdlib ({corpus.chars / 1e6:.1f}M chars), batch {args.batch_size}, "
                     f"{args.steps} steps, seed {args.seed}")
            note = plot_losses(runs, out / "loss.png", title, cmp)
            files.append(out / "loss.png")
        write_json(out / "summary.json", summary)
        print()
        for n, rec in runs.items():
            print(f"{n:>12}: final val loss {rec['final_val_loss']:.4f} (train {rec['final_train_loss']:.4f}), "
                  f"{rec['steps']} steps, {rec['seconds']:.0f} s ({rec['eval_seconds']:.0f} s of it evaluating), "
                  f"{format_rate(rec['tokens_per_s'] or 0)} training (evaluations excluded)")
        if args.compare:
            hit = cmp["steps_to_reach"][args.optimizer]
            target = f"{args.compare}'s final val loss {cmp['target_val_loss']:.4f}"
            if hit:
                print(f"{args.optimizer} reaches {target} at step {hit['step']} (~{hit['interpolated']:.0f} "
                      f"interpolated): {cmp['step_ratio'].get(args.optimizer, float('nan')):.2f}x fewer steps")
            else:
                print(f"{args.optimizer} does not reach {target} in {args.steps} steps")
        if note:
            print(note)
        print("wrote " + ", ".join(str(f) for f in files))
        return 0
    finally:
        teardown(rt, completed)
        sys.stdout.flush()


def train_command(args, argv: list[str], prog: str = "muonfx train") -> int:
    """:func:`run_train` with bad options reported as one line (exit status 2)."""
    try:
        return run_train(args, argv, prog)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # raised while restoring a checkpoint that loaded
        print(f"{prog}: error: --resume {args.resume}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per rank
            print(f"{prog}: interrupted", file=sys.stderr)
        return 130
