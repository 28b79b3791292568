"""A small residual conv net for 32x32 images (CIFAR-sized), 10 classes.

Factory for the CLI: ``autoprec probe --model examples.small_convnet:make_model``.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.stage1 = ResidualBlock(width)
        self.down = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
        )
        self.stage2 = ResidualBlock(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(images))))
        return self.head(self.pool(x).flatten(1))


def make_model(batch_size: int = 8, seed: int = 0) -> tuple[SmallConvNet, torch.Tensor]:
    """A SmallConvNet and a batch of random images."""
    torch.manual_seed(seed)
    return SmallConvNet(), torch.randn(batch_size, 3, 32, 32)


def make_batches(count: int = 32, batch_size: int = 32, seed: int = 0) -> list:
    """A learnable 10-class task: each class is a fixed random 3x32x32 template plus noise.

    Data factory for the CLI (``--loss examples.small_convnet:loss_fn``).
    """
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, 32, 32, generator=generator)
    batches = []
    for _ in range(count):
        labels = torch.randint(0, 10, (batch_size,), generator=generator)
        images = templates[labels] + 2.0 * torch.randn(batch_size, 3, 32, 32, generator=generator)
        batches.append((images, labels))
    return batches


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the class logits."""
    return nn.functional.cross_entropy(logits.float(), labels)
