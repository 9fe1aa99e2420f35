"""The distributed Muon step on paper, W = 8 to 1024 ranks (no GPU, no communication).

    python benchmarks/fsdp_scale.py                 # Llama-1B-like and 8B-like matrix sets
    python benchmarks/fsdp_scale.py --tokens 2e6 --mfu 0.35

For each world size the script builds muonfx's own exchange plan for FSDP2 (every
hidden matrix ``Shard(0)`` over W ranks; :func:`muonfx.distributed.plan.plan_exchange`,
the pure function the ranks run) and reads off, per rank: the bytes it sends (the
worst rank), the Newton-Schulz flops it owns (the worst rank) and the number of
all-to-alls (two per bucket of 256 MiB of whole matrices per owner, the GPU budget).
Then it prices them with published figures (assumptions, not measurements):

* NVLink 4 (H100 SXM): 450 GB/s per direction per GPU, within a node of 8;
* InfiniBand NDR: 400 Gb/s = 50 GB/s per direction per GPU, across nodes;
* an all-to-all costs ``bytes leaving the node / 50 GB/s + bytes inside / 450 GB/s +
  W * 5 us`` (a fixed cost per peer message), the forward and backward ones alike;
* Newton-Schulz: 5 iterations of ``4 a^2 b + 2 a^3`` flops per ``a x b`` matrix
  (``a <= b``) at 60 % of the measured 780 TFLOP/s bf16 GEMM peak of an H100 (the
  batched efficiencies measured on one were 48-73 % for these shapes);
* the training step: ``6 N T`` flops for ``T`` tokens per step over all ranks at
  ``--mfu`` of the 989 TFLOP/s bf16 peak.

The optimizer's time is taken as NS + communication with no overlap (an upper bound:
the exchange overlaps the next bucket's transfer with this bucket's work).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from muonfx.distributed.layout import stack_layout  # noqa: E402
from muonfx.distributed.plan import plan_exchange  # noqa: E402

NVLINK = 450e9  # bytes/s per direction per GPU (H100 SXM, NVLink 4)
IB = 50e9  # bytes/s per direction per GPU (NDR 400 Gb/s)
PER_PEER = 5e-6  # seconds per peer message in an all-to-all (assumed)
GEMM = 780e12 * 0.60  # effective bf16 FLOP/s of batched Newton-Schulz on an H100
PEAK = 989e12  # bf16 dense peak of an H100 SXM
NODE = 8
BUDGET = 256 << 20  # muonfx's GPU budget: bytes of whole matrices per owner and bucket
NS_STEPS = 5

#: (name, total parameters N, layers, matrices per layer as (rows, cols))
SETS = {
    "Llama-1B-like": (1.1e9, 22, [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048),
                                  (5632, 2048), (5632, 2048), (2048, 5632)]),
    "8B-like": (8.0e9, 32, [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
                            (14336, 4096), (14336, 4096), (4096, 14336)]),
}


def model(name: str, W: int, tokens: float, mfu: float) -> dict:
    N, layers, shapes = SETS[name]
    mats = [s for _ in range(layers) for s in shapes]
    lays = [stack_layout((1, m, n), (W,), [("S", 1)]) for m, n in mats]
    plan = plan_exchange(lays, [list(range(W))] * len(lays), W, 2, BUDGET)
    sent = plan.bytes_sent()
    worst = max(range(W), key=lambda r: sent[r])
    # the worst rank's traffic, split into what stays in its node and what leaves it
    node = worst // NODE
    inside = outside = 0
    for mp in plan.matrices:
        for p in mp.sources:
            if p.rank == worst:
                inside, outside = (inside + p.numel * 2, outside) if mp.owner // NODE == node else \
                    (inside, outside + p.numel * 2)
        if mp.owner == worst:
            for p in mp.targets:
                inside, outside = (inside + p.numel * 2, outside) if p.rank // NODE == node else \
                    (inside, outside + p.numel * 2)
    collectives = 2 * plan.buckets
    comm = outside / IB + inside / NVLINK + collectives * W * PER_PEER
    ns = max(plan.loads()) * NS_STEPS / GEMM
    E = sum(m * n for m, n in mats)
    train = 6 * N * tokens / (W * mfu * PEAK)
    return dict(W=W, sent=sent[worst], floor=2 * (W - 1) / W ** 2 * E * 2, gather=(W - 1) / W * E * 2,
                owners=sum(1 for c in plan.owned() if c), buckets=plan.buckets, ns=ns, comm=comm,
                train=train, share=(ns + comm) / (train + ns + comm), matrices=len(mats), one_gpu=E)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--tokens", type=float, default=4 * 2 ** 20, help="tokens per training step, all ranks")
    ap.add_argument("--mfu", type=float, default=0.40, help="model FLOP utilisation of the training step")
    args = ap.parse_args(argv)
    for name in SETS:
        print(f"\n{name}: {len(SETS[name][2]) * SETS[name][1]} matrices; {args.tokens / 2 ** 20:g}M tokens per "
              f"step at {args.mfu:.0%} MFU")
        print(f"{'W':>5} {'sent MB':>9} {'floor MB':>9} {'sent/floor':>10} {'gather MB':>10} {'owners':>7} "
              f"{'a2a':>4} {'NS ms':>7} {'comm ms':>8} {'train ms':>9} {'opt share':>10}")
        for W in args.worlds:
            r = model(name, W, args.tokens, args.mfu)
            print(f"{W:>5} {r['sent'] / 1e6:9.1f} {r['floor'] / 1e6:9.1f} {r['sent'] / r['floor']:10.2f} "
                  f"{r['gather'] / 1e6:10.1f} {r['owners']:>7} {2 * r['buckets']:>4} {r['ns'] * 1e3:7.2f} "
                  f"{r['comm'] * 1e3:8.2f} {r['train'] * 1e3:9.1f} {r['share']:10.2%}")


if __name__ == "__main__":
    main()
