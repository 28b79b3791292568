"""A LightningModule trained by a Lightning Trainer, tuned and applied by autoprec.

The lines autoprec adds to an ordinary Lightning script end with ``# autoprec`` (three of them):
the import, ``tune_module`` (its ``training_step`` and ``configure_optimizers``, the Trainer's
accumulation and clipping) and the ``AutoprecPrecision`` plugin in the Trainer that trains.

    python -m examples.lightning_module [--budget MINUTES] [--smoke]
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from autoprec.integrations.lightning import AutoprecPrecision, tune_module  # autoprec


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(),
            nn.Linear(256, 16),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=300)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=generator)
    y = torch.sin(x @ torch.randn(64, 16, generator=generator) / 8)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=2.0, help="tuning budget, minutes")
    parser.add_argument("--smoke", action="store_true", help="a few steps (CI)")
    options = parser.parse_args(argv)
    torch.manual_seed(0)
    module, loader = Regression(), _loader()
    settings = {
        "max_steps": 10 if options.smoke else 300,
        "gradient_clip_val": 1.0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
    }
    budget = 0.3 if options.smoke else options.budget
    result = tune_module(module, loader, budget, trainer=pl.Trainer(**settings))  # autoprec
    trainer = pl.Trainer(**settings, plugins=[AutoprecPrecision(result.profile)])  # autoprec
    trainer.fit(module, loader)
    print(f"trained in {result.chosen.label}: {trainer.global_step} steps")


if __name__ == "__main__":
    main()
