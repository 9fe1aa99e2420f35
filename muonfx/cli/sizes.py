"""The sizes of ``muonfx train``'s GPT (``--model``): plain data, no torch, so that the
command's options and their errors need no heavy import (:mod:`muonfx.cli.model` builds
the model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["GPTConfig", "MODELS"]


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    d: int
    heads: int
    context: int
    bias: bool = False
    tie_weights: bool = False
    init: str = "torch"  # "torch": PyTorch's default init; "gpt2": N(0, 0.02), scaled residual projections
    vocab: int = 256

    def to_dict(self) -> dict:
        return asdict(self)


MODELS = {
    "tiny": GPTConfig(layers=4, d=128, heads=4, context=128),
    "small": GPTConfig(layers=6, d=256, heads=8, context=256),
    "gpt2": GPTConfig(layers=12, d=768, heads=12, context=1024, bias=True, tie_weights=True, init="gpt2"),
}
