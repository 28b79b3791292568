"""Tensors updated together, through one flat fp32 buffer a chunk.

The stochastic-rounding optimizers do their arithmetic in fp32. One tensor at a time, that is
some 25 tensor operations a parameter, each a kernel launch on a GPU and Python and dispatch
overhead on a CPU: on an H100, ``bf16_sr``'s step made a 59M-parameter GPT 2.3x slower than
``bf16_pure`` (README, "Development"), and on our CPU its optimizer step took 13-23 ms on the
0.47M-parameter TinyGPT against torch AdamW's 2.5-3.6 ms. Gathered into one flat fp32 buffer, the
same element-wise arithmetic is one operation a chunk of parameters. On a GPU a chunk holds no
more elements than the largest tensor beside it (a larger tensor is a chunk of its own, as it
was its own update before): the step's temporary memory, some 28 bytes an element of the chunk
being updated (weight, gradient, moments, rounding noise in fp32), stays what the per-tensor
loop's was, whose peak was its largest tensor's. On a CPU a chunk holds up to
``CPU_CHUNK_ELEMENTS``. A single tensor is updated in its shape, as the loop updated it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from autoprec.weight_dtypes import as_real

CPU_CHUNK_ELEMENTS = 1 << 16
"""On a CPU, where the rounding noise (one draw from a sequential generator an element) and
passes over memory cost and launches hardly do: chunks of up to 256 KiB of fp32 stay in cache
(and take at most some 2 MiB of temporaries where every tensor is smaller).
Measured on our 2-core Xeon against the per-tensor loop (one thread, interleaved, best of 4-10
rounds; ``benchmarks.sr_8bit_step``'s parameters): the TinyGPT's step 14.3 ms against the
loop's 14.5, 8.4M parameters in 16 tensors 234 ms against 256; chunks of 2^24 took 17.1 and
380."""


def chunk_elements(tensors: Sequence[torch.Tensor]) -> int:
    """The most elements a chunk of these tensors (on one device) holds: on a CPU
    ``CPU_CHUNK_ELEMENTS``, elsewhere as many as the largest of them holds."""
    if tensors[0].device.type == "cpu":
        return CPU_CHUNK_ELEMENTS
    return max(as_real(tensor).numel() for tensor in tensors)


def chunks(
    tensors: Sequence[torch.Tensor],
    key: Callable[[torch.Tensor], Hashable],
    limit: int | None = None,
) -> list[list[torch.Tensor]]:
    """The tensors in runs that share ``key`` (in their order) of at most ``limit`` elements
    each (default: ``chunk_elements`` of those that share it; ``key`` must tell devices
    apart); a tensor larger than that, or ``alone``, is a run of its own."""
    by_key: dict[Hashable, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_key.setdefault((key(tensor), id(tensor) if alone(tensor) else None), []).append(tensor)
    runs: list[list[torch.Tensor]] = []
    for members in by_key.values():
        most = chunk_elements(members) if limit is None else limit
        run: list[torch.Tensor] = []
        size = 0
        for tensor in members:
            elements = as_real(tensor).numel()
            if run and size + elements > most:
                runs.append(run)
                run, size = [], 0
            run.append(tensor)
            size += elements
        runs.append(run)
    return runs


def gather(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new fp32 tensor of the tensors' values (complex ones as their real and imaginary parts,
    as ``as_real`` views them): one tensor's in its shape, several flat, one after the other."""
    if len(tensors) == 1:  # one pass, where a concatenation and a cast would take two
        return as_real(tensors[0]).to(torch.float32, copy=True)
    return torch.cat([as_real(tensor).reshape(-1) for tensor in tensors]).float()


def pieces(values: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``gather``'s values tensor by tensor: views shaped as ``as_real`` views each of ``like``."""
    if len(like) == 1:
        return [values]
    shapes = [as_real(tensor).shape for tensor in like]
    sizes = [as_real(tensor).numel() for tensor in like]
    return [piece.view(shape) for piece, shape in zip(values.split(sizes), shapes, strict=True)]


def scatter(values: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy ``gather``-shaped values into the targets, in the targets' dtype (one foreach copy
    for several)."""
    if len(targets) == 1:
        as_real(targets[0]).copy_(values)
        return
    torch._foreach_copy_([as_real(target) for target in targets], pieces(values, targets))


def alone(tensor: torch.Tensor) -> bool:
    """Whether a tensor is updated in a chunk of its own: a tensor subclass (FSDP2's DTensor
    shards), whose ops (a concatenation, a foreach copy) may be missing or gather the shards."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)
