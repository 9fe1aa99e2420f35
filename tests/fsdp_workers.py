"""Worker functions and small models for ``tests/test_fsdp.py``.

Every ``task_*`` runs on every rank of a gloo world started by
:func:`dist_harness.run_world` (``world_main`` runs a list of them in one world, so
that one spawn serves many checks) and returns plain data (floats, dicts, tensors)
for the parent to assert on. Single-process references are computed in the worker,
on rank 0, with the same thread settings as the distributed run.
"""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

import muonfx as mfx  # noqa: E402
import muonfx.distributed as mdist  # noqa: E402

# ---------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm attention + MLP block. No q/k/v bias: a k-bias has a mathematically
    zero gradient that Adam amplifies from rounding noise, which would swamp parity."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v
        x = x + self.proj(a)
        return x + self.out(torch.relu(self.fc(x)))


class Net(nn.Module):
    """Tiny causal-free LM: embedding (AdamW), ``L`` blocks (Muon matrices), lm_head (AdamW).
    With d=24, V=37 the embedding/head rows (37) shard unevenly at W=2 and W=3."""

    def __init__(self, d: int = 24, V: int = 37, L: int = 2):
        super().__init__()
        self.V = V
        self.embed = nn.Embedding(V, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(L)])
        self.lm_head = nn.Linear(d, V, bias=False)

    def trunk(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, t):
        return self.lm_head(self.trunk(self.embed(t)))


class NetMixed(Net):
    """``Net`` plus a root-level hidden matrix ``mid``: with only the blocks sharded,
    the Muon group mixes DTensor (block) and plain (``mid``) matrices."""

    def __init__(self, d: int = 24, V: int = 37, L: int = 2):
        super().__init__(d, V, L)
        self.mid = nn.Linear(d, d)

    def forward(self, t):
        x = self.trunk(self.embed(t))
        return self.lm_head(x + torch.tanh(self.mid(x)))


class Odd(nn.Module):
    """Linears whose out_features shard unevenly or leave ranks empty:
    a 5 rows (W=2: 3+2, W=3: 2+2+1), b 2 rows (W=3: 1+1+0), c 4 rows (W=3: 2+2+0),
    d 8 rows (W=3: 3+3+2). The skip from ``x`` into ``d`` keeps d's gradient well
    conditioned (through the 2-wide bottleneck alone, NS amplifies rounding noise)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 5, bias=False)
        self.b = nn.Linear(5, 2)
        self.c = nn.Linear(2, 4)
        self.d = nn.Linear(4, 8)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))) + x[:, :4])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

MUON_HP = dict(lr=0.02, ns_dtype=torch.float32, weight_decay=0.01, adamw_lr=3e-3)


def make_muon(model: nn.Module):
    return mfx.TransformOptimizer(model.named_parameters(), mfx.muon_adamw, **MUON_HP)


def muon_adamw_gram_ns(lr: float = 0.02, weight_decay: float = 0.01, adamw_lr: float = 3e-3,
                       ns_dtype: torch.dtype = torch.float32) -> mfx.GradientTransformation:
    """``mfx.muon_adamw`` with the Gram Newton-Schulz iteration for rectangular matrices
    (``ns_method="auto"``; the default is the standard iteration)."""
    return mfx.partition({
        "muon": mfx.muon(lr, weight_decay=weight_decay, ns_dtype=ns_dtype, ns_method="auto"),
        "adamw": mfx.adamw(adamw_lr, (0.9, 0.95), 1e-8, 0.01),
    }, mfx.default_muon_labels)


def make_muon_gram(model: nn.Module):
    return mfx.TransformOptimizer(model.named_parameters(), muon_adamw_gram_ns, **MUON_HP)


def per_head_adam_ns(lr: float = 0.02, adamw_lr: float = 3e-3) -> mfx.GradientTransformation:
    """State kept per block: Adam inside ``blockwise`` on the fused qkv weights' 24-row
    heads (then Newton-Schulz per head), Muon on the other matrices, AdamW elsewhere."""
    def label(key, t):
        name = key if isinstance(key, str) else ".".join(key)
        if "qkv" in name:
            return "heads"
        return "adamw" if t.ndim < 2 or name.startswith(("embed", "lm_head")) else "muon"

    heads = mfx.chain(mfx.blockwise(mfx.chain(mfx.scale_by_adam(), mfx.newton_schulz(dtype=torch.float32)), 24),
                      mfx.scale_by_learning_rate(lr))
    return mfx.partition({"heads": heads, "muon": mfx.muon(lr, ns_dtype=torch.float32),
                          "adamw": mfx.adamw(adamw_lr)}, label)


def make_per_head(model: nn.Module):
    return mfx.TransformOptimizer(model.named_parameters(), per_head_adam_ns, lr=0.02)


OPTIMIZERS = {"muon": make_muon, "per_head": make_per_head}


def make_torch_adamw(model: nn.Module):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def lm_batches(steps: int, rows: int, V: int = 37, T: int = 9, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (rows, T), generator=g) for _ in range(steps)]


def lm_loss(model: Net, t: torch.Tensor) -> torch.Tensor:
    logits = model(t[:, :-1])
    return F.cross_entropy(logits.reshape(-1, model.V), t[:, 1:].reshape(-1))


def train_lm(model, opt, batches, rank: int = 0, world: int = 1) -> None:
    """One step per batch; under FSDP each rank takes its equal chunk of the global batch
    (FSDP2 averages gradients, so this equals the full-batch mean gradient)."""
    for t in batches:
        if world > 1:
            t = t.chunk(world)[rank]
        lm_loss(model, t).backward()
        opt.step()
        opt.zero_grad()


def cpu_mesh():
    """The world as a CPU mesh. Every ``fully_shard`` here names it (or another CPU mesh):
    FSDP2's default mesh is a CUDA one whenever a GPU exists, and these worlds are gloo
    on the CPU."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard_net(model: Net, mesh=None, root: bool = True) -> Net:
    if mesh is None:
        mesh = cpu_mesh()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def rel_errors(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-tensor ``||ref - got|| / ||ref||``."""
    assert set(ref) == set(got), (sorted(ref), sorted(got))
    return {n: ((ref[n] - got[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in ref}


def stats() -> dict:
    return dataclasses.asdict(mdist.comm_stats())


def sum_over_ranks(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


# ---------------------------------------------------------------------------
# 1. parity of a fully_shard-ed transformer with one process
# ---------------------------------------------------------------------------


def task_parity(rank: int, world: int, steps: int = 10, rows_per_rank: int = 4) -> dict:
    batches = lm_batches(steps, rows_per_rank * world)
    out: dict = {}
    for name, make in (("muon_adamw", make_muon), ("muon_adamw_gram_ns", make_muon_gram),
                       ("torch_adamw", make_torch_adamw)):
        mdist.comm_stats().reset()
        torch.manual_seed(0)
        model = shard_net(Net())
        opt = make(model)
        train_lm(model, opt, batches, rank, world)
        out[f"{name}_stats"] = stats()
        out[f"{name}_ortho_total"] = sum_over_ranks(mdist.comm_stats().matrices_orthogonalized)
        got = full_params(model)
        if rank == 0:
            torch.manual_seed(0)
            ref = Net()
            train_lm(ref, make(ref), batches)
            out[name] = rel_errors(full_params(ref), got)
    return out


# ---------------------------------------------------------------------------
# 2. sharded blocks + plain root params, FSDPMuonOptimizer, unshard_params
# ---------------------------------------------------------------------------


def _fsdp_muon(model, beta2):
    return mfx.FSDPMuonOptimizer(model, lr=0.02, beta2=beta2, gradient_accumulation_steps=2,
                                 ns_dtype=torch.float32, weight_decay=0.01, adamw_lr=3e-3)


def _train_micro(model, opt, batches) -> list[bool]:
    """step() after every micro-batch; returns, per call, whether the params moved."""
    moved = []
    for t in batches:
        before = [p.detach().clone() for p in model.parameters()]
        lm_loss(model, t).backward()
        opt.step()
        opt.zero_grad()
        moved.append(any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())))
    return moved


def task_mixed(rank: int, world: int, micro_batches: int = 6) -> dict:
    batches = lm_batches(micro_batches, 4, seed=2)  # identical data on every rank
    out: dict = {}
    for beta2 in (None, 0.95):
        torch.manual_seed(0)
        model = shard_net(NetMixed(), root=False)
        kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
        opt = _fsdp_muon(model, beta2)
        moved = _train_micro(model, opt, batches[:4])
        gathered = full_params(model)
        with opt.unshard_params():
            inside = {n: (type(p).__name__, p.detach().clone()) for n, p in model.named_parameters()}
        after = {n: type(p).__name__ for n, p in model.named_parameters()}
        # training goes on after the reshard (the optimizer still holds the live params)
        moved += _train_micro(model, opt, batches[4:])
        got = full_params(model)
        res = dict(kinds=kinds, moved=moved, after_kinds=after,
                   inside_kinds={n: k for n, (k, _) in inside.items()},
                   unshard_err={n: (v - gathered[n]).abs().max().item() if v.shape == gathered[n].shape
                                else float("inf") for n, (_, v) in inside.items()},
                   groups=[[type(p).__name__ for p in g["params"]] for g in opt.param_groups])
        if rank == 0:
            torch.manual_seed(0)
            ref = NetMixed()
            ref_moved = _train_micro(ref, _fsdp_muon(ref, beta2), batches)
            res["ref_moved"] = ref_moved
            res["errors"] = rel_errors(full_params(ref), got)
        out[f"beta2={beta2}"] = res
    return out


# ---------------------------------------------------------------------------
# 3. empty and uneven shards
# ---------------------------------------------------------------------------


def task_odd(rank: int, world: int, steps: int = 6, rows: int = 12) -> dict:
    # Identical data on every rank: FSDP's averaged gradient is then the full-batch one
    # (up to one rounding at W=3), so any error is the optimizer's shard bookkeeping.
    # (test_parity measures FSDP's reduction-order noise with per-rank batches.)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g)) for _ in range(steps)]

    def train(model, opt):
        for x, y in data:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    out: dict = {}
    for name, make in (("muon_adamw", make_muon), ("fsdp_muon_normuon", _fsdp_muon_normuon)):
        mdist.comm_stats().reset()
        torch.manual_seed(0)
        model = Odd()
        fully_shard(model.b, mesh=cpu_mesh())
        fully_shard(model, mesh=cpu_mesh())
        out["local_shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        init = full_params(model)
        train(model, make(model))
        out[f"{name}_stats"] = stats()
        got = full_params(model)
        if rank == 0:
            torch.manual_seed(0)
            ref = Odd()
            train(ref, make(ref))
            out[f"{name}_errors"] = rel_errors(full_params(ref), got)
            out[f"{name}_moved"] = rel_errors(init, got)
    return out


def _fsdp_muon_normuon(model):
    return mfx.FSDPMuonOptimizer(model, lr=0.02, beta2=0.95, ns_dtype=torch.float32, weight_decay=0.01, adamw_lr=3e-3)


# ---------------------------------------------------------------------------
# 4. the matrix exchange: work and bytes, Shard(1), expert stacks
# ---------------------------------------------------------------------------


def _ns_case(mesh, fulls: dict[str, torch.Tensor], placements, dtype=torch.float32) -> dict:
    """NS once on DTensors made from ``fulls``; compare with NS of the full tensors."""
    td = TensorDict({k: distribute_tensor(v, mesh, placements) for k, v in fulls.items()}, [])
    tx = mfx.newton_schulz(dtype=dtype)
    mdist.install()
    mdist.comm_stats().reset()
    out, _ = tx.update(td, tx.init(td))
    st = stats()
    st["ortho_total"] = sum_over_ranks(st["matrices_orthogonalized"])
    types = {k: type(out[k]).__name__ for k in fulls}
    placements_out = {k: tuple(out[k].placements) == tuple(td[k].placements) for k in fulls}
    got = {k: full(out[k]) for k in fulls}
    ref, _ = tx.update(TensorDict(dict(fulls), []), tx.init(TensorDict(dict(fulls), [])))
    return dict(stats=st, types=types, same_placements=placements_out,
                errors=rel_errors({k: ref[k] for k in fulls}, got),
                local_shapes={k: tuple(td[k].to_local().shape) for k in fulls})


def task_ns(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    return {
        # n=5 same-shape row-sharded matrices: one shape group
        "rows": _ns_case(mesh, {f"m{i}": torch.randn(16, 24) for i in range(5)}, [Shard(0)]),
        # column-sharded (tensor-parallel style); 10 columns are uneven at W=3 (4+4+2)
        "cols": _ns_case(mesh, {f"c{i}": torch.randn(12, 10) for i in range(4)}, [Shard(1)]),
        # expert stacks sharded on the expert dim: no communication; 2 experts < W=3 leaves a rank empty
        "experts": _ns_case(mesh, {"e5": torch.randn(5, 8, 12), "e2": torch.randn(2, 6, 6)}, [Shard(0)]),
        # an expert stack sharded inside its matrices (rows): exchanged like 3 matrices
        "experts_rows": _ns_case(mesh, {"x": torch.randn(3, 8, 12)}, [Shard(1)]),
        # replicated matrices: transformed where they are, counted once
        "replicated": _ns_case(mesh, {"r": torch.randn(6, 10)}, [Replicate()]),
        # bf16 Newton-Schulz on float32 shards: exchanged in bf16 both ways (half the bytes)
        "rows_bf16": _ns_case(mesh, {f"h{i}": torch.randn(16, 24) for i in range(5)}, [Shard(0)],
                              dtype=torch.bfloat16),
        # mixed shapes, tall and tiny matrices, an empty shard (2 rows at W=3), a conv weight
        # in float64 (one all-to-all each way carries 8-byte elements): the exchange is
        # exact, whatever the batch composition on the owners does to float32 rounding
        "mixed": _ns_case(mesh, {k: v.double() for k, v in {
            "tall": torch.randn(30, 7), "tiny": torch.randn(2, 9), "sq": torch.randn(9, 14),
            "sq2": torch.randn(9, 14), "conv": torch.randn(5, 3, 2, 2)}.items()}, [Shard(0)], dtype=None),
    }


# ---------------------------------------------------------------------------
# 8. global transforms on shards
# ---------------------------------------------------------------------------


def _global_fulls(seed: int) -> dict[str, tuple[torch.Tensor, list]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": (torch.randn(7, 5, generator=g), [Shard(0)]),       # uneven rows
        "b": (torch.randn(4, 6, generator=g), [Shard(1)]),       # column-sharded
        "c": (torch.randn(2, 3, generator=g), [Shard(0)]),       # empty shard at W=3
        "e": (torch.randn(3, 4, 2, generator=g), [Shard(0)]),    # expert stack
        "r": (torch.randn(5, generator=g), [Replicate()]),       # replicated vector
    }


def task_global(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    mdist.install()

    def dt(fulls):
        return TensorDict({k: distribute_tensor(v.clone(), mesh, pl) for k, (v, pl) in fulls.items()}, [])

    def plain(fulls):
        return TensorDict({k: v.clone() for k, (v, _) in fulls.items()}, [])

    out: dict = {}
    # clip_by_global_norm and global_norm
    fulls = _global_fulls(0)
    clip = mfx.clip_by_global_norm(1.0)
    got, _ = clip.update(dt(fulls), None)
    ref, _ = clip.update(plain(fulls), None)
    out["norm"] = mfx.global_norm(dt(fulls)).item()
    out["norm_ref"] = mfx.global_norm(plain(fulls)).item()
    out["clip_errors"] = rel_errors({k: ref[k] for k in fulls}, {k: full(got[k]) for k in fulls})
    out["clip_ref_norm"] = mfx.global_norm(ref).item()

    # apply_if_finite(momentum): a NaN on the last rank's shard of "a" at step 2
    tx = mfx.apply_if_finite(mfx.momentum(0.9), max_consecutive_errors=3)
    steps = [_global_fulls(s) for s in (1, 2, 3)]
    sizes = mdist.shard_sizes(7, world)
    nan_row = sum(sizes[:-1])  # first row of the last rank's shard of "a"
    ref_steps = [plain(f) for f in steps]
    ref_steps[1]["a"][nan_row, 0] = float("nan")
    dt_steps = [dt(f) for f in steps]
    if rank == world - 1:
        dt_steps[1]["a"].to_local()[0, 0] = float("nan")
    s_d = tx.init(dt_steps[0])
    s_r = tx.init(ref_steps[0])
    out["skips"], out["skips_ref"], out["errors"] = [], [], []
    for ud, ur in zip(dt_steps, ref_steps):
        od, s_d = tx.update(ud, s_d)
        orr, s_r = tx.update(ur, s_r)
        out["skips"].append((s_d.notfinite_count, s_d.last_finite, s_d.total_notfinite))
        out["skips_ref"].append((s_r.notfinite_count, s_r.last_finite, s_r.total_notfinite))
        got = {k: full(od[k]) for k in fulls}
        out["errors"].append({k: (orr[k] - got[k]).abs().max().item() for k in fulls})
        out.setdefault("all_zero", []).append(all(bool((got[k] == 0).all()) for k in fulls))
    return out


# ---------------------------------------------------------------------------
# 7. refused inputs
# ---------------------------------------------------------------------------


def task_bad(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("all", "solo"))
    mesh = mesh2["all"]
    solo = mesh2["solo"]  # a 1-rank slice: {rank}; next to parameters on mesh2, a replica over "all"
    first = DeviceMesh("cpu", [0])  # a mesh over rank 0 alone, sliced from nothing
    out: dict = {}

    # a Partial placement
    partial = nn.Module()
    partial.ok = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    partial.pending = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()], run_check=False))
    try:
        mfx.TransformOptimizer(partial.named_parameters(), mfx.muon, lr=0.02)
        out["partial"] = None
    except ValueError as e:
        out["partial"] = str(e)

    # parameters on meshes over different rank sets
    mixed = nn.Module()
    mixed.shared = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    mixed.lonely = nn.Parameter(DTensor.from_local(torch.randn(4, 4), first, [Replicate()], run_check=False))
    try:
        mfx.TransformOptimizer(mixed.named_parameters(), mfx.muon, lr=0.02)
        out["meshes"] = None
    except ValueError as e:
        out["meshes"] = str(e)

    # the same through FSDPMuonOptimizer
    try:
        mfx.FSDPMuonOptimizer(mixed)
        out["meshes_fsdp_muon"] = None
    except ValueError as e:
        out["meshes_fsdp_muon"] = str(e)

    # a 1-rank named slice of mesh2 next to a parameter on mesh2: served (replicated over "all")
    sliced = nn.Module()
    sliced.shared = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh2, [Shard(0), Replicate()]))
    sliced.lonely = nn.Parameter(distribute_tensor(torch.ones(4, 4), solo, [Replicate()]))
    opt = mfx.TransformOptimizer(sliced.named_parameters(), mfx.muon, lr=0.02, ns_dtype=torch.float32)
    for p in sliced.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    out["sliced_step"] = full(sliced.lonely).tolist()
    dist.barrier()  # every rank got here: nobody hung
    return out


# ---------------------------------------------------------------------------
# 5. HSDP: 2 x 2 mesh (replicate x shard)
# ---------------------------------------------------------------------------


def task_hsdp(rank: int, world: int, steps: int = 10, rows_per_rank: int = 4) -> dict:
    assert world == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict = {}
    for data in ("same", "split"):
        # "same": every rank gets the whole batch; the averaged gradient of 4 equal terms is
        # exact, so what differs from one process is the optimizer alone.
        # "split": each rank gets a quarter of the batch (real data parallelism).
        batches = lm_batches(steps, rows_per_rank * world, seed=4)
        mdist.comm_stats().reset()
        torch.manual_seed(0)
        model = shard_net(Net(), mesh=mesh)
        out["placements"] = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
        train_lm(model, make_muon(model), batches, rank, world if data == "split" else 1)
        out[f"{data}_stats"] = stats()
        out[f"{data}_ortho_total"] = sum_over_ranks(mdist.comm_stats().matrices_orthogonalized)
        got = full_params(model)
        if rank == 0:
            torch.manual_seed(0)
            ref = Net()
            train_lm(ref, make_muon(ref), batches)
            out[f"{data}_errors"] = rel_errors(full_params(ref), got)

    # functional: (Replicate(), Shard(0)) and (Replicate(), Shard(1)) matrices, an expert stack
    torch.manual_seed(1)
    fulls = {"r0": torch.randn(10, 6), "r1": torch.randn(10, 6), "c0": torch.randn(6, 9)}
    pls = {"r0": [Replicate(), Shard(0)], "r1": [Replicate(), Shard(0)], "c0": [Replicate(), Shard(1)]}
    td = TensorDict({k: distribute_tensor(v, mesh, pls[k]) for k, v in fulls.items()}, [])
    tx = mfx.newton_schulz(dtype=torch.float32)
    mdist.install()
    mdist.comm_stats().reset()
    o, _ = tx.update(td, tx.init(td))
    out["ns_stats"] = stats()
    out["ns_ortho_total"] = sum_over_ranks(mdist.comm_stats().matrices_orthogonalized)
    ref, _ = tx.update(TensorDict(dict(fulls), []), None)
    out["ns_errors"] = rel_errors({k: ref[k] for k in fulls}, {k: full(o[k]) for k in fulls})
    # sharded on both mesh dims (2-D tensor parallel style): the same owner exchange
    full2 = torch.randn(8, 6)
    td2 = TensorDict({"s2": distribute_tensor(full2, mesh, [Shard(0), Shard(1)])}, [])
    mdist.comm_stats().reset()
    o2, _ = tx.update(td2, None)
    out["s2_stats"] = stats()
    out["s2_ortho_total"] = sum_over_ranks(mdist.comm_stats().matrices_orthogonalized)
    ref2, _ = tx.update(TensorDict({"s2": full2}, []), None)
    out["s2_error"] = rel_errors({"s2": ref2["s2"]}, {"s2": full(o2["s2"])})["s2"]
    out["s2_placements"] = str(tuple(o2["s2"].placements))
    # the same in bf16: sent both ways in bf16, the float32 result cast back
    tx16 = mfx.newton_schulz(dtype=torch.bfloat16)
    mdist.comm_stats().reset()
    o3, _ = tx16.update(td2, None)
    out["s2_bf16_stats"] = stats()
    ref3, _ = tx16.update(TensorDict({"s2": full2}, []), None)
    out["s2_bf16_error"] = rel_errors({"s2": ref3["s2"]}, {"s2": full(o3["s2"])})["s2"]
    out["s2_bf16_dtype"] = str(o3["s2"].dtype) + str(tuple(o3["s2"].placements))
    out["norm"] = mfx.global_norm(td).item()
    out["norm_ref"] = mfx.global_norm(TensorDict(dict(fulls), [])).item()
    return out


# ---------------------------------------------------------------------------
# 6. checkpoints with torch.distributed.checkpoint, across world sizes
# ---------------------------------------------------------------------------

CKPT_ROWS = 12  # global batch rows: divisible by 1, 2, 3 and 4
CKPT_STEPS = 6  # N = 3 before the checkpoint, M = 3 after


def ckpt_batches() -> list[torch.Tensor]:
    return lm_batches(CKPT_STEPS, CKPT_ROWS, seed=5)


def ckpt_model(world: int, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    model = Net()
    return shard_net(model) if world > 1 else model


def dump_opt_state(model, opt) -> dict:
    """``{"param:entry": full tensor or value}`` of the optimizer's per-parameter state."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}:{k}": (full(v) if isinstance(v, torch.Tensor) else v)
            for p, st in opt.state.items() for k, v in st.items()}


def task_ckpt_save(rank: int, world: int, path: str, n: int = 3, uninterrupted: bool = False,
                   optimizer: str = "muon") -> dict:
    """Train ``n`` steps at this world size and save model + optimizer with DCP. With
    ``uninterrupted``, also train all CKPT_STEPS in one go (the floor of the comparison).
    ``optimizer``: a name of :data:`OPTIMIZERS`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    make = OPTIMIZERS[optimizer]
    model = ckpt_model(world)
    opt = make(model)
    train_lm(model, opt, ckpt_batches()[:n], rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    out = {"params": full_params(model), "state": dump_opt_state(model, opt)}
    if uninterrupted:
        model = ckpt_model(world)
        train_lm(model, make(model), ckpt_batches(), rank, world)
        out["uninterrupted"] = full_params(model)
    return out


def load_checkpoint(model, opt, path: str, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def describe_opt_state(model, opt) -> dict:
    """For each (param, state entry): is it a DTensor with the param's placements and local shape?"""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                is_dt = isinstance(v, DTensor)
                out[f"{names[id(p)]}:{k}"] = dict(
                    dtensor=is_dt, param_dtensor=isinstance(p, DTensor),
                    same_placements=is_dt and isinstance(p, DTensor) and tuple(v.placements) == tuple(p.placements),
                    local_shape=tuple(v.to_local().shape) if is_dt else tuple(v.shape),
                    param_local_shape=tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
                    global_shape=tuple(v.shape),
                )
    return out


def task_ckpt_resume(rank: int, world: int, path: str, n: int = 3, optimizer: str = "muon") -> dict:
    model = ckpt_model(world, seed=123)  # other init: the load must overwrite it
    opt = OPTIMIZERS[optimizer](model)
    load_checkpoint(model, opt, path)
    out = {"loaded": full_params(model), "loaded_state": dump_opt_state(model, opt),
           "layout": describe_opt_state(model, opt)}
    train_lm(model, opt, ckpt_batches()[n:], rank, world)
    out["params"] = full_params(model)
    return out


# ---------------------------------------------------------------------------
# 9. tensor parallel (alone and under FSDP2), CPU offload, expert parallel: 4 ranks
# ---------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: ``up`` colwise, ``down`` rowwise under tensor parallelism.
    h=30 rows of ``up`` cut over tp=2 then dp=2 (``_StridedShard``) leave 8+7 rows. RMSNorm,
    not LayerNorm: LayerNorm's output has no component along the ones vector, so ``up``'s
    gradient would lack a direction, and Newton-Schulz amplifies rounding noise there (the
    single-process floor of chunked vs whole-batch gradients measured 1.7e-6 with it,
    4e-7 to 7e-7 without)."""

    def __init__(self, d: int = 9, h: int = 30):
        super().__init__()
        self.ln = nn.RMSNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.ln(x))))


class ResMLP(nn.Module):
    """``inp`` (a hidden matrix that only ``fully_shard`` cuts), ``L`` MLP blocks, ``head``
    (AdamW). Muon matrices: inp, up, down of each block. ``k >= d`` outputs, so the last
    ``down``'s gradient has full rank (through a 3-wide head it had rank 3 of 9)."""

    def __init__(self, d_in: int = 7, d: int = 9, h: int = 30, L: int = 2, k: int = 12):
        super().__init__()
        self.inp = nn.Linear(d_in, d, bias=False)
        self.blocks = nn.ModuleList([MLPBlock(d, h) for _ in range(L)])
        self.head = nn.Linear(d, k)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


RES_MATRICES = 1 + 2 * 2  # inp + (up, down) x 2 blocks


def _res_data(steps: int, rows: int, seed: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 7, generator=g), torch.randn(rows, 12, generator=g)) for _ in range(steps)]


def _train_res(model, opt, data, part: int = 0, parts: int = 1) -> None:
    for x, y in data:
        if parts > 1:
            x, y = x.chunk(parts)[part], y.chunk(parts)[part]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _tp(block: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


#: hidden width per layout: tensor parallelism needs it even over tp (30 over tp=2 leaves
#: 15 rows, which FSDP2 then cuts 8+7), 32 over tp=4 in "tp"
RES_H = {"fsdp_tp": 30, "tp": 32, "hsdp": 30, "offload": 30}
RES_LAYOUTS = tuple(RES_H)


def fsdp_tp_2x2(model: nn.Module, world: int):
    """``model``'s blocks tensor parallel inside a 2 x (world / 2) mesh, FSDP2 across;
    ``(model, data part, parts)`` of this rank."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for b in model.blocks:
        _tp(b, mesh["tp"])
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank(), 2


def _res_layout(layout: str, world: int):
    """A ResMLP laid out as ``layout``, and (data part, parts) of this rank."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    torch.manual_seed(0)
    model = ResMLP(h=RES_H[layout])
    if layout == "fsdp_tp":  # 2 x 2: tensor parallel inside, FSDP2 across
        return fsdp_tp_2x2(model, world)
    if layout == "tp":  # tensor parallel alone over every rank: every rank sees the whole batch
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for b in model.blocks:
            _tp(b, mesh)
        return model, 0, 1
    if layout == "hsdp":  # 2 x 2: replicate x shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dist.get_rank(), world
    if layout == "offload":  # FSDP2 with its parameters and optimizer step on the host
        mesh = cpu_mesh()
        policy = CPUOffloadPolicy(pin_memory=False)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        return model, dist.get_rank(), world
    raise ValueError(layout)


def task_mesh(rank: int, world: int, steps: int = 8, rows: int = 32) -> dict:
    """Parity with one process and the exchange's counters, per layout."""
    data = _res_data(steps, rows)
    out: dict = {}
    for layout in RES_LAYOUTS:
        # torch.optim.AdamW on the same layout: the floor (the layout's own reduction order)
        model, part, parts = _res_layout(layout, world)
        _train_res(model, make_torch_adamw(model), data, part, parts)
        floor = full_params(model)
        mdist.comm_stats().reset()
        model, part, parts = _res_layout(layout, world)
        opt = make_muon(model)
        res: dict = {"placements": {n: str(tuple(p.placements)) if isinstance(p, DTensor) else "plain"
                                    for n, p in model.named_parameters()}}
        plan = mdist.describe(opt, dtype=torch.float32)
        res["describe"], res["plan_sent"] = str(plan), plan.plan.bytes_sent()
        res["matrix_elements"] = sum(mp.m * mp.n for mp in plan.plan.matrices)
        init = full_params(model)
        _train_res(model, opt, data, part, parts)
        res["stats"] = stats()
        res["ortho_total"] = sum_over_ranks(mdist.comm_stats().matrices_orthogonalized)
        got = full_params(model)
        if rank == 0:
            torch.manual_seed(0)
            ref = ResMLP(h=RES_H[layout])
            _train_res(ref, make_muon(ref), data)
            res["errors"] = rel_errors(full_params(ref), got)
            res["moved"] = min(rel_errors(init, got).values())  # every parameter trained
            torch.manual_seed(0)
            ref = ResMLP(h=RES_H[layout])
            _train_res(ref, make_torch_adamw(ref), data)
            res["floor"] = rel_errors(full_params(ref), floor)
        out[layout] = res
    return out


def _ep_grads(shapes: dict, steps: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(steps)]


def task_ep(rank: int, world: int, steps: int = 4) -> dict:
    """Expert stacks ``[E, m, n]`` as DTensor parameters, the same gradients on every rank:
    ``ep``: Shard(0) over 4 ranks (8 experts, and 3 experts: a rank with none);
    ``ep_dp``: a 2 x 2 (ep, dp) mesh, experts over ep, each expert's rows over dp.
    muon for ``steps`` steps vs one process; the exchange's counters."""
    from torch.distributed.tensor import distribute_tensor as dt_

    out: dict = {}
    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "dp"))
    cases = {
        "ep": ({"w8": (8, 12, 16), "w3": (3, 6, 8)}, {"w8": (mesh1, [Shard(0)]), "w3": (mesh1, [Shard(0)])}),
        "ep_dp": ({"w4": (4, 12, 16)}, {"w4": (mesh2, [Shard(0), Shard(1)])}),
    }
    for case, (shapes, place) in cases.items():
        torch.manual_seed(0)
        fulls = {k: torch.randn(s) for k, s in shapes.items()}
        grads = _ep_grads(shapes, steps)
        mod = nn.Module()
        for k, v in fulls.items():
            setattr(mod, k, nn.Parameter(dt_(v.clone(), *place[k])))
        opt = mfx.TransformOptimizer(mod.named_parameters(), mfx.muon, lr=0.02, ns_dtype=torch.float32)
        mdist.comm_stats().reset()
        for gs in grads:
            for k, p in mod.named_parameters():
                p.grad = dt_(gs[k], *place[k])
            opt.step()
            opt.zero_grad()
        plan = mdist.describe(opt, dtype=torch.float32)
        res = {"stats": stats(), "ortho_total": sum_over_ranks(mdist.comm_stats().matrices_orthogonalized),
               "describe": str(plan), "plan": plan.plan}
        got = {k: full(p) for k, p in mod.named_parameters()}
        ref = nn.Module()
        for k, v in fulls.items():
            setattr(ref, k, nn.Parameter(v.clone()))
        ref_opt = mfx.TransformOptimizer(ref.named_parameters(), mfx.muon, lr=0.02, ns_dtype=torch.float32)
        for gs in grads:
            for k, p in ref.named_parameters():
                p.grad = gs[k].clone()
            ref_opt.step()
            ref_opt.zero_grad()
        res["errors"] = rel_errors({k: p.detach() for k, p in ref.named_parameters()}, got)
        out[case] = res
    return out


# ---------------------------------------------------------------------------
# one world, many tasks
# ---------------------------------------------------------------------------

TASKS = {
    "parity": task_parity, "mixed": task_mixed, "odd": task_odd, "ns": task_ns, "global": task_global,
    "bad": task_bad, "hsdp": task_hsdp, "ckpt_save": task_ckpt_save, "ckpt_resume": task_ckpt_resume,
    # the same with state kept per block (blockwise): entries keyed (*key, "block<i>")
    "ckpt_save_per_head": functools.partial(task_ckpt_save, optimizer="per_head"),
    "ckpt_resume_per_head": functools.partial(task_ckpt_resume, optimizer="per_head"),
    "mesh": task_mesh, "ep": task_ep,
}


def world_main(rank: int, world: int, tasks: list) -> dict:
    """Run ``tasks`` (``name`` or ``(name, kwargs)``) in order; ``{name: result}``."""
    out: dict = {"seconds": {}}
    for t in tasks:
        name, kwargs = (t, {}) if isinstance(t, str) else t
        start = time.perf_counter()
        out[name] = TASKS[name](rank, world, **kwargs)
        dist.barrier()
        out["seconds"][name] = time.perf_counter() - start
    return out
