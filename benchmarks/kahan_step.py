"""bf16_kahan's optimizer step: its list step against torch-optimi's loop, and the bf16 moment.

bf16_kahan keeps Adam's second moment in fp32 (``autoprec.kahan_adamw``) and steps with
``autoprec.kahan_foreach`` (the loop's ops over lists of tensors, the same figures to the bit);
torch-optimi as it ships keeps that moment in bf16, where with beta2 0.999 it cannot decrease,
and steps with its Triton kernel where there is one (else its per-tensor loop). All three carry
AdamW's weight decay through the Kahan compensation. The bf16 TinyGPT of ``examples.tiny_gpt``
(0.47M parameters in 28 tensors) with fixed random gradients: ``--steps`` optimizer steps after
5 of warm-up, best of ``--rounds`` rounds, interleaved in each round. Printed: milliseconds per
step, on a GPU where there is one, else on the CPU.

    python -m benchmarks.kahan_step [--steps 50] [--rounds 3]
    python -m benchmarks.kahan_step --quick    # 5 steps, 1 round: the CI variant
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import optimi
import torch

from autoprec.kahan_adamw import KahanDecayAdamW, _parent_step
from examples import tiny_gpt


class Bf16MomentKahanAdamW(optimi.AdamW):
    """bf16_kahan as it was until 2026-11-26: the same decay through the compensation, Adam's
    second moment in the weight's dtype, torch-optimi's own step (Triton where there is one)."""

    step = KahanDecayAdamW.step
    _decay_into_compensation = KahanDecayAdamW._decay_into_compensation

    def _step_groups(self) -> None:
        _parent_step()(self)


class LoopKahanAdamW(KahanDecayAdamW):
    """bf16_kahan with its fp32 second moment, stepped by torch-optimi's per-tensor loop (its
    step until ``kahan_foreach``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, foreach=False, **kwargs)


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
    kinds = {
        "second moment bf16, torch-optimi's step": Bf16MomentKahanAdamW,
        "second moment fp32, per-tensor loop": LoopKahanAdamW,
        "second moment fp32, list step (bf16_kahan)": KahanDecayAdamW,
    }
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
