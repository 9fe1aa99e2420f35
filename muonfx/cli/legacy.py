"""``muon-fsdp``: the predecessor's command, kept as a pointer to ``muonfx``.

    muon-fsdp info            ->  muonfx info
    muon-fsdp check [--full]  ->  muonfx info (and the test suite: python -m pytest tests/)
    muon-fsdp <anything else> ->  muonfx <the same arguments>

Each call prints one line saying what it runs instead, then runs it.
"""

from __future__ import annotations

import sys

__all__ = ["main", "translate"]


def translate(argv: list[str]) -> tuple[list[str], str]:
    """``(muonfx argv, the deprecation line)`` for a ``muon-fsdp`` command line.

    Example::

        >>> from muonfx.cli.legacy import translate
        >>> translate(["check", "--full"])[0]
        ['info']
    """
    if argv[:1] == ["check"]:
        new = ["info"] + [a for a in argv[1:] if a != "--full"]
        extra = "; the full check is the test suite: python -m pytest tests/"
    else:
        new, extra = list(argv), ""
    shown = " ".join(["muonfx", *new])
    return new, f"muon-fsdp is now muonfx (also python -m muonfx): running '{shown}'{extra}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``muon-fsdp`` command."""
    from . import main as muonfx_main

    new, line = translate(list(sys.argv[1:] if argv is None else argv))
    print(line, file=sys.stderr, flush=True)
    return muonfx_main(new)
