"""Run the drift gate on a few tasks and print, per mode, its figures and verdict.

Each task: an fp32 reference, a noise run (another seed and batch order), then every mode
that runs on this machine; the gate judges each against the reference. Anyone can see why a
mode was rejected.

    python -m benchmarks.drift_gate [--steps 150]
"""

from __future__ import annotations

import argparse
import logging

import torch

from autoprec.drift import judge
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from benchmarks import objects_frozen
from examples import tasks, tiny_gpt

MODES = [
    ModeSpec(mode="amp_bf16"),
    ModeSpec(mode="amp_fp16"),
    ModeSpec(mode="bf16_pure"),
    ModeSpec(mode="bf16_sr"),
    ModeSpec(mode="bf16_kahan"),
    ModeSpec(mode="bf16_sr_kahan"),
    ModeSpec(mode="amp_bf16", optimizer_bits=8),
    ModeSpec(mode="fp8_torchao", emulate=True),
    ModeSpec(mode="tf32"),
]


def _gpt_task() -> tasks.Task:
    model, _ = tiny_gpt.make_model(vocab_size=128, block_size=32, n_layer=1, n_embd=64)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(64):
        tokens = [torch.randint(0, 128, (8, 1), generator=generator)]
        for _ in range(32):
            tokens.append((tokens[-1] * 3 + 1) % 128)
        sequence = torch.cat(tokens, dim=1)
        batches.append((sequence[:, :-1], sequence[:, 1:]))
    return tasks.Task(
        model, batches[:60], batches[60:], torch.optim.AdamW(model.parameters(), lr=1e-4)
    )


TASKS = {
    "regression MLP, AdamW lr 1e-4": lambda: tasks.regression(lr=1e-4),
    "regression MLP, AdamW lr 3e-3": lambda: tasks.regression(lr=3e-3),
    "TinyGPT next-token, AdamW lr 1e-4": _gpt_task,
    "activations near fp16 max (3e4)": lambda: tasks.fp16_range(3e4),
}


@objects_frozen
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    for title, make in TASKS.items():
        task = make()
        loss_fn = None if title.startswith("TinyGPT") else task.mse

        def trial(spec: ModeSpec, task: tasks.Task = task, loss_fn=loss_fn, **kw: int):
            return run_trial(
                spec,
                task.model,
                task.batches,
                recipe=TrainingRecipe(optimizer=task.optimizer, loss_fn=loss_fn),
                steps=args.steps,
                heldout=task.heldout,
                **kw,
            )

        reference = trial(ModeSpec(mode="fp32"))
        noise = trial(ModeSpec(mode="fp32"), seed=1, shuffle_seed=1)
        print(
            f"\n== {title}: {args.steps} steps; fp32 held-out loss "
            f"{sum(reference.record.heldout_losses) / len(reference.record.heldout_losses):.4f}"
        )
        print(
            f"{'mode':32} {'samples/s':>9} {'state KiB':>9} {'ho loss':>8} {'moved':>6} "
            f"{'out err':>7}  verdict"
        )
        for spec in [ModeSpec(mode="fp32"), *MODES]:
            result = reference if spec.mode == "fp32" and spec.optimizer_bits == 32 else trial(spec)
            verdict = judge(result, reference, noise)
            record, m = result.record, verdict.metrics
            speed = (
                f"{record.samples_per_second:9.0f}"
                if record.samples_per_second and record.speed_is_meaningful
                else f"{'-':>9}"
            )
            state = f"{record.state_bytes.total / 1024:9.0f}" if record.state_bytes else f"{'-':>9}"
            heldout = (
                f"{sum(record.heldout_losses) / len(record.heldout_losses):8.4f}"
                if record.heldout_losses
                else f"{'-':>8}"
            )
            moved = f"{m.update_fraction:6.2f}" if m.update_fraction is not None else f"{'-':>6}"
            error = f"{m.output_error:7.1%}" if m.output_error is not None else f"{'-':>7}"
            status = "accept" if verdict.accepted else "REJECT: " + " | ".join(verdict.reasons)
            print(f"{spec.label:32} {speed} {state} {heldout} {moved} {error}  {status}")


if __name__ == "__main__":
    main()
