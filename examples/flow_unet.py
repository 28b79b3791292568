"""A small U-Net trained with flow matching (rectified flow) on synthetic 16x16 images.

The scenario autoprec was built for (../shared/seeds/000): pure bf16 training where the loss
curve looks normal but generated images are not. ``eval_fn`` samples images in a few Euler steps
from fixed noise and scores them against the data (lower is better), so the drift gate judges
the samples, not only the loss.

    autoprec tune examples.flow_unet:make_model --data examples.flow_unet:make_batches \\
        --loss examples.flow_unet:loss_fn --eval examples.flow_unet:eval_fn --budget 2 \\
        --out runs/flow_unet.json
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.nn import functional as F

SIZE = 16
SQUARE_SIZES = range(4, 9)
"""Side lengths of the bright squares the images hold."""


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    frequencies = torch.exp(-math.log(1000.0) * torch.arange(half, device=t.device) / half)
    angles = t[:, None].float() * 1000.0 * frequencies[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, time_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(8, channels_in)
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.time = nn.Linear(time_dim, channels_out)
        self.norm2 = nn.GroupNorm(8, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.skip = (
            nn.Conv2d(channels_in, channels_out, 1)
            if channels_in != channels_out
            else (nn.Identity())
        )

    def forward(self, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(time)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class FlowUNet(nn.Module):
    """Two resolutions, one residual block each way, time-conditioned; predicts velocity."""

    def __init__(self, channels: int = 32, time_dim: int = 64) -> None:
        super().__init__()
        self.time_dim = time_dim
        self.time_mlp = nn.Sequential(
            nn.Linear(time_dim, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim)
        )
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.down = ResBlock(channels, channels, time_dim)
        self.pool = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.middle = ResBlock(2 * channels, 2 * channels, time_dim)
        self.upsample = nn.ConvTranspose2d(2 * channels, channels, 2, stride=2)
        self.up = ResBlock(2 * channels, channels, time_dim)
        self.out = nn.Conv2d(channels, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        time = self.time_mlp(_timestep_embedding(t, self.time_dim))
        h1 = self.down(self.stem(x), time)
        h2 = self.middle(self.pool(h1), time)
        h = self.up(torch.cat([self.upsample(h2), h1], dim=1), time)
        return self.out(h)


def make_images(count: int, generator: torch.Generator) -> torch.Tensor:
    """Bright squares of random size and position on a dark background, in [-1, 1]."""
    sizes = torch.randint(SQUARE_SIZES.start, SQUARE_SIZES.stop, (count,), generator=generator)
    images = []
    for size in sizes.tolist():
        row, col = torch.randint(0, SIZE - size + 1, (2,), generator=generator).tolist()
        images.append(_square(size, row, col))
    return torch.stack(images)


def _square(size: int, row: int, col: int) -> torch.Tensor:
    """One image: a bright ``size`` x ``size`` square at (row, col) on a dark background."""
    image = -torch.ones(1, SIZE, SIZE)
    image[0, row : row + size, col : col + size] = 1.0
    return image


def make_batches(
    count: int = 40, batch_size: int = 32, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Flow-matching batches ``(x_t, t, velocity)``: noise, time and path fixed per batch, so every
    trial sees the same ones. Data factory for the CLI."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        data = make_images(batch_size, generator)
        noise = torch.randn(data.shape, generator=generator)
        t = torch.rand(batch_size, generator=generator)
        x_t = (1 - t[:, None, None, None]) * noise + t[:, None, None, None] * data
        batches.append((x_t, t, data - noise))
    return batches


def loss_fn(output: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """Flow-matching loss: mean squared error of the predicted velocity."""
    return F.mse_loss(output.float(), velocity)


@functools.cache
def possible_images() -> torch.Tensor:
    """Every image the data can hold (each square size at each position: 615 images), built
    on first use, not at import."""
    return torch.stack(
        [
            _square(size, row, col)
            for size in SQUARE_SIZES
            for row in range(SIZE - size + 1)
            for col in range(SIZE - size + 1)
        ]
    )


@torch.no_grad()
def sample(model: nn.Module, count: int = 64, steps: int = 8, seed: int = 7) -> torch.Tensor:
    """Euler integration of the learned velocity field from fixed noise (t: 0 -> 1)."""
    parameter = next(model.parameters())
    x = torch.randn(count, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))
    x = x.to(parameter.device)
    for step in range(steps):
        t = torch.full((count,), step / steps, device=x.device)
        x = x + model(x, t).float() / steps
    return x.float().cpu()


def eval_fn(model: nn.Module) -> float:
    """Sample quality, lower is better: the mean distance (RMS per pixel) from each of 256
    samples to the nearest image the data can hold, so a perfect sample scores 0.

    It used to measure against 256 random real images, where a perfect sample scored 0.27 on
    average (65% of possible images were not among them) and a trained model 0.32: the floor
    hid most of the difference between models (benchmarks/ground_truth.py, flow_unet)."""
    samples = sample(model, count=256).flatten(1)
    distances = torch.cdist(samples, possible_images().flatten(1))
    return float(distances.min(dim=1).values.mean() / math.sqrt(SIZE * SIZE))


def make_model(seed: int = 0) -> tuple[FlowUNet, tuple[torch.Tensor, torch.Tensor]]:
    """A FlowUNet and an example input ``(x_t, t)``. Model factory for the CLI."""
    torch.manual_seed(seed)
    x_t, t, _ = make_batches(count=1, batch_size=4)[0]
    return FlowUNet(), (x_t, t)
