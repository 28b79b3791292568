"""Is tune()'s pick under a short budget as good as an exhaustive grid's best? Prints figures.

For each task: every candidate mode runs long (no budget, no pruning) and is judged by the drift
gate; every accepted mode is then re-timed in two interleaved rounds (forward and reverse order:
on our CPU machines whichever run comes first in a sequence is several percent slower, so single
runs misrank close modes). Then tune() runs under a short budget. Printed per objective: the
pick's throughput as a fraction of the best accepted mode's (target >= 0.95; both from the
grid's re-timed figures), its memory against the leanest accepted mode, and the budget used.

    python -m benchmarks.decision_quality [--steps 200] [--budget 0.5]
"""

from __future__ import annotations

import argparse
import logging
import time

from autoprec.candidates import candidate_specs
from autoprec.drift import judge
from autoprec.probing import probe
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.tuning import tune
from benchmarks import objects_frozen
from examples import tasks, tiny_gpt


def _tasks() -> dict[str, tuple[tasks.Task, object]]:
    gpt_model, _ = tiny_gpt.make_small_model()
    gpt_batches = tiny_gpt.make_small_batches()
    import torch

    gpt = tasks.Task(
        gpt_model,
        gpt_batches[:-4],
        gpt_batches[-4:],
        torch.optim.AdamW(gpt_model.parameters(), lr=3e-4),
    )
    regression = tasks.regression(lr=1e-4)
    return {
        "regression MLP (AdamW 1e-4)": (regression, regression.mse),
        "TinyGPT small (AdamW 3e-4)": (gpt, None),
    }


@objects_frozen
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", type=float, default=0.5, help="tune() budget in minutes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    for title, (task, loss_fn) in _tasks().items():
        common = {"optimizer": task.optimizer, "loss_fn": loss_fn}
        recipe = TrainingRecipe(**common)
        specs = candidate_specs(probe(task.model, task.batches[0][0])).specs
        started = time.monotonic()
        long = {"recipe": recipe, "heldout": task.heldout, "steps": args.steps}
        reference = run_trial(ModeSpec(mode="fp32"), task.model, task.batches, **long)
        noise = run_trial(
            ModeSpec(mode="fp32"), task.model, task.batches, seed=1, shuffle_seed=1, **long
        )
        grid = {}
        for spec in specs:
            result = (
                reference
                if spec.label == "fp32"
                else run_trial(spec, task.model, task.batches, **long)
            )
            grid[spec.label] = (result.record, judge(result, reference, noise).accepted)
        accepted = {label: record for label, (record, ok) in grid.items() if ok}
        by_label = {spec.label: spec for spec in specs}
        timed: dict[str, list[float]] = {label: [] for label in accepted}
        for order in (list(accepted), list(accepted)[::-1]):
            for label in order:
                record = run_trial(
                    by_label[label], task.model, task.batches, steps=args.steps // 2, recipe=recipe
                ).record
                timed[label].append(record.samples_per_second or 0.0)
        speed_of = {label: sum(values) / len(values) for label, values in timed.items()}
        grid_seconds = time.monotonic() - started
        print(
            f"\n== {title}: exhaustive grid {len(grid)} modes x {args.steps} steps + "
            f"re-timing in {grid_seconds:.0f} s; accepted (samples/s): "
            + ", ".join(f"{label} {speed:.0f}" for label, speed in speed_of.items())
        )
        best_speed = max(speed_of.values())
        least_memory = min(r.state_bytes.total for r in accepted.values() if r.state_bytes)
        for objective in ("speed", "memory"):
            result = tune(
                task.model,
                task.batches + task.heldout,
                budget_minutes=args.budget,
                objective=objective,
                **common,
            )
            pick = result.chosen.label
            record = grid[pick][0] if pick in grid else None
            speed = speed_of.get(pick, float("nan")) / best_speed
            memory = (
                record.state_bytes.total / least_memory
                if record and record.state_bytes
                else float("nan")
            )
            print(
                f"  {objective:7} pick {pick:22} throughput {speed:5.2f} of best accepted, "
                f"memory {memory:5.2f} x leanest accepted; budget "
                f"{result.budget.used_seconds:.0f} of {result.budget.budget_seconds:.0f} s "
                f"({result.budget.trials_run} trials of {result.budget.trial_steps} steps)"
            )


if __name__ == "__main__":
    main()
