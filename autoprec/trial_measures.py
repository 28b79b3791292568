"""The instruments of a trial: sampled weights, exact state and saved-activation bytes, memory
peaks, gradient maxima, random streams, window clocks and compile counters."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autoprec.layer_flops import storage_key
from autoprec.modes.base import matmul_precision_kept
from autoprec.plan import PrecisionPlan
from autoprec.running_state import power_iteration_vectors
from autoprec.trial_records import LowPrecisionMoment, StateBytes, StateDigest
from autoprec.weight_dtypes import as_real, is_floating, stored_values

MOVEMENT_SAMPLE_ELEMENTS = 2**20
"""Weight elements sampled (evenly across tensors) to measure how far training moved them."""

_COMPENSATION_KEYS = ("kahan_comp", "compensation")  # torch-optimi, StochasticAdamW


def _moves_weights(group: dict[str, Any]) -> bool:
    """Whether a parameter group trains at the lr it has now (the peak leg's, when the figures
    below are read). Only the weight-decay note reads it: a group at lr 0 there said "weight
    decay never applies" of a head whose decay did (found by a hunt). The optimizer-state rule
    counts every group: a group at lr 0 in the peak leg may train later in the run (a staged
    unfreeze), which no leg shows, and leaving it out accepted pure bf16 there (found by a
    review); a group held at lr 0 for the whole run is a false reject it accepts (leave such
    weights out of the optimizer, or set ``requires_grad_(False)``)."""
    return float(group.get("lr", 0.0)) != 0.0


def low_precision_moment(plan: PrecisionPlan) -> LowPrecisionMoment | None:
    elements, beta2 = 0, 0.0
    for group in plan.optimizer.param_groups:
        group_beta2 = group["betas"][1] if "betas" in group else group.get("beta2", 0.0)
        for parameter in group["params"]:
            state = plan.optimizer.state.get(parameter, {}).get("exp_avg_sq")
            if isinstance(state, torch.Tensor) and state.dtype == torch.bfloat16:
                elements += state.numel()
                beta2 = max(beta2, float(group_beta2))
    if not elements:
        return None
    return LowPrecisionMoment(
        dtype="bfloat16", rounding=plan.mode.state_rounding, beta2=beta2, elements=elements
    )


def nearest_adam_beta2(plan: PrecisionPlan) -> float | None:
    """bf16_pure (weights rounded to nearest) trained by an Adam (torch's Adam/AdamW,
    bitsandbytes' Adam8bit/AdamW8bit): the largest beta2 of the groups holding trainable bf16
    weights, whatever their lr now (:func:`_moves_weights`). None for other modes and
    optimizers (SGD8bit also keeps ``betas``: its name tells it apart)."""
    optimizer = plan.optimizer
    if plan.mode.name != "bf16_pure" or "adam" not in type(optimizer).__name__.lower():
        return None
    betas = [
        float(group["betas"][1])
        for group in optimizer.param_groups
        if "betas" in group
        and any(p.dtype == torch.bfloat16 and p.requires_grad for p in group["params"])
    ]
    return max(betas) if betas else None


def nearest_rounded_decay(plan: PrecisionPlan) -> float | None:
    """The smallest ``lr x weight_decay`` per step of the parameter groups whose decoupled
    weight decay multiplies bf16 weights on its own, rounded to nearest: bf16_pure with torch's
    AdamW (or Adam with ``decoupled_weight_decay``), whose ``param.mul_(1 - lr * wd)`` rounds
    back to the same weight when ``lr * wd`` is below half a bf16 ulp (2**-9 of any weight).
    None when no group decays that way (other modes compensate or round stochastically;
    bitsandbytes fuses the decay into the update). The smallest: with the largest, a body at
    1e-3 x 0.01 beside a head at 1e-2 x 0.5 got no note, though the body's decay never applies
    (found by a hunt)."""
    optimizer = plan.optimizer
    if plan.mode.name != "bf16_pure" or not isinstance(optimizer, torch.optim.Adam):
        return None  # torch's AdamW is an Adam whose groups say decoupled_weight_decay
    decays = [
        float(group["lr"]) * float(group["weight_decay"])
        for group in filter(_moves_weights, optimizer.param_groups)
        if group.get("weight_decay") and group.get("decoupled_weight_decay")
        and any(p.dtype == torch.bfloat16 and p.requires_grad for p in group["params"])
    ]  # fmt: skip
    return min(decays) if decays else None


def sample_indices(model: nn.Module, budget: int) -> dict[str, torch.Tensor]:
    """Which elements of each trainable parameter the movement check follows: all of them
    when the model has at most ``budget`` elements, else a share of each tensor proportional to
    its size, drawn with replacement (duplicates dropped) so that the cost grows with the
    budget, never with the model (a permutation of a 45M-element tensor took 2.2 s). A complex
    element counts as two real values."""
    sizes = {
        name: as_real(parameter).numel()
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    }
    total = sum(sizes.values()) or 1
    generator = torch.Generator().manual_seed(0)
    indices = {}
    for name, size in sizes.items():
        if total <= budget:
            indices[name] = torch.arange(size)
            continue
        count = max(1, size * budget // total)
        drawn = torch.randint(0, size, (count,), generator=generator)
        indices[name] = torch.unique(drawn)  # sorted
    return indices


def state_no_optimizer_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """The model's buffers and the parameters ``optimizer`` does not hold: what a forward pass
    or a ``train_step`` may change in place (running statistics, a teacher's EMA weights) and
    no optimizer steps. Frozen or not: a mean teacher left with ``requires_grad=True`` (a
    common oversight) escaped the check and was accepted in bf16 (found by a hunt)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [
        *((name, b) for name, b in model.named_buffers()),
        *(
            (name, p)
            for name, p in model.named_parameters()
            if not p.requires_grad or id(p) not in held
        ),
    ]


def outside_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, StateDigest]:
    """Digests of the model's state no optimizer steps (``state_no_optimizer_steps``) that is
    floating, spectral norm's power-iteration vectors left out (``power_iteration_vectors``).
    Two float64 reductions per tensor, no copy of it."""
    digests = {}
    recomputed = power_iteration_vectors(model)
    for name, tensor in state_no_optimizer_steps(model, optimizer):
        if not is_floating(tensor) or tensor.is_meta or name in recomputed:
            continue
        values = as_real(tensor.detach())
        total = float(torch.nansum(values, dtype=torch.float64))  # a NaN fill value stays put
        norm = float(torch.linalg.vector_norm(values, dtype=torch.float64))
        digests[name] = StateDigest(str(tensor.dtype), total, norm)
    return digests


def unstepped_parameter_digests(
    plan: PrecisionPlan,
    never_reached: Collection[int],
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
) -> tuple[dict[str, StateDigest], dict[str, StateDigest]]:
    """Digests before and after training of the parameters the optimizer holds that no step
    gave a gradient (ids in ``never_reached``): state it never steps (optimizers skip a
    parameter without one; its state says nothing, as Adagrad fills it for every parameter at
    construction, a review), which a ``train_step`` may move in place (an EMA teacher left
    ``requires_grad=True`` inside the optimizer's groups, found by a hunt: bf16_sr was
    accepted while the teacher's bf16 EMA moved it 8% as far as fp32's in 600 steps). From
    their sampled values (``sampled_weights``, fp32): no pass over the whole tensors."""
    held = {id(p) for group in plan.optimizer.param_groups for p in group["params"]}
    starts, ends = {}, {}
    for name, parameter in plan.model.named_parameters():
        key = id(parameter)
        if key not in never_reached or key not in held:
            continue
        if name not in before or name not in after:
            continue
        dtype = str(parameter.dtype)
        starts[name], ends[name] = (_sample_digest(dtype, s[name]) for s in (before, after))
    return starts, ends


def _sample_digest(dtype: str, values: torch.Tensor) -> StateDigest:
    values = values.double()
    return StateDigest(dtype, float(torch.nansum(values)), float(values.norm()))


def parameter_group_indices(plan: PrecisionPlan) -> dict[str, int]:
    """Index of the optimizer parameter group each trainable parameter is in, by name."""
    group_of = {
        id(parameter): index
        for index, group in enumerate(plan.optimizer.param_groups)
        for parameter in group["params"]
    }
    return {
        name: group_of[id(parameter)]
        for name, parameter in plan.model.named_parameters()
        if id(parameter) in group_of
    }


def sampled_weights(
    plan: PrecisionPlan, indices: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Sampled weight values in fp32, Kahan compensation included (it is part of the weight)."""
    parameters = dict(plan.model.named_parameters())
    values = {}
    for name, chosen in indices.items():
        parameter = parameters[name]
        where = chosen.to(parameter.device)
        weight = as_real(parameter.detach()).reshape(-1)[where].float()  # only the sampled elements
        state = plan.optimizer.state.get(parameter, {})
        for key in _COMPENSATION_KEYS:
            compensation = state.get(key)
            if isinstance(compensation, torch.Tensor) and compensation.shape == parameter.shape:
                weight = weight + as_real(compensation.detach()).reshape(-1)[where].float()
        values[name] = weight.cpu()
    return values


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors: a tensor held twice (the same data pointer on the
    same device) counts once, a sparse one by its indices and values."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            # torch's SGD keeps a sparse momentum buffer for a sparse gradient (no storage of
            # its own: its indices and values hold the bytes)
            parts = (value._indices(), value._values()) if value.is_sparse else (value,)
            for part in parts:
                key = (part.data_ptr(), str(part.device))
                if key not in seen:
                    seen.add(key)
                    total += part.numel() * part.element_size()
    return total


def state_bytes(plan: PrecisionPlan) -> StateBytes:
    parameters = [p for p in plan.model.parameters()]
    return StateBytes(
        parameters=sum(p.numel() * p.element_size() for p in parameters),
        gradients=sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
        + plan.mode.accumulation_bytes(),
        optimizer=optimizer_state_bytes(plan.optimizer),
    )


class SavedForBackward:
    """Counts the bytes autograd saves for backward during a forward pass (saved-tensor hooks
    see every saved tensor, exactly): each storage once, what every mode holds anyway left
    out: the parameters (state, counted in :class:`StateBytes`), the model's buffers and the
    batch's own tensors (``inputs``; a training loop holds its batch through backward). A
    copy is counted: an autocast copy of a weight, a buffer or the batch is held until
    backward. Counting the batch a first Linear saves as it is counted a batch sliced from one
    tensor of the data set as the whole data set (found by a hunt: amp_bf16 read a 94% saving
    where 19% was real), and its spans alone still credited autocast, whose bf16 copy of the
    batch is new memory, with halving it: on a Linear(4096, 4) fp32 holds nothing beyond the
    batch and bf16_sr a 4 MiB copy, and the memory objective chose bf16_sr (a hunt)."""

    def __init__(self, model: nn.Module, inputs: Iterable[torch.Tensor] = ()) -> None:
        held = [*model.parameters(), *model.buffers(), *inputs]
        self._held = {_saved_key(tensor) for tensor in held}
        self._saved: dict[object, int] = {}
        self._live = self._peak = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _saved_key(tensor)
        if key not in self._held and key not in self._saved:
            self._saved[key] = _storage_bytes(tensor)
            self._live += self._saved[key]
            self._peak = max(self._peak, self._live)
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A saved tensor read by backward, which frees it after: a ``train_step`` running
        its own backward between two forwards (a GAN's, SAM's) holds one pass's at a time,
        and the two were summed (a hunt)."""
        self._live -= self._saved.pop(_saved_key(tensor), 0)
        return tensor

    @property
    def bytes(self) -> int:
        """The most held at once."""
        return self._peak


def _saved_key(tensor: torch.Tensor) -> object:
    """The tensor's storage; a wrapper subclass (FP8) without one counts by identity."""
    key = storage_key(tensor)
    return ("tensor", id(tensor)) if key is None else key


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_now(device: torch.device) -> dict[str, int]:
    """Memory in use before a trial: CUDA allocated and reserved, or the process's RSS."""
    if device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
        }
    rss = rss_bytes()
    return {} if rss is None else {"rss": rss}


def memory_peak(
    device: torch.device, baseline: dict[str, int], rss_samples: list[int | None]
) -> dict[str, Any]:
    """The trial's own peak: the peak since ``baseline`` was taken, minus the baseline (CUDA:
    the allocator's peak counters; CPU: the RSS sampled after every window of steps)."""
    if device.type == "cuda":
        return {
            "allocated": max(0, torch.cuda.max_memory_allocated(device) - baseline["allocated"]),
            "reserved": max(0, torch.cuda.max_memory_reserved(device) - baseline["reserved"]),
            "source": "cuda_allocator",
        }
    samples = [value for value in rss_samples if value is not None]
    if not samples or "rss" not in baseline:
        return {}
    return {"allocated": max(0, max(samples) - baseline["rss"]), "source": "process_rss"}


def max_abs_gradient(plan: PrecisionPlan, kept: Collection[int] = ()) -> torch.Tensor | None:
    """Largest |gradient| of the parameters not in ``kept`` (ids), loss scaling removed, as a
    device tensor (no host read); None when no such parameter has a gradient."""
    grads = [
        stored_values(p.grad)
        for p in plan.model.parameters()
        if p.grad is not None and id(p) not in kept
    ]
    if not grads:
        return None
    largest = torch.stack(torch._foreach_norm(grads, math.inf)).max().float()
    scale = plan.mode.loss_scale_tensor()
    return largest if scale is None else largest / scale.to(largest.device)


@contextlib.contextmanager
def torch_settings_kept() -> Iterator[None]:
    """torch's process-wide settings user code may change (the default dtype, the thread
    count, fp32 matmul precision and TF32 flags, cuDNN's benchmark and deterministic flags,
    deterministic algorithms) as they were after the block: an ``eval_fn`` calling
    ``torch.set_float32_matmul_precision("medium")`` changed every later run (TF32 matmuls in
    an "fp32" reference on a GPU) and outlived tune() (found by a hunt); a ``loss_fn`` or
    ``train_step`` doing the same did too, and an ``eval_fn`` setting ``cudnn.benchmark``
    (found by a later hunt): each run and the whole of tune() and check() are kept."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    cudnn = torch.backends.cudnn
    benchmark, deterministic = cudnn.benchmark, cudnn.deterministic
    algorithms = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    with matmul_precision_kept():
        try:
            yield
        finally:
            torch.set_default_dtype(dtype)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            cudnn.benchmark, cudnn.deterministic = benchmark, deterministic
            if algorithms != (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ):
                torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])


class WindowClock:
    """Times a window of steps. On a GPU: CUDA events recorded on the device's current stream,
    waited for once, at the window's end. On a CPU, where ops run as they are called: the host
    clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._started: float = 0.0
        self._start_event: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record(torch.cuda.current_stream(self.device))
        else:
            self._started = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`; on a GPU this waits for the window's work to finish."""
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            return float(self._start_event.elapsed_time(end)) / 1e3
        return time.perf_counter() - self._started


def compiled_graph_count() -> int:
    """Graphs torch.compile (dynamo) has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_counts(figures: dict[str, Any], before: int) -> tuple[int | None, int | None]:
    """(graphs built in warm-up, graphs built after it) of a compiled trial."""
    after_warmup = figures.get("graphs_after_warmup")
    if after_warmup is None:
        return None, None
    after_training = figures.get("graphs_after_training", compiled_graph_count())
    return after_warmup - before, after_training - after_warmup
