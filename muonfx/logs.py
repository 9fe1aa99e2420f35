"""The ``muonfx`` logger, and saying a thing once.

Everything muonfx tells a user outside an error goes to the ``logging`` logger
``"muonfx"``: configure it as any other (``logging.getLogger("muonfx").setLevel(...)``).
"""

from __future__ import annotations

import logging

__all__ = ["log", "say_once"]

log = logging.getLogger("muonfx")

_said: set[str] = set()


def say_once(key: str, message: str, *args: object) -> None:
    """Log ``message`` on the ``muonfx`` logger: at WARNING the first time ``key`` is
    said in this process (so a user sees it without configuring logging), then at INFO.

    Example::

        >>> from muonfx.logs import say_once
        >>> say_once("example", "muonfx: said once at WARNING, then at INFO")
    """
    log.log(logging.INFO if key in _said else logging.WARNING, message, *args)
    _said.add(key)
