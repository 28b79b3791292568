"""What bf16_kahan's fp32 second moment costs in its optimizer step, timed against the bf16 one.

bf16_kahan keeps Adam's second moment in fp32 (``autoprec.kahan_adamw``); torch-optimi as it
ships keeps it in bf16, where with beta2 0.999 it cannot decrease. Both optimizers here carry
AdamW's weight decay through the Kahan compensation, so the second moment's dtype is the only
difference. The bf16 TinyGPT of ``examples.tiny_gpt`` (0.47M parameters in 28 tensors) with
fixed random gradients: ``--steps`` optimizer steps after 5 of warm-up, best of ``--rounds``
rounds, the two interleaved in each round. Printed: milliseconds per step, on a GPU where there
is one (the bf16 moment then takes torch-optimi's Triton kernel where Triton is, the fp32 one
its per-tensor loop), else on the CPU.

    python -m benchmarks.kahan_step [--steps 50] [--rounds 3]
    python -m benchmarks.kahan_step --quick    # 5 steps, 1 round: the CI variant
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import optimi
import torch

from autoprec.kahan_adamw import KahanDecayAdamW
from examples import tiny_gpt


class Bf16MomentKahanAdamW(optimi.AdamW):
    """bf16_kahan as it was until 2026-11-26: the same decay through the compensation, Adam's
    second moment in the weight's dtype (torch-optimi's own)."""

    step = KahanDecayAdamW.step
    _decay_into_compensation = KahanDecayAdamW._decay_into_compensation


def step_milliseconds(kind: type[Any], parameters: list[torch.Tensor], steps: int) -> float:
    optimizer = kind(parameters, lr=3e-4, betas=(0.9, 0.999), weight_decay=0.01, kahan_sum=True)
    for _ in range(5):
        optimizer.step()
    if parameters[0].is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if parameters[0].is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5 steps, 1 round (CI)")
    args = parser.parse_args(argv)
    steps, rounds = (5, 1) if args.quick else (args.steps, args.rounds)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_gpt.make_model()[0].to(device=device, dtype=torch.bfloat16)
    parameters = list(model.parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter) * 1e-3
    kinds = {"second moment bf16": Bf16MomentKahanAdamW, "second moment fp32": KahanDecayAdamW}
    best = {name: float("inf") for name in kinds}
    for _ in range(rounds):
        for name, kind in kinds.items():
            best[name] = min(best[name], step_milliseconds(kind, parameters, steps))
    count = sum(p.numel() for p in parameters)
    print(f"Kahan AdamW step on {device}, {count} bf16 parameters in {len(parameters)} tensors:")
    for name, milliseconds in best.items():
        print(f"  {name}: {milliseconds:.2f} ms")
    return best


if __name__ == "__main__":
    main()
