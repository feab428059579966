"""The embedded default corpus: the text of CPython's own standard library, present wherever Python is.

Character-level, so no tokenizer download is needed. Point `load_corpus(path=...)` at any text file instead.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


def stdlib_text(max_chars: int = 4_000_000) -> str:
    """Concatenate the standard library's .py files in a fixed (sorted) order, up to max_chars."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            parts.append(text)
            total += len(text)
            if total >= max_chars:
                return "".join(parts)[:max_chars]
    return "".join(parts)


@dataclass
class CharCorpus:
    train: torch.Tensor  # int64 token ids
    val: torch.Tensor
    vocab: Tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


def load_corpus(path: Optional[str] = None, max_chars: int = 4_000_000, val_fraction: float = 0.05) -> CharCorpus:
    """Character-level corpus with a fixed train/val split (the last `val_fraction` of the text is validation)."""
    if path is not None:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()[:max_chars]
    else:
        text = stdlib_text(max_chars)
    vocab = tuple(sorted(set(text)))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
    split = int(len(ids) * (1 - val_fraction))
    return CharCorpus(train=ids[:split], val=ids[split:], vocab=vocab)


def batches(ids: torch.Tensor, batch_size: int, context: int, steps: int, seed: int):
    """`steps` random (x, y) batches of next-character prediction, reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - context - 1, (batch_size,), generator=g)
        x = torch.stack([ids[s : s + context] for s in starts.tolist()])
        y = torch.stack([ids[s + 1 : s + context + 1] for s in starts.tolist()])
        yield x, y


def fixed_val_batches(ids: torch.Tensor, batch_size: int, context: int, n_batches: int):
    """A fixed validation set: evenly spaced windows, the same for every run."""
    stride = max(1, (len(ids) - context - 1) // (batch_size * n_batches))
    starts = [i * stride for i in range(batch_size * n_batches)]
    out = []
    for b in range(n_batches):
        chunk = starts[b * batch_size : (b + 1) * batch_size]
        x = torch.stack([ids[s : s + context] for s in chunk])
        y = torch.stack([ids[s + 1 : s + context + 1] for s in chunk])
        out.append((x, y))
    return out
