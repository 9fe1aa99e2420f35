"""The muonfx command: train, info, bench.

    muonfx train                         # tiny GPT on the Python stdlib, Muon + AdamW, 300 steps
    muonfx train --compare adamw         # the same run with AdamW too; loss.png + summary.json
    muonfx train --optimizer adamw --lr 1e-2 --steps 300
    muonfx train --steps 1000 --save ck.pt --stop-at 500    # later: muonfx train --resume ck.pt
    torchrun --nproc_per_node=2 -m muonfx train --fsdp      # FSDP2 (gloo on CPU, NCCL on GPUs)
    muonfx info                          # versions, devices, backends, bf16 check
    muonfx bench [--only fsdp_step]      # the repository's benchmarks/*.py

Also ``python -m muonfx ...``. Each module of this package stays small: ``args``
(options), ``corpus`` (data), ``model`` (GPT), ``optimizers`` (``--optimizer``),
``train`` (the loop), ``checkpoint``, ``report`` (summary, plot), ``runtime``
(device, FSDP), ``progress``, ``info``, ``bench``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

__all__ = ["main", "build_parser", "Parser"]


class Parser(argparse.ArgumentParser):
    """argparse, with errors as one line: ``muonfx train: error: ... (see --help)``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from .args import add_train_args

    p = Parser(prog="muonfx", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n".join(__doc__.split("\n\n")[1].splitlines()))
    from .. import __version__

    p.add_argument("--version", action="version", version=f"muonfx {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,info,bench}", parser_class=Parser)
    t = sub.add_parser("train", help="train a small GPT on the Python standard library's sources",
                       description="Train a character-level GPT on this Python's standard library sources with a "
                                   "muonfx optimizer; print losses, write summary.json (and loss.png with --compare).")
    add_train_args(t)
    i = sub.add_parser("info", help="versions, devices, distributed backends, bf16 check",
                       description="Print muonfx/torch/tensordict/Python versions, CPUs and CUDA devices, "
                                   "distributed backends, and whether bf16 matmul works (checked in a subprocess).")
    i.add_argument("--no-bf16-check", action="store_true", help="skip the bf16 matmul subprocess")
    i.add_argument("--cache-dir", help=argparse.SUPPRESS)
    b = sub.add_parser("bench", help="run the repository's benchmarks/*.py and print their tables",
                       description="Run benchmarks/*.py of the source repository, one process each.")
    b.add_argument("--only", action="append", metavar="NAME", help="run only this benchmark (repeatable)")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument("--dir", help="a benchmarks directory other than <repo>/benchmarks")
    b.add_argument("script_args", nargs=argparse.REMAINDER, help="after --: arguments for every script")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (also used as ``sys.exit(main())``).

    Output read by a program that stops early (``muonfx info | head``) ends the command
    quietly with status 141 (128 + SIGPIPE), as it ends other Unix tools."""
    try:
        return _main(argv)
    except BrokenPipeError:
        try:  # the interpreter's last flush of stdout would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (a test's capture)
            pass
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "info":
        from .info import run_info

        return run_info(args)
    if args.command == "bench":
        from .bench import run_bench

        if args.script_args[:1] == ["--"]:
            args.script_args = args.script_args[1:]
        elif args.script_args:  # a word before any "--": a benchmark's name, not every script's argument
            print(f"muonfx bench: unexpected {args.script_args[0]!r}: name a benchmark with --only NAME "
                  "(muonfx bench --list names them); arguments for the scripts go after --", file=sys.stderr)
            return 2
        return run_bench(args)
    from .train_cmd import train_command

    return train_command(args, argv)
