"""Does the paired run's nudge move the gate's verdicts? ``check()`` on ground-truth tasks twice.

A model without random draws gets a paired fp32 run from weights nudged by ``NUDGE``
(``autoprec.model_copies``): its output difference and weight movement set the bars of the
output and movement checks. This benchmark runs ``autoprec.check()`` at the gate's trial length
on each task under two nudges (``--nudges``, default one fp32 ulp, 2^-23, the nudge until
2026-11-29, and today's 2^-12) and prints, per pair, both verdicts and the paired run's output
difference and movement; a verdict that moves is marked. Measured on 2026-11-29 (all 14 tasks,
172 pairs, one thread each, about 20 minutes a nudge): no verdict moved; the conv nets' paired
output difference rose from 0.0% to 3.6-4.0%, every other task's stayed under 0.3%.

    python -m benchmarks.paired_nudge [--tasks cosine_regression,...] [--trial-steps 200]
    python -m benchmarks.paired_nudge --quick     # digits_mlp, 30-step trials, 2 modes: CI
"""

from __future__ import annotations

import autoprec.model_copies as model_copies
from benchmarks.ground_truth import ALL_TASKS, chosen_tasks, gate, task_parser
from benchmarks.ground_truth_heldout import HELDOUT_TASKS
from benchmarks.ground_truth_tasks import TASKS

QUICK_MODES = ["amp_bf16", "bf16_pure"]


def verdicts(
    task_name: str, nudge: float, trial_steps: int, modes: list[str] | None
) -> dict[str, dict]:
    """Each mode's verdict on ``task_name`` with the paired run nudged by ``nudge``."""
    kept = model_copies.NUDGE
    model_copies.NUDGE = nudge
    try:
        report = gate(ALL_TASKS[task_name](2000), trial_steps, modes)
    finally:
        model_copies.NUDGE = kept
    return {
        verdict.label: {
            "status": verdict.status,
            "output": verdict.drift.get("output_error"),
            "output_noise": verdict.drift.get("output_error_noise"),
            "movement_noise": verdict.drift.get("update_fraction_noise"),
        }
        for verdict in report.verdicts
        if verdict.status in ("safe", "unsafe")  # judged: not failed or stopped
    }


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[dict, dict]]]:
    parser = task_parser(__doc__, quick="digits_mlp, 30-step trials, amp_bf16 and bf16_pure (CI)")
    parser.add_argument("--trial-steps", type=int, default=200, help="the gate's trial length")
    parser.add_argument(
        "--nudges", default="2**-23,2**-12", help="the two nudges, as powers of two (a**b)"
    )
    args = parser.parse_args(argv)
    names = chosen_tasks(
        parser, args, default=(*TASKS, *HELDOUT_TASKS), quick=("digits_mlp",), known=ALL_TASKS
    )
    before, after = (_power(text) for text in args.nudges.split(","))
    trial_steps, modes = (30, QUICK_MODES) if args.quick else (args.trial_steps, None)
    results: dict[str, dict[str, tuple[dict, dict]]] = {}
    moved = 0
    for name in names:
        old = verdicts(name, before, trial_steps, modes)
        new = verdicts(name, after, trial_steps, modes)
        results[name] = {label: (old[label], new[label]) for label in old if label in new}
        for label, (was, now) in results[name].items():
            mark = "MOVED" if was["status"] != now["status"] else "     "
            moved += mark == "MOVED"
            print(
                f"{mark} {name:18} {label:44} {was['status']:6} -> {now['status']:6} "
                f"paired output {_shown(was['output_noise'])} -> {_shown(now['output_noise'])}, "
                f"movement {_shown(was['movement_noise'])} -> {_shown(now['movement_noise'])}",
                flush=True,
            )
    pairs = sum(len(pairs) for pairs in results.values())
    print(f"\n{moved} of {pairs} verdicts moved from a nudge of {before:.3g} to {after:.3g}")
    return results


def _power(text: str) -> float:
    base, _, exponent = text.partition("**")
    return float(base) ** float(exponent) if exponent else float(base)


if __name__ == "__main__":
    main()
