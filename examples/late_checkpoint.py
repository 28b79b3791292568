"""Would FP8 hurt my model at the loss my run reaches? Check from a late checkpoint.

A regression MLP trains in fp32 (AdamW, cosine decay 3e-3 -> 3e-5) and saves a checkpoint, as a
real run does. Then ``autoprec.check()`` screens FP8 (torchao, emulated where the hardware has
none) and AMP bf16 twice: from the initial weights, and from the checkpoint at the lr the run
ends at. FP8's cost is a floor of its forward pass that matters only once the loss is low: from
the start it passes; from the checkpoint the gate reads the same trained weights in FP8 and in
fp32 and rejects it ("the mode's forward pass alone costs ..."). The CLI does the same with
``autoprec check ... --weights CHECKPOINT.pt --lr LR``.

    python -m examples.late_checkpoint [--steps 3000] [--out runs/regression_checkpoint.pt]
"""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path

import torch

import autoprec
from autoprec.screening import QualityReport
from examples import tasks

PEAK_LR, FINAL_LR = 3e-3, 3e-5
MODES = ["amp_bf16", "fp8_torchao"]


def train_and_save(task: tasks.Task, steps: int, out: Path) -> None:
    """fp32 training as a user's run does it; its weights saved with ``torch.save``."""
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=PEAK_LR)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=FINAL_LR)
    for step in range(steps):
        x, y = task.batches[step % len(task.batches)]
        optimizer.zero_grad()
        task.mse(task.model(x), y).backward()
        optimizer.step()
        schedule.step()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": task.model.state_dict(), "step": steps}, out)


def screen(task: tasks.Task, model: torch.nn.Module, lr: float) -> QualityReport:
    return autoprec.check(
        model,
        task.batches + task.heldout,  # check() holds out the last batches itself
        loss_fn=task.mse,
        optimizer=functools.partial(torch.optim.AdamW, lr=lr),
        modes=MODES,
        progress=False,
    )


def main(argv: list[str] | None = None) -> dict[str, QualityReport]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=3000, help="fp32 training steps")
    parser.add_argument("--out", type=Path, default=Path("runs/regression_checkpoint.pt"))
    args = parser.parse_args(argv)
    task = tasks.regression()
    initial = copy.deepcopy(task.model)
    train_and_save(task, args.steps, args.out)
    checkpoint = copy.deepcopy(initial)  # the same architecture, loaded from the file
    checkpoint.load_state_dict(torch.load(args.out, weights_only=True)["model"])
    reports = {
        "from the initial weights": screen(task, initial, PEAK_LR),
        f"from the checkpoint ({args.out}, lr {FINAL_LR:g})": screen(task, checkpoint, FINAL_LR),
    }
    for start, report in reports.items():
        print(f"\n{start}:\n{report.summary()}")
    return reports


if __name__ == "__main__":
    main()
