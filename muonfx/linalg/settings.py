"""The settings of the matrix work, as a value: :class:`MatrixSettings`.

The default Newton-Schulz dtype, the batch budget of each device type and the switch of
the symmetric Triton products have process-wide defaults
(:func:`muonfx.linalg.set_default_ns_dtype` and ``MUONFX_NS_DTYPE``,
:func:`muonfx.linalg.set_batch_bytes`, :func:`muonfx.linalg.triton_ns.set_enabled` and
``MUONFX_TRITON_NS``). :meth:`MatrixSettings.capture` reads them once into a frozen
value, and whoever runs a step passes that value down explicitly: as the extra argument
``matrix_settings`` of a transform's update (:data:`EXTRA_ARG`, see
:mod:`muonfx.core.contract`), which :func:`muonfx.newton_schulz` hands to
:func:`muonfx.seam.map_matrices` (the batch budget, also of the DTensor exchange) and to
:class:`muonfx.linalg.NewtonSchulz` (the dtype, the Triton switch). Nothing is written to
a module while a step runs, so two optimizers stepping in two threads each compute with
their own settings. A transform called without it reads the process defaults (the
dtype when it was built, the rest when it runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from . import batching, precision, triton_ns

__all__ = ["MatrixSettings", "EXTRA_ARG"]

#: the name of the extra argument that carries a step's :class:`MatrixSettings`
EXTRA_ARG = "matrix_settings"


@dataclass(frozen=True)
class MatrixSettings:
    """The settings of a step's matrix work (see the module doc).

    Attributes:
        ns_dtype: the default Newton-Schulz dtype pinned for the process
            (:func:`muonfx.linalg.set_default_ns_dtype`, ``MUONFX_NS_DTYPE``), or None
            (each device's own default).
        batch_bytes: ``((device type, bytes), ...)``: the batch budget of each device type
            (:func:`muonfx.linalg.set_batch_bytes`); other device types get the process's.
        triton: whether the symmetric Triton products are asked for
            (:func:`muonfx.linalg.triton_ns.set_enabled`, ``MUONFX_TRITON_NS``).
        stats: where the DTensor exchange also counts its traffic (the stepping
            optimizer's :class:`muonfx.distributed.CommStats`), or None; not compared.

    Example::

        >>> import torch, muonfx as mfx
        >>> from tensordict import TensorDict
        >>> from muonfx.linalg.settings import MatrixSettings
        >>> s = MatrixSettings(torch.float32, (("cpu", 1 << 20),), False)
        >>> s.budget("cpu")
        1048576
        >>> tx = mfx.newton_schulz()
        >>> g = TensorDict({"w": torch.randn(8, 16)}, [])
        >>> out, _ = tx.update(g, tx.init(g), None, matrix_settings=s)   # float32 Newton-Schulz
    """

    ns_dtype: torch.dtype | None
    batch_bytes: tuple[tuple[str, int], ...]
    triton: bool
    stats: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def capture(cls, device_types: Iterable[str] = (), stats: Any = None) -> "MatrixSettings":
        """The process defaults now, with the budgets of ``device_types`` (each device's
        own default dtype decided now as well: a compiled graph cannot read /proc/cpuinfo),
        and ``stats`` (see the attributes)."""
        device_types = sorted(set(device_types))
        for d in device_types:
            precision.device_ns_dtype(torch.device(d))
        return cls(precision.pinned_ns_dtype(), tuple((d, batching.batch_bytes(d)) for d in device_types),
                   triton_ns.requested(), stats)

    def budget(self, device_type: str) -> int:
        """The batch budget on ``device_type`` (the process's for a type not captured)."""
        for d, n in self.batch_bytes:
            if d == device_type:
                return n
        return batching.batch_bytes(device_type)
