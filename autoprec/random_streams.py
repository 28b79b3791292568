"""The global random streams a training step may draw from: torch's (the CPU's and the CUDA
devices'), Python's ``random`` and NumPy's legacy ``numpy.random``. A trial seeds all of them as
the fp32 reference seeded them, so a ``train_step`` that draws its noise, masks or augmentation
from any of them draws the same numbers in every run; whatever autoprec runs leaves the
caller's streams exactly as they were. (A generator the user owns, ``numpy.random.default_rng``
or a ``torch.Generator``, is theirs: it travels with the model or the closure.)"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

NUMPY_SEED_RANGE = 2**32
"""NumPy's legacy seed takes 0 … 2^32 - 1; a wider seed is folded into that range."""


@dataclass(frozen=True)
class StreamStates:
    """Where every global stream stands: as :func:`stream_states` took them."""

    torch_states: tuple[torch.Tensor, ...]
    python_state: tuple[Any, ...]
    numpy_state: tuple[Any, ...]


def cuda_devices_of(device: torch.device) -> list[torch.device]:
    """The CUDA device whose stream a run on ``device`` draws from, if any."""
    return [device] if device.type == "cuda" else []


def seed_torch(seed: int, cuda_devices: Sequence[torch.device | int]) -> None:
    """Seed torch's CPU stream and those of ``cuda_devices`` only: ``torch.manual_seed``
    reseeds every CUDA device, and a block that puts back only the ones it draws from left the
    other GPUs of a multi-GPU machine reseeded."""
    torch.random.default_generator.manual_seed(seed)
    for device in cuda_devices:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def stream_states(device: torch.device) -> StreamStates:
    """The global streams a run on ``device`` draws from, as they stand now."""
    torch_states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        torch_states.append(torch.cuda.get_rng_state(device))
    return StreamStates(tuple(torch_states), random.getstate(), numpy.random.get_state())


def drew_between(before: StreamStates, after: StreamStates) -> bool:
    """Whether anything drew from a global stream between the two readings."""
    if any(
        not torch.equal(a, b) for a, b in zip(before.torch_states, after.torch_states, strict=True)
    ):
        return True
    return before.python_state != after.python_state or not _same_numpy_state(
        before.numpy_state, after.numpy_state
    )


def _same_numpy_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """NumPy's state holds its key as an array: compared element by element."""
    return all(
        numpy.array_equal(x, y) if isinstance(x, numpy.ndarray) else x == y
        for x, y in zip(a, b, strict=True)
    )


@contextlib.contextmanager
def kept_streams(cuda_devices: Sequence[torch.device | int]) -> Iterator[None]:
    """Run a block; every global stream (torch on the CPU and ``cuda_devices``, Python's,
    NumPy's) is put back as it was when the block ends, however it ends."""
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=list(cuda_devices)):
            yield
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def seeded_streams(device: torch.device, seed: int) -> Iterator[None]:
    """Run a block with every global stream seeded from ``seed`` (the caller's are kept): two
    runs with one seed draw the same numbers from each."""
    cuda = cuda_devices_of(device)
    with kept_streams(cuda):
        seed_torch(seed, cuda)
        random.seed(seed)
        numpy.random.seed(seed % NUMPY_SEED_RANGE)
        yield


def set_streams(device: torch.device, states: StreamStates) -> None:
    """Set the global streams a run on ``device`` draws from to ``states``."""
    torch.random.set_rng_state(states.torch_states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states.torch_states[1], device)
    random.setstate(states.python_state)
    numpy.random.set_state(states.numpy_state)


@contextlib.contextmanager
def replayed_streams(device: torch.device, states: StreamStates) -> Iterator[None]:
    """Run a block from the streams ``states`` (the caller's are kept): a second pass draws
    what the first drew."""
    with kept_streams(cuda_devices_of(device)):
        set_streams(device, states)
        yield
