"""The default Newton-Schulz compute dtype of each device: the fastest accurate enough.

Newton-Schulz is a handful of matrix products. ``torch.optim.Muon`` runs them in
bfloat16 everywhere; muonfx runs them in bfloat16 where bfloat16 matmul is fast and in
float32 where it is not:

* CUDA: bfloat16 (tensor cores; several times float32's rate).
* CPU: decided once per process, bfloat16 where oneDNN's bf16 matmul is the faster one:

  - AMD and Arm CPUs that announce native bf16 (AVX512-BF16, Arm BF16) and whose
    ``ONEDNN_MAX_CPU_ISA`` leaves it on: bf16 (about 2x float32's rate on an AMD EPYC);
  - Intel CPUs: bf16 only with AMX (AMX-BF16 announced, oneDNN not capped below it, and a
    bf16 ``bmm`` that runs in a probe process: a VM that forbids AMX kills it with SIGILL,
    so the check can never kill the caller). Without AMX, oneDNN's AVX512-BF16 matmul ran
    slower than float32 (a Sapphire Rapids capped at ``AVX512_CORE_BF16``: 14.4 against
    8.8 ms for 1024 x 1024), so float32 there;
  - everywhere else float32 (bf16 would be emulated: about half float32's rate).

  No timing: the default must not depend on the machine's load.
* float64 input: float64 (a reference computation asked for it).
* any other device: float32.

Accuracy: bf16 Newton-Schulz differs from the exactly computed iteration by ~1e-2
relative (``benchmarks/newton_schulz.py --only restarts``), 10-40x less than the 5-step
schedule's own distance to the exact polar factor (0.09-0.45 by schedule and input,
``--only accuracy``), and is what ``torch.optim.Muon`` computes.

Override, in order of precedence: an explicit ``dtype=`` / ``ns_dtype=`` argument,
:func:`set_default_ns_dtype` (process-wide, e.g. in a test's ``conftest.py``), the
environment variable ``MUONFX_NS_DTYPE`` (``float32``, ``bfloat16``, ``float16`` or
``auto``). A :func:`muonfx.newton_schulz` transform reads the override once, when it is
built, so it computes the same function at every step; only the device's own choice (a
fact of the machine) is looked up when it runs. An optimizer captures the override when
its step plan is built and keeps it until the plan is rebuilt (:func:`held`).
``muonfx info`` prints the choice and why.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

import torch

__all__ = ["ns_dtype_for", "pinned_ns_dtype", "device_ns_dtype", "set_default_ns_dtype", "cpu_ns_choice",
           "CpuChoice", "ENV"]

ENV = "MUONFX_NS_DTYPE"
_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_override: torch.dtype | None = None
_cpu: "CpuChoice | None" = None


@dataclass(frozen=True)
class CpuChoice:
    """The CPU's Newton-Schulz dtype and the evidence for it (``muonfx info`` prints it)."""

    dtype: torch.dtype
    reason: str


def set_default_ns_dtype(dtype: torch.dtype | str | None) -> None:
    """Fix the default Newton-Schulz dtype of every device for this process.

    ``None`` (or ``"auto"``) returns to the per-device choice. An explicit ``dtype=``
    argument of :func:`muonfx.newton_schulz` or ``ns_dtype=`` of a preset still wins.

    Example::

        >>> import torch, muonfx
        >>> muonfx.linalg.set_default_ns_dtype(torch.float32)
        >>> muonfx.linalg.ns_dtype_for(torch.device("cpu"))
        torch.float32
        >>> muonfx.linalg.set_default_ns_dtype(None)
    """
    global _override
    _override = _parse(dtype, "set_default_ns_dtype(dtype)")


def _parse(value, where: str) -> torch.dtype | None:
    if value is None or value == "auto" or value == "":
        return None
    if isinstance(value, str):
        if value.lower() not in _NAMES:
            raise ValueError(f"{where}: unknown Newton-Schulz dtype {value!r}; "
                             f"use one of float32, bfloat16, float16 or auto")
        return _NAMES[value.lower()]
    if value not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{where}: Newton-Schulz needs a floating dtype "
                         f"(float32, bfloat16, float16 or float64), got {value}")
    return value


def ns_dtype_for(device: torch.device, input_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The Newton-Schulz compute dtype used when none is given (see the module docstring).

    Example::

        >>> import torch
        >>> from muonfx.linalg import ns_dtype_for
        >>> ns_dtype_for(torch.device("cpu"), torch.float64)
        torch.float64
    """
    if input_dtype == torch.float64:
        return torch.float64
    return pinned_ns_dtype() or device_ns_dtype(device)


def pinned_ns_dtype() -> torch.dtype | None:
    """The process-wide override in force now: :func:`set_default_ns_dtype`, else
    ``MUONFX_NS_DTYPE`` (``"auto"``: none); None when neither pins a dtype.
    :func:`muonfx.newton_schulz` reads it once, when it is built; an optimizer's step
    plan reads it when the plan is built and passes it to every step
    (:class:`muonfx.linalg.MatrixSettings`)."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV)
    return _env_dtype(env) if env else None


def device_ns_dtype(device: torch.device) -> torch.dtype:
    """The device's own choice, without overrides: bfloat16 on CUDA, :func:`cpu_ns_choice`
    on the CPU (a fact of the machine, decided once per process), float32 elsewhere."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        return cpu_ns_choice().dtype
    return torch.float32


@functools.lru_cache(maxsize=8)
def _env_dtype(value: str) -> torch.dtype | None:
    return _parse(value, f"the environment variable {ENV}")


def cpu_ns_choice(refresh: bool = False) -> CpuChoice:
    """The CPU's default Newton-Schulz dtype, decided once per process (cached)."""
    global _cpu
    if _cpu is None or refresh:
        _cpu = _decide_cpu(_cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"), platform.machine())
    return _cpu


def _cpu_flags() -> tuple[str, set[str]]:
    """(vendor, flags) from /proc/cpuinfo; empty where there is none."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if vendor and flags:
                    break
    except OSError:
        pass
    return vendor, flags


_NATIVE_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16, x86 AMX-BF16, Arm BF16


def _isa_cap_allows_bf16(cap: str | None) -> bool:
    """Whether oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``) leaves native bf16 kernels on."""
    if not cap:
        return True
    cap = cap.upper()
    return cap in ("ALL", "DEFAULT") or any(word in cap for word in ("BF16", "FP16", "AMX", "AVX10"))


def _may_pick_amx(vendor: str, machine: str, cap: str | None, flags: set[str] | None = None) -> bool:
    """Whether oneDNN might use AMX here: an Intel x86 CPU (announcing AMX-BF16, where the
    flags are given) with no cap below AMX."""
    if vendor != "GenuineIntel" or machine not in ("x86_64", "AMD64"):
        return False
    if flags is not None and "amx_bf16" not in flags:
        return False
    return not cap or cap.upper() in ("ALL", "DEFAULT") or "AMX" in cap.upper() or "AVX10" in cap.upper()


def _decide_cpu(cpu: tuple[str, set[str]], onednn_isa: str | None, machine: str,
                bf16_runs=None) -> CpuChoice:
    """The rule: bf16 where oneDNN's bf16 matmul is native and fast (AMD's and Arm's native
    bf16; Intel's only with AMX, after a subprocess check that the VM allows AMX); else
    float32.

    A flag rule, not a timing: the default must not change with the machine's load (a
    timing under load can flip it, and training would silently change numerics). On the
    CPUs measured, AMD's native bf16 matmul runs at about 2x float32, Intel's AVX512-BF16
    without AMX below float32, emulated bf16 at about half; ``muonfx info`` times both on
    the machine at hand.
    """
    vendor, flags = cpu
    if not _NATIVE_FLAGS & flags:
        return CpuChoice(torch.float32, "this CPU announces no native bf16 matmul "
                                        "(no avx512_bf16, amx_bf16 or bf16 flag): bf16 would be emulated")
    if not _isa_cap_allows_bf16(onednn_isa):
        return CpuChoice(torch.float32, f"ONEDNN_MAX_CPU_ISA={onednn_isa} turns native bf16 kernels off: "
                                        "bf16 would be emulated")
    if vendor == "GenuineIntel" and machine in ("x86_64", "AMD64"):
        if not _may_pick_amx(vendor, machine, onednn_isa, flags):
            why = (f"ONEDNN_MAX_CPU_ISA={onednn_isa} keeps AMX off" if "amx_bf16" in flags
                   else "this Intel CPU has no AMX")
            return CpuChoice(torch.float32, f"{why}: Intel's AVX512-BF16 matmul without AMX ran slower than float32")
        if not (bf16_runs or _bf16_runs_in_subprocess)():
            return CpuChoice(torch.float32, "bf16 matmul failed in a probe process (an AMX-capable CPU whose VM "
                                            "forbids AMX? ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 avoids the crash)")
        return CpuChoice(torch.bfloat16, "native bf16 matmul with AMX (checked in a probe process)")
    return CpuChoice(torch.bfloat16, "native bf16 matmul (" + ", ".join(sorted(_NATIVE_FLAGS & flags)) + ")")


_PROBE = """
import torch
a = torch.randn(2, 256, 256).to(torch.bfloat16)
print("ok" if torch.isfinite(torch.bmm(a, a).float()).all() else "nan")
"""


def _bf16_runs_in_subprocess() -> bool:
    """Whether a bf16 ``bmm`` runs in a fresh process (it may die of SIGILL there, not here)."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (subprocess.TimeoutExpired, OSError):
        return False
    return p.returncode == 0 and p.stdout.strip().endswith("ok")
