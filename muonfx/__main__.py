"""``python -m muonfx`` (and ``torchrun ... -m muonfx train --fsdp``): the ``muonfx`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
