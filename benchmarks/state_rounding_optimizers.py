"""Does a bf16 state rounded to nearest hurt other optimizers as it hurts Adam's second moment?

The gate's optimizer-state rule rejects a mode that keeps Adam's ``exp_avg_sq`` in bf16 rounded
to nearest when beta2 is above 1 - 2**-8: a step then moves the moment by less than half a bf16
ulp, so it cannot decrease. Pure bf16 keeps every optimizer's state in bf16, so the same
question stands for the running statistics of Adagrad (``sum``, which only grows: its relative
increments fall as 1/t), Adafactor (``row_var``/``col_var``, whose beta2 climbs towards 1) and
RMSprop (``square_avg``, alpha 0.99). Here each trains a regression MLP in fp32 for ``--steps``
steps, once as is and once with only that state rounded to bf16 (nearest) after every step,
over ``--seeds`` seeds; Adam's ``exp_avg_sq`` is the control the rule rests on. The change in
held-out loss is given in percent and in fp32 seed deviations.

    python -m benchmarks.state_rounding_optimizers [--steps 10000] [--seeds 5]
    python -m benchmarks.state_rounding_optimizers --quick    # 300 steps, 2 seeds: the CI variant
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.seeded_runs import run_arguments, seeded_regression

OPTIMIZERS: dict[str, tuple[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], str]] = {
    "AdamW lr 1e-3 (control)": (lambda p: torch.optim.AdamW(p, lr=1e-3), "exp_avg_sq"),
    "Adagrad lr 1e-2": (lambda p: torch.optim.Adagrad(p, lr=1e-2), "sum"),
    "Adafactor lr 1e-2": (lambda p: torch.optim.Adafactor(p, lr=1e-2), "row_var,col_var,variance"),
    "RMSprop lr 1e-3": (lambda p: torch.optim.RMSprop(p, lr=1e-3), "square_avg"),
}


@dataclass(frozen=True)
class Row:
    optimizer: str
    state: str
    steps: int
    fp32: tuple[float, ...]
    rounded: tuple[float, ...]

    @property
    def change(self) -> float:
        return statistics.mean(self.rounded) / statistics.mean(self.fp32) - 1

    @property
    def deviations(self) -> float:
        spread = statistics.stdev(self.fp32) if len(self.fp32) > 1 else 0.0
        gap = statistics.mean(self.rounded) - statistics.mean(self.fp32)
        return gap / spread if spread else float("inf")


def _round_to_bf16(optimizer: torch.optim.Optimizer, keys: tuple[str, ...]) -> None:
    for state in optimizer.state.values():
        for key in keys:
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.copy_(value.to(torch.bfloat16))


def heldout_loss(name: str, seed: int, steps: int, round_state: bool) -> float:
    """Held-out MSE after ``steps`` fp32 steps of ``name`` (its state rounded or not)."""
    make, keys = OPTIMIZERS[name]
    task = seeded_regression(seed)
    model = task.model
    optimizer = make(model.parameters())
    order = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = task.batches[int(torch.randint(0, len(task.batches), (1,), generator=order))]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if round_state:
            _round_to_bf16(optimizer, tuple(keys.split(",")))
    with torch.no_grad():
        return statistics.mean(float(nn.functional.mse_loss(model(x), y)) for x, y in task.heldout)


def main(argv: list[str] | None = None) -> list[Row]:
    _, steps, seeds = run_arguments(__doc__, argv, steps=10_000, seeds=5, quick=(300, 2))
    print(f"{'optimizer':<26} {'state rounded':<26} {'fp32 held-out':>16} {'rounded':>10} change")
    rows = []
    for name, (_, keys) in OPTIMIZERS.items():
        fp32 = tuple(heldout_loss(name, seed, steps, False) for seed in range(seeds))
        rounded = tuple(heldout_loss(name, seed, steps, True) for seed in range(seeds))
        row = Row(name, keys, steps, fp32, rounded)
        print(
            f"{name:<26} {keys:<26} {statistics.mean(fp32):>9.5f} ± {statistics.stdev(fp32):.5f}"
            f" {statistics.mean(rounded):>10.5f} {row.change:+.1%} ({row.deviations:+.1f} sd)",
            flush=True,
        )
        rows.append(row)
    print(f"{steps} steps, {seeds} seeds each; only the named state is rounded (weights fp32)")
    return rows


if __name__ == "__main__":
    main()
