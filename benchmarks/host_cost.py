"""Host cost of a step: Python calls and time, muonfx's MuonOptimizer vs torch.optim.Muon.

    python benchmarks/host_cost.py                  # every row below
    python benchmarks/host_cost.py --repeats 30     # more timed rounds

Where a step is host-bound (many small matrices; on a GPU most optimizer steps are),
what counts is the Python work per parameter. Measured side by side in one run:

* **calls**: every Python function call of one step (``sys.setprofile`` "call" events,
  every module: muonfx, torch, tensordict; C functions are not counted), for
  ``mfx.MuonOptimizer`` (its defaults: eager, nothing compiled) and
  ``torch.optim.Muon``, over 20 and 200 same-shape 64 x 64 matrices, keyed flat
  (``w0``, ``w1``, ...) and nested (``layers.0.weight``, ...); the calls each extra
  parameter adds from 20 to 200;
* **a missing gradient**: the calls of a full step before and after one step in which
  one of 200 matrices had no gradient (its counts stay one behind for good);
* **time**: the default step over 200 matrices of 32 x 32 (host-bound), medians of
  alternating rounds;
* **the chain, and a group in pieces**: the calls of a step of Muon's chain
  (``"fused": False``, the path of a transform without a lowering) over 200 matrices;
  the host time a piece adds: Lion (a chain) over 48 matrices of 64 x 64, whole and in
  48 pieces (a batch budget of one matrix), medians of alternating rounds;
* **DTensor**: the calls of a step whose matrices are DTensors (``Shard(0)`` on a
  one-rank gloo mesh in this process, what FSDP2 hands an optimizer), 20 and 200 of them,
  for ``mfx.TransformOptimizer(..., mfx.muon)`` and ``torch.optim.Muon``.

Targets: calls at 200 matrices <= 3x torch's; <= 10 more calls per parameter from 20 to
200, for plain tensors and for DTensors; after a missing gradient <= 1.15x the calls of before; time over 200 32 x 32
matrices <= 0.5x torch's.
"""

from __future__ import annotations

import argparse
import sys

import _common  # (sets ONEDNN_MAX_CPU_ISA before torch)
import torch

import muonfx as mfx


def calls(fn) -> int:
    """Python function calls (every module) made by ``fn()``."""
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def matrices(n: int, side: int, nested: bool, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.nn.Parameter(torch.randn(side, side, generator=gen))
        p.grad = torch.randn(side, side, generator=gen)
        out.append((f"layers.{i}.weight" if nested else f"w{i}", p))
    return out


def muonfx_opt(named):
    return mfx.MuonOptimizer(named, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)


def torch_opt(named):
    return torch.optim.Muon([p for _, p in named], lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)


def step_calls(make, n: int, side: int, nested: bool) -> int:
    opt = make(matrices(n, side, nested))
    opt.step()  # the state, the plan
    opt.step()
    return calls(opt.step)


def missing_gradient(n: int, side: int) -> tuple[int, int]:
    """Calls of a full step before, and after one step with one missing gradient."""
    named = matrices(n, side, False)
    opt = muonfx_opt(named)
    opt.step()
    opt.step()
    before = calls(opt.step)
    grad = named[0][1].grad
    named[0][1].grad = None
    opt.step()
    named[0][1].grad = grad
    opt.step()
    return before, calls(opt.step)


def dtensor_calls() -> dict[tuple[str, int], int]:
    """Calls of a step over 20 and 200 ``Shard(0)`` DTensor matrices (64 x 64) on a
    one-rank gloo mesh, muonfx and torch.optim.Muon."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        out = {}
        for n in (20, 200):
            for who in ("muonfx", "torch"):
                named = []
                for k, p in matrices(n, 64, False):
                    q = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
                    q.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
                    named.append((k, q))
                opt = (mfx.TransformOptimizer(named, mfx.muon, lr=0.02, weight_decay=0.1) if who == "muonfx"
                       else torch.optim.Muon([q for _, q in named], lr=0.02, weight_decay=0.1))
                opt.step()
                opt.step()
                out[who, n] = calls(opt.step)
        return out
    finally:
        dist.destroy_process_group()


def piece_cost(repeats: int, warmup: int) -> tuple[float, float]:
    """Seconds of a Lion step by its chain (``"fused": False``: the plan's lowering takes no
    pieces) over 48 matrices of 64 x 64, whole and in 48 pieces."""
    from muonfx.linalg import set_batch_bytes

    whole = mfx.TransformOptimizer(matrices(48, 64, False), mfx.lion, fused=False)
    held = set_batch_bytes(64 * 64 * 4, "cpu")
    try:
        pieces = mfx.TransformOptimizer(matrices(48, 64, False), mfx.lion, fused=False)
        pieces.step()  # its plan, in pieces, built under this budget
    finally:
        set_batch_bytes(held, "cpu")
    assert len(pieces.plan.groups[0].pieces) == 48, pieces.plan
    secs = _common.interleaved({"whole": whole.step, "pieces": pieces.step}, repeats, warmup, torch.device("cpu"))
    return secs["whole"], secs["pieces"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    rows = []
    checks = []
    for nested in (False, True):
        m = {n: step_calls(muonfx_opt, n, 64, nested) for n in (20, 200)}
        t = {n: step_calls(torch_opt, n, 64, nested) for n in (20, 200)}
        per = (m[200] - m[20]) / 180
        keys = "nested (layers.i.weight)" if nested else "flat (w0, w1, ...)"
        rows.append([keys, m[20], m[200], t[20], t[200], f"{m[200] / t[200]:.2f}", f"{per:.1f}",
                     f"{(t[200] - t[20]) / 180:.1f}"])
        if not nested:
            checks.append(("calls at 200 matrices <= 3x torch's", m[200] / t[200], 3.0))
            checks.append(("calls per extra parameter (20 -> 200) <= 10", per, 10.0))
    before, after = missing_gradient(200, 64)
    checks.append(("a full step after a missing gradient <= 1.15x the calls of before", after / before, 1.15))
    # time, host-bound: 200 matrices of 32 x 32
    named_m, named_t = matrices(200, 32, False), matrices(200, 32, False)
    om, ot = muonfx_opt(named_m), torch_opt(named_t)
    paths = {"muonfx": _common.settle(om), "torch": _common.settle(ot)}
    secs = _common.interleaved({"muonfx": om.step, "torch": ot.step}, args.repeats, args.warmup, torch.device("cpu"))
    checks.append(("time over 200 32 x 32 matrices <= 0.5x torch's", secs["muonfx"] / secs["torch"], 0.5))
    print(f"\nHost cost of a step: mfx.MuonOptimizer vs torch.optim.Muon ({_common.machine()})")
    print("Python function calls of one step (sys.setprofile 'call' events, every module), 64 x 64 matrices:")
    print(_common.table(["keys", "muonfx 20", "muonfx 200", "torch 20", "torch 200", "muonfx/torch at 200",
                         "muonfx per extra parameter", "torch per extra parameter"], rows))
    print(f"a full step's calls, 200 matrices: {before} before a step with one missing gradient, {after} after "
          f"({after / before:.3f}x)")
    print(f"time of a step over 200 matrices of 32 x 32 (median of {args.repeats} alternating rounds; muonfx path: "
          f"{paths['muonfx']}): muonfx {secs['muonfx'] * 1e3:.2f} ms, torch {secs['torch'] * 1e3:.2f} ms "
          f"({secs['muonfx'] / secs['torch']:.2f}x)")
    chain = step_calls(lambda named: mfx.TransformOptimizer([dict(params=named, fused=False)], mfx.muon, lr=0.02,
                                                             weight_decay=0.1), 200, 64, False)
    per_piece = piece_cost(args.repeats, args.warmup)
    print(f"the chain's step (\"fused\": False), 200 matrices: {chain} calls; a group in pieces (Lion's chain, 48 matrices "
          f"of 64 x 64): whole {per_piece[0] * 1e3:.2f} ms, in 48 pieces {per_piece[1] * 1e3:.2f} ms: "
          f"{(per_piece[1] - per_piece[0]) / 48 * 1e3:.3f} ms a piece")
    dt = dtensor_calls()
    checks.append(("DTensor calls per extra parameter (20 -> 200) <= 10", (dt["muonfx", 200] - dt["muonfx", 20]) / 180,
                   10.0))
    print("DTensor matrices (Shard(0), one gloo rank), 64 x 64, calls of one step:")
    print(_common.table(["", "20", "200", "per extra parameter"],
                        [[who, dt[who, 20], dt[who, 200], f"{(dt[who, 200] - dt[who, 20]) / 180:.1f}"]
                         for who in ("muonfx", "torch")]))
    print(_common.table(["target", "measured", "bound", "met"],
                        [[what, f"{got:.3f}", f"{bound:g}", "yes" if got <= bound else "NO"] for what, got, bound
                         in checks]))


if __name__ == "__main__":
    main()
