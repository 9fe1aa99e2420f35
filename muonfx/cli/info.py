"""``muonfx info``: versions, devices, distributed backends, and whether bf16 matmul works.

The bf16 check runs in a subprocess: on CPUs whose virtual machine forbids AMX
instructions, oneDNN's bf16 kernels die with SIGILL (killing the process), unless
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` is set before torch is imported.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import signal
import subprocess
import sys

__all__ = ["run_info", "bf16_matmul_check", "ns_dtype_advice"]

WORKAROUND = "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"

_PROBE = """
import torch
a = torch.randn(512, 512).to(torch.bfloat16)
b = torch.nn.functional.linear(a, a)
c = (a @ a).float()
assert torch.isfinite(c).all() and torch.isfinite(b.float()).all()
print("ok")
"""


def _probe(env: dict) -> tuple[bool, str]:
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if p.returncode == 0 and p.stdout.strip().endswith("ok"):
        return True, "works"
    if p.returncode < 0:
        try:
            sig = signal.Signals(-p.returncode).name
        except ValueError:
            sig = f"signal {-p.returncode}"
        return False, f"the process died with {sig}"
    tail = (p.stderr.strip().splitlines() or ["?"])[-1]
    return False, f"failed: {tail}"


def bf16_matmul_check() -> list[str]:
    """Lines describing CPU bf16 matmul, as this environment runs it and with the workaround."""
    env = dict(os.environ)
    set_now = env.get("ONEDNN_MAX_CPU_ISA")
    ok, what = _probe(env)
    where = f"with ONEDNN_MAX_CPU_ISA={set_now} (set here)" if set_now else "as this environment is"
    lines = [f"bf16 matmul (CPU) {where}: {what}"]
    if set_now:
        bare = {k: v for k, v in env.items() if k != "ONEDNN_MAX_CPU_ISA"}
        ok_bare, what_bare = _probe(bare)
        lines.append(f"bf16 matmul (CPU) without ONEDNN_MAX_CPU_ISA: {what_bare}")
        if not ok_bare and ok:
            lines.append(f"  -> keep {WORKAROUND} set before Python starts (this CPU's VM forbids AMX)")
    elif not ok:
        ok_fix, what_fix = _probe({**env, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
        lines.append(f"bf16 matmul (CPU) with {WORKAROUND}: {what_fix}")
        if ok_fix:
            lines.append(f"  -> export {WORKAROUND} before running bf16 on this CPU (its VM forbids AMX); "
                         "muonfx train computes in float32 on CPUs and does not need it")
    if ok:
        rates = _speed_probe(env)
        if rates is not None:
            lines.append(ns_dtype_advice(*rates))
    return lines


_SPEED_PROBE = """
import time, torch
def rate(dtype):
    a = torch.randn(4, 768, 768).to(dtype)
    torch.bmm(a, a)
    t = time.perf_counter()
    for _ in range(3):
        torch.bmm(a, a)
    return 3 * 4 * 2 * 768 ** 3 / (time.perf_counter() - t) / 1e9
print("rates", rate(torch.float32), rate(torch.bfloat16))
"""


def _speed_probe(env: dict) -> tuple[float, float] | None:
    """float32 and bf16 ``bmm`` GFLOP/s in a subprocess (None if it fails)."""
    try:
        p = subprocess.run([sys.executable, "-c", _SPEED_PROBE], env=env, capture_output=True, text=True, timeout=120)
        words = p.stdout.split()
        i = words.index("rates")
        return float(words[i + 1]), float(words[i + 2])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def ns_dtype_advice(f32: float, bf16: float) -> str:
    """The measured matmul rates next to muonfx's default Newton-Schulz dtype on this CPU
    (:func:`muonfx.linalg.cpu_ns_choice`), and a word where the two disagree."""
    import torch

    from ..linalg import cpu_ns_choice

    head = f"matmul (CPU): float32 {f32:.0f} GFLOP/s, bf16 {bf16:.0f} GFLOP/s"
    faster = "bf16" if bf16 > 1.3 * f32 else "float32"
    choice = cpu_ns_choice()
    default = "bf16" if choice.dtype == torch.bfloat16 else "float32"
    line = f"{head}\nNewton-Schulz default (CPU): {default} ({choice.reason})"
    if faster == default:
        return f"{line}; measured: {faster} is the faster one here"
    return (f"{line}\n  -> but {faster} measured faster here (a busy machine can blur this): "
            f"export MUONFX_NS_DTYPE={'bfloat16' if faster == 'bf16' else 'float32'} or pass "
            f"ns_dtype=torch.{'bfloat16' if faster == 'bf16' else 'float32'} to use it")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    """An installed package's version, without importing it (tensordict's import alone
    takes seconds: it imports torch._dynamo)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def run_info(args) -> int:
    import torch
    import torch.distributed as dist

    from .. import __file__ as pkg_file, __version__
    from .bench import find_benchmarks
    from .corpus import default_cache_dir

    print(f"muonfx      {__version__} ({os.path.dirname(pkg_file)})")
    print(f"torch       {torch.__version__}")
    print(f"tensordict  {_version('tensordict')}")
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"platform    {platform.platform()}")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    print(f"cpu         {os.cpu_count()} cores ({usable} usable), torch threads {torch.get_num_threads()}, "
          f"{_cpu_name()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            pr = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}      {pr.name}, {pr.total_memory / 2**30:.0f} GiB, capability {pr.major}.{pr.minor}, "
                  f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    else:
        print(f"cuda        none (torch built with CUDA {torch.version.cuda})" if torch.version.cuda
              else "cuda        none (CPU-only torch build)")
    if dist.is_available():
        backends = {n: getattr(dist, f"is_{n}_available", lambda: False)() for n in ("gloo", "nccl", "mpi", "ucc")}
        print("distributed " + ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in backends.items()))
    else:
        print("distributed not available in this torch build")
    extras = []
    for mod in ("tqdm", "matplotlib"):
        try:
            m = __import__(mod)
            extras.append(f"{mod} {getattr(m, '__version__', '?')}")
        except ImportError:
            extras.append(f"{mod} missing")
    print("optional    " + ", ".join(extras))
    bench = find_benchmarks()
    print(f"benchmarks  {bench if bench else 'not found (installed package; they live in the source repository)'}")
    print(f"cache       {args.cache_dir or default_cache_dir()}")
    from ..linalg import cpu_ns_choice
    from ..linalg.precision import ENV, pinned_ns_dtype

    choice = cpu_ns_choice()
    try:
        pinned, env_error = pinned_ns_dtype(), None
    except ValueError as e:  # every optimizer would refuse it: say so, never "overrides"
        pinned, env_error = None, str(e)
    print(f"ns dtype    CPU {str(choice.dtype).replace('torch.', '')} ({choice.reason})"
          + ("; CUDA bfloat16" if torch.cuda.is_available() else "")
          + (f"; {ENV}={os.environ[ENV]} overrides it" if pinned is not None and os.environ.get(ENV) else "")
          + (f"; {ENV}={os.environ[ENV]!r} is invalid (last line)" if env_error else ""))
    from ..linalg import SPECTRAL_MIN_DIM

    if choice.dtype == torch.bfloat16:
        auto = "the Gram iteration on rectangular m x n matrices (bf16, restarting every 3 steps, where n > 1.5 m)"
    else:
        auto = (f"float32 at bf16's accuracy: the spectral form (eigh of X X^T) on matrices whose smaller side is at "
                f"least {SPECTRAL_MIN_DIM}, the Gram iteration on smaller rectangular m x n ones (n > 1.2 m)")
    print("ns method   standard (torch.optim.Muon's iteration; the default); ns_method='auto' takes " + auto)
    if not torch.cuda.is_available():
        cuda_products = "no GPU here"
    elif importlib.util.find_spec("triton") is None:
        cuda_products = "torch's (Triton not installed)"
    else:
        from ..linalg import triton_ns

        try:
            asked = triton_ns.requested()
        except ValueError as e:
            asked = None
            cuda_products = f"torch's batched products ({e})"
        if asked is not None:
            cuda_products = ("symmetric Triton products, asked for (MUONFX_TRITON_NS / triton_ns.set_enabled), "
                             "each shape checked against torch's products on first use" if asked else
                             "torch's batched products (the default; MUONFX_TRITON_NS=1 asks for the symmetric "
                             "Triton products, checked against torch's per shape)")
    print(f"ns products CUDA: {cuda_products}")
    if args.no_bf16_check:
        print("bf16        not checked (--no-bf16-check)")
    else:
        for line in bf16_matmul_check():
            print(line)
    if env_error:
        print(f"muonfx info: error: {env_error}", file=sys.stderr)
        return 2
    return 0
