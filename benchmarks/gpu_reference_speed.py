"""Is the fp32 reference fp32 on a GPU? Its speed under each path that times it.

The first GPU run (benchmarks/gpu_validation.py on an H100) timed fp32 at 460 samples/s in
``run_trial`` and at 1571 in ``tune()``'s reference, near TF32's 1442: faster than IEEE fp32's
peak allows for that model. This times one model's fp32 steps through each path, printing the
float32 matmul settings torch reports around each:

- a hand loop with TF32 off and on (the two anchors);
- ``run_trial`` for fp32 with a plain AdamW recipe, and with ``tune()``'s recipe in
  gpu_validation (nanoGPT's AdamW and cosine schedule, 2 micro-batches, clipping);
- ``tune()`` restricted to fp32 and amp_bf16 under that recipe.

    python -m benchmarks.gpu_reference_speed [--quick]   # --quick: small model (CPU check)
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from autoprec.candidates import candidate_specs
from autoprec.probing import probe
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.tuning import tune
from benchmarks import objects_frozen
from benchmarks.gpu_validation import validation_model
from examples import tiny_gpt


def settings() -> str:
    """torch's float32 matmul settings, as it reports them."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return (
        f"matmul.fp32_precision={precision} allow_tf32={matmul.allow_tf32} "
        f"float32_matmul_precision={torch.get_float32_matmul_precision()}"
    )


def hand_loop(model: torch.nn.Module, batches: list, steps: int, tf32: bool) -> float:
    """Samples/s of a plain AdamW fp32 loop with TF32 set as asked for the whole loop."""
    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-4)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for count in (3, steps):  # warm-up, then timed
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            for step in range(count):
                idx, targets = batches[step % len(batches)]
                loss = trained(idx, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return steps * batches[0][0].shape[0] / (time.perf_counter() - start)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def leak_after_failed_trial(model: torch.nn.Module, batches: list, steps: int) -> None:
    """The first GPU run's failure, reproduced: island hooks traced by dynamo (as before they
    ran eagerly) fail a compiled pure-bf16 trial; then an fp32 trial, with the trial's
    autocast guard off and on. Prints the device's autocast state and fp32's samples/s."""
    import contextlib

    import autoprec.trial as trial_module
    from autoprec.modes.islands import EagerHook

    recipe = TrainingRecipe(optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    common = {"recipe": recipe, "steps": steps, "heldout": batches[-4:]}
    specs = candidate_specs(probe(model, batches[0][0])).specs
    pure = next(s for s in specs if s.mode == "bf16_pure" and s.optimizer_bits == 32)
    kind = batches[0][0].device.type
    eager_call = EagerHook.__call__
    guard = trial_module.autocast_state_kept
    try:
        EagerHook.__call__ = lambda self, *args: self.function(*args)  # traced: before the fix
        for guarded in (False, True):
            trial_module.autocast_state_kept = (
                guard if guarded else (lambda: contextlib.nullcontext())
            )
            failed = run_trial(
                pure.model_copy(update={"compile": True}), model, batches[:-4], **common
            )
            failure = failed.record.failure.message[:60] if failed.record.failure else "none"
            state = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            fp32 = run_trial(ModeSpec(mode="fp32"), model, batches[:-4], **common).record
            print(
                f"guard {'on ' if guarded else 'off'}: compiled bf16_pure failure: {failure}; "
                f"{kind} autocast after it (enabled, dtype): {state}; fp32 next: "
                f"{fp32.samples_per_second or 0:.1f} samples/s",
                flush=True,
            )
            torch.set_autocast_enabled(kind, False)
    finally:
        EagerHook.__call__ = eager_call  # type: ignore[method-assign]
        trial_module.autocast_state_kept = guard


def after_each_mode(model: torch.nn.Module, batches: list, steps: int) -> None:
    """A short trial of every candidate, each followed by an fp32 trial's samples/s: a mode
    that leaves global state behind (TF32 on, say) shows as an fp32 speed that jumps."""
    recipe = TrainingRecipe(optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    common = {"recipe": recipe, "steps": steps, "heldout": batches[-4:]}
    specs = candidate_specs(probe(model, batches[0][0])).specs
    for compiled in (False, True):
        for spec in specs:
            spec = spec.model_copy(update={"compile": compiled})
            run_trial(spec, model, batches[:-4], **common)
            fp32 = run_trial(ModeSpec(mode="fp32"), model, batches[:-4], **common).record
            print(
                f"after {spec.label:40} fp32 {fp32.samples_per_second or 0:8.1f} samples/s; "
                f"{settings()}",
                flush=True,
            )


@objects_frozen
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (CPU check)")
    parser.add_argument(
        "--leak",
        action="store_true",
        help="a compiled pure-bf16 trial failing in its island hooks (as before the fix), "
        "then fp32, without and with the trial's autocast guard",
    )
    parser.add_argument(
        "--after-each-mode",
        action="store_true",
        help="time fp32 again after a short trial of every candidate (eager, then compiled)",
    )
    args = parser.parse_args()
    _, model, batches = validation_model(args.quick)
    steps = 4 if args.quick else 40
    print(f"start: {settings()}")
    if args.leak:
        leak_after_failed_trial(model, batches, steps)
        return
    if args.after_each_mode:
        after_each_mode(model, batches, steps)
        return
    for tf32 in (False, True):
        speed = hand_loop(model, batches, steps, tf32)
        print(f"hand loop, TF32 {'on ' if tf32 else 'off'}: {speed:8.1f} samples/s")
    print(f"after the hand loops: {settings()}")
    plain = TrainingRecipe(optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    nanogpt = TrainingRecipe(
        optimizer=tiny_gpt.make_optimizer,
        scheduler=tiny_gpt.cosine_schedule,
        total_steps=5000,
        grad_accumulation_steps=2,
        clip_grad_norm=1.0,
    )
    for name, recipe in (("plain AdamW", plain), ("nanoGPT, 2 micro-batches", nanogpt)):
        record = run_trial(
            ModeSpec(mode="fp32"),
            model,
            batches[:-4],
            recipe=recipe,
            steps=steps,
            heldout=batches[-4:],
        ).record
        print(
            f"run_trial fp32, {name}: {record.samples_per_second or 0:8.1f} samples/s, median "
            f"step {1e3 * (record.median_step_seconds or 0):.2f} ms; after: {settings()}"
        )
    result = tune(
        model,
        batches,
        budget_minutes=0.3 if args.quick else 1.5,
        optimizer=tiny_gpt.make_optimizer,
        scheduler=tiny_gpt.cosine_schedule,
        total_steps=5000,
        grad_accumulation_steps=2,
        clip_grad_norm=1.0,
        modes=["fp32", "amp_bf16"],
        progress=False,
    )
    print("\n" + result.summary())
    print(f"after tune: {settings()}")


if __name__ == "__main__":
    main()
