"""Small synthetic training tasks (CPU, seconds) for tests and benchmarks of the drift gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Task:
    model: nn.Module
    batches: list[Any]
    heldout: list[Any]
    optimizer: torch.optim.Optimizer

    def mse(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output.float(), target)


def regression(lr: float = 1e-4, batches: int = 60, dropout: float = 0.0) -> Task:
    """sin(x W) regression with an MLP; AdamW at ``lr`` (1e-4: pure bf16 loses its updates);
    ``dropout`` after the hidden layers (a model that draws random numbers)."""
    torch.manual_seed(0)

    def dropped() -> list[nn.Module]:  # no module at all without dropout
        return [nn.Dropout(dropout)] if dropout else []

    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.LayerNorm(64),
        *dropped(),
        nn.Linear(64, 64),
        nn.GELU(),
        *dropped(),
        nn.Linear(64, 16),
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn((batches + 4) * 64, 32, generator=generator)
    y = torch.sin(x @ (torch.randn(32, 16, generator=generator) / 5))
    pairs = [(x[i : i + 64], y[i : i + 64]) for i in range(0, len(x), 64)]
    return Task(
        model, pairs[:batches], pairs[batches:], torch.optim.AdamW(model.parameters(), lr=lr)
    )


class Amplify(nn.Module):
    """Scales activations up and back down: harmless in fp32 and bf16, beyond fp16 range."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.inner = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.factor) / self.factor


def fp16_range(factor: float) -> Task:
    """Activations around ``factor``: 1e5 overflows fp16 (max 65504), 3e4 only nears it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Amplify(factor), nn.Linear(32, 8))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24 * 32, 16, generator=generator)
    y = torch.randn(24 * 32, 8, generator=generator) * 0.1
    pairs = [(x[i : i + 32], y[i : i + 32]) for i in range(0, len(x), 32)]
    return Task(model, pairs[:20], pairs[20:], torch.optim.AdamW(model.parameters(), lr=1e-3))
