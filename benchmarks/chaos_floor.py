"""How far two fp32 runs of a model without random draws drift apart: the chaos floor.

A model that draws no random numbers gets no paired run: a second fp32 run on the same batches
would repeat the reference, so the weight-movement and output checks fall back to their fixed
floors (0.8 of the movement, 10% of the outputs). A chaotic training run breaks that premise:
a difference far below any precision change grows to the size of the trajectory's own spread,
and a faithful mode is rejected (examples/README: small_convnet's amp_bf16).

This benchmark trains, at the gate's trial length, the fp32 reference, an fp32 run whose initial
weights are nudged (each element times 1 +- 2**-12, ``model_copies.NUDGE``, signs from a
generator of its own), and amp_bf16, all with the same seed (a model with dropout draws the
same masks in each: what a trial sharing the reference's draws is judged against), and
prints:

- the nudged run's output difference and movement projection: the chaos floor;
- amp_bf16's, with its verdict under the fixed floors and against the nudged run as the paired
  run (what a nudged paired run for models without draws would give).

    python -m benchmarks.chaos_floor [--steps 82]
    python -m benchmarks.chaos_floor --quick    # 4 steps, without the dropout variant: CI
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.drift import _relative_error, judge
from autoprec.model_copies import nudge_weights
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.trial_records import TrialResult
from benchmarks import objects_frozen
from examples import small_convnet, tasks


@dataclass(frozen=True)
class ChaosTask:
    name: str
    model: nn.Module
    train: list[Any]
    heldout: list[Any]
    recipe: TrainingRecipe


def _small_convnet() -> ChaosTask:
    """examples/README's documented command: AdamW lr 1e-3, clip 1."""
    torch.manual_seed(0)
    model, _ = small_convnet.make_model()
    batches = small_convnet.make_batches()
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=small_convnet.loss_fn,
        clip_grad_norm=1.0,
    )
    return ChaosTask("small_convnet", model, batches[:-4], batches[-4:], recipe)


def _small_convnet_dropout() -> ChaosTask:
    """The same with dropout 0.2 before the head: a model with random draws whose trials draw
    the reference's (every trial takes its seed), so the nudged run keeps those draws too."""
    task = _small_convnet()
    task.model.head = nn.Sequential(nn.Dropout(0.2), task.model.head)
    return task


def _regression() -> ChaosTask:
    task = tasks.regression()  # AdamW at lr 1e-4, built here for each trial's copy
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4), loss_fn=task.mse
    )
    return ChaosTask("regression", task.model, task.batches, task.heldout, recipe)


TASKS = {
    "small_convnet": _small_convnet,
    "small_convnet_dropout": _small_convnet_dropout,
    "regression": _regression,
}
QUICK_TASKS = ("small_convnet", "regression")
QUICK_STEPS = 4
"""``--quick``'s trial length: it checks that every figure comes out, not the floor (amp_bf16's
12-step conv trial took 45 s on our CPU without bf16 instructions, fp32's 3.8 s)."""


def nudged(model: nn.Module, seed: int = 7) -> nn.Module:
    """A copy of ``model`` nudged by 2^-12 (``model_copies.nudge_weights``)."""
    copied = copy.deepcopy(model)
    nudge_weights(copied, seed)
    return copied


def measure(task: ChaosTask, steps: int) -> dict[str, Any]:
    """The chaos floor and amp_bf16's figures on ``task`` at ``steps`` trial steps."""
    common = {"recipe": task.recipe, "steps": steps, "heldout": task.heldout}

    def trial(spec: ModeSpec, model: nn.Module) -> TrialResult:
        return run_trial(spec, model, task.train, **common)

    reference = trial(ModeSpec(mode="fp32"), task.model)
    chaos = trial(ModeSpec(mode="fp32"), nudged(task.model))
    amp = trial(ModeSpec(mode="amp_bf16"), task.model)
    fixed = judge(amp, reference, reference)
    against_chaos = judge(amp, reference, reference, paired=chaos)
    return {
        "chaos_output_error": _relative_error(chaos.heldout_outputs, reference.heldout_outputs)[0],
        "chaos_movement": against_chaos.metrics.update_fraction_noise,
        "amp_output_error": fixed.metrics.output_error,
        "amp_movement": fixed.metrics.update_fraction,
        "amp_fixed_floors": fixed.reasons,
        "amp_against_chaos": against_chaos.reasons,
    }


@objects_frozen
def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=82, help="trial steps (tune picked 82)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps (CI)")
    args = parser.parse_args(argv)
    steps = QUICK_STEPS if args.quick else args.steps
    results = {}
    for name in QUICK_TASKS if args.quick else TASKS:
        figures = measure(TASKS[name](), steps)
        results[name] = figures
        print(
            f"{name} ({steps} steps): nudged fp32 run: outputs "
            f"{figures['chaos_output_error']:.1%} apart, movement {figures['chaos_movement']:.3f}"
            f"; amp_bf16: outputs {figures['amp_output_error']:.1%} apart, movement "
            f"{figures['amp_movement']:.3f}"
        )
        for label, reasons in (
            ("fixed floors", figures["amp_fixed_floors"]),
            ("against the nudged run", figures["amp_against_chaos"]),
        ):
            print(f"  amp_bf16, {label}: {'rejected: ' + reasons[0] if reasons else 'accepted'}")
    return results


if __name__ == "__main__":
    main()
