"""Does a trial time a mode as the user's loop runs it, and how noisy is that timing?

For each mode, on the device at hand (a GPU when there is one), this runs ``--rounds`` rounds
of the same training two ways: a trial (``run_trial``, the speed figures tune() ranks by) and
the loop a user writes with ``apply()``'s plan (``gpu_validation.loop_speed``: warm-up steps,
then the steps timed between two synchronizations, nothing read back in between). Whichever
runs second in a pair can be measurably slower (allocator and cache state,
``benchmarks.plan_overhead``), so each round runs them in both orders and takes the geometric
mean of the two ``trial/loop`` ratios. Printed per mode:

- ``trial/loop``: the rounds' median and range (target 0.97-1.03; below it the trial charges the
  mode for work a real run does not do);
- the trial's and the loop's own spread over the runs (max / min - 1);
- the pruning race on identical modes: every pair of the mode's trials compared as the search
  compares a candidate with the best so far (``search.paired_step_ratio``: the later trial's
  first ``MIN_MEASURED_WINDOWS`` windows against the earlier one's on the same steps), its
  95th percentile and maximum. A ratio above ``1 + PRUNE_MARGIN`` is a mode that would be
  pruned as slower than itself.

    python -m benchmarks.trial_timing [--modes fp32,amp_bf16] [--rounds 3] [--steps 60]
        [--window-steps N] [--compile]
    python -m benchmarks.trial_timing --quick   # a small model, 1 round: the CI variant
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass, field

import torch

from autoprec.candidates import candidate_specs
from autoprec.probing import probe
from autoprec.recipe import TrainingRecipe
from autoprec.search import MIN_MEASURED_WINDOWS, PRUNE_MARGIN, paired_step_ratio
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.trial_records import StepWindow
from benchmarks import objects_frozen
from benchmarks.gpu_validation import loop_speed, validation_model
from examples import tiny_gpt

WARMUP_STEPS = 2
"""Steps before timing, in the trial (``run_trial``'s default) and in the loop alike."""


@dataclass
class ModeTiming:
    label: str
    trial: list[float] = field(default_factory=list)
    loop: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    """One per round: the geometric mean of trial/loop in the two orders."""
    race: list[float] = field(default_factory=list)
    """Every pair of this mode's trials compared as the pruning race compares a candidate
    with the best so far: the later one's first windows against the earlier one's."""


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1 if values and min(values) > 0 else float("nan")


def timing_model(quick: bool) -> tuple[str, torch.nn.Module, list]:
    """(device, model, batches): the GPU validation's 59M TinyGPT on a GPU; on a CPU the
    examples' default TinyGPT (0.47M parameters), or the small one with ``quick``."""
    if torch.cuda.is_available() or quick:
        return validation_model(quick)
    model, _ = tiny_gpt.make_model(batch_size=16)
    return "cpu", model, tiny_gpt.make_batches(count=24, batch_size=16)


def time_mode(
    spec: ModeSpec,
    model: torch.nn.Module,
    batches: list,
    device: str,
    steps: int,
    rounds: int,
    window_steps: int | None,
) -> ModeTiming:
    recipe = TrainingRecipe(optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    timing = ModeTiming(spec.label)
    windows: list[tuple[StepWindow, ...]] = []

    def trial() -> float:
        record = run_trial(
            spec,
            model,
            batches,
            recipe=recipe,
            steps=steps,
            warmup_steps=WARMUP_STEPS,
            window_steps=window_steps,
        ).record
        if record.failure is not None or not record.samples_per_second:
            raise RuntimeError(f"{spec.label}: the trial failed: {record.failure}")
        windows.append(record.windows)
        timing.trial.append(record.samples_per_second)
        return record.samples_per_second

    def loop() -> float:
        speed = loop_speed(spec, model, batches, steps - WARMUP_STEPS, device, WARMUP_STEPS)
        timing.loop.append(speed)
        return speed

    for _ in range(rounds):
        trial_first, loop_second = trial(), loop()
        loop_first, trial_second = loop(), trial()
        timing.ratios.append((trial_first / loop_second * trial_second / loop_first) ** 0.5)
    for earlier, later in itertools.combinations(windows, 2):  # the best ran first
        first = [w for w in later if not w.warmup][:MIN_MEASURED_WINDOWS]
        paired = paired_step_ratio(earlier, first)
        if paired is not None:
            timing.race.append(paired[0])
    return timing


def report(timing: ModeTiming) -> str:
    race = sorted(timing.race)
    high = race[min(len(race) - 1, int(0.95 * len(race)))] if race else float("nan")
    pruned = sum(ratio > 1 + PRUNE_MARGIN for ratio in race)
    return (
        f"{timing.label:34} {statistics.median(timing.trial):10.1f} "
        f"{statistics.median(timing.loop):10.1f} {statistics.median(timing.ratios):10.3f} "
        f"{min(timing.ratios):6.3f}-{max(timing.ratios):5.3f} {spread(timing.trial):8.1%} "
        f"{spread(timing.loop):8.1%} {high:8.3f} {max(race, default=float('nan')):8.3f} "
        f"{pruned:>4}/{len(race)}"
    )


@objects_frozen
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, 1 round (CI)")
    parser.add_argument("--modes", help="canonical mode names (default: fp32 and amp_bf16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per trial")
    parser.add_argument("--window-steps", type=int, help="steps per timed window")
    parser.add_argument("--compile", action="store_true", help="torch.compile every run")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, model, batches = timing_model(args.quick)
    rounds, steps = (1, 12) if args.quick else (args.rounds, args.steps)
    wanted = (args.modes or "fp32,amp_bf16").split(",")
    candidates = candidate_specs(probe(model, batches[0][0])).specs
    missing = set(wanted) - {spec.label for spec in candidates}
    if missing:
        parser.error(
            f"not a candidate on this machine: {', '.join(sorted(missing))} (candidates: "
            f"{', '.join(spec.label for spec in candidates)})"
        )
    specs = [
        spec.model_copy(update={"compile": args.compile})
        for spec in candidates
        if spec.label in wanted
    ]
    print(
        f"device {device}, {torch.get_num_threads()} threads, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; {rounds} rounds of a "
        f"{steps}-step trial and loop ({WARMUP_STEPS} warm-up steps) in both orders"
        f"{', compiled' if args.compile else ''}; pruning margin {PRUNE_MARGIN:.0%}"
    )
    print(
        f"{'mode':34} {'trial s/s':>10} {'loop s/s':>10} {'trial/loop':>10} {'range':>12} "
        f"{'trial +-':>8} {'loop +-':>8} {'race 95%':>8} {'race max':>8} {'pruned':>8}"
    )
    for spec in specs:
        timing = time_mode(spec, model, batches, device, steps, rounds, args.window_steps)
        print(report(timing), flush=True)


if __name__ == "__main__":
    main()
