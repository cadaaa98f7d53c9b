"""The corpus, built here with no download: the Python standard library's own sources, as characters."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

ALPHABET = "\n\t" + "".join(chr(c) for c in range(32, 127))  # printable ASCII: 97 characters


def stdlib_text(max_chars: int = 2_000_000) -> str:
    """The first ``max_chars`` characters of the stdlib's .py files (sorted: the same text every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    allowed = set(ALPHABET)
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = "".join(c for c in path.read_text(encoding="utf-8", errors="ignore") if c in allowed)
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharData:
    """Encoded train/validation splits and random batches drawn with a seeded CPU generator."""

    def __init__(self, text: str | None = None, val_fraction: float = 0.1):
        text = stdlib_text() if text is None else text
        self.stoi = {c: i for i, c in enumerate(ALPHABET)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:n], data[n:]
        self.vocab_size = len(ALPHABET)

    def decode(self, ids) -> str:
        return "".join(ALPHABET[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text if c in self.stoi]

    def batch(self, split: str, batch_size: int, block_size: int, gen: torch.Generator):
        data = self.train if split == "train" else self.val
        ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
        x = torch.stack([data[i:i + block_size] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix.tolist()])
        return x, y
