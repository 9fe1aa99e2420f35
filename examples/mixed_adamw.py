"""Train a small transformer with Muon + AdamW (``mfx.create_hybrid_optimizer``).

The task is deterministic toy data: a causal language model reads a random digit
string, a separator, and must write the string back reversed::

    3 1 4 1 5 9 2 6 | 6 2 9 5 1 4 1 3

The loss is next-token cross-entropy on the reversed half. Muon trains the hidden
matrices (attention and MLP weights), AdamW the token/position embeddings, the output
head, the norms and the biases. One ``LambdaLR`` (linear warm-up, then cosine decay to
zero) drives both param groups; each keeps its own base learning rate.

Run it (the 100 default steps take a few seconds on two CPU cores and reach ~100 %
token accuracy)::

    python examples/mixed_adamw.py                 # 100 steps on the CPU
    python examples/mixed_adamw.py --steps 20      # a quick smoke run
    python examples/mixed_adamw.py --device cuda
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import muonfx as mfx
from muonfx import create_hybrid_optimizer  # noqa: F401  the predecessor's `from examples.mixed_adamw import create_hybrid_optimizer`

DIGITS = 10  # tokens 0..9 are digits
SEP = DIGITS  # token 10 separates the input from its reversal
VOCAB = DIGITS + 1


class TinyGPT(nn.Module):
    """Token + position embedding, a few pre-norm causal transformer blocks, an LM head."""

    def __init__(self, vocab: int, max_len: int, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        block = nn.TransformerEncoderLayer(
            d_model=dim, nhead=heads, dim_feedforward=4 * dim, dropout=0.0,
            activation="gelu", batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, num_layers=layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(max_len), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        h = self.tok_emb(idx) + self.pos_emb(pos)
        h = self.blocks(h, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.lm_head(self.norm(h))


def reversal_batch(gen: torch.Generator, batch: int, length: int, device: str) -> torch.Tensor:
    """``[x_1 .. x_n, SEP, x_n .. x_1]`` for ``batch`` random digit strings."""
    x = torch.randint(0, DIGITS, (batch, length), generator=gen)
    sep = torch.full((batch, 1), SEP)
    return torch.cat([x, sep, x.flip(1)], dim=1).to(device)


def warmup_cosine(warmup: int, total: int):
    """LambdaLR factor: linear warm-up to 1 over ``warmup`` steps, then cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def group_kind(group: dict) -> str:
    return "muon" if "momentum" in group else "adamw"


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--length", type=int, default=8, help="digits per string (default 8)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1: faster than more for a model this small)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    seq_len = 2 * args.length + 1
    model = TinyGPT(VOCAB, seq_len, dim=args.dim, layers=args.layers).to(args.device)

    # Muon on the hidden matrices, AdamW on embeddings, head, norms, biases: ONE optimizer.
    opt = mfx.create_hybrid_optimizer(model, muon_lr=args.muon_lr, adamw_lr=args.adamw_lr, adamw_weight_decay=0.01)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, args.steps))

    n = args.length
    print(f"reversal task: {n} digits, vocab {VOCAB}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"{args.steps} steps on {args.device}")
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(args.steps):
        seq = reversal_batch(gen, args.batch_size, n, args.device)
        logits = model(seq[:, :-1])
        # predict the reversed half: positions n .. 2n-1 predict tokens n+1 .. 2n
        loss = nn.functional.cross_entropy(logits[:, n:].reshape(-1, VOCAB), seq[:, n + 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lrs = "  ".join(f"{group_kind(g)} lr {g['lr']:.2e}" for g in opt.param_groups)  # this step's
        opt.step()
        sched.step()
        loss_value = loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d} | loss {loss_value:.4f} | {lrs}")
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        seq = reversal_batch(gen, 256, n, args.device)
        pred = model(seq[:, :-1])[:, n:].argmax(-1)
        acc = (pred == seq[:, n + 1:]).float().mean().item()
    print(f"final loss {loss_value:.4f} | token accuracy on fresh strings {acc:.1%} | {elapsed:.1f} s")

    print("param groups:")
    for g, base_lr in zip(opt.param_groups, sched.base_lrs):
        numel = sum(p.numel() for p in g["params"])
        print(f"  {group_kind(g):5s} base lr {base_lr:.0e}: "
              f"{len(g['params'])} tensors, {numel} elements")
        for name, p in zip(g["param_names"], g["params"]):
            print(f"      {name:45s} {tuple(p.shape)}")
    return loss_value


if __name__ == "__main__":
    main()
