"""Translate one parameter's saved torch optimizer state (AdamW, Adam, SGD) into the state of
the optimizer a mode rebuilt it into: torch-optimi with Kahan summation, or bitsandbytes'
8-bit states.

A run switched mid-way from fp32 (or AMP) to bf16_kahan or 8-bit states resumes with its Adam
moments or SGD momentum, not with fresh state. What each library keeps (read in their sources,
torch-optimi 0.3, bitsandbytes 0.50):

- torch: ``exp_avg`` m, ``exp_avg_sq`` v (raw; the update divides by ``1 - beta ** step``),
  ``step`` per parameter; SGD ``momentum_buffer``.
- torch-optimi: the *bias-corrected* moments ``m / (1 - beta1 ** t)`` and ``v / (1 - beta2 ** t)``
  (its betas are debiased step by step, ``optimi.utils.debias_beta``), in the parameter's dtype,
  one ``step`` per group, and a ``kahan_comp`` buffer (zeros: the weights' rounding to bf16 on
  load is what any switch to bf16 weights costs); SGD keeps the momentum as ``exp_avg``, torch's
  undampened buffer.
- bitsandbytes: raw m and v as ``state1``/``state2``, block-wise quantised to 8 bits (blocks of
  256, its own ``qmap1``/``qmap2``) for tensors of ``min_8bit_size`` elements or more, fp32 below;
  ``step`` per parameter. Its SGD overwrites the momentum with the gradient at step 1, so a loaded
  buffer is given step 1.
"""

from __future__ import annotations

from typing import Any

import torch


def saved_step(saved: dict[str, Any]) -> int:
    """The saved parameter's step count (0 when it holds none)."""
    step = saved.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def _moment(saved: dict[str, Any], key: str, parameter: torch.Tensor) -> torch.Tensor:
    value = saved.get(key)
    if not isinstance(value, torch.Tensor) or value.shape != parameter.shape:
        found = "nothing" if value is None else f"shape {tuple(getattr(value, 'shape', ()))}"
        raise ValueError(
            f"The saved optimizer state's {key!r} does not fit its parameter (shape "
            f"{tuple(parameter.shape)}; found {found}): the checkpoint was written for another "
            "model. Load the optimizer state saved with this model's weights."
        )
    return value.detach().to(device=parameter.device, dtype=torch.float32, copy=True)


def optimi_state(
    saved: dict[str, Any], parameter: torch.Tensor, betas: tuple[float, float] | None
) -> dict[str, Any]:
    """torch-optimi's state for ``parameter`` from torch's (``betas`` None: SGD)."""
    compensation = (
        torch.zeros_like(parameter) if parameter.dtype in (torch.float16, torch.bfloat16) else None
    )
    if betas is None:
        buffer = saved.get("momentum_buffer")
        exp_avg = None if buffer is None else _moment(saved, "momentum_buffer", parameter)
        return {
            "exp_avg": None if exp_avg is None else exp_avg.to(parameter.dtype),
            "kahan_comp": compensation,
        }
    step = saved_step(saved)
    if step < 1:
        raise ValueError(f"The saved Adam state has step {step}; expected at least 1.")
    beta1, beta2 = betas
    exp_avg = _moment(saved, "exp_avg", parameter) / (1 - beta1**step)
    exp_avg_sq = _moment(saved, "exp_avg_sq", parameter) / (1 - beta2**step)
    return {
        "exp_avg": exp_avg.to(parameter.dtype),
        "exp_avg_sq": exp_avg_sq.to(parameter.dtype),
        "kahan_comp": compensation,
    }


def bnb_state(
    optimizer: torch.optim.Optimizer,
    saved: dict[str, Any],
    indices: tuple[int, int],
    adam: bool,
) -> dict[str, Any]:
    """bitsandbytes' state for the parameter at ``indices`` (group, position) from torch's,
    built by the optimizer's own ``init_state`` (8-bit or fp32 by its ``min_8bit_size``) and
    filled with bitsandbytes' block-wise quantisation."""
    from bitsandbytes import functional

    group_index, position = indices
    group = optimizer.param_groups[group_index]
    parameter = group["params"][position]
    keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
    values = [_moment(saved, key, parameter) for key in keys]
    live = optimizer.state.pop(parameter, None)
    try:
        optimizer.init_state(group, parameter, group_index, position)  # type: ignore[attr-defined]
        state = optimizer.state.pop(parameter)
    finally:
        if live is not None:
            optimizer.state[parameter] = live
    for number, value in enumerate(values, start=1):
        target = state[f"state{number}"]
        if target.dtype == torch.uint8:
            quantised, quant_state = functional.quantize_blockwise(
                value.contiguous(), code=state[f"qmap{number}"], blocksize=256
            )
            target.copy_(quantised.view_as(target))
            state[f"absmax{number}"].copy_(quant_state.absmax)
        else:
            target.copy_(value)
    state["step"] = saved_step(saved) if adam else 1
    return state


def optimi_group_resumed(group: dict[str, Any], step: int | None) -> None:
    """Set a torch-optimi group up as its first step would, at ``step`` (None: SGD, which counts
    none): its first step otherwise resets the group's step to 0, and Adam's bias correction
    would start again over moments that are already corrected."""
    from optimi.utils import _default_to_triton

    if step is not None:
        group["step"] = torch.tensor(step, dtype=torch.int32)
    if not group["setup"]:
        group["setup"] = True
        if group["triton"] is None and group["foreach"] is None:
            group["triton"] = _default_to_triton(group["params"])
