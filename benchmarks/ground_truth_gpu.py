"""Ground truth on a GPU: does real FP8 hurt the 59M-parameter GPT the gate rejected it on?

On an H200 a 3-minute ``tune()`` of ``gpu_validation``'s GPT under nanoGPT's recipe rejected FP8
(torchao, tensorwise) because its 86-step trial took 79% of fp32's weight movement at the
schedule's floor lr; in 300-step trials it took 89% and passed (``benchmarks.fp8_movement``,
docs/gpu-sessions.md, "Third H200 session"). Real FP8 kernels moved the weights less than their CPU
emulation, so the CPU ground truth (emulated FP8 only) cannot say which verdict is right. This
trains the same GPT (4 layers, n_embd 1024, 16 x 256 tokens a batch) on a language with learnable
structure (``ground_truth_tasks``' sparse Markov chain over 8192 tokens, its loss floor at most
ln 4 = 1.386) as the ground truth does: ``--steps`` long runs under nanoGPT's recipe over that
many steps (AdamW, betas 0.9 / 0.95, warm-up then cosine to a tenth, clipping at 1.0), fp32 at
``--fp32-seeds`` seeds and every mode at ``--mode-seeds``, each judged by its final test loss
against fp32's spread (the truth of ``benchmarks.ground_truth``), and scores the gate's verdicts at
each ``--trial-steps`` against that truth. Long runs are cached (``--cache``), so a run cut by a
device command's time limit goes on where it stopped.

    python -m benchmarks.ground_truth_gpu              # a GPU with FP8 (an H200: about 11.5
                                                       # minutes, two device commands)
    python -m benchmarks.ground_truth_gpu --quick      # CPU: a small GPT, emulated FP8 (CI)

Fewer seeds than the CPU truth (3 fp32, 2 of each mode, not 8 and 3) fit one lent GPU's
15 minutes: its line sits 2.7 fp32 sds above fp32's mean (3 standard errors), not 2.0. The time,
from the third H200 session's step times (eager, ms a step: fp32 33.9, FP8 tensorwise 31.7,
rowwise 54.5, amp_bf16 11.1): 2000-step runs 210 s of fp32, 127 + 218 s of FP8, 44 s of
amp_bf16; the gate about 25 s at 86 steps and 60 s at 300. ``--modes fp8_torchao`` with
``--trial-steps 86`` saves about 100 s.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from benchmarks.gpu_validation import LARGE
from benchmarks.ground_truth import Pair, Seeds, confusion, score
from benchmarks.ground_truth_tasks import GroundTask, _markov_tokens, nanogpt_training
from examples import tiny_gpt

SMALL = {"vocab_size": 128, "block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 64}
"""``--quick``: a GPT that trains a 150-step run in seconds on a CPU."""


def gpt_markov(
    total_steps: int, config: dict[str, int], device: torch.device, batch_count: int
) -> GroundTask:
    """The GPT of ``config`` on ``device``, ``batch_count`` training batches of 16 sequences from
    the Markov chain (a long run sees each about ``total_steps / batch_count`` times) and 8 test
    batches, under nanoGPT's recipe over ``total_steps``. Its cache name holds the model's
    width and the device type: a CPU run is never read as a GPU one."""
    vocab, block = config["vocab_size"], config["block_size"]
    model, _ = tiny_gpt.make_model(**config)

    def batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tokens = _markov_tokens(count * 16, block + 1, vocab, seed).to(device)
        return [(t[:, :-1], t[:, 1:]) for t in tokens.split(16)]

    name = f"gpt_markov.e{config['n_embd']}.l{config['n_layer']}.{device.type}"
    return GroundTask(
        name,
        "decoder LM, nanoGPT's recipe (FP8 real where the GPU has it)",
        model.to(device),
        batches(batch_count, 31),
        batches(8, 32),
        nanogpt_training(total_steps),
    )


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small GPT, 150-step runs (CI)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of a long run")
    parser.add_argument(
        "--trial-steps", default="86,300", help="the gate's trial lengths, comma-separated"
    )
    parser.add_argument("--modes", default="fp8_torchao,amp_bf16", help="modes to judge")
    parser.add_argument("--fp32-seeds", type=int, default=3)
    parser.add_argument("--mode-seeds", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path("runs/ground_truth"))
    args = parser.parse_args(argv)
    if args.fp32_seeds < 2:
        parser.error("--fp32-seeds must be at least 2: their spread is the truth's unit")
    return args


def main(argv: list[str] | None = None) -> dict[int, list[Pair]]:
    """The pairs scored at each trial length."""
    args = _arguments(argv)
    logging.getLogger("autoprec").setLevel(logging.ERROR)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    config, steps, batch_count = (SMALL, 150, 60) if args.quick else (LARGE, args.steps, 500)
    trials = [30] if args.quick else [int(value) for value in args.trial_steps.split(",")]
    task = gpt_markov(steps, config=config, device=device, batch_count=batch_count)
    parameters = sum(p.numel() for p in task.model.parameters())
    seeds = Seeds(fp32=args.fp32_seeds, mode=args.mode_seeds)
    print(
        f"device {device}; {parameters:,} parameters; {steps}-step runs ({seeds.fp32} fp32 "
        f"seeds, {seeds.mode} of each mode) against the gate at {trials} steps",
        flush=True,
    )
    modes = args.modes.split(",")
    scored = {}
    for trial_steps in trials:
        pairs = score(task.name, task, steps, trial_steps, args.cache, seeds, modes)
        print(f"\nthe gate at {trial_steps} steps:\n{confusion(pairs)}", flush=True)
        scored[trial_steps] = pairs
    return scored


if __name__ == "__main__":
    main()
