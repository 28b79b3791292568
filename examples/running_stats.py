"""An MLP whose first module standardises its inputs with running statistics it updates itself.

Observation normalisers in reinforcement learning, EMA codebooks in VQ-VAEs and hand-written
BatchNorm variants keep state this way: buffers changed in place by the forward pass in training
mode, outside the optimizer. Under pure bf16 those buffers are bf16 and every update rounds to
nearest, whatever rounding the optimizer uses: with momentum 1e-3 an update falls below half a
bf16 ulp once the mean is within a few times its own size of the target, and it stops there
(``python -m benchmarks.running_state_rounding``). The inputs here have mean 20 and std 3.

Factories for the CLI: ``autoprec check examples.running_stats:make_model --data
examples.running_stats:make_batches --loss examples.running_stats:loss_fn``.
"""

from __future__ import annotations

import torch
from torch import nn


class RunningStandardizer(nn.Module):
    """(x - running mean) / running std, the statistics updated with ``momentum`` per batch."""

    def __init__(self, features: int, momentum: float = 1e-3) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("var", torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0).to(self.mean.dtype), self.momentum)
                self.var.lerp_(x.var(0).to(self.var.dtype), self.momentum)
        return (x - self.mean) / (self.var + 1e-5).sqrt()


FEATURES = 16


def make_model(seed: int = 0) -> tuple[nn.Sequential, torch.Tensor]:
    """The standardiser, then a 2-hidden-layer MLP; and a batch of inputs."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        RunningStandardizer(FEATURES),
        nn.Linear(FEATURES, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 1),
    )
    return model, make_batches(count=1, seed=seed + 100)[0][0]


def make_batches(count: int = 64, batch_size: int = 128, seed: int = 1) -> list:
    """Regression of sin((x - 20) / 3) w for inputs of mean 20 and std 3."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(FEATURES, 1, generator=generator)
    batches = []
    for _ in range(count):
        x = torch.randn(batch_size, FEATURES, generator=generator) * 3 + 20
        batches.append((x, torch.sin((x - 20) / 3) @ weight))
    return batches


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return nn.functional.mse_loss(output.float(), target)
