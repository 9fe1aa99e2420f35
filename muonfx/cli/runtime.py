"""Where a run executes: device, threads, and (with ``--fsdp``) the process group."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..distributed import pick_backend

__all__ = ["Runtime", "pick_backend", "setup", "teardown", "shard_model"]


@dataclass
class Runtime:
    device: torch.device
    fsdp: bool = False
    rank: int = 0
    world: int = 1
    backend: str | None = None
    amp: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over ranks (identity without --fsdp)."""
        if not self.fsdp:
            return t
        import torch.distributed as dist

        t = t.detach().clone()
        dist.all_reduce(t)
        return t / self.world


def auto_threads() -> int:
    """torch's thread count, less the cores other processes keep busy (1-minute load average).

    On a busy machine oversubscribed OpenMP threads make small models several times slower
    than one thread does; on a quiet one this is torch's own choice.
    """
    n = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
        free = cores - os.getloadavg()[0]
    except (AttributeError, OSError):
        return n
    return max(1, min(n, int(free + 0.5)))


def setup(device: str, fsdp: bool, threads: int, amp: str) -> Runtime:
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if fsdp and cuda:  # NCCL only with a GPU per rank on this machine; else gloo on the CPU
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        cuda = pick_backend(ranks, local)[0] == "nccl"
    torch.set_num_threads(threads or (torch.get_num_threads() if cuda else auto_threads()))
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for the float32 matmuls outside autocast
    if not fsdp:
        dev = torch.device("cuda") if cuda else torch.device("cpu")
        return Runtime(dev, amp=_amp(amp, dev))
    import torch.distributed as dist

    if cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if not threads and not cuda:  # every rank the same automatic count (the fewest): one rounding, which
        agreed = torch.tensor([torch.get_num_threads()])  # the checkpoint records and --resume reuses
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        torch.set_num_threads(int(agreed))
    return Runtime(dev, True, dist.get_rank(), dist.get_world_size(), backend, _amp(amp, dev))


def _amp(amp: str, dev: torch.device) -> bool:
    return amp == "bf16" or (amp == "auto" and dev.type == "cuda")


def teardown(rt: Runtime, completed: bool = False) -> None:
    """End a run: under FSDP, destroy the process group. Where every rank ``completed``
    its training, a barrier first: the other ranks used to destroy gloo's group while
    rank 0 still wrote the summary, and a rank could abort at exit ("terminate called
    without an active exception", seen once on a loaded CI machine). After an error no
    barrier (the other ranks may never come; torchrun stops them)."""
    if rt.fsdp:
        import torch.distributed as dist

        if dist.is_initialized():
            if completed:
                dist.barrier()
            dist.destroy_process_group()


def shard_model(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every transformer block, then the root (embeddings, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # the mesh names its device: FSDP2's default mesh is CUDA whenever a GPU exists,
    # also in a gloo run on the CPU
    mesh = init_device_mesh(rt.device.type, (rt.world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
