"""The options of ``muonfx train`` (shared with ``examples/train_gpt.py``).

Every option's parser default is ``None`` so that ``--resume`` can tell what was
given on the command line from what was not: :func:`resolve` fills the gaps from
the checkpoint's settings, then from :data:`DEFAULTS`.
"""

from __future__ import annotations

import argparse
import math
import os

from .sizes import MODELS

__all__ = ["DEFAULTS", "RUN_KEYS", "add_train_args", "resolve", "fill_lr", "validate", "check_settings"]

DEFAULTS = dict(
    optimizer="muon_adamw", steps=300, lr=None, adamw_lr=3e-3, weight_decay=0.01, batch_size=32, model="tiny",
    context=None, seed=0, warmup=20, grad_clip=0.0, compare=None, device="auto", eval_every=50, eval_batches=16,
    out=None, save=None, resume=None, stop_at=None, threads=0, cache_dir=None, amp="auto", ns_method="standard",
    qk_clip=0.0, log_max_logit=False,
)

#: ``--ns-method``'s choices (the Muon presets' ``ns_method``)
NS_METHODS = ("standard", "gram", "auto")

#: settings a resumed run must share with its checkpoint (they shape the model, the
#: optimizer state, the schedule or the data stream)
RUN_KEYS = ("optimizer", "lr", "adamw_lr", "weight_decay", "batch_size", "model", "context", "seed", "warmup",
            "grad_clip", "ns_method", "qk_clip")


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = DEFAULTS
    g = p.add_argument_group("what to train")
    g.add_argument("--optimizer", metavar="NAME",
                   help="muon_adamw (default), adamw, muon, or one of the catalogue: lion, adopt, laprop, "
                        "cautious_adamw, mars_adamw, mars_muon, schedule_free_adamw, soap, dion2 (mars_muon, "
                        "dion2 and muon take the matrices, AdamW the rest; the others take every parameter)")
    g.add_argument("--model", choices=sorted(MODELS),
                   help="tiny: 4x128, 4 heads, ctx 128 (default, CPU); small: 6x256, 8 heads, ctx 256; "
                        "gpt2: the GPT-2 124M configuration 12x768, ctx 1024 (GPUs)")
    g.add_argument("--steps", type=int, metavar="N", help=f"optimizer steps, the schedule's length (default {d['steps']})")
    g.add_argument("--lr", type=float, help="learning rate of --optimizer: Muon's for muon presets (default 0.02); "
                                            "AdamW's for --optimizer adamw and the --compare adamw baseline "
                                            "(default 0.01, the best of a small sweep); the elementwise "
                                            "catalogue's own (default: the best of a sweep on this job, "
                                            "e.g. lion 1e-3, soap 3e-2; docs/evidence.md)")
    g.add_argument("--adamw-lr", type=float, help=f"AdamW lr of the hybrids' embeddings, head, norms and biases "
                                                  f"(default {d['adamw_lr']})")
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay (default {d['weight_decay']}); Muon uses none")
    g.add_argument("--batch-size", type=int, metavar="B",
                   help=f"sequences per step, all ranks together (default {d['batch_size']})")
    g.add_argument("--context", type=int, metavar="T", help="sequence length (default: the model's context)")
    g.add_argument("--warmup", type=int, metavar="N",
                   help=f"linear warm-up steps, then linear decay to 0 (default {d['warmup']})")
    g.add_argument("--grad-clip", type=float, metavar="NORM", help="clip the global gradient norm (default 0: off)")
    g.add_argument("--seed", type=int, help="model init and data order (default 0)")
    g.add_argument("--ns-method", choices=NS_METHODS,
                   help="Newton-Schulz form of the Muon presets: standard (torch.optim.Muon's iteration, the "
                        "default), gram (the Gram iteration on rectangular matrices: fewer flops, up to 4x bf16's "
                        "rounding; docs/evidence.md) or auto")
    g.add_argument("--qk-clip", type=float, metavar="TAU",
                   help="QK-clip (Kimi K2's MuonClip): after every step, scale the query and key rows of each "
                        "attention head whose largest logit went above TAU (100 in K2) so that it is TAU; the "
                        "per-head max logit is reported (default 0: off)")
    g.add_argument("--log-max-logit", action="store_true",
                   help="report the largest attention logit (per head in summary.json) without clipping it")
    g.add_argument("--compare", metavar="NAME",
                   help="also train NAME (e.g. adamw) with the same seed and data; write loss.png and summary.json")
    g = p.add_argument_group("where and how")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto: cuda if available")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 fully_shard (one process per rank: start with torchrun)")
    g.add_argument("--amp", choices=["auto", "bf16", "off"],
                   help="bf16 autocast: auto = on CUDA only (default)")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default 0: torch's choice less the cores the load average says are busy; "
                        "--resume reuses the checkpoint's count, which keeps the run exact)")
    g.add_argument("--eval-every", type=int, metavar="N", help=f"validation loss every N steps and at the end "
                                                                f"(default {d['eval_every']})")
    g.add_argument("--eval-batches", type=int, metavar="N", help=f"validation batches per evaluation, always the same ones "
                                                                  f"(default {d['eval_batches']})")
    g.add_argument("--out", metavar="DIR", help="summary.json (and loss.png with --compare) go here "
                                                "(default runs/<date>-<time>-<optimizer>[-vs-<compare>])")
    g.add_argument("--save", metavar="PATH", help="checkpoint at the end, at --stop-at, and on Ctrl-C (after the current step, "
                                                 "also under --fsdp); resume exactly with --resume")
    g.add_argument("--resume", metavar="PATH", help="continue a --save checkpoint exactly (its settings are the defaults)")
    g.add_argument("--stop-at", type=int, metavar="STEP", help="stop after this step (the schedule still spans --steps); "
                                                               "with --save, resume later")
    g.add_argument("--cache-dir", metavar="DIR", help="corpus cache (default $MUONFX_CACHE_DIR or ~/.cache/muonfx)")
    g.add_argument("--no-cache", action="store_true", help="rebuild the corpus, write no cache")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (loss lines are still printed)")
    return p


#: the type of each numeric or named setting (``--resume`` reads them from a file)
_INTS = ("steps", "batch_size", "context", "seed", "warmup", "eval_every", "eval_batches", "threads", "stop_at")
_FLOATS = ("lr", "adamw_lr", "weight_decay", "grad_clip", "qk_clip")
_STRS = ("optimizer", "model", "amp", "compare", "ns_method")


def _type_error(k: str, v) -> str | None:
    """Why ``v`` cannot be the value of setting ``k`` (None: it can; None values are "not given")."""
    if v is None:
        return None
    if k in _INTS and (isinstance(v, bool) or not isinstance(v, int)):
        return f"must be an integer, got {v!r}"
    if k in _FLOATS:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"must be a number, got {v!r}"
        if not math.isfinite(v):
            return f"must be a finite number, got {v!r}"
    if k in _STRS and not isinstance(v, str):
        return f"must be a name, got {v!r}"
    return None


def check_settings(saved: dict) -> str | None:
    """A one-line message for the first setting of a checkpoint's ``saved`` dict that has
    the wrong type (a damaged or hand-made file), else None."""
    for k in RUN_KEYS + ("steps", "eval_every", "eval_batches", "amp", "threads"):
        if k in saved:
            err = _type_error(k, saved[k])
            if err:
                return f"the checkpoint's setting {k!r} {err}"
    if "amp" in saved and saved["amp"] not in ("auto", "bf16", "off"):
        return f"the checkpoint's setting 'amp' must be auto, bf16 or off, got {saved['amp']!r}"
    if "ns_method" in saved and saved["ns_method"] not in NS_METHODS:
        return f"the checkpoint's setting 'ns_method' must be one of {', '.join(NS_METHODS)}, got {saved['ns_method']!r}"
    if "model" in saved and saved["model"] not in MODELS:
        return f"the checkpoint's setting 'model' names no model: {saved['model']!r} (known: {', '.join(sorted(MODELS))})"
    return None


def resolve(args: argparse.Namespace, saved: dict | None = None) -> argparse.Namespace:
    """Fill options not given: from the checkpoint's settings ``saved``, then from DEFAULTS
    (``--lr`` stays None: :func:`fill_lr` sets it once the options are valid; a checkpoint
    saved before ``--ns-method`` existed ran ``"auto"``, the default then)."""
    if saved is not None and "ns_method" not in saved and getattr(args, "ns_method", None) is None:
        args.ns_method = "auto"
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            if saved is not None and k in saved and k in RUN_KEYS + ("steps", "eval_every", "eval_batches", "amp"):
                setattr(args, k, saved[k])
            else:
                setattr(args, k, v)
    if args.context is None and args.model in MODELS:
        args.context = MODELS[args.model].context
    return args


def fill_lr(args: argparse.Namespace) -> argparse.Namespace:
    """``--lr`` not given: the optimizer's default (the concrete value goes into the summary
    and the checkpoint)."""
    if args.lr is None and args.optimizer:
        from .optimizers import default_lr

        args.lr = default_lr(args.optimizer, args.adamw_lr)
    return args


def validate(args: argparse.Namespace) -> str | None:
    """A one-line message for the first bad option, else None. The optimizer names are
    checked last: listing the presets imports torch, the other checks need nothing."""
    for k in _INTS + _FLOATS + _STRS:
        err = _type_error(k, getattr(args, k, None))
        if err:
            return f"--{k.replace('_', '-')} {err}"
    positive = dict(steps=args.steps, batch_size=args.batch_size, eval_every=args.eval_every,
                    eval_batches=args.eval_batches)
    if args.context is not None:
        positive["context"] = args.context
    for k, v in positive.items():
        if v < 1:
            return f"--{k.replace('_', '-')} must be at least 1, got {v}"
    for k in ("adamw_lr", "weight_decay", "warmup", "grad_clip", "threads", "qk_clip"):
        if getattr(args, k) < 0:
            return f"--{k.replace('_', '-')} must not be negative, got {getattr(args, k)}"
    if args.lr is not None and args.lr <= 0:
        return f"--lr must be positive, got {args.lr}"
    if args.context is not None and args.context > MODELS[args.model].context:
        return f"--context {args.context} is longer than the {args.model} model's {MODELS[args.model].context}"
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        return f"--stop-at must be between 1 and --steps ({args.steps}), got {args.stop_at}"
    if args.compare and (args.save or args.resume or args.stop_at):
        return "--compare runs two trainings from scratch; it does not combine with --save, --resume or --stop-at"
    if args.compare == args.optimizer:
        return f"--compare {args.compare} is the same as --optimizer {args.optimizer}"
    for k in ("resume", "save", "out", "cache_dir"):  # an empty path would silently mean "none"
        v = getattr(args, k, None)
        if v is not None and not str(v).strip():
            return f"--{k.replace('_', '-')} is empty; give a path (or leave the option out)"
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out} is a file; give a folder for summary.json (and loss.png)"
    if args.resume and not os.path.exists(args.resume):
        return f"--resume {args.resume}: no such file"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return f"--device cuda: torch {torch.__version__} sees no CUDA device here; use --device cpu"
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) if args.fsdp else 1
        if torch.cuda.device_count() < ranks:
            return (f"--device cuda --fsdp needs a GPU per rank: {ranks} ranks, {torch.cuda.device_count()} GPU(s) "
                    "here; use --device auto (gloo on the CPU) or fewer ranks")
    if args.fsdp and "RANK" not in os.environ:
        return ("--fsdp runs one process per rank: launch with torchrun, e.g. "
                "'torchrun --nproc_per_node=2 -m muonfx train --fsdp' (gloo on CPU, NCCL on GPUs)")
    world = int(os.environ.get("WORLD_SIZE", "1")) if args.fsdp else 1
    if args.batch_size % world:
        return f"--batch-size {args.batch_size} must be a multiple of the {world} ranks (each takes an equal share)"
    from .optimizers import check_optimizer

    for name in [args.optimizer] + ([args.compare] if args.compare else []):
        err = check_optimizer(name)
        if err:
            return err
    return None


#: the predecessor's ``examples/train_gpt.py`` flags: old flag -> (new flags, what changed);
#: ``{}`` in a new flag is the old flag's value
LEGACY_FLAGS = {
    "--seq-length": (["--context", "{}"], "the sequence length is --context"),
    "--save-dir": (["--save", "{}/checkpoint.pt", "--out", "{}"],
                   "the checkpoint is --save PATH, the summary and plot go to --out DIR"),
    "--num-workers": ([], "the data is in memory: no loader workers, the flag has no effect"),
    "--no-mixed-precision": (["--amp", "off"], "precision is --amp auto|bf16|off"),
}


def translate_legacy_flags(argv: list[str], prog: str) -> tuple[list[str], list[str]]:
    """Rewrite the predecessor's flags (:data:`LEGACY_FLAGS`) into today's.

    Returns ``(argv, notes)``: the new command line and one deprecation line per old
    flag (``"train_gpt.py: --seq-length 64 is deprecated: ... use --context 64"``).
    Both ``--flag value`` and ``--flag=value`` are read; other arguments pass unchanged.

    Example::

        >>> from muonfx.cli.args import translate_legacy_flags
        >>> translate_legacy_flags(["--seq-length", "64", "--steps", "5"], "train_gpt.py")[0]
        ['--context', '64', '--steps', '5']
    """
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if arg == "--":
            out += argv[i:]
            break
        if flag not in LEGACY_FLAGS:
            out.append(arg)
            i += 1
            continue
        new, why = LEGACY_FLAGS[flag]
        takes_value = flag != "--no-mixed-precision"
        if takes_value and not eq:
            if i + 1 >= len(argv):
                out.append(arg)  # argparse's own error ("expected one argument") follows
                i += 1
                continue
            value = argv[i + 1]
            i += 1
        i += 1
        replaced = [part.replace("{}", value) for part in new]
        out += replaced
        old = f"{flag} {value}" if takes_value else flag
        notes.append(f"{prog}: {old} is deprecated ({why}); "
                     + (f"use {' '.join(replaced)}" if replaced else "dropping it"))
    return out, notes
