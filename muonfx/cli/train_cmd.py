"""``muonfx train``: settings -> corpus -> one run (or two with ``--compare``) -> summary."""

from __future__ import annotations

import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path

from .args import RUN_KEYS, check_settings, fill_lr, resolve, validate

# torch, tensordict and the rest of the command are imported once the options are valid:
# ``--help`` and a bad option answer at once.

__all__ = ["run_train", "train_command", "UsageError", "warmup_note", "threads_note", "gpt2_on_cpu_note"]


class UsageError(Exception):
    """A bad option: shown as one line, exit status 2."""


def _versions() -> dict:
    import tensordict
    import torch

    from .. import __version__

    return {"muonfx": __version__, "torch": torch.__version__, "tensordict": tensordict.__version__,
            "python": platform.python_version()}


def warmup_note(warmup: int, steps: int) -> str | None:
    """A warning when the lr warm-up does not fit the run, else None. The warm-up factor
    of step ``s`` (from 0) is ``(s + 1) / warmup``: ``--warmup 1`` (or 0) starts at the
    peak, so it always fits.

    Example::

        >>> print(warmup_note(20, 5))
        note: --warmup 20 is longer than --steps 5: the learning rate climbs for the whole run and never reaches its peak (pass --warmup 1, or more --steps)
        >>> print(warmup_note(5, 5))
        note: --warmup 5 is as long as --steps 5: the learning rate reaches its peak only at the last step and never decays (pass --warmup 1, or more --steps)
        >>> warmup_note(20, 600) is None, warmup_note(1, 1) is None
        (True, True)
    """
    if warmup > 1 and warmup >= steps > 0:
        what = ("is as long as --steps {s}: the learning rate reaches its peak only at the last step and never decays"
                if warmup == steps else
                "is longer than --steps {s}: the learning rate climbs for the whole run and never reaches its peak")
        return (f"note: --warmup {warmup} {what.format(s=steps)} (pass --warmup {max(1, steps // 10)}, "
                "or more --steps)")
    return None


def gpt2_on_cpu_note(steps: int, prog: str) -> str:
    """Said before anything is built when ``--model gpt2`` (86M parameters, context 1024:
    made for GPUs) runs on a CPU, where one step takes minutes (one forward pass of its
    32 x 1024 batch: 118 s on one thread of a 2-core AMD EPYC VM; a step is about three).

    Example::

        >>> print(gpt2_on_cpu_note(300, "muonfx train"))
        note: --model gpt2 on a CPU: minutes a step on a 2-core CPU (GPT-2's 124M configuration, context 1024), so 300 steps take hours; for a first run: muonfx train --model tiny (the default, under a second a step) or --model small, or fewer --steps
    """
    return (f"note: --model gpt2 on a CPU: minutes a step on a 2-core CPU (GPT-2's 124M configuration, context 1024), "
            f"so {steps} step{'s take' if steps != 1 else ' takes'} {'hours' if steps >= 15 else 'minutes'}; for a "
            f"first run: {prog} --model tiny (the default, under a second a step) or --model small, or fewer --steps")


def threads_note(saved: int | None, now: int, capped: bool = False) -> str | None:
    """A note when ``--threads`` makes a resumed CPU run use another thread count than its
    checkpoint's (``saved``): the sums of the model's products then round differently, so
    the run goes on close to, not bit for bit as, the uninterrupted one. None when they agree.

    Example::

        >>> print(threads_note(1, 2))
        note: the checkpoint was trained with 1 CPU thread, this run uses 2 (--threads): the results differ from an uninterrupted run by rounding (drop --threads to continue bit for bit)
        >>> threads_note(2, 2) is None
        True
    """
    if saved is None or saved == now:
        return None
    if capped:  # more than this machine's cores
        return (f"note: the checkpoint was trained with {saved} CPU threads, this run uses {now} (this machine's "
                "cores): the results differ from an uninterrupted run by rounding")
    return (f"note: the checkpoint was trained with {saved} CPU thread{'s' if saved != 1 else ''}, this run uses "
            f"{now} (--threads): the results differ from an uninterrupted run by rounding (drop --threads to "
            "continue bit for bit)")


def prepare(args) -> dict | None:
    """Resolve the settings (from ``--resume``'s checkpoint and the defaults) and check
    them; return the checkpoint, if any. Raises UsageError."""
    ckpt = None
    if args.resume:
        if not Path(args.resume).exists():
            raise UsageError(f"--resume {args.resume}: no such file")
        from .checkpoint import CheckpointError, load_checkpoint

        try:
            ckpt = load_checkpoint(args.resume)
        except CheckpointError as e:  # not a checkpoint, a damaged or a hand-edited one
            raise UsageError(f"--resume {args.resume}: {e}") from None
        saved = ckpt["settings"]
        err = check_settings(saved)
        if err:
            raise UsageError(f"--resume {args.resume}: {err}")
        for k in RUN_KEYS + ("amp",):  # (another autocast computes another run)
            given = getattr(args, k, None)
            if given is not None and k in saved and given != saved[k]:
                raise UsageError(f"--resume: the checkpoint was trained with --{k.replace('_', '-')} {saved[k]}, "
                                 f"not {given}; drop the option or pass the same value")
        args.threads_given = args.threads is not None
        if args.threads is None and isinstance(saved.get("threads"), int):
            # the same sums, rounded the same way: exact; but never more threads than this machine has cores
            # (a checkpoint from a larger machine, or a damaged one asking for a million)
            args.threads = max(0, min(saved["threads"], os.cpu_count() or 1))
            args.threads_capped = args.threads != saved["threads"]
        resolve(args, saved)
    else:
        resolve(args)
    err = validate(args)
    if err:
        raise UsageError(err)
    fill_lr(args)
    if ckpt is not None and ckpt["step"] >= args.steps:
        raise UsageError(f"--resume: the checkpoint is at step {ckpt['step']}, already at --steps {args.steps}; "
                         "pass a larger --steps to train on")
    if ckpt is not None and args.stop_at is not None and args.stop_at <= ckpt["step"]:
        raise UsageError(f"--resume: the checkpoint is at step {ckpt['step']}, --stop-at {args.stop_at} leaves "
                         f"nothing to train; pass a --stop-at after step {ckpt['step']}, or drop it")
    from ..linalg.precision import pinned_ns_dtype

    try:
        pinned_ns_dtype()  # MUONFX_NS_DTYPE: refused now, not by the first optimizer built
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.save and os.environ.get("RANK", "0") == "0":  # rank 0 writes it
        from .checkpoint import save_problem

        err = save_problem(args.save)
        if err:
            raise UsageError(err)
    return ckpt


def run_train(args, argv: list[str], prog: str = "muonfx train") -> int:
    args.prog = prog  # the command the messages name (examples/train_gpt.py runs this too)
    ckpt = prepare(args)
    import torch

    from .corpus import load_corpus
    from .progress import format_rate
    from .report import compare_runs, plot_losses, write_json
    from .runtime import setup, teardown
    from .train import train_run

    rt = setup(args.device, args.fsdp, args.threads, args.amp)
    completed = False
    try:
        if rt.is_main and rt.device.type == "cpu" and args.model == "gpt2":
            print(gpt2_on_cpu_note(args.steps, args.prog), flush=True)
        if ckpt is not None and rt.is_main and rt.device.type == "cpu" and (
                getattr(args, "threads_given", False) or getattr(args, "threads_capped", False)):
            note = threads_note(ckpt["settings"].get("threads"), torch.get_num_threads(),
                                getattr(args, "threads_capped", False) and not getattr(args, "threads_given", False))
            if note:
                print(note, flush=True)
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
                                                   "ns_method", "qk_clip", "log_max_logit")}
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
        unsaved = [rec["save_error"] for rec in runs.values() if rec.get("save_error")]
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
        for err in unsaved:  # the training is in summary.json; the checkpoint is not on disk
            print(f"{prog}: error: --save: {err}", file=sys.stderr)
        return 1 if unsaved else 0
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
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP (the run stopped at its last completed step)
        signum = getattr(e, "signum", signal.SIGINT)
        if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per rank
            print(f"{prog}: {'interrupted' if signum == signal.SIGINT else f'terminated ({signal.Signals(signum).name})'}",
                  file=sys.stderr)
        return 128 + signum
    except Exception as e:
        from .checkpoint import CheckpointError

        if not isinstance(e, CheckpointError):
            raise
        print(f"{prog}: error: --resume {args.resume}: {e}", file=sys.stderr)  # restoring a checkpoint that loaded
        return 2
