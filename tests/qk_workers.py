"""Worker of ``tests/test_qk_clip_fsdp.py``: QK-clip on an FSDP2 model against one process."""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import muonfx as mfx  # noqa: E402

D, HEADS, VOCAB = 9, 3, 13  # c_attn has 27 rows: shards of 14 and 13, a head cut across ranks


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.recorder = None
        self.wte = nn.Embedding(VOCAB, D)
        # no q/k/v bias: a k-bias has a mathematically zero gradient that Adam amplifies from
        # rounding noise, and it shifts the logits (not the softmax): it would swamp parity
        self.c_attn = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        self.recorder.record("attn", q, k, is_causal=True)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.proj(y.transpose(1, 2).reshape(B, T, D)))

    def loss(self, idx):
        return nn.functional.cross_entropy(self(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


LAYOUT = {"attn": mfx.QKLayout.fused("c_attn.weight", heads=HEADS, head_dim=D // HEADS)}


def _build(tau: float):
    torch.manual_seed(0)
    model = Attn()
    with torch.no_grad():
        model.c_attn.weight.mul_(6.0)
    model.recorder = rec = mfx.QKLogitRecorder()
    return model, rec


def qk_clip_fsdp(rank: int, world: int, steps: int = 3, tau: float = 4.0) -> dict:
    torch.set_num_threads(1)
    ref, ref_rec = _build(tau)
    model, rec = _build(tau)
    fully_shard(model)
    opts = dict(muon_lr=0.05, adamw_lr=1e-2, ns_dtype=torch.float32)
    ref_opt = mfx.create_hybrid_optimizer(ref, qk_clip=mfx.QKClip(ref_rec, LAYOUT, tau=tau), **opts)
    opt = mfx.create_hybrid_optimizer(model, qk_clip=mfx.QKClip(rec, LAYOUT, tau=tau), **opts)
    gen = torch.Generator().manual_seed(1)
    clipped = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (2 * world, 7), generator=gen)
        ref.loss(idx).backward()
        clipped.append(int((ref_rec.maxima()["attn"] > tau).sum()))
        ref_opt.step()
        ref_opt.zero_grad()
        model.loss(idx[2 * rank:2 * rank + 2]).backward()  # this rank's share of the batch
        opt.step()
        opt.zero_grad()
    errors = {}
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor().detach()
        errors[n] = float((full - r.detach()).abs().max() / r.detach().abs().max())
    return {"errors": errors, "clipped": clipped, "reset": bool(torch.isneginf(rec.maxima()["attn"]).all())}


def missing_on_one_rank(rank: int, world: int) -> str:
    """Rank 1 records nothing: every rank raises the same error."""
    torch.set_num_threads(1)
    model, rec = _build(4.0)
    fully_shard(model)
    opt = mfx.create_hybrid_optimizer(model, qk_clip=mfx.QKClip(rec, LAYOUT, tau=4.0))
    idx = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(rank))
    model.loss(idx).backward()
    if rank == 1:
        rec.reset()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"


# -- 4 ranks: HSDP, tensor parallel, FSDP2 + TP, FSDP2 with uneven and empty shards ----------

GD = 8  # width
#: (query heads, key heads, head dim) per layout: grouped-query attention everywhere; tensor
#: parallelism over 4 ranks needs key heads divisible by 4
GQA_CFG = {"fsdp4": (4, 2, 3), "hsdp": (4, 2, 3), "tp": (8, 4, 2), "fsdp_tp": (4, 2, 3)}
LAYOUTS4 = tuple(GQA_CFG)
GQA_TAU = 4.0
GQA_OPTS = dict(muon_lr=0.05, adamw_lr=1e-2, ns_dtype=torch.float32)


def loud(heads: int) -> list[int]:
    """The heads whose query rows start large (clipped); the others stay under tau."""
    return [h for h in range(heads) if h % 4 in (0, 3)]


class GQAttn(nn.Module):
    """Separate q/k/v projections (grouped-query attention), o_proj after.

    Under tensor parallelism q/k/v are ``ColwiseParallel`` and o ``RowwiseParallel``: a tp
    rank computes attention for its own heads (``-1`` heads in the view), and records those
    (``QKClip(tp_mesh=...)`` places them). Row counts at (4, 2, 3): q 12, k 6, so over 4
    FSDP2 ranks k is 2, 2, 2, 0 (uneven, an empty shard, a head cut across ranks); over tp 2
    then dp 2 (``_StridedShard(0), Shard(0)``) q is 3 + 3 per tp rank and k 2 + 1."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.recorder, self.hd = None, head_dim
        self.wte = nn.Embedding(VOCAB, GD)
        self.q_proj = nn.Linear(GD, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(GD, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(GD, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, GD, bias=False)
        self.head = nn.Linear(GD, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        self.recorder.record("attn", q, k, is_causal=True)
        rep = q.shape[1] // k.shape[1]
        y = nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                       is_causal=True)
        return self.head(self.o_proj(y.transpose(1, 2).reshape(B, T, -1)))

    def loss(self, idx):
        return nn.functional.cross_entropy(self(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def gqa_layout(cfg) -> dict:
    heads, kv, hd = cfg
    return {"attn": mfx.QKLayout.separate("q_proj.weight", "k_proj.weight", heads=heads, head_dim=hd, kv_heads=kv)}


def _gqa_model(cfg):
    torch.manual_seed(0)
    model = GQAttn(*cfg)
    hd = cfg[2]
    with torch.no_grad():
        for h in loud(cfg[0]):
            model.q_proj.weight[h * hd:(h + 1) * hd].mul_(10.0)
        model.k_proj.weight.mul_(3.0)
    model.recorder = mfx.QKLogitRecorder()
    return model


def _gqa_layout(layout: str, world: int):
    """The model laid out as ``layout`` on 4 ranks, its QKClip keywords, and (part, parts):
    this rank's share of each batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _gqa_model(GQA_CFG[layout])
    tp_plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
               "o_proj": RowwiseParallel()}
    if layout == "fsdp4":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        return model, {}, dist.get_rank(), world
    if layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
        return model, {}, dist.get_rank(), world
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan)
        return model, {"tp_mesh": mesh}, 0, 1
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fully_shard(model, mesh=mesh["dp"])
        return model, {"tp_mesh": mesh["tp"]}, mesh["dp"].get_local_rank(), 2
    raise ValueError(layout)


def _gqa_batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 7), generator=gen) for _ in range(steps)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _gqa_reference(cfg, batches):
    """One process: the trained model and each step's statistics."""
    ref = _gqa_model(cfg)
    opt = mfx.create_hybrid_optimizer(ref, qk_clip=mfx.QKClip(ref.recorder, gqa_layout(cfg), tau=GQA_TAU),
                                      **GQA_OPTS)
    stats = []
    for idx in batches:
        ref.loss(idx).backward()
        stats.append(ref.recorder.maxima()["attn"])
        opt.step()
        opt.zero_grad()
    return ref, stats


def qk_clip_layouts(rank: int, world: int, steps: int = 4) -> dict:
    """Every layout against one process (each rank runs the reference itself), then the
    mismatches: a rank that recorded nothing, and tp ranks recording without ``tp_mesh``."""
    from muonfx._compat.dtensor import local_indices
    from muonfx.distributed.layout import placement_key, stack_layout

    torch.set_num_threads(1)
    batches = _gqa_batches(steps)
    refs = {cfg: _gqa_reference(cfg, batches) for cfg in set(GQA_CFG.values())}
    out: dict = {}
    for layout in LAYOUTS4:
        ref, ref_stats = refs[GQA_CFG[layout]]
        model, kw, part, parts = _gqa_layout(layout, world)
        clip = mfx.QKClip(model.recorder, gqa_layout(GQA_CFG[layout]), tau=GQA_TAU, **kw)
        opt = mfx.create_hybrid_optimizer(model, qk_clip=clip, **GQA_OPTS)
        res: dict = {"placements": {}, "local_rows": {}, "stat_errors": [],
                     "ref_stats": [s.tolist() for s in ref_stats]}
        for n in ("q_proj.weight", "k_proj.weight"):
            p = dict(model.named_parameters())[n]
            res["placements"][n] = [type(pl).__name__ for pl in p.placements]
            rows = local_indices(p, 0)
            res["local_rows"][n] = rows.tolist()
            # the rows agree with the exchange's own layout (muonfx.distributed.layout)
            keys = [k if k[0] == "R" else (k[0], k[1] + 1, *k[2:]) for k in map(placement_key, p.placements)]
            lay = stack_layout((1, *p.shape), tuple(p.device_mesh.shape), keys)  # [1, m, n]: dims move by one
            coord, pos = p.device_mesh.get_coordinate(), 0
            for c, size in zip(coord, p.device_mesh.shape):
                pos = pos * size + c
            want = [i for a, b in lay.pieces[pos][1] for i in range(a, b)]
            assert rows.tolist() == want, (layout, n, rows.tolist(), want)
        for idx, want in zip(batches, ref_stats):
            model.loss(idx.chunk(parts)[part]).backward()
            got = clip.statistics()["attn"]  # what the step is about to use: every head, on every rank
            res["stat_errors"].append(float(((got - want).abs() / want.abs()).max()))
            opt.step()
            opt.zero_grad()
        res["errors"] = {n: float((_full(p) - r.detach()).abs().max() / r.detach().abs().max())
                         for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters())}
        res["reset"] = bool(torch.isneginf(model.recorder.maxima()["attn"]).all())
        out[layout] = res
        dist.barrier()
    out["missing"] = {}
    for layout in ("fsdp_tp", "hsdp"):  # rank 2 records nothing
        out["missing"][layout] = _step_error(layout, world, lambda m: m.recorder.reset() if rank == 2 else None)
    # tensor parallel without tp_mesh: each rank records its own 2 heads of 8
    out["no_tp_mesh"] = _step_error("tp", world, None, tp_mesh=False)
    return out


def _step_error(layout: str, world: int, before_step, tp_mesh: bool = True) -> str:
    """The message of the step's error on this rank ("no error" without one; "changed: ..."
    where a parameter moved)."""
    model, kw, part, parts = _gqa_layout(layout, world)
    if not tp_mesh:
        kw = {}
    clip = mfx.QKClip(model.recorder, gqa_layout(GQA_CFG[layout]), tau=GQA_TAU, **kw)
    opt = mfx.create_hybrid_optimizer(model, qk_clip=clip, **GQA_OPTS)
    before = {n: _full(p).clone() for n, p in model.named_parameters()}
    model.loss(_gqa_batches(1)[0].chunk(parts)[part]).backward()
    if before_step is not None:
        before_step(model)
    try:
        opt.step()
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    unchanged = all(torch.equal(_full(p), before[n]) for n, p in model.named_parameters())
    dist.barrier()  # every rank is still in step with the others
    return msg if unchanged else "changed: " + msg
