"""The training text: this Python's own standard library sources, character-level.

The corpus is every ``*.py`` file directly in ``sysconfig.get_paths()["stdlib"]``
(not in sub-packages, so no ``site-packages``, ``test`` or ``idlelib`` trees), sorted
by file name and concatenated as read (UTF-8). On CPython 3.11 that is 168 files,
4.7M characters, 166 distinct characters. The vocabulary is the sorted set of those
characters; the last ``val_fraction`` (10%) of the encoded text is the validation
split.

The encoded corpus is cached (``<cache dir>/corpus-<key>.pt``, the key made from
the Python version, the stdlib path and every file's name, size and mtime), so
later runs start at once. The cache dir is ``--cache-dir``, else ``$MUONFX_CACHE_DIR``,
else ``$XDG_CACHE_HOME/muonfx``, else ``~/.cache/muonfx``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "default_cache_dir", "stdlib_files", "load_corpus", "sample_batch"]

_FORMAT = 1  # bump when the cached layout changes


def default_cache_dir() -> Path:
    env = os.environ.get("MUONFX_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "muonfx"


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The corpus's files, in corpus order: top-level ``*.py`` of the stdlib, sorted by name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


@dataclass
class Corpus:
    """An encoded corpus: ``data`` (1-D int64 token ids), ``vocab`` (id -> character)."""

    data: torch.Tensor
    vocab: str
    files: int
    chars: int
    sha256: str
    source: str
    val_fraction: float = 0.1
    from_cache: bool = False

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def split(self) -> int:
        """Index of the first validation token."""
        return int(len(self.data) * (1.0 - self.val_fraction))

    @property
    def train(self) -> torch.Tensor:
        return self.data[: self.split]

    @property
    def val(self) -> torch.Tensor:
        return self.data[self.split:]

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def info(self) -> dict:
        return {
            "source": self.source, "files": self.files, "chars": self.chars, "sha256": self.sha256,
            "vocab_size": self.vocab_size, "train_tokens": int(self.split),
            "val_tokens": int(len(self.data) - self.split), "val_fraction": self.val_fraction,
        }


def _cache_key(files: list[Path], root: Path) -> str:
    h = hashlib.sha256(f"{_FORMAT}|{sys.version}|{root}".encode())
    for p in files:
        st = p.stat()
        h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _build(files: list[Path]) -> tuple[torch.Tensor, str, int, str]:
    text = "".join(p.read_text(encoding="utf-8") for p in files)
    vocab = "".join(sorted(set(text)))
    stoi = {c: i for i, c in enumerate(vocab)}
    dtype = torch.uint8 if len(vocab) <= 256 else torch.int32
    data = torch.tensor([stoi[c] for c in text], dtype=dtype)
    return data, vocab, len(text), hashlib.sha256(text.encode("utf-8")).hexdigest()


def _cache_ok(d) -> bool:
    """Whether a loaded cache holds a whole corpus: the token tensor as long as the text,
    every token in the vocabulary, the counts and checksum of the right types (a file
    damaged where torch.load does not notice is rebuilt, not trained on)."""
    if not isinstance(d, dict):
        return False
    data, vocab, chars = d.get("data"), d.get("vocab"), d.get("chars")
    if not (isinstance(data, torch.Tensor) and data.ndim == 1 and not data.is_floating_point()
            and isinstance(vocab, (list, tuple, str)) and len(vocab) > 0 and isinstance(chars, int)
            and isinstance(d.get("files"), int) and isinstance(d.get("sha256"), str) and len(data) == chars > 1):
        return False
    return bool(data.min() >= 0) and bool(data.max() < len(vocab))


def load_corpus(cache_dir: str | Path | None = None, use_cache: bool = True, root: str | Path | None = None,
                val_fraction: float = 0.1) -> Corpus:
    """Build (or load from the cache) the stdlib corpus."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no *.py files in {root}: this Python has no standard library sources to train on")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    path = cache / f"corpus-{_cache_key(files, root)}.pt"
    if use_cache and path.exists():
        try:
            d = torch.load(path, weights_only=True)
            if _cache_ok(d):
                return Corpus(d["data"].long(), d["vocab"], d["files"], d["chars"], d["sha256"], str(root),
                              val_fraction, from_cache=True)
        except Exception:  # a damaged cache file is rebuilt
            pass
    data, vocab, chars, sha = _build(files)
    if use_cache:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save({"data": data, "vocab": vocab, "files": len(files), "chars": chars, "sha256": sha}, tmp)
            os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
        except OSError:
            pass  # a read-only home is no reason to fail
    return Corpus(data.long(), vocab, len(files), chars, sha, str(root), val_fraction)


def sample_batch(split: torch.Tensor, batch_size: int, context: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``context + 1`` tokens: (inputs, next-token targets)."""
    if len(split) <= context + 1:
        raise ValueError(f"the split has {len(split)} tokens, fewer than context + 1 = {context + 1}")
    starts = torch.randint(0, len(split) - context - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    win = split[idx]
    return win[:, :-1], win[:, 1:]
