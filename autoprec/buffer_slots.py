"""A model's buffer slots, kept before a forward pass autoprec runs on the user's model (the
probe's FLOP scan, its search for running state) and put back after it.

A forward may update a buffer in place (BatchNorm's running statistics), assign the slot a new
tensor (``self.mean = 0.9 * self.mean + ...``) or register a buffer on its first call. Each
slot gets its own tensor object back with its values, and buffers the pass created are removed:
a reference the user holds to a buffer keeps tracking the model (the FLOP scan put back values
alone, leaving a reassigned slot holding the scan's new tensor; found by a hunt).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class BufferSlot(NamedTuple):
    """One module's buffer slot as it was before the forward pass."""

    fqn: str
    module: nn.Module
    name: str
    buffer: torch.Tensor


def buffer_slots(model: nn.Module) -> list[BufferSlot]:
    """Every buffer slot of ``model``, under every name a shared module has."""
    return [
        BufferSlot(f"{fqn}.{name}" if fqn else name, module, name, buffer)
        for fqn, module in model.named_modules(remove_duplicate=False)
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]


def empty_buffer_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every buffer slot registered as None (InstanceNorm's running statistics, a BatchNorm
    with ``track_running_stats=False``): :func:`restore_buffer_slots` puts them back, where it
    had deleted them as made by the forward pass, and the user's model then failed
    ("'InstanceNorm2d' object has no attribute 'running_mean'"; found by a hunt)."""
    return [
        (module, name)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is None
    ]


def kept_values(slots: list[BufferSlot]) -> dict[int, torch.Tensor]:
    """Copies of the slots' values, by the id of their tensor."""
    return {id(slot.buffer): slot.buffer.detach().clone() for slot in slots}


def restore_buffer_slots(
    model: nn.Module,
    slots: list[BufferSlot],
    values: dict[int, torch.Tensor],
    empty: list[tuple[nn.Module, str]],
) -> None:
    """Put the slots back: their tensor objects and values, the ``empty`` ones (None) as
    None; buffers made since are removed."""
    kept = {(id(slot.module), slot.name) for slot in slots}
    kept |= {(id(module), name) for module, name in empty}
    for module in model.modules():
        for name in [n for n in module._buffers if (id(module), n) not in kept]:
            del module._buffers[name]  # made by the forward pass (a lazy initialisation)
    for module, name in empty:
        module._buffers[name] = None
    with torch.no_grad():
        for slot in slots:
            slot.module._buffers[slot.name] = slot.buffer
            value = values[id(slot.buffer)]
            if value.shape == slot.buffer.shape:
                slot.buffer.copy_(value)
