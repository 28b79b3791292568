"""Pure bf16: weights, gradients and optimizer state in bf16 (no fp32 master copy).

``bf16_pure`` rounds every update to nearest (updates below half a bf16 ulp vanish);
``bf16_sr`` rounds them stochastically, ``bf16_kahan`` carries the rounding error in a Kahan
buffer (torch-optimi, with Adam's second moment in fp32), ``bf16_sr_kahan`` does both.
``keep_fp32`` modules keep fp32 weights, run in fp32 (a model input handed to one directly
arrives as the fp32 original, not the bf16 cast the rest of the model sees) and hand bf16
outputs on; a module tied to one (a ``lm_head`` sharing ``wte``'s weight) keeps that weight
fp32 and computes in bf16 from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoprec._warnings import warn_caller
from autoprec.eligibility import Situation
from autoprec.modes.base import (
    BackwardRunner,
    PrecisionMode,
    override,
    tensor_backward,
    under_root,
)
from autoprec.modes.islands import install_autocast_islands, install_fp32_islands
from autoprec.modes.root_inputs import (
    InputsToBf16,
    in_narrow_call,
    install_root_cast,
    original_input,
)


def _cast_own_tensors(
    module: nn.Module, dtype: torch.dtype, skip: set[int], casts: dict[int, torch.Tensor]
) -> None:
    """Cast a module's own floating parameters (but those in ``skip``, and buffers whose id is
    in it) in place; a buffer is cast once (``casts``, by its id) and the cast shared by every
    module holding it: cast per owner, a buffer two modules share became two tensors, one
    updated and one never (found by a hunt: a running mean read 0.0 by its second owner).
    float64 tensors stay float64: a model holds them so on purpose (a frozen physics operator;
    trainable float64 weights are refused up front), and cast to bf16 the forward that
    computes in float64 failed on them (found by a hunt)."""
    for parameter in module.parameters(recurse=False):
        if _cast(parameter) and id(parameter) not in skip:
            parameter.data = parameter.data.to(dtype)  # keeps the Parameter object
    for name, buffer in list(module._buffers.items()):  # every name: one tensor may hold two
        if buffer is not None and _cast(buffer) and id(buffer) not in skip:
            setattr(module, name, casts.setdefault(id(buffer), buffer.to(dtype)))


def _cast(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


class Bf16PureMode(PrecisionMode):
    """bf16 weights with the user's own optimizer (its states become bf16 too).

    With gradient accumulation the micro-batches' bf16 gradients are summed in fp32 and
    rounded to bf16 once per optimizer step: summing them in bf16 ``.grad`` rounds at every
    micro-batch (measured on a TinyGPT: 3.1e-3 relative error over 8 micro-batches, 7.9e-3 over
    64, against 1.7e-3 for one rounding). The fp32 sums cost 4 bytes per bf16 parameter.
    """

    name = "bf16_pure"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fp32_accumulation = False
        self.micro_batches_synced = False
        """A trainer that synchronises every micro-batch under DDP (apply_profile replaces
        this Trainer's ``accelerator.no_sync`` with one that synchronises): no warning about
        ``no_sync`` is needed."""
        self._parameters: list[nn.Parameter] = []
        self._sums: dict[nn.Parameter, torch.Tensor] = {}

    @override
    def configure_accumulation(self, steps: int) -> None:
        self.fp32_accumulation = steps > 1

    @override
    def accumulation_bytes(self) -> int:
        # the sums of the weights that get gradients: a frozen one has none to sum (found by a
        # hunt: a frozen backbone's 4 bytes a weight made bf16_pure read larger than fp32)
        trained = (p for p in self._parameters if p.requires_grad)
        return sum(4 * p.numel() for p in trained) if self.fp32_accumulation else 0

    @override
    def backward(self, loss: torch.Tensor, run: BackwardRunner = tensor_backward) -> None:
        super().backward(loss, run)
        if not self.fp32_accumulation:
            return
        if not self._sums and not self.micro_batches_synced:
            _warn_if_replicated()
        for parameter in self._parameters:
            if parameter.grad is None:
                continue
            total = self._sums.get(parameter)
            if total is None:
                self._sums[parameter] = parameter.grad.float()
            else:
                total.add_(parameter.grad)
            parameter.grad = None

    @override
    def gradients_ready(self) -> None:
        for parameter, total in self._sums.items():
            parameter.grad = total.to(parameter.dtype)
        self._sums = {}

    @override
    def discard_accumulated(self) -> None:
        self._sums = {}

    @override
    def convert_module(self, model: nn.Module) -> nn.Module:
        model = super().convert_module(model)
        kept = self.kept_roots(model)
        roots = set(kept)

        def inside_kept(fqn: str) -> bool:
            return under_root(fqn, roots)

        # a buffer a kept module holds stays fp32 for every module sharing it
        kept_buffers = {
            id(buffer)
            for fqn, module in model.named_modules(remove_duplicate=False)
            if inside_kept(fqn)
            for buffer in module.buffers(recurse=False)
        }
        skip = self.parameter_ids(model, kept) | kept_buffers
        casts: dict[int, torch.Tensor] = {}
        for fqn, module in model.named_modules():
            if not inside_kept(fqn):
                _cast_own_tensors(module, torch.bfloat16, skip, casts)
        # every cast below asks whether the model still holds bf16 weights (by one it cast):
        # a copy made fp32 again (an fp32 weight average) runs as plain fp32
        witness = next((n for n, p in model.named_parameters() if p.dtype == torch.bfloat16), None)
        if kept:  # kept modules handed a model input get its fp32 original
            install_root_cast(model, witness)
        else:  # nothing to record: a plain cast, which torch.compile traces
            model.register_forward_pre_hook(InputsToBf16(witness), with_kwargs=True)
        # fp32 tensors made inside forward (a timestep embedding, a mask) meet bf16 weights:
        # every layer that holds bf16 parameters casts its fp32 inputs to bf16.
        for fqn, module in model.named_modules():
            own = list(module.named_parameters(recurse=False))
            if fqn and own and all(p.dtype == torch.bfloat16 for _, p in own):
                module.register_forward_pre_hook(InputsToBf16(own[0][0]), with_kwargs=True)
        install_fp32_islands(
            model,
            kept,
            self.device_type,
            output_dtype=torch.bfloat16,
            original=original_input,
            narrow=in_narrow_call,
        )
        tied = self.tied_to_kept(model)  # their shared weight is fp32: compute in bf16 from it
        install_autocast_islands(model, tied, self.device_type, torch.bfloat16, in_narrow_call)
        self._parameters = [p for p in model.parameters() if p.dtype == torch.bfloat16]
        return model


class Bf16SrMode(Bf16PureMode):
    """bf16 weights; AdamW/Adam/SGD updates computed in fp32 and rounded stochastically."""

    name = "bf16_sr"
    optimizer_target = "stochastic"
    state_rounding = "stochastic"


class Bf16KahanMode(Bf16PureMode):
    """bf16 weights; torch-optimi's Kahan-compensated updates (AdamW, Adam, SGD), Adam's
    second moment in fp32 (``autoprec.kahan_adamw``)."""

    name = "bf16_kahan"
    optimizer_target = "optimi_kahan"
    fp32_second_moment = True

    @override
    def requirements(self, situation: Situation) -> list[str]:
        """Beside the mode's own: torch-optimi cannot add a sparse gradient into a bf16 weight's
        Kahan buffer (0.3.3: "copy_() between dense and sparse Tensors is not implemented" at
        the first step). Every embedding is kept in fp32 by default, where it trains; a spec
        whose ``keep_fp32`` leaves a ``sparse=True`` one out is refused up front."""
        reasons = super().requirements(situation)
        layers = situation.layers
        converted = [
            name
            for name in (layers.sparse_gradient_modules if layers is not None else ())
            if not self.keeps_fp32(name)
        ]
        if converted:
            listed = ", ".join(repr(name) for name in converted)
            reasons.append(
                f"bf16_kahan: torch-optimi cannot step a sparse gradient on bf16 weights (found: "
                f"sparse=True in {listed}, outside keep_fp32); keep them in fp32 "
                f"(keep_fp32={[*self.spec.keep_fp32, *converted]!r}), pass sparse=False, or "
                "use bf16_sr"
            )
        return reasons


class Bf16SrKahanMode(Bf16PureMode):
    """bf16 weights; stochastic rounding plus a Kahan buffer (AdamW, Adam, SGD)."""

    name = "bf16_sr_kahan"
    optimizer_target = "stochastic_kahan"
    state_rounding = "stochastic"


_warned_replicated: list[bool] = []


def _warn_if_replicated() -> None:
    """Once a process, in a process group of several ranks: the micro-batches' gradients are
    summed in fp32 outside ``.grad``, which DDP cannot see. A run that skips DDP's all-reduce
    on its first micro-batches (``no_sync()``) reduced the last one alone, and the replicas
    drifted apart, silently (found by a hunt: 8e-3 apart after 5 steps)."""
    import torch.distributed as dist

    if _warned_replicated or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() < 2:
        return
    _warned_replicated.append(True)
    warn_caller(
        "Pure bf16 sums the gradients of a step's micro-batches in fp32 outside .grad. Under "
        "DistributedDataParallel, let every micro-batch's backward synchronise (no "
        "`no_sync()`): with no_sync, DDP all-reduces the last micro-batch alone and the "
        "replicas drift apart. Under FSDP2 each rank sums its own shard, as it should."
    )
