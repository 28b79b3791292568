"""Does PrecisionPlan cost anything over writing the same recipe by hand? Prints the ratio.

For each mode, the same model, batches and optimizer run through (a) the hand-written loop a
careful user would write (nanoGPT's ctx / GradScaler lines) and (b) ``plan.autocast()`` +
``plan.step(loss, clip_grad_norm=1.0)``. Whichever loop runs second in a pair is measurably
slower on our CPU machines (allocator and cache state: up to 10%), so each round runs the pair
in both orders (ABBA) and takes the geometric mean of the two ratios; the figure is the median
over rounds of plan / hand per-step time. Target: <= 1.02.

    python -m benchmarks.plan_overhead [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

import autoprec
from autoprec.specs import ModeSpec

WIDTH, BATCH = 512, 128


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, WIDTH),
    )


def _hand_loop(mode: str, steps: int, data: torch.Tensor) -> float:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}.get(mode)
    ctx = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "amp_fp16")
    start = time.perf_counter()
    for _ in range(steps):
        with ctx:
            loss = model(data).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def _plan_loop(mode: str, steps: int, data: torch.Tensor) -> float:
    model = _model()
    plan = autoprec.prepare(
        ModeSpec(mode=mode), model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    )
    start = time.perf_counter()
    for _ in range(steps):
        with plan.autocast():
            loss = plan.model(data).float().pow(2).mean()
        plan.step(loss, clip_grad_norm=1.0)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["fp32", "amp_bf16", "amp_fp16"])
    args = parser.parse_args()
    data = torch.randn(BATCH, WIDTH)
    print(
        f"MLP {WIDTH}x{WIDTH}x3, batch {BATCH}, {torch.get_num_threads()} threads, "
        f"{args.rounds} alternating rounds of {args.steps} steps"
    )
    print(f"{'mode':10} {'hand ms/step':>13} {'plan ms/step':>13} {'ratio':>7}")
    for mode in args.modes:
        # autocast runs 10x slower than fp32 on CPUs without native bf16/fp16 kernels
        steps = args.steps if mode == "fp32" else max(args.steps // 10, 10)
        _hand_loop(mode, 5, data), _plan_loop(mode, 5, data)  # warm-up
        ratios, hands, plans = [], [], []
        for _ in range(args.rounds):
            hand_first, plan_second = _hand_loop(mode, steps, data), _plan_loop(mode, steps, data)
            plan_first, hand_second = _plan_loop(mode, steps, data), _hand_loop(mode, steps, data)
            hands += [hand_first, hand_second]
            plans += [plan_first, plan_second]
            ratios.append(((plan_second / hand_first) * (plan_first / hand_second)) ** 0.5)
        print(
            f"{mode:10} {statistics.median(hands) * 1e3:13.3f} "
            f"{statistics.median(plans) * 1e3:13.3f} {statistics.median(ratios):7.3f}"
        )


if __name__ == "__main__":
    main()
