"""An MLP whose hidden layers are raw ``nn.Parameter`` matmuls (``x @ self.w``), not nn.Linear.

Many research codebases write layers this way. FP8 module swapping (torchao, Transformer
Engine) replaces nn.Linear modules, so it cannot reach these weights; autocast can.
Factory for the CLI: ``autoprec probe --model examples.raw_param_mlp:make_model``.
"""

from __future__ import annotations

import torch
from torch import nn


class RawParamMLP(nn.Module):
    def __init__(self, features: int = 64, hidden: int = 256, outputs: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.w1 = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = h + torch.relu(h @ self.w1) @ self.w2
        return self.head(self.norm(h))


def make_model(batch_size: int = 32, seed: int = 0) -> tuple[RawParamMLP, torch.Tensor]:
    """A RawParamMLP and a batch of random features."""
    torch.manual_seed(seed)
    return RawParamMLP(), torch.randn(batch_size, 64)


def make_batches(count: int = 32, batch_size: int = 32, seed: int = 0) -> list:
    """Regression of sin(x W) for a fixed random W. Data factory for the CLI
    (``--loss examples.raw_param_mlp:loss_fn``)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 16, generator=generator) / 8
    batches = []
    for _ in range(count):
        x = torch.randn(batch_size, 64, generator=generator)
        batches.append((x, torch.sin(x @ weight)))
    return batches


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return nn.functional.mse_loss(output.float(), target)
