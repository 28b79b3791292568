"""Validate the GPU paths on a lent GPU and print the figures for the issue note.

Prints: the probe's verdicts for cuda:0; for every mode that can run there, one measured trial
on a mid-size TinyGPT (samples/s, tokens/s, median step, peak CUDA memory, exact state bytes),
eager and again compiled (``torch.compile``, graphs built and recompiles after warm-up shown),
the samples/s of the loop a user writes with ``apply()`` (same model, recipe and batches; one
synchronization at each end of the timed window) and the trial's share of it (``trial/loop``,
target 0.97-1.03: below it the trial charges the mode for host syncs a real run does not
make) and of the same loop reading its loss every 10 steps as a logging loop does
(``t/logged``: the trial's windows end in such a read; on the first H200 run amp_bf16's
``trial/loop`` was 0.83-0.96 while fp32's and tf32's were 0.98-1.00), the mode's forward
cost (its trained weights read in the mode vs in fp32: real FP8's precision floor on this
model) and its drift verdict against fp32; then a short ``tune()``
under a real recipe (nanoGPT's AdamW and cosine schedule, gradient accumulation, clipping).
On a CPU (``--quick``) it runs the same code on a small model so the script itself stays
tested.

How it was meant to be run on the device machine (torch with CUDA there, no internet;
``bash benchmarks/gpu_session.sh validation`` does this, and the other stages of a GPU session):

    here:    bash ../shared/tools/offline-wheels.sh          # .whl/, git-excluded
    device:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
             && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \\
             && python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \\
                tests/test_mode_contract.py \\
             && python3 -m benchmarks.gpu_validation --profile-out $OUT/gpu-profile.json \\
                | tee $OUT/gpu.txt
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
import warnings

import torch

from autoprec.candidates import candidate_specs
from autoprec.drift import judge
from autoprec.errors import OptimizerRebuiltWarning
from autoprec.plan import prepare
from autoprec.probing import probe
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.trial_loop import MAX_WINDOW_STEPS
from autoprec.tuning import tune
from benchmarks import objects_frozen
from examples import tiny_gpt

LARGE = {"vocab_size": 8192, "block_size": 256, "n_layer": 4, "n_head": 16, "n_embd": 1024}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def loop_speed(
    spec: ModeSpec,
    model: torch.nn.Module,
    batches: list,
    steps: int,
    device: str,
    warmup_steps: int = 2,
    log_every: int | None = None,
) -> float:
    """Samples/s of a plain training loop with ``apply()``'s plan: ``warmup_steps`` (as the
    trial's default), then ``steps`` steps timed between two synchronizations, nothing read
    back in between; with ``log_every``, the loss read back (``.item()``) every that many
    steps, as a loop that logs does (torchtitan's default: every 10)."""
    trained = copy.deepcopy(model)
    with warnings.catch_warnings():  # the rebuilt-optimizer warning: no scheduler here
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(spec, trained, torch.optim.AdamW(trained.parameters(), lr=3e-4))

    def train(count: int) -> None:
        for step in range(count):
            inputs, targets = batches[step % len(batches)]
            with plan.autocast():
                loss = plan.model(inputs, targets)
            plan.step(loss)
            if log_every and (step + 1) % log_every == 0:
                loss.item()

    train(warmup_steps)
    _synchronize(device)
    start = time.perf_counter()
    train(steps)
    _synchronize(device)
    return steps * batches[0][0].shape[0] / (time.perf_counter() - start)


def mode_table(
    specs: list[ModeSpec],
    model: torch.nn.Module,
    train: list,
    common: dict,
    steps: int,
    device: str,
) -> None:
    """One row per mode: the trial's figures, the hand-written loop's samples/s, their ratio
    and the drift verdict against an fp32 reference run the same way (eager or compiled)."""
    reference = run_trial(specs[0], model, train, **common)
    noise = run_trial(specs[0], model, train, seed=1, shuffle_seed=1, **common)
    print(
        f"{'mode':34} {'samples/s':>10} {'tokens/s':>11} {'step ms':>8} {'peak MiB':>9} "
        f"{'state MiB':>9} {'loop s/s':>9} {'trial/loop':>10} {'t/logged':>10} {'graphs':>6}"
        f" {'recomp':>6}"
        f" {'fwd cost':>8}  verdict"
    )
    for spec in specs:
        result = reference if spec == specs[0] else run_trial(spec, model, train, **common)
        record = result.record
        if record.failure is not None:
            print(f"{spec.label:34} FAILED ({record.failure.kind}): {record.failure.message}")
            continue
        verdict = judge(result, reference, noise)
        speed = f"{record.samples_per_second:10.1f}" if record.samples_per_second else f"{'-':>10}"
        tokens = f"{record.tokens_per_second:11.0f}" if record.tokens_per_second else f"{'-':>11}"
        step = (
            f"{record.median_step_seconds * 1e3:8.2f}"
            if record.median_step_seconds
            else f"{'-':>8}"
        )
        peak = (
            f"{record.peak_memory_bytes / 2**20:9.0f}" if record.peak_memory_bytes else f"{'-':>9}"
        )
        state = f"{record.state_bytes.total / 2**20:9.1f}" if record.state_bytes else f"{'-':>9}"
        loop = loop_speed(spec, model, train, steps, device)
        logged = loop_speed(spec, model, train, steps, device, log_every=MAX_WINDOW_STEPS)
        ratio = (record.samples_per_second or 0.0) / loop
        logged_ratio = (record.samples_per_second or 0.0) / logged
        graphs = "-" if record.compiled_graphs is None else str(record.compiled_graphs)
        recompiles = "-" if record.recompiles is None else str(record.recompiles)
        status = "accept" if verdict.accepted else "REJECT " + " | ".join(verdict.reasons)
        cost = verdict.metrics.forward_cost
        forward = f"{'-':>8}" if cost is None else f"{cost:+8.2%}"
        print(
            f"{spec.label:34} {speed} {tokens} {step} {peak} {state} {loop:9.1f} {ratio:10.3f}"
            f" {logged_ratio:10.3f}"
            f" {graphs:>6} {recompiles:>6} {forward}  {status}"
        )


def _asked_for(spec: ModeSpec, wanted: list[str]) -> bool:
    """Whether ``--modes`` asked for ``spec``: its label, or its mode's name for a 32-bit run
    (``bf16_sr`` once took its 8-bit run too, and ``fp32`` fp32's with 8-bit states)."""
    return spec.label in wanted or (spec.mode in wanted and spec.optimizer_bits == 32)


def validation_model(quick: bool) -> tuple[str, torch.nn.Module, list]:
    """(device, model, 24 batches of 16 sequences on it): the 59M-parameter TinyGPT on the GPU
    when there is one, the small one with ``quick``."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    config = tiny_gpt.SMALL if quick else LARGE
    model, _ = tiny_gpt.make_model(batch_size=16, **config)
    batches = tiny_gpt.make_batches(
        count=24, batch_size=16, vocab_size=config["vocab_size"], block_size=config["block_size"]
    )
    return device, model.to(device), [tuple(t.to(device) for t in batch) for batch in batches]


@objects_frozen
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (CPU check)")
    parser.add_argument(
        "--steps",
        type=int,
        default=200,
        help="optimizer steps per trial and loop (the first GPU run's 60 steps of 9-35 ms "
        "left trial/loop between 0.67 and 1.30)",
    )
    parser.add_argument("--budget", type=float, default=3.0, help="tune() budget in minutes")
    parser.add_argument("--profile-out", help="save the tune's profile here (proven on this GPU)")
    parser.add_argument(
        "--modes",
        help="only these (comma-separated) in tables and tune: a canonical mode name is its "
        "32-bit runs, a label (bf16_sr+8bit-optim) that run",
    )
    parser.add_argument("--compiled-only", action="store_true", help="skip the eager table")
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled table")
    parser.add_argument("--no-tune", action="store_true", help="skip the tune() run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device, model, batches = validation_model(args.quick)
    steps = 6 if args.quick else args.steps
    train, heldout = batches[:-4], batches[-4:]
    report = probe(model, train[0][0])
    gpu = report.hardware.gpus[0] if report.hardware.gpus else None
    print(
        f"device {report.device}: {gpu.label if gpu else report.hardware.cpu.model_name}; "
        f"torch {report.hardware.torch_version}, CUDA {report.hardware.torch_cuda_runtime}, "
        f"driver {report.hardware.driver_version}, NVML {report.hardware.nvml_status}"
    )
    for verdict in (*report.modes, report.optimizer_8bit):
        state = "try" if verdict.worth_trying else ("possible" if verdict.eligible else "no")
        print(f"  {verdict.name:18} {state:8} {'; '.join(verdict.reasons + verdict.notes)}")
    print(
        f"model: {report.layers.parameters if report.layers else '?':,} parameters; "
        + "; ".join(report.layers.findings if report.layers else ())
    )

    optimizer = lambda params: torch.optim.AdamW(params, lr=3e-4)  # noqa: E731
    common = {"recipe": TrainingRecipe(optimizer=optimizer), "steps": steps, "heldout": heldout}
    specs = list(candidate_specs(report).specs)
    wanted = args.modes.split(",") if args.modes else None
    if wanted:  # the reference first, then the modes asked for
        specs = [specs[0], *(spec for spec in specs[1:] if _asked_for(spec, wanted))]
    if args.compiled_only and args.eager_only:
        parser.error("--compiled-only and --eager-only leave no table to run: pass one of them")
    tables = (True,) if args.compiled_only else (False,) if args.eager_only else (False, True)
    for compiled in tables:
        # --quick (CPU): compile two modes only, inductor on a CPU takes its time
        chosen = specs[:2] if compiled and args.quick else specs
        if compiled:
            chosen = [spec.model_copy(update={"compile": True}) for spec in chosen]
        print(f"\n{'compiled (torch.compile)' if compiled else 'eager'}:")
        mode_table(chosen, model, train, common, steps, device)

    if args.no_tune:
        return
    # a tune under a real recipe: nanoGPT's optimizer and cosine schedule, 2 micro-batches
    result = tune(
        model,
        batches,
        budget_minutes=0.3 if args.quick else args.budget,
        optimizer=tiny_gpt.make_optimizer,
        scheduler=tiny_gpt.cosine_schedule,
        total_steps=5000,
        grad_accumulation_steps=2,
        clip_grad_norm=1.0,
        modes=sorted({name.split("+")[0] for name in wanted}) if wanted else None,
        progress=True,  # on stderr: which trial ran when, and the re-timings
    )
    print("\n" + result.summary())
    if args.profile_out:
        print(f"profile: {result.profile.save(args.profile_out)}")


if __name__ == "__main__":
    main()
