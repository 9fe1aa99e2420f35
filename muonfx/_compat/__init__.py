"""The only code that touches other libraries' private fields, one module per library:
:mod:`muonfx._compat.tensordict` and :mod:`muonfx._compat.dtensor`. Each decides once
whether the installed version has the layout it reads, takes the public API where it has
not, and names the versions it was checked against (``tests/test_compat.py``).

These modules import torch and tensordict only (never DTensor code at import)."""
