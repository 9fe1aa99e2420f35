"""A small, reusable harness that runs a worker function on W gloo ranks (CPU).

The ranks are gloo on the CPU on every machine, GPUs or not (GPUs are hidden from
them): the tests compare with single-process CPU references. Multi-rank runs on GPUs
(NCCL, one GPU per rank) are ``muonfx train --fsdp`` and ``examples/fsdp_muon.py``.

    results = run_world(worker, world_size, *args, timeout=120, **kwargs)

* ``worker`` is a *top-level* (picklable) function ``worker(rank, world_size, *args,
  **kwargs)``; it runs in a fresh ``spawn``-ed process per rank, inside an initialised
  gloo process group (rendezvous through a ``FileStore`` in a temporary directory,
  collective timeout 60 s, or ``collective_timeout``, so a mismatched collective errors
  instead of hanging).
* Each rank's return value is ``torch.save``-d and handed back: ``results[rank]``.
* If a rank raises, its traceback is re-raised in the parent as :class:`RankError`
  (the other ranks get a few seconds to finish or fail, then are killed).
* If the ranks do not all finish within ``timeout`` seconds, every rank is killed and
  :class:`WorldTimeout` is raised: a hang fails the test instead of stalling it.
* ``destroy_process_group()`` always runs at the end of a rank (gloo aborts the
  process at exit otherwise).
"""

from __future__ import annotations

import os

# bf16 matmul on CPUs whose VM forbids AMX dies with SIGILL unless oneDNN is capped;
# must be set before torch is imported in a worker process.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

__all__ = ["run_world", "RankError", "WorldTimeout", "COLLECTIVE_TIMEOUT_S"]

#: gloo's per-collective timeout inside the workers.
COLLECTIVE_TIMEOUT_S = 60
#: after the first rank fails, how long the others get before they are killed.
GRACE_S = 5.0


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


class WorldTimeout(RuntimeError):
    """The world did not finish in time; every rank was killed."""


def _entry(fn: Callable[..., Any], rank: int, world_size: int, workdir: str, args: tuple, kwargs: dict,
           collective_timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    # The worlds are gloo on the CPU whatever the machine: hide GPUs from the ranks (before
    # anything initialises CUDA), so that no default (FSDP2's mesh, torch.accelerator) picks
    # one and W ranks never share a GPU. The workers also name CPU meshes explicitly.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)  # W ranks share few cores; keeps runs fast and reproducible
    err_path = os.path.join(workdir, f"error_{rank}.txt")
    code = 0
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        try:
            result = fn(rank, world_size, *args, **kwargs)
            tmp_path = os.path.join(workdir, f"result_{rank}.pt.tmp")
            torch.save(result, tmp_path)
            os.replace(tmp_path, os.path.join(workdir, f"result_{rank}.pt"))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (atexit handlers of torch/gloo)


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: float = COLLECTIVE_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return
    the ranks' results in rank order. ``collective_timeout``: the process group's timeout
    (seconds). See the module docstring."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    workdir = tempfile.mkdtemp(prefix="mfx_world_")
    ctx = tmp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, workdir, args, kwargs, collective_timeout), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            failed = any(p.exitcode not in (None, 0) for p in procs)
            now = time.monotonic()
            if failed and first_failure is None:
                first_failure = now
            if first_failure is not None and now - first_failure > GRACE_S:
                break
            if now > deadline:
                for p in alive:
                    p.kill()
                for p in alive:
                    p.join(5)
                errors = _errors(workdir, world_size)
                raise WorldTimeout(
                    f"world of {world_size} ranks did not finish in {timeout:.0f}s; killed ranks "
                    f"{[procs.index(p) for p in alive]}" + (f"\n{RankError(errors)}" if errors else "")
                )
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        errors = _errors(workdir, world_size)
        for r, p in enumerate(procs):
            if p.exitcode != 0 and r not in errors:
                errors[r] = f"exited with code {p.exitcode} (killed, crashed or aborted) without a Python traceback"
        if errors:
            raise RankError(errors)
        return [torch.load(os.path.join(workdir, f"result_{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _errors(workdir: str, world_size: int) -> dict[int, str]:
    out = {}
    for r in range(world_size):
        path = os.path.join(workdir, f"error_{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                out[r] = f.read()
    return out


# ---------------------------------------------------------------------------
# workers for the harness's own tests (top-level so that spawn can pickle them)
# ---------------------------------------------------------------------------


def selftest_one_rank_fails(rank: int, world_size: int) -> int:
    """The last rank raises; the others wait in a barrier it never joins."""
    if rank == world_size - 1:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return rank


def selftest_hang(rank: int, world_size: int) -> int:
    """Rank 0 waits in a collective nobody else joins; the others never get there."""
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)
    return rank
