"""The stochastic-rounding optimizers' step and memory, against the optimizers beside them.

``bf16_sr`` and ``bf16_sr+8bit-optim`` step with autoprec's stochastic-rounding AdamW, which
updates parameters in chunks through flat fp32 buffers (``autoprec.flat_chunks``); with 8-bit
moments (``autoprec.eight_bit_states``) it dequantises a tensor's moments to fp32, updates them
and quantises them again. This times both against bitsandbytes' fused ``AdamW8bit`` on bf16
weights (``bf16_pure+8bit-optim``), torch's AdamW on bf16 weights (``bf16_pure``) and on fp32
weights (fp32), over the same model and fixed random gradients: ``--steps`` optimizer steps
after 3 of warm-up, best of ``--rounds`` rounds, interleaved in each round. Printed:
milliseconds per step and the bytes of weights plus optimizer state per parameter, on a GPU
where there is one, else on the CPU. Many small tensors (``--width 256 --layers 48``) show the
per-tensor cost a chunk saves: kernel launches on a GPU; the "one tensor a chunk" rows are the
same optimizers stepping one parameter at a time, as they did before the chunked step.

    python -m benchmarks.sr_8bit_step [--width 1024] [--layers 8] [--steps 20] [--rounds 3]
    python -m benchmarks.sr_8bit_step --quick    # a small model, 2 steps, 1 round (CI)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Hashable

import bitsandbytes as bnb
import torch

from autoprec.stochastic_optim import StochasticAdamW
from autoprec.trial_measures import optimizer_state_bytes

OPTIONS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class OneTensorAChunk(StochasticAdamW):
    """The same optimizer with every parameter a chunk of its own: the per-tensor loop the
    chunked step replaced (2026-11-28), its ops and writes unchanged (a single tensor is
    updated in its shape and written straight back)."""

    def _chunk_key(self, param: torch.Tensor) -> Hashable:
        return id(param)


CONTENDERS: dict[
    str, tuple[torch.dtype, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]
] = {
    "fp32 (torch AdamW)": (torch.float32, lambda p: torch.optim.AdamW(p, **OPTIONS)),
    "bf16_pure (torch AdamW on bf16)": (torch.bfloat16, lambda p: torch.optim.AdamW(p, **OPTIONS)),
    "bf16_sr (bf16 moments)": (torch.bfloat16, lambda p: StochasticAdamW(p, **OPTIONS)),
    "bf16_sr, one tensor a chunk": (torch.bfloat16, lambda p: OneTensorAChunk(p, **OPTIONS)),
    "bf16_sr+8bit-optim": (torch.bfloat16, lambda p: StochasticAdamW(p, state_bits=8, **OPTIONS)),
    "bf16_sr+8bit-optim, one tensor a chunk": (
        torch.bfloat16,
        lambda p: OneTensorAChunk(p, state_bits=8, **OPTIONS),
    ),
    "bf16_pure+8bit-optim (AdamW8bit)": (
        torch.bfloat16,
        lambda p: bnb.optim.AdamW8bit(p, **OPTIONS),
    ),
}


def _parameters(
    width: int, layers: int, dtype: torch.dtype, device: str
) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(width, width), (width,)] * layers
    parameters = []
    for shape in shapes:
        weight = torch.randn(shape, generator=generator).mul_(0.02)
        parameter = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        parameter.grad = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        parameters.append(parameter)
    return parameters


def _state_bytes(optimizer: torch.optim.Optimizer, parameters: list[torch.nn.Parameter]) -> int:
    """Weights and optimizer state, as a trial counts them."""
    return sum(p.numel() * p.element_size() for p in parameters) + optimizer_state_bytes(optimizer)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small model, 2 steps, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.steps, args.rounds = 128, 2, 2, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    built = {}
    for name, (dtype, make) in CONTENDERS.items():
        parameters = _parameters(args.width, args.layers, dtype, device)
        optimizer = make(parameters)
        for _ in range(3):
            optimizer.step()
        built[name] = (parameters, optimizer)
    best = {name: float("inf") for name in built}
    for _ in range(args.rounds):
        for name, (_, optimizer) in built.items():
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(args.steps):
                optimizer.step()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - started) / args.steps)
    count = sum(p.numel() for p in next(iter(built.values()))[0])
    print(f"{count / 1e6:.2f}M parameters in {2 * args.layers} tensors, on {device}:")
    figures = {}
    for name, (parameters, optimizer) in built.items():
        per_parameter = _state_bytes(optimizer, parameters) / count
        figures[name] = (best[name] * 1e3, per_parameter)
        print(f"  {name:40s} {best[name] * 1e3:8.2f} ms/step  {per_parameter:5.2f} bytes/parameter")
    return figures


if __name__ == "__main__":
    main()
