"""Train a GPT with Muon: the predecessor's ``examples/train_gpt.py``, on ``muonfx train``.

    python examples/train_gpt.py --model gpt2 --epochs 3                       # one GPU (or the CPU: slow)
    torchrun --nproc_per_node=4 examples/train_gpt.py --model gpt2 --fsdp --epochs 3
    python examples/train_gpt.py --model tiny --steps 300                      # about 2-3 min of one CPU core
    python examples/train_gpt.py --model tiny --epochs 0.5 --compare adamw

It is ``muonfx train`` (same options, same code: ``muonfx.cli``) plus ``--epochs``.
The data is the Python standard library's own sources (character-level, cached
under ~/.cache/muonfx); ``--model`` is tiny (4x128, the default), small (6x256) or
gpt2 (the GPT-2 124M configuration, 12x768, context 1024); the optimizer is Muon on
the hidden matrices with AdamW on embeddings, head and norms (``--optimizer``).

Epochs to steps: batches are random windows of the training split, so an epoch is
counted in tokens: one epoch is ``ceil(train_tokens / (batch_size * context))``
steps, the number of steps that draws as many tokens as the split holds
(4,228,452 tokens on CPython 3.11: 1033 steps of tiny at batch 32 x 128, 130
steps of gpt2 at 32 x 1024). ``--epochs`` may be fractional; ``--steps`` wins
over ``--epochs``. Under ``--fsdp`` the batch is the global one (all ranks).

The predecessor's flags still work, each with a deprecation line: ``--seq-length T``
is ``--context T``, ``--save-dir DIR`` is ``--save DIR/checkpoint.pt --out DIR``,
``--no-mixed-precision`` is ``--amp off``, ``--num-workers`` is ignored (the data is
in memory).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from muonfx.cli import Parser
from muonfx.cli.args import DEFAULTS, add_train_args, translate_legacy_flags
from muonfx.cli.corpus import load_corpus
from muonfx.cli.model import MODELS
from muonfx.cli.train_cmd import train_command

PROG = "train_gpt.py"


def epochs_to_steps(epochs: float, train_tokens: int, batch_size: int, context: int) -> int:
    """``ceil(epochs * train_tokens / (batch_size * context))``, at least 1."""
    return max(1, math.ceil(epochs * train_tokens / (batch_size * context)))


def epochs_line(epochs: float, train_tokens: int, batch_size: int, context: int) -> str:
    """What ``--epochs`` became, with the rounding up said.

    Example::

        >>> print(epochs_line(3, 4_228_452, 32, 1024))
        --epochs 3: 3 x 4,228,452 training tokens / (32 x 1024 per step) = 387.13 steps, rounded up -> --steps 388
    """
    exact = epochs * train_tokens / (batch_size * context)
    steps = epochs_to_steps(epochs, train_tokens, batch_size, context)
    return (f"--epochs {epochs:g}: {epochs:g} x {train_tokens:,} training tokens / ({batch_size} x {context} per step) "
            f"= {exact:.2f} steps, {'rounded up -> ' if steps != exact else ''}--steps {steps}")


def main(argv: list[str] | None = None) -> int:
    argv, notes = translate_legacy_flags(list(sys.argv[1:] if argv is None else argv), PROG)
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(note, file=sys.stderr, flush=True)
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=float, metavar="E",
                   help=f"train for E epochs of the training split's tokens (see below); "
                        f"default: --steps {DEFAULTS['steps']}")
    add_train_args(p)
    args = p.parse_args(argv)
    if args.epochs is not None and args.steps is None:
        if args.epochs <= 0:
            p.error(f"--epochs must be positive, got {args.epochs}")
        model = args.model or DEFAULTS["model"]
        batch = args.batch_size or DEFAULTS["batch_size"]
        context = args.context or MODELS[model].context
        corpus = load_corpus(args.cache_dir, use_cache=not args.no_cache)
        args.steps = epochs_to_steps(args.epochs, corpus.split, batch, context)
        if os.environ.get("RANK", "0") == "0":
            print(epochs_line(args.epochs, corpus.split, batch, context), flush=True)
    return train_command(args, argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
