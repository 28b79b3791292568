"""torch-optimi's Adam and AdamW as bf16_kahan runs them: Adam's second moment kept in fp32,
and AdamW's decoupled weight decay carried by the Kahan compensation.

**The second moment in fp32.** torch-optimi keeps a bf16 weight's ``exp_avg_sq`` in bf16,
rounded to nearest. With beta2 0.999 a step moves it by 0.1% of itself, below half a bf16 ulp:
it cannot decrease, and long runs end worse (the drift gate's optimizer-state rule; measured on
autoprec's long-run tasks: bf16_kahan with a bf16 second moment ended 2-17% worse on 3 of 8, and
fine on all three with beta2 0.95 alone changed, ``python -m benchmarks.state_rule_beta2``).
Here it is fp32, as torchdistX's AnyPrecisionAdamW (the Hugging Face Trainer's
``adamw_anyprecision``) keeps it by default: 2 more bytes per bf16 weight (12 for AdamW with
bf16 weights, gradients, compensation and first moment, against 16 in fp32). The first moment
stays bf16 (beta1 0.9 moves it 10% a step, far above bf16's resolution). torch-optimi's Triton
kernel writes both moments back in the weight's dtype, so it is off, and so is its foreach step,
which takes the square root of that moment copied into a bf16 gradient: the step runs
``autoprec.kahan_foreach`` (the per-tensor loop's ops over lists of tensors, to the bit; a group
with ``foreach=False`` runs the loop itself).

**The weight decay.** torch-optimi multiplies a bf16 weight by ``1 - lr * weight_decay``
outside its Kahan compensation: below half a bf16 ulp the product rounds back to the same
weight, and the decay never applies. Measured: AdamW at lr 1e-3, weight_decay 0.01, 2000 steps
of zero gradient, weights of 1.0 stayed 1.0 where torch's reach 0.9802 (0.9805 here); with real
gradients, weight_decay 0.01 and 0 gave bit-identical weights.

Imported only where torch-optimi is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from optimi import Adam, AdamW
from optimi.adam import adam as optimi_adam

from autoprec.kahan_foreach import LOW_PRECISION, foreach_adam_step


class Fp32SecondMoment:
    """Mixed into a torch-optimi Adam: a low-precision weight's ``exp_avg_sq`` is fp32 when
    made, after ``load_state_dict``, and through every step (Triton off)."""

    param_groups: list[dict[str, Any]]
    state: Any

    def _init_state(self, group: dict[str, Any], state: dict[str, Any], param: torch.Tensor):
        # both step paths (the whole model, and a gradient-release step of one parameter) make
        # their state here first: its kernel stores exp_avg_sq in the weight's dtype
        group["triton"] = False
        fresh = "kahan_comp" not in state  # torch-optimi's own test for a state not yet made
        super()._init_state(group, state, param)  # type: ignore[misc]
        if fresh and param.dtype in LOW_PRECISION:
            state["exp_avg_sq"] = state["exp_avg_sq"].float()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, param: torch.Tensor | None = None):
        if param is not None:  # gradient release: never built by autoprec
            return _parent_step()(self, closure, param)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_groups()
        return loss

    @torch.no_grad()
    def _step_groups(self) -> None:
        """Every group's step: ``kahan_foreach`` unless the group asks ``foreach=False``
        (torch-optimi's per-tensor loop then)."""
        for group in self.param_groups:
            lists: tuple[list[Any], ...] = ([], [], [], [], [])
            self._init_group(group, *lists)  # type: ignore[attr-defined]
            if group["foreach"] is not False:
                foreach_adam_step(group, *lists)
                continue
            optimi_adam(
                *lists,
                lr=group["lr"],
                beta1=group["beta1"],
                beta2=group["beta2"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                step=group["step"],
                decouple_wd=group["decouple_wd"],
                decouple_lr=group["decouple_lr"],
                max_lr=group["max_lr"],
                kahan_sum=group["kahan_sum"],
                foreach=False,
                triton=False,
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every loaded state to its weight's dtype: a bf16 weight's fp32 second
        moment is put back from the saved values themselves, as your load pre-hooks left them
        and before your post-hooks run."""
        final: list[dict[str, Any]] = []

        def record(optimizer: Any, loaded: dict[str, Any]) -> None:
            final.append(loaded)

        def restore(optimizer: Any) -> None:
            _restore_second_moments(self, final[-1])

        pre = self.register_load_state_dict_pre_hook(record)  # type: ignore[attr-defined]
        post = self.register_load_state_dict_post_hook(restore, prepend=True)  # type: ignore[attr-defined]
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            pre.remove()
            post.remove()


def _restore_second_moments(optimizer: Fp32SecondMoment, loaded: dict[str, Any]) -> None:
    """Each low-precision weight's ``exp_avg_sq`` from ``loaded``, in fp32."""
    groups = zip(optimizer.param_groups, loaded["param_groups"], strict=True)
    for group, saved_group in groups:
        for param, index in zip(group["params"], saved_group["params"], strict=True):
            saved = loaded["state"].get(index, {}).get("exp_avg_sq")
            if param.dtype in LOW_PRECISION and isinstance(saved, torch.Tensor):
                optimizer.state[param]["exp_avg_sq"] = saved.detach().to(
                    device=param.device, dtype=torch.float32, copy=True
                )


class KahanAdam(Fp32SecondMoment, Adam):
    """torch-optimi's Adam (L2 weight decay, Kahan summation) with an fp32 second moment."""


class KahanDecayAdamW(Fp32SecondMoment, AdamW):
    """torch-optimi's AdamW (Kahan summation on low-precision weights, an fp32 second moment)
    whose decoupled weight
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
            self._step_groups()
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
    step = Adam.step  # AdamW's too
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]
