"""A student and its mean teacher: state your ``train_step`` updates, kept fp32 with keep_fp32.

The teacher's weights are frozen (no optimizer moves them); ``train_step`` moves them towards the
student's after every step (an EMA of decay 0.996, as in mean-teacher and self-distillation
training) and the student learns from the targets and from the teacher. Under pure bf16 the
teacher's weights are bf16 too, and every EMA update rounds to nearest, whatever rounding the
optimizer uses: the gate rejects bf16_sr for it ("state outside the optimizer held in
bfloat16"). The probe cannot find such state (no forward pass updates it); you name it:
``keep_fp32=["teacher"]`` keeps the teacher fp32 in every mode, and bf16_sr passes.

    python -m examples.mean_teacher            # check bf16_sr and amp_bf16, without and with it
    autoprec check examples.mean_teacher:make_model --data examples.mean_teacher:make_batches \\
        --train-step examples.mean_teacher:train_step --modes bf16_sr --keep-fp32 teacher
"""

from __future__ import annotations

import torch
from torch import nn

import autoprec

DECAY = 0.996


class MeanTeacher(nn.Module):
    """A student and its EMA teacher (frozen weights ``train_step`` moves towards the student)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
        self.teacher = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def make_model(seed: int = 0) -> tuple[MeanTeacher, torch.Tensor]:
    """The model and a batch of inputs."""
    torch.manual_seed(seed)
    return MeanTeacher(), make_batches(count=1)[0][0]


def make_batches(count: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression of sin(x w) for 8 inputs, 4 outputs; batches of 32."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 4, generator=generator)
    inputs = [torch.randn(32, 8, generator=generator) for _ in range(count)]
    return [(x, torch.sin(x @ weight)) for x in inputs]


def train_step(plan: autoprec.PrecisionPlan, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The teacher's EMA update (in training only), then the loss: targets plus the teacher."""
    x, y = batch
    model = plan.model
    if model.training:  # autoprec's held-out pass runs train_step in eval mode too
        with torch.no_grad():
            pairs = zip(model.teacher.parameters(), model.student.parameters(), strict=True)
            for teacher, student in pairs:
                teacher.lerp_(student.to(teacher.dtype), 1 - DECAY)
    with plan.autocast():
        target = model.teacher(x).detach().float()
        out = model(x).float()
    return nn.functional.mse_loss(out, y) + nn.functional.mse_loss(out, target)


def main() -> None:
    for keep in (None, ["teacher"]):
        model, _ = make_model()
        report = autoprec.check(
            model, make_batches(), train_step=train_step, steps=100, keep_fp32=keep,
            modes=["bf16_sr", "amp_bf16"], progress=False,
        )  # fmt: skip
        print(f"keep_fp32={keep}:")
        for verdict in report.verdicts:
            print(f"  {verdict.label:9} {verdict.status}")
            for reason in verdict.reasons:
                print(f"    {reason[:150]}...")


if __name__ == "__main__":
    main()
