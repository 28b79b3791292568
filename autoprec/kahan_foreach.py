"""bf16_kahan's Adam step over whole lists of tensors (torch's ``_foreach`` ops), the second
moment and the denominator in fp32.

torch-optimi's Triton kernel stores Adam's second moment in the weight's dtype, and its own
foreach step copies that moment into the bf16 gradient to take its square root (a bf16
denominator), so bf16_kahan ran torch-optimi's per-tensor loop: about ten small ops per tensor
from Python. On an H200 that loop cost bf16_kahan 12-30% of its samples/s on a 59M-parameter GPT
against the Triton kernel (docs/gpu-sessions.md, "Second H200 session"). This step runs the
loop's exact ops, each over a list of tensors: the same figures to the bit (tested), in fewer
launches. Ops whose lists mix dtypes (the fp32 moment beside bf16 gradients) take torch's
per-tensor path inside the op, the others its fused one.

The denominator is a new fp32 tensor per weight, as in the loop; the loop holds one at a time,
a list op one per tensor of its list, so the lists are cut into chunks of at most
``CHUNK_ELEMENTS`` (a tensor larger than that is a chunk of its own, as in the loop). Imported only
where torch-optimi is (its bias correction, ``optimi.utils.debias_beta``, is the loop's own).
"""

from __future__ import annotations

from typing import Any

import torch
from optimi.utils import debias_beta
from torch import Tensor

from autoprec.flat_chunks import chunks

LOW_PRECISION = (torch.bfloat16, torch.float16)

CHUNK_ELEMENTS = 2**24
"""At most this many weight elements per list op: the fp32 denominators of a chunk take 64 MiB."""


@torch.no_grad()
def foreach_adam_step(
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    kahan_comps: list[Tensor | None],
) -> None:
    """One Adam (or AdamW: ``group["decouple_wd"]``) step of a torch-optimi group, as
    ``optimi.adam._single_adam`` runs it, with list ops: the group's step counter advances, the
    weights (with their Kahan compensation where the group sums so and the weight is bf16 or
    fp16) and both moments are updated in place, and the gradients are used as scratch (as
    torch-optimi does)."""
    group["step"].add_(1)
    step = int(group["step"].item())
    lr, eps = float(group["lr"]), float(group["eps"])
    beta1_comp = 1 - debias_beta(group["beta1"], step)  # the loop's own correction
    beta2_hat = debias_beta(group["beta2"], step)
    decay = float(group["weight_decay"])
    decoupled = bool(group["decouple_wd"] or group["decouple_lr"])
    if decay and group["decouple_lr"]:
        decay = 1 - (lr / group["max_lr"]) * decay
    elif decay and group["decouple_wd"]:
        decay = 1 - lr * decay

    def kind(param: Tensor) -> tuple[torch.device, torch.dtype, bool]:
        summed = bool(group["kahan_sum"]) and param.dtype in LOW_PRECISION
        return param.device, param.dtype, summed

    position = {id(param): index for index, param in enumerate(params)}
    for members in chunks(params, kind, limit=CHUNK_ELEMENTS):
        chunk = [position[id(param)] for param in members]
        kahan = kind(members[0])[2]
        _step_lists(
            [params[i] for i in chunk],
            [grads[i] for i in chunk],
            [exp_avgs[i] for i in chunk],
            [exp_avg_sqs[i] for i in chunk],
            [kahan_comps[i] for i in chunk] if kahan else None,
            lr=lr,
            eps=eps,
            beta1_comp=beta1_comp,
            beta2_hat=beta2_hat,
            decay=decay,
            decoupled=decoupled,
        )


def _step_lists(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    kahan_comps: list[Tensor | None] | None,
    *,
    lr: float,
    eps: float,
    beta1_comp: float,
    beta2_hat: float,
    decay: float,
    decoupled: bool,
) -> None:
    """``optimi.adam._single_param_adam``'s ops, in its order, each over the lists."""
    if decay != 0:
        if decoupled:
            torch._foreach_mul_(params, decay)
        else:
            torch._foreach_add_(grads, params, alpha=decay)
    torch._foreach_lerp_(exp_avgs, grads, beta1_comp)
    torch._foreach_mul_(exp_avg_sqs, beta2_hat)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2_hat)
    denominators = torch._foreach_sqrt(exp_avg_sqs)  # in the moment's dtype: fp32
    torch._foreach_add_(denominators, eps)
    if kahan_comps is None:
        torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-lr)
        return
    comps = [comp for comp in kahan_comps if comp is not None]
    if len(comps) != len(params):
        raise RuntimeError("A low-precision weight has no Kahan compensation to sum into.")
    torch._foreach_addcdiv_(comps, exp_avgs, denominators, value=-lr)
    del denominators
    torch._foreach_copy_(grads, params)  # the weights before the step, in the gradients' room
    torch._foreach_add_(params, comps)
    torch._foreach_sub_(grads, params)  # what rounding left out of the weights...
    torch._foreach_add_(comps, grads)  # ...goes back into the compensation
