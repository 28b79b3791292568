"""How much of Adam's update does a bf16 second moment rounded to nearest let through?

The drift gate rejects pure-bf16 modes whose Adam second moment (``exp_avg_sq``) is kept in bf16
with nearest rounding and beta2 = 0.999 (``DriftThresholds.max_rounded_beta2``): a step changes
that moment by 0.1% of itself, below half a bf16 ulp, so decreases are rounded away and only
gradient spikes raise it. The moment inflates, and Adam's steps, divided by its square root,
shrink. This benchmark measures by how much, on each ground-truth task's own gradients: it trains
the task in fp32 (``ground_truth.long_run``: the task's recipe and schedule) and, on a fixed
sample of gradient elements, keeps beside the fp32 moment the two bf16 moments the pure-bf16
modes keep:

- ``torch`` (bf16_pure, bf16_pure+8bit-optim: torch's AdamW on bf16 parameters):
  ``v.mul_(beta2).addcmul_(g, g, value=1 - beta2)``, each operation rounded to bf16;
- ``optimi`` (bf16_kahan: torch-optimi, whose beta2 is debiased step by step):
  ``v.mul_(beta2_t).addcmul_(g, g, value=1 - beta2_t)`` in bf16, against the same in fp32.

Printed per task and step: the **update fraction**, ``|m / sqrt(v_bf16)| / |m / sqrt(v_fp32)|``
(bias-corrected, the fp32 first moment ``m``): the share of Adam's step size that arrives. It
asks whether anything a trial of tune's length (200 steps) can measure about the state tells the
tasks where bf16_kahan hurt apart from those where it did not.

    python -m benchmarks.state_ratchet [--steps 2000] [--tasks a,b] [--threads 1]
    python -m benchmarks.state_ratchet --quick    # 1 task, 300 steps: the CI variant
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoprec.plan import PrecisionPlan
from autoprec.specs import ModeSpec
from benchmarks.ground_truth import long_run, run_arguments
from benchmarks.ground_truth_tasks import TASKS

SAMPLED_ELEMENTS = 20_000
"""Gradient elements followed, spread over the parameters in proportion to their sizes."""
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
"""AdamW's defaults, which every ground-truth task uses."""
CHECKPOINTS = (200, 500, 1000, 2000, 5000, 10000)


def _update_fraction(m: torch.Tensor, low: torch.Tensor, exact: torch.Tensor) -> float:
    """Share of the step size that arrives with the rounded moment ``low`` instead of ``exact``
    (both fp32 tensors, bias-corrected)."""
    arrived = (m / (low.sqrt() + EPS)).norm()
    intended = (m / (exact.sqrt() + EPS)).norm()
    return float(arrived / intended) if intended > 0 else 1.0


@dataclass
class MomentShadows:
    """The fp32 and bf16 second moments of one sample of gradient elements, stepped together."""

    indices: list[torch.Tensor]
    m: torch.Tensor
    torch_fp32: torch.Tensor
    torch_bf16: torch.Tensor
    optimi_fp32: torch.Tensor
    optimi_bf16: torch.Tensor
    step: int = 0
    fractions: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Optimizer step -> (torch update fraction, optimi update fraction)."""

    @classmethod
    def sampling(cls, parameters: list[torch.nn.Parameter]) -> MomentShadows:
        generator = torch.Generator().manual_seed(0)
        total = sum(p.numel() for p in parameters)
        sizes = [max(1, round(SAMPLED_ELEMENTS * p.numel() / total)) for p in parameters]
        indices = [
            torch.randint(0, p.numel(), (size,), generator=generator)
            for p, size in zip(parameters, sizes, strict=True)
        ]
        count = sum(len(i) for i in indices)
        return cls(
            indices,
            torch.zeros(count),
            torch.zeros(count),
            torch.zeros(count, dtype=torch.bfloat16),
            torch.zeros(count),
            torch.zeros(count, dtype=torch.bfloat16),
        )

    def observe(self, gradients: torch.Tensor) -> None:
        """One optimizer step with these (fp32) gradients."""
        self.step += 1
        t, g = self.step, gradients
        g_bf16 = g.to(torch.bfloat16)
        self.m.mul_(BETA1).add_(g, alpha=1 - BETA1)
        self.torch_fp32.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
        self.torch_bf16.mul_(BETA2).addcmul_(g_bf16, g_bf16, value=1 - BETA2)
        debiased = BETA2 * (1 - BETA2 ** (t - 1)) / (1 - BETA2**t)  # torch-optimi's beta2_t
        self.optimi_fp32.mul_(debiased).addcmul_(g, g, value=1 - debiased)
        self.optimi_bf16.mul_(debiased).addcmul_(g_bf16, g_bf16, value=1 - debiased)
        if t in CHECKPOINTS:
            correction = 1 - BETA2**t
            m = self.m / (1 - BETA1**t)
            self.fractions[t] = (
                _update_fraction(
                    m, self.torch_bf16.float() / correction, self.torch_fp32 / correction
                ),
                _update_fraction(m, self.optimi_bf16.float(), self.optimi_fp32),
            )


def shadow(plan: PrecisionPlan) -> MomentShadows:
    """Shadows for ``plan``'s parameters, fed the sampled gradients before each optimizer step."""
    parameters = [
        p for group in plan.optimizer.param_groups for p in group["params"] if p.requires_grad
    ]
    shadows = MomentShadows.sampling(parameters)

    def before_step(*_: object) -> None:
        sampled = [
            (torch.zeros(len(i)) if p.grad is None else p.grad.detach().flatten()[i].float())
            for p, i in zip(parameters, shadows.indices, strict=True)
        ]
        shadows.observe(torch.cat(sampled))

    plan.optimizer.register_step_pre_hook(before_step)
    return shadows


def measure(name: str, steps: int) -> MomentShadows:
    """The task trained ``steps`` fp32 steps, its gradients shadowed."""
    shadows: list[MomentShadows] = []
    task = TASKS[name](steps)
    long_run(task, ModeSpec(mode="fp32"), 0, steps, lambda plan: shadows.append(shadow(plan)))
    return shadows[0]


def main(argv: list[str] | None = None) -> dict[str, MomentShadows]:
    names, steps, _ = run_arguments(
        __doc__, argv, default=list(TASKS), quick=["digits_mlp"], quick_steps=500
    )
    shown = [c for c in CHECKPOINTS if c <= steps]
    print("update fraction a bf16 second moment lets through (torch / optimi) at step:")
    print(f"{'task':20}" + "".join(f"{c:>14}" for c in shown), flush=True)
    results = {}
    for name in names:
        results[name] = measure(name, steps)
        pairs = [results[name].fractions[c] for c in shown]
        cells = "".join(f"{f'{a:.2f} / {b:.2f}':>14}" for a, b in pairs)
        print(f"{name:20}{cells}", flush=True)
    return results


if __name__ == "__main__":
    main()
