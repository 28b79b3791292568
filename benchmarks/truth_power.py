"""Can the truth see the harm? Chosen task x mode pairs read again on more seeds.

``benchmarks.ground_truth`` calls a mode harmful when the mean of its 3 long runs ends worse
than 8 fp32 runs' mean by 3 standard errors of the difference. Where the fp32 seeds spread
widely that line sits far out (the SGD conv net's 325 test images: +72.5% of its mean), so a
"fine" there means only "not worse by more than the line", and a gate that rejects the mode is
scored a false reject whatever the mode really costs. This trains more seeds of the pairs asked
for, from the same cache as the truth (its runs at seeds 0-2 and fp32's 0-7 are reused), and
reads each pair again: the means truth at the larger counts, and the paired differences (each
mode run minus the fp32 run of its seed) with their standard error.

    python -m benchmarks.truth_power --tasks convnet_sgd --modes bf16_pure,bf16_pure+8bit-optim
    python -m benchmarks.truth_power --tasks recommender --modes bf16_pure+8bit-optim \
        --keep-fp32 mlp.0    # which layers carry a harm: the pair again with mlp.0 in fp32

Default: 16 fp32 seeds and 8 of each mode, 2000-step runs; ``--quick`` (CI) checks that it runs
and reads (digits_mlp, 300-step runs, 4 fp32 seeds and 3 of pure bf16), not the truth.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from autoprec.run_inputs import checked_keep_fp32
from autoprec.screening import screen_setup
from autoprec.specs import ModeSpec
from benchmarks import objects_frozen
from benchmarks.ground_truth import (
    ALL_TASKS,
    FULL_SEEDS,
    HURT_SDS,
    GroundTask,
    chosen_tasks,
    fp32_metrics,
    hurt_line,
    mode_runs,
    paired_differences,
    refuse_unpaired_seeds,
    runs_metric,
    task_parser,
)

DEFAULT_TASKS = ("convnet_sgd",)
DEFAULT_MODES = ("bf16_pure", "bf16_pure+8bit-optim")
"""The pairs this was written for: the gate rejects both (updates lost at the schedule's floor
lr) and the truth calls both fine, on a line at +72.5% of the fp32 mean (8 fp32 seeds)."""


@dataclass(frozen=True)
class PowerRow:
    task: str
    label: str
    fp32_runs: int
    mode_runs: int
    difference: float
    """The mode's mean minus the fp32 mean, as a share of the fp32 mean."""
    line: float
    """The means truth's line at these counts, as a share of the fp32 mean."""
    paired: float
    """The mean paired difference (mode run minus the fp32 run of its seed), as a share."""
    paired_error: float
    """Its standard error, as a share of the fp32 mean."""

    @property
    def hurts(self) -> bool:
        return self.difference > self.line

    @property
    def paired_sds(self) -> float:
        """The mean paired difference in its standard errors (inf with no spread)."""
        return self.paired / self.paired_error if self.paired_error else math.inf


def specs_by_label(task: GroundTask, labels: list[str]) -> list[ModeSpec]:
    """The specs ``check()`` builds for ``labels`` on ``task`` (its cache keys are theirs); a
    mode that cannot run here raises autoprec's own error, naming why."""
    eight_bit = "+8bit-optim"
    modes = sorted(
        {label.split("+")[0] + (eight_bit if label.endswith(eight_bit) else "") for label in labels}
    )  # "fp8_torchao+tensorwise+emulated" is the mode fp8_torchao
    setup = screen_setup(task.model, task.batches, task.recipe, modes=modes, eval_fn=task.eval_fn)
    found = {spec.label: spec for spec in setup.candidates.specs}
    missing = [label for label in labels if label not in found]
    if missing:
        raise SystemExit(f"{task.name}: check() builds no {missing}; it builds {sorted(found)}")
    return [found[label] for label in labels]


def kept_in_fp32(task: GroundTask, spec: ModeSpec, patterns: list[str]) -> ModeSpec:
    """``spec`` keeping the modules ``patterns`` name in fp32 besides those ``check()`` keeps
    (its cache key is another: a run of the mode as ``check()`` builds it is never read as
    this one's); each pattern is checked as ``tune(keep_fp32=...)`` checks it."""
    try:
        extra = checked_keep_fp32(task.model, patterns)
    except ValueError as error:
        raise SystemExit(f"{task.name}: --keep-fp32: {error}") from error
    return spec.model_copy(update={"keep_fp32": tuple(dict.fromkeys([*spec.keep_fp32, *extra]))})


def read_pair(
    task: GroundTask, spec: ModeSpec, fp32: list[float], seeds: int, steps: int, cache: Path
) -> PowerRow:
    """The pair's truth from ``len(fp32)`` fp32 runs and ``seeds`` of the mode's."""
    runs = mode_runs(cache, task, spec, steps, seeds)
    metric, _, _ = runs_metric(runs)
    mean = statistics.fmean(fp32)
    differences = paired_differences(runs, fp32)  # () when a run failed
    if differences:
        paired = statistics.fmean(differences)
        spread = statistics.stdev(differences) if len(differences) > 1 else 0.0
        error = spread / math.sqrt(len(differences))
    else:
        paired, error = math.inf, 0.0
    return PowerRow(
        task=task.name,
        label=spec.label,
        fp32_runs=len(fp32),
        mode_runs=len(runs),
        difference=(metric - mean) / abs(mean),
        line=hurt_line(fp32, len(runs)) / abs(mean),
        paired=paired / abs(mean),
        paired_error=error / abs(mean),
    )


def shown(row: PowerRow) -> str:
    return (
        f"  {row.label:24} {row.fp32_runs:2} fp32 / {row.mode_runs} runs: "
        f"{row.difference:+.1%} against a line at {row.line:+.1%} "
        f"({'HURTS' if row.hurts else 'fine'}); paired {row.paired:+.1%} "
        f"+- {row.paired_error:.1%} ({row.paired_sds:+.1f} standard errors, "
        f"{'past' if row.paired_sds > HURT_SDS else 'within'} {HURT_SDS:g})"
    )


@objects_frozen
def main(argv: list[str] | None = None) -> list[PowerRow]:
    parser = task_parser(__doc__, quick="digits_mlp, bf16_pure, 300 steps, 4/3 seeds (CI)")
    parser.add_argument("--modes", help="comma-separated labels (default: the SGD conv net's)")
    parser.add_argument("--fp32-seeds", type=int, default=16)
    parser.add_argument("--mode-seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of a long run")
    parser.add_argument(
        "--keep-fp32",
        help="comma-separated module names or patterns every mode keeps in fp32 besides "
        "check()'s own: which layers carry a harm",
    )
    parser.add_argument("--cache", type=Path, default=Path("runs/ground_truth"))
    args = parser.parse_args(argv)
    names = chosen_tasks(
        parser, args, default=DEFAULT_TASKS, quick=("digits_mlp",), known=ALL_TASKS
    )
    labels = args.modes.split(",") if args.modes else list(DEFAULT_MODES)
    if args.quick:
        labels, steps, fp32_seeds, mode_seeds = ["bf16_pure"], 300, 4, 3
    else:
        steps, fp32_seeds, mode_seeds = args.steps, args.fp32_seeds, args.mode_seeds
    refuse_unpaired_seeds(parser, fp32_seeds, mode_seeds)
    rows = []
    for name in names:
        task = ALL_TASKS[name](steps)
        specs = specs_by_label(task, labels)
        if args.keep_fp32:
            specs = [kept_in_fp32(task, spec, args.keep_fp32.split(",")) for spec in specs]
        fp32 = fp32_metrics(args.cache, task, steps, fp32_seeds)
        print(f"\n{name}: fp32 over {fp32_seeds} seeds {statistics.fmean(fp32):.5g}", flush=True)
        truths = dict.fromkeys(  # the truth's own counts first, then the larger ones
            [
                (min(FULL_SEEDS.fp32, fp32_seeds), min(FULL_SEEDS.mode, mode_seeds)),
                (fp32_seeds, mode_seeds),
            ]
        )
        for spec in specs:
            for fp32_runs, seeds in truths:
                row = read_pair(task, spec, fp32[:fp32_runs], seeds, steps, args.cache)
                if args.keep_fp32:
                    row = replace(row, label=f"{row.label} keeping {args.keep_fp32} in fp32")
                print(shown(row), flush=True)
                rows.append(row)
    return rows


if __name__ == "__main__":
    main()
