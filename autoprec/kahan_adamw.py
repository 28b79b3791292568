"""torch-optimi's AdamW with its decoupled weight decay carried by the Kahan compensation.

torch-optimi multiplies a bf16 weight by ``1 - lr * weight_decay`` outside its Kahan
compensation: below half a bf16 ulp the product rounds back to the same weight, and the decay
never applies. Measured: AdamW at lr 1e-3, weight_decay 0.01, 2000 steps of zero gradient,
weights of 1.0 stayed 1.0 where torch's reach 0.9802 (0.9805 here); with real gradients,
weight_decay 0.01 and 0 gave bit-identical weights. Imported only where torch-optimi is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from optimi import AdamW

LOW_PRECISION = (torch.bfloat16, torch.float16)


class KahanDecayAdamW(AdamW):
    """torch-optimi's AdamW (Kahan summation on low-precision weights) whose decoupled weight
    decay goes into each low-precision weight's compensation before the step, which carries it
    into the weight as it carries the Adam update; an fp32 weight, or one on its first step
    (before torch-optimi made its compensation), is decayed directly, as torch-optimi would.
    The groups show the user's ``weight_decay`` throughout; a step that raises takes back the
    decay it moved (to the compensation's own rounding: a retried step decays once), and a
    ``closure`` runs before the decay, which needs the gradients it makes."""

    def step(self, closure: Callable[[], Any] | None = None, param: torch.Tensor | None = None):
        if param is not None:  # gradient release: never built by autoprec
            return _parent_step()(self, closure, param)
        loss = None
        if closure is not None:  # before the decay: the closure makes the gradients it reads
            with torch.enable_grad():
                loss = closure()
        decays = [group["weight_decay"] for group in self.param_groups]
        moved = self._decay_into_compensation()
        try:
            for group in self.param_groups:
                group["weight_decay"] = 0.0
            _parent_step()(self)
        except BaseException:
            _undo(moved)
            raise
        finally:
            for group, decay in zip(self.param_groups, decays, strict=True):
                group["weight_decay"] = decay
        return loss

    @torch.no_grad()
    def _decay_into_compensation(self) -> list[tuple[torch.Tensor, torch.Tensor | None, float]]:
        """Apply every group's decay for this step; (weight, compensation or None, factor) of
        each, for an undo."""
        moved = []
        for group in self.param_groups:
            if not group["weight_decay"]:
                continue
            factor = float(group["lr"]) * group["weight_decay"]
            for weight in group["params"]:
                if weight.grad is None:  # torch-optimi leaves it alone, decay included
                    continue
                compensation = self.state.get(weight, {}).get("kahan_comp")
                if (
                    weight.dtype in LOW_PRECISION
                    and isinstance(compensation, torch.Tensor)
                    and compensation.dtype == weight.dtype
                    and compensation.shape == weight.shape
                ):
                    compensation.add_(weight, alpha=-factor)
                    moved.append((weight, compensation, factor))
                else:
                    weight.mul_(1 - factor)
                    moved.append((weight, None, factor))
        return moved


@torch.no_grad()
def _undo(moved: list[tuple[torch.Tensor, torch.Tensor | None, float]]) -> None:
    for weight, compensation, factor in moved:
        if compensation is None:
            weight.div_(1 - factor)
        else:
            compensation.add_(weight, alpha=factor)


def _parent_step() -> Callable[..., Any]:
    """torch-optimi's own step, without the step-hook wrapper torch puts on a class once one
    of its instances exists: this class's step runs the hooks already."""
    step = AdamW.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]
