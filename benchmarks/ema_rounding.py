"""An average of the weights (EMA) under bf16 weights: kept in bf16 it stops moving.

After ``apply()`` in a mode with bf16 weights (bf16_pure, bf16_sr, bf16_kahan, bf16_sr_kahan) the
model's weights are bf16, and so is any average made from it afterwards: ``torch.optim.swa_utils.
AveragedModel(model)`` deep-copies it, diffusers' ``EMAModel`` clones its parameters. With decay
0.999 an update moves the average by 0.1% of its distance to the weights, below half a bf16 ulp
(2**-9 of a value) once the two are close: it rounds away, and the average freezes. Diffusion
models sample from that average ("training loss fine, generated images garbage").

A regression MLP trains ``--steps`` steps in bf16_sr (``StochasticAdamW`` on bf16 weights), over
``--seeds`` seeds, with two averages of decay ``--decay`` beside it: what users write,
``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` (bf16, like the model), and
``AveragedModel(model, avg_fn=get_ema_avg_fn(decay)).float()`` (fp32; with ``multi_avg_fn`` the
fp32 copy fails to update from bf16 weights). Printed: held-out loss of the live weights and of
each average.

    python -m benchmarks.ema_rounding [--steps 3000] [--seeds 3] [--decay 0.999]
    python -m benchmarks.ema_rounding --quick    # 200 steps, 1 seed: the CI variant
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from autoprec.stochastic_optim import StochasticAdamW
from benchmarks.seeded_runs import run_arguments, seeded_regression
from examples import tasks


@dataclass(frozen=True)
class Run:
    live: float
    average_fp32: float
    average_bf16: float


def _heldout(model: nn.Module, task: tasks.Task) -> float:
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return statistics.mean(
            float(nn.functional.mse_loss(model(x.to(dtype)).float(), y)) for x, y in task.heldout
        )


def run(seed: int, steps: int, decay: float) -> Run:
    task = seeded_regression(seed)
    model = task.model.to(torch.bfloat16)  # as apply() leaves it in bf16_sr
    optimizer = StochasticAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), seed=seed)
    in_bf16 = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    in_fp32 = AveragedModel(model, avg_fn=get_ema_avg_fn(decay)).float()
    order = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = task.batches[int(torch.randint(0, len(task.batches), (1,), generator=order))]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        optimizer.step()
        in_bf16.update_parameters(model)
        in_fp32.update_parameters(model)
    live = _heldout(model, task)
    return Run(live, _heldout(in_fp32.module, task), _heldout(in_bf16.module, task))


def main(argv: list[str] | None = None) -> list[Run]:
    args, steps, seeds = run_arguments(
        __doc__,
        argv,
        steps=3000,
        seeds=3,
        quick=(200, 1),
        add=lambda parser: parser.add_argument("--decay", type=float, default=0.999),
    )
    runs = [run(seed, steps, args.decay) for seed in range(seeds)]
    print(f"bf16_sr regression MLP, {steps} steps, decay {args.decay}, {seeds} seed(s): held-out")
    for name, field in (
        ("live bf16 weights", "live"),
        ("average in fp32", "average_fp32"),
        ("average in bf16", "average_bf16"),
    ):
        values = [getattr(one, field) for one in runs]
        each = ", ".join(f"{value:.5f}" for value in values)
        print(f"  {name:<18} {statistics.mean(values):.5f}  ({each})")
    return runs


if __name__ == "__main__":
    main()
