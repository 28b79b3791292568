"""Running state: floating buffers a model's own forward pass updates in training mode.

BatchNorm's statistics, an observation normaliser's running mean, a VQ-VAE's EMA codebook:
state changed in place by the forward pass, outside the optimizer. A mode that casts it to bf16
updates it with nearest rounding whatever rounding the optimizer uses, and an EMA's small
updates then round away: a running mean of momentum 1e-3 stopped at 4.9 where fp32's reached
19.0, and held-out loss ended 2.8x fp32's after 3000 steps (``python -m
benchmarks.running_state_rounding``). The probe finds such buffers so that pure-bf16
candidates keep their modules in fp32.

Spectral norm's power-iteration vectors change too, but are not averages: each forward
recomputes them from the weight and normalises them, so no small increment accumulates to round
away. They are not counted (their modules stay in the mode's precision): bf16_sr with them in
bf16 ended 2000 steps where fp32 and the kept variant did (held-out loss 0.0189 / 0.0191 against
fp32's 0.0197 / 0.0197 and kept 0.0201 / 0.0194, hook / parametrization spectral norm, 3 seeds:
``python -m benchmarks.spectral_norm_rounding``).

One training-mode forward without gradients finds them; every buffer (its tensor object and
values), every module's training flag and the random number generators are restored after it,
so the user's model is left as it was.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from autoprec.buffer_slots import (
    BufferSlot,
    buffer_slots,
    empty_buffer_slots,
    kept_values,
    restore_buffer_slots,
)
from autoprec.layer_flops import call_model, renormed_weights_kept
from autoprec.random_streams import kept_streams
from autoprec.weight_dtypes import is_floating, same_values


def _power_iteration(entry: BufferSlot) -> bool:
    """Is this buffer one of spectral norm's power-iteration vectors (the hook of
    ``nn.utils.spectral_norm``: ``{name}_u`` / ``{name}_v``; the parametrization of
    ``nn.utils.parametrizations.spectral_norm``: ``_u`` / ``_v``)?"""
    from torch.nn.utils import parametrizations
    from torch.nn.utils.spectral_norm import SpectralNorm

    # a private class: where a torch release renames it, its shape still tells it apart
    parametrization = getattr(parametrizations, "_SpectralNorm", None)
    if parametrization is None:
        if hasattr(entry.module, "n_power_iterations") and hasattr(entry.module, "_power_method"):
            return entry.name in ("_u", "_v")
    elif isinstance(entry.module, parametrization):
        return entry.name in ("_u", "_v")
    return any(
        isinstance(hook, SpectralNorm) and entry.name in (f"{hook.name}_u", f"{hook.name}_v")
        for hook in entry.module._forward_pre_hooks.values()
    )


def power_iteration_vectors(model: nn.Module) -> frozenset[str]:
    """Names of spectral norm's power-iteration vectors in ``model``, under every name a
    shared module has. Recomputed by each forward, not averaged: the gate's check of state
    outside the optimizer leaves them out as the probe does (it rejected every pure-bf16 mode
    on a spectral-normed model, a GAN discriminator, for holding them in bf16; found by a
    hunt)."""
    return frozenset(entry.fqn for entry in buffer_slots(model) if _power_iteration(entry))


def running_buffers(model: nn.Module, example_input: Any, grad: bool = False) -> tuple[str, ...]:
    """Names of the floating buffers one training-mode forward of ``example_input`` changes
    (a shared buffer under its first name), spectral norm's vectors left out; () on the meta
    device. Raises what the forward pass raises; the model is restored either way. ``grad``:
    with gradients (a forward that differentiates by its inputs needs them)."""
    entries = buffer_slots(model)
    if not any(is_floating(entry.buffer) for entry in entries):
        return ()
    if any(entry.buffer.is_meta for entry in entries):
        return ()
    modes = {module: module.training for module in model.modules()}
    values, empty = kept_values(entries), empty_buffer_slots(model)
    devices = [p.device for p in model.parameters()] + [e.buffer.device for e in entries]
    cuda = sorted({device.index or 0 for device in devices if device.type == "cuda"})
    try:
        # the probe's own pass: what it warns of is not the user's training (a checkpointed
        # layer run without gradients warns that none of its inputs requires grad)
        with (
            kept_streams(cuda),
            torch.enable_grad() if grad else torch.no_grad(),
            warnings.catch_warnings(),
            renormed_weights_kept(model),
        ):
            warnings.simplefilter("ignore")
            model.train()
            call_model(model, example_input)
        changed: dict[int, str] = {}
        for entry in entries:
            now = entry.module._buffers.get(entry.name)
            before = values[id(entry.buffer)]
            moved = now is None or not same_values(before, now)
            if is_floating(entry.buffer) and moved and not _power_iteration(entry):
                changed.setdefault(id(entry.buffer), entry.fqn)
        return tuple(changed.values())
    finally:
        restore_buffer_slots(model, entries, values, empty)
        for module, training in modes.items():
            module.training = training
