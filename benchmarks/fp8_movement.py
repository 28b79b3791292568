"""FP8's weight movement leg by leg, real FP8 against emulated: why the movement check rejected it.

In the second H200 session (2026-11-26) a 3-minute ``tune()`` on ``gpu_validation``'s
59M-parameter GPT under nanoGPT's recipe (AdamW, cosine to a tenth, 2 micro-batches, clipping)
rejected fp8_torchao tensorwise: at the schedule's floor lr (7.32e-05) its 86-step trial took
79% of the fp32 reference's weight movement, below the check's 0.8. FP8 keeps fp32 weights, so
nothing is rounded away; on autoprec's CPU ground truth emulated FP8 kept at least 95% on every
task (the threshold sweep: a 0.95 bar adds no FP8 reject). Which differs on the GPU: the model,
or real FP8 kernels (their fast accumulation) against the emulation?

On the same model, recipe and trial length as that tune, this trains the fp32 reference and
noise run, then: fp32 again (same seed and batches: a GPU's own nondeterminism), tf32, amp_bf16,
and FP8 tensorwise and rowwise, each real (on FP8 hardware) and emulated. For each it prints
every lr leg's projection onto the reference's movement, the share of moved weights it never
moved, and the gate's verdict.

On an H200 (third session, 2026-11-27; docs/gpu-sessions.md) the answer was both. Real FP8
moved less than its emulation on the same GPU (floor lr, 86 steps: tensorwise 0.786 against
0.864 emulated, rowwise 0.699 against 0.859; amp_bf16 0.923), and emulated FP8 moved less on
this model than on the CPU's (0.864 against 0.982 on the 2.1M-parameter ``--medium`` GPT). Every
shortfall shrank in 300-step trials (tensorwise 0.891, rowwise 0.821, amp_bf16 0.956), where
the gate accepts all four FP8 runs; an fp32 rerun moved 1.000 both times.

    python -m benchmarks.fp8_movement [--steps 86]   # on an FP8 GPU (86 steps: 1.5 minutes)
    python -m benchmarks.fp8_movement --medium       # CPU: a 2.1M-parameter GPT, emulated FP8
    python -m benchmarks.fp8_movement --quick        # CPU: small model, emulated FP8 (CI)
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch

from autoprec.candidates import candidate_specs
from autoprec.drift_movement import leg_movements
from autoprec.recipe import TrainingRecipe
from autoprec.run_setup import RunSetup, calibration_run, reference_runs
from autoprec.screening import screen_setup
from autoprec.specs import ModeSpec
from benchmarks import objects_frozen
from benchmarks.gpu_validation import LARGE
from examples import tiny_gpt

MEDIUM = {"vocab_size": 2048, "block_size": 128, "n_layer": 2, "n_head": 4, "n_embd": 256}
"""A GPT that trains 86-step trials on a 2-core CPU in minutes (the 59M one takes hours)."""

TUNE_TRIAL_STEPS = 86
"""The trial length of the tune that rejected FP8 (3 minutes, 18 candidates, on the H200)."""


def nanogpt_recipe() -> TrainingRecipe:
    """gpu_validation's tune recipe: nanoGPT's AdamW and cosine schedule over 5000 steps, 2
    micro-batches, clipping at 1.0."""
    return TrainingRecipe(
        optimizer=tiny_gpt.make_optimizer,
        scheduler=tiny_gpt.cosine_schedule,
        total_steps=5000,
        grad_accumulation_steps=2,
        clip_grad_norm=1.0,
    )


def model_and_batches(config: dict[str, int]) -> tuple[str, torch.nn.Module, list]:
    """(device, model, 24 batches of 16 sequences on it), as gpu_validation builds them."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model, _ = tiny_gpt.make_model(batch_size=16, **config)
    batches = tiny_gpt.make_batches(
        count=24, batch_size=16, vocab_size=config["vocab_size"], block_size=config["block_size"]
    )
    return device, model.to(device), [tuple(t.to(device) for t in batch) for batch in batches]


def compared_specs(fp8_specs: list[ModeSpec], real_fp8: bool, cuda: bool) -> list[ModeSpec]:
    """fp32 again, tf32 (CUDA only), amp_bf16, then each FP8 spec real (where the hardware has
    FP8) and emulated, with the tune's own FP8 options (skipped layers, converted layers)."""
    specs = [ModeSpec(mode="fp32")]
    if cuda:
        specs.append(ModeSpec(mode="tf32"))
    specs.append(ModeSpec(mode="amp_bf16"))
    for spec in fp8_specs:
        if real_fp8:
            specs.append(spec.model_copy(update={"emulate": False}))
        specs.append(spec.model_copy(update={"emulate": True}))
    return specs


class LegRow(NamedTuple):
    """One trial's figures in one lr leg."""

    label: str
    lr: float | None
    moved: float
    never_moved: float
    accepted: bool


def fp8_specs_to_compare(setup: RunSetup) -> list[ModeSpec]:
    """The tune's own FP8 specs where the hardware has FP8 (its skipped and converted layers,
    tensorwise and rowwise), else the quality screen's emulated one."""
    if setup.report.hardware.gpus:
        tuned = [s for s in candidate_specs(setup.report).specs if s.mode == "fp8_torchao"]
        if tuned:
            return [spec.model_copy(update={"optimizer_bits": 32}) for spec in tuned]
    screened = [spec for spec in setup.candidates.specs if spec.mode == "fp8_torchao"]
    if not screened:
        raise SystemExit(
            "fp8_torchao cannot run here, not even emulated: "
            + "; ".join(reason for skip in setup.candidates.skipped for reason in skip.reasons)
        )
    return screened


@objects_frozen
def main(argv: list[str] | None = None) -> list[LegRow]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, 8 steps (CPU check)")
    parser.add_argument("--medium", action="store_true", help="a 2.1M-parameter GPT (CPU)")
    parser.add_argument("--steps", type=int, default=TUNE_TRIAL_STEPS)
    args = parser.parse_args(argv)
    config = tiny_gpt.SMALL if args.quick else MEDIUM if args.medium else LARGE
    device, model, batches = model_and_batches(config)
    steps = 8 if args.quick else args.steps
    setup = screen_setup(model, batches, nanogpt_recipe(), modes=["fp8_torchao"], device=device)
    fp8_specs = list(dict.fromkeys(fp8_specs_to_compare(setup)))
    real_fp8 = not fp8_specs[0].emulate
    cuda = device.startswith("cuda")
    print(
        f"device {device}; {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"{steps}-step trials under nanoGPT's recipe; real FP8: {'yes' if real_fp8 else 'no'}"
    )
    calibration_run(setup)
    references = reference_runs(setup, steps, 0, "speed")
    print(f"{'mode':40} {'lr':>9} {'moved':>6} {'never':>6}  verdict")
    rows = []
    for spec in compared_specs(fp8_specs, real_fp8, cuda):
        result = setup.run(spec, steps, heldout=setup.heldout)
        if result.record.failure is not None:
            print(f"{spec.label:40} failed: {result.record.failure.reason()}")
            continue
        verdict = references.judge(result, setup.thresholds)
        said = "accept" if verdict.accepted else "REJECT " + "; ".join(verdict.reasons)[:120]
        for index, leg in enumerate(leg_movements(result, references.reference)):
            lr = None if leg.point is None else leg.point.lrs[(leg.groups or (0,))[0]]
            rows.append(LegRow(spec.label, lr, leg.fraction, leg.never_moved, verdict.accepted))
            print(
                f"{spec.label if index == 0 else '':40} {'-' if lr is None else f'{lr:.3g}':>9} "
                f"{leg.fraction:6.3f} {leg.never_moved:6.3f}  {said if index == 0 else ''}"
            )
    return rows


if __name__ == "__main__":
    main()
