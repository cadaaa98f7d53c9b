"""What test_distributed's ranks compute on, a function of the rank alone (torch only: the test's reference uses it)."""
from __future__ import annotations

import torch

STEPS = 3  # DDP steps; the last runs two micro-batches, the first under no_sync


def inputs(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {"f": torch.randn(6, generator=g), "i": torch.randint(-5, 6, (6,), generator=g),
            "p": torch.rand(6, generator=g) + 0.5, "big": torch.randn(4, 8, generator=g)}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's full batch (16 rows): rank r trains on rows r*16/world.. of it."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, 16, 64, generator=g), torch.randn(STEPS, 16, 64, generator=g)
