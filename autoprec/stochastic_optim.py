"""Adam/AdamW and SGD with torch's exact semantics whose bf16 updates are rounded
stochastically.

Used by ``bf16_sr`` and ``bf16_sr_kahan``. The rounding primitive is torchastic's
``copy_stochastic_``. torchastic's own AdamW is not used: it refuses fp32 parameters (so
``keep_fp32`` modules could not be trained alongside) and scales weight decay by the
bias-corrected step size, which would be a silent hyper-parameter change against the user's
``torch.optim.AdamW``. Here every parameter is updated in fp32 arithmetic exactly as torch's
(non-amsgrad) Adam/AdamW or SGD does; bf16 parameters and their optimizer state are then written
back with stochastic rounding, optionally with a Kahan compensation buffer that carries what the
rounding lost into the next step. fp32 parameters are updated normally; complex ones (a
Fourier layer's spectral weights) as torch's optimizers update them: their real and imaginary
parts as two real numbers. Parameters are updated in chunks (``autoprec.flat_chunks``): a
chunk's weights, gradients and moments are gathered into flat fp32 buffers, updated there with
one operation each, and written back, the rounding noise drawn for the whole chunk at once.

With ``state_bits=8`` (``bf16_sr+8bit-optim``) the moments are kept 8-bit as bitsandbytes' 8-bit
optimizers keep them: block-wise (blocks of 256, an fp32 absmax each) on its dynamic maps (signed
for Adam's first moment and SGD's momentum, unsigned for the second moment), rounded to nearest,
fp32 for tensors under 4096 elements (its ``min_8bit_size``). Each step reads them back to fp32,
updates them there and quantises them again, tensor by tensor (each its own blocks), as
bitsandbytes' fused kernels do. bf16 weights with
8-bit moments hold 4 bytes a parameter, against 6 with bf16 moments.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

from autoprec._imports import require
from autoprec.eight_bit_states import (
    SIGNED_MOMENTS,
    EightBitStates,
    absmax_key,
    blocks,
    codes_key,
    keeps_8bit,
)
from autoprec.flat_chunks import chunks, gather, pieces, scatter
from autoprec.random_streams import seed_torch
from autoprec.weight_dtypes import as_real

_STORAGE_KEYS = ("kahan", "state_bits")
"""Group options that say how the optimizer keeps its weights and moments: its own, not a
checkpoint's."""


def _complex_in_8_bits(param: torch.Tensor) -> ValueError:
    return ValueError(
        "8-bit optimizer states take real parameters only (as bitsandbytes'), but a "
        f"{tuple(param.shape)} parameter is {param.dtype}; keep its module in fp32 with "
        "32-bit states, or use bf16_sr without 8-bit states."
    )


_SAVED_KEYS = {*SIGNED_MOMENTS, *(absmax_key(key) for key in SIGNED_MOMENTS)}
"""A checkpoint's per-parameter tensors a load reads before torch's load casts them."""


def _saved_moments(state_dict: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Each parameter's moments (and 8-bit block scales) in a checkpoint, in the groups'
    parameter order (the order torch's load pairs them with the optimizer's parameters)."""
    state = state_dict.get("state", {})
    order = [index for group in state_dict.get("param_groups", []) for index in group["params"]]
    return [
        {
            key: value
            for key, value in state.get(index, {}).items()
            if key in _SAVED_KEYS and isinstance(value, torch.Tensor)
        }
        for index in order
    ]


class _StochasticOptimizer(torch.optim.Optimizer, abc.ABC):
    """What both optimizers share: the rounding writes, the Kahan compensation, the step loop
    over parameters, and the rounding noise drawn from the optimizer's own random stream,
    saved in its state dict."""

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        kahan: bool,
        state_bits: int,
        seed: int | None,
    ) -> None:
        if state_bits not in (8, 32):
            raise ValueError(f"state_bits must be 8 or 32 but got {state_bits!r}.")
        self._copy_stochastic = require("torchastic").stochastic_optim.copy_stochastic_
        self._eight_bit: EightBitStates | None = None  # made at the first 8-bit moment
        # None: torch's seed (torch.manual_seed's, a trial's run seed), read without a draw;
        # a fixed 0 made every seed of `tune --seed` round with the same noise. In a process
        # group of several ranks, the first step seeds from the weights instead (_first_seed)
        self._seed = (torch.initial_seed() if seed is None else seed) % 2**63
        self._seed_given = seed is not None
        self._rng_states: dict[str, torch.Tensor] = {}
        self._cuda_devices: list[int] = []
        super().__init__(params, {**defaults, "kahan": kahan, "state_bits": state_bits})

    @abc.abstractmethod
    def _chunk_key(self, param: torch.Tensor) -> Hashable:
        """What parameters updated together share (their device and dtype at least)."""

    @abc.abstractmethod
    def _update(self, chunk: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Update a chunk of parameters (each has a gradient; they share ``_chunk_key``) with
        their group's options, in fp32 arithmetic on flat buffers (``autoprec.flat_chunks``),
        writing them back through ``_write`` / ``_finish_weights``."""

    def _write(self, targets: list[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
        """Write fp32 ``values`` (``gather``-shaped) into the targets (one dtype): bf16 ones
        rounded stochastically. Returns what was written, as ``values`` is shaped (bf16 for
        bf16 targets)."""
        if targets[0].dtype != torch.bfloat16:
            scatter(values, targets)
            return values
        if len(targets) == 1:  # straight into it, as shaped as the values
            self._copy_stochastic(targets[0], values)
            return targets[0]
        rounded = torch.empty_like(values, dtype=torch.bfloat16)
        self._copy_stochastic(rounded, values)
        scatter(rounded, targets)
        return rounded

    def _new_moment(self, param: torch.Tensor, group: dict[str, Any], key: str) -> None:
        """A zero moment: in the parameter's dtype, or with ``state_bits=8`` 8-bit codes
        (fp32 for a tensor under ``MIN_8BIT_SIZE`` elements, as bitsandbytes keeps it)."""
        state = self.state[param]
        if group["state_bits"] != 8:
            state[key] = torch.zeros_like(param)
        elif param.is_complex():
            raise _complex_in_8_bits(param)
        elif keeps_8bit(param):
            state[codes_key(key)], state[absmax_key(key)] = self._quantizer().fresh(param)
        else:
            state[key] = torch.zeros_like(param, dtype=torch.float32)

    def _has_moment(self, param: torch.Tensor, key: str) -> bool:
        state = self.state[param]
        return state.get(key) is not None or codes_key(key) in state

    def _read_moment(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """One parameter's moment in fp32 (a new tensor for 8-bit codes)."""
        state = self.state[param]
        if codes_key(key) in state:
            signed = SIGNED_MOMENTS[key]
            return self._quantizer().dequantize(
                state[codes_key(key)], state[absmax_key(key)], signed=signed
            )
        return as_real(state[key]).float()

    def _read_moments(
        self, chunk: list[torch.Tensor], group: dict[str, Any], key: str
    ) -> torch.Tensor:
        """A chunk's moments in fp32, shaped as ``gather`` shapes them, to update in place and
        write back with ``_write_moments``: gathered, or with ``state_bits=8`` read tensor by
        tensor."""
        if group["state_bits"] != 8:
            return gather([self.state[param][key] for param in chunk])
        if len(chunk) == 1:
            return self._read_moment(chunk[0], key)
        return torch.cat([self._read_moment(param, key).reshape(-1) for param in chunk])

    def _write_moments(
        self, chunk: list[torch.Tensor], group: dict[str, Any], key: str, values: torch.Tensor
    ) -> None:
        """Write a chunk's updated moments back: in the parameters' dtype (bf16 rounded
        stochastically), or with ``state_bits=8`` quantised tensor by tensor (fp32 below
        ``MIN_8BIT_SIZE``)."""
        if group["state_bits"] != 8:
            self._write([self.state[param][key] for param in chunk], values)
            return
        for param, value in zip(chunk, pieces(values, chunk), strict=True):
            state = self.state[param]
            if codes_key(key) in state:
                codes, absmax = self._quantizer().quantize(value, signed=SIGNED_MOMENTS[key])
                state[codes_key(key)].copy_(codes)
                state[absmax_key(key)].copy_(absmax)
            else:
                state[key].copy_(value)

    def _quantizer(self) -> EightBitStates:
        if self._eight_bit is None:  # bitsandbytes is required here (and by the rebuild)
            self._eight_bit = EightBitStates()
        return self._eight_bit

    def _start_weights(self, chunk: list[torch.Tensor], group: dict[str, Any]) -> torch.Tensor:
        """The chunk's weights in fp32 (``gather``), plus their Kahan compensation when the
        group keeps one for bf16 weights (created at the first step, and after loading the
        state of an optimizer without one)."""
        weight = gather(chunk)
        if group["kahan"] and chunk[0].dtype == torch.bfloat16:
            for param in chunk:
                if "compensation" not in self.state[param]:
                    self.state[param]["compensation"] = torch.zeros_like(param)
            weight.add_(gather([self.state[param]["compensation"] for param in chunk]))
        return weight

    def _finish_weights(self, chunk: list[torch.Tensor], weight: torch.Tensor) -> None:
        """Write the updated fp32 weights back, keeping what rounding lost as compensation."""
        written = self._write(chunk, weight)
        if "compensation" in self.state[chunk[0]]:
            compensations = [self.state[param]["compensation"] for param in chunk]
            # cast first: a copy between dtypes takes torch's per-tensor path on a GPU
            scatter(weight.sub_(written.float()).bfloat16(), compensations)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the rounding stream (``"rounding_rng"``): a run resumed
        from a checkpoint draws the rounding noise an uninterrupted run would draw, not the
        stream's start again (which would repeat the first steps' noise)."""
        state = super().state_dict()
        state["state"] = {
            index: self._torch_layout(entry) for index, entry in state["state"].items()
        }
        state["rounding_rng"] = {device: rng.clone() for device, rng in self._rng_states.items()}
        return state

    def _torch_layout(self, entry: dict[str, Any]) -> dict[str, Any]:
        """One parameter's saved state with its 8-bit moments as fp32 tensors under torch's
        names, beside their block scales (``exp_avg_absmax``, 1/256 of the size; a new dict:
        the optimizer's own state is not touched). Every mode's optimizer, and torch's, loads
        that; the 8-bit load encodes them again on those scales, the codes they came from.
        The fp32 moments are moved to the CPU one tensor at a time: on the GPU all of them
        would need 8 bytes a parameter beside the mode's 2, and a model that fits only with
        8-bit moments ran out of memory saving a checkpoint (found by a review of the CUDA
        paths). Every load moves them back to the parameter's device."""
        if not any(codes_key(key) in entry for key in SIGNED_MOMENTS):
            return entry
        saved = dict(entry)
        for key, signed in SIGNED_MOMENTS.items():
            if codes_key(key) in saved:
                codes, absmax = saved.pop(codes_key(key)), saved[absmax_key(key)].clone()
                saved[key] = self._quantizer().dequantize(codes, absmax, signed=signed).cpu()
                saved[absmax_key(key)] = absmax  # the load re-encodes on it: resumes exactly
        return saved

    def _eight_bit_layout(self, saved_moments: list[dict[str, torch.Tensor]]) -> None:
        """After a load: the moments of ``state_bits=8`` groups as they train (8-bit codes, or
        fp32 under ``MIN_8BIT_SIZE``), made from the checkpoint's own tensors (torch's load
        cast them to the parameter's dtype, bf16, which moved an fp32 moment's codes); the
        block scales a 32-bit group does not use dropped."""
        parameters = [p for group in self.param_groups for p in group["params"]]
        groups = [group for group in self.param_groups for _ in group["params"]]
        for param, group, saved in zip(parameters, groups, saved_moments, strict=True):
            state = self.state.get(param, {})
            for key, signed in SIGNED_MOMENTS.items():
                state.pop(absmax_key(key), None)  # torch's load cast it to bf16
                value = state.get(key)
                if group["state_bits"] != 8 or not isinstance(value, torch.Tensor):
                    continue
                value = saved.get(key, value).to(param.device).float()
                if not keeps_8bit(param):  # (a complex one was refused before the load)
                    state[key] = value
                    continue
                del state[key]
                scale = saved.get(absmax_key(key))
                quantizer = self._quantizer()
                if scale is not None and scale.numel() == blocks(value):
                    absmax = scale.float().to(param.device)
                    codes = quantizer.encode(value, absmax, signed=signed)
                else:  # a moment saved without 8-bit scales (torch's, bf16_sr's)
                    codes, absmax = quantizer.quantize(value, signed=signed)
                state[codes_key(key)], state[absmax_key(key)] = codes, absmax

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer state and, when the checkpoint carries one, the rounding
        stream (checkpoints of torch's own AdamW have none: the stream starts from ``seed``).
        ``kahan`` and ``state_bits`` stay this optimizer's: they say how it keeps weights and
        moments, not a hyper-parameter to take from the checkpoint (a ``bf16_sr`` checkpoint
        loaded into ``bf16_sr+8bit-optim``'s optimizer trains on with 8-bit moments, and
        back; a ``bf16_sr_kahan`` one loaded into ``bf16_sr``'s trains on without the Kahan
        buffer, which it drops, where it trained on as ``bf16_sr_kahan``). A step count
        saved on the GPU (torch's fused or capturable AdamW keep it there) comes to the host:
        each step reads it, and on the GPU that read was a sync a parameter (found by a
        review of the CUDA paths)."""
        for group in self.param_groups:  # before anything loads: 8-bit codes hold no complex
            complex_param = next((p for p in group["params"] if p.is_complex()), None)
            if group["state_bits"] == 8 and complex_param is not None:
                raise _complex_in_8_bits(complex_param)  # (its moments lost their imaginary part)
        state_dict = dict(state_dict)
        saved = state_dict.pop("rounding_rng", None) or {}
        own = [{key: group[key] for key in _STORAGE_KEYS} for group in self.param_groups]
        saved_moments = _saved_moments(state_dict)  # as saved: torch's load casts them
        super().load_state_dict(state_dict)
        for group, storage in zip(self.param_groups, own, strict=True):
            for key, value in self.defaults.items():  # torch's own groups lack our options
                group.setdefault(key, value)
            group.update(storage)
            for param in group["params"]:
                state = self.state.get(param, {})
                if not group["kahan"]:  # a Kahan run's buffer: this optimizer keeps none
                    state.pop("compensation", None)
                if isinstance(state.get("step"), torch.Tensor):  # on the host, as ours keep it
                    state["step"] = state["step"].detach().to("cpu", torch.float32)
        self._eight_bit_layout(saved_moments)
        self._rng_states = {device: rng.clone() for device, rng in saved.items()}
        self._cuda_devices = self._parameter_cuda_devices()

    def _parameter_cuda_devices(self) -> list[int]:
        return sorted(
            {
                p.device.index or 0
                for group in self.param_groups
                for p in group["params"]
                if p.device.type == "cuda"
            }
        )

    def _first_seed(self) -> int:
        """The rounding stream's seed at the first step. In a process group of several ranks,
        without a ``seed`` given: a digest of the weights, which DDP made every rank's when it
        wrapped the model, so every replica rounds alike. ``torch.initial_seed()`` differs by
        rank under the usual ``torch.manual_seed(base + rank)``, and bf16_sr's replicas
        drifted apart from the first step, silently (found by a hunt). FSDP2's shards differ,
        and so does their noise."""
        import torch.distributed as dist

        if self._seed_given or not (dist.is_available() and dist.is_initialized()):
            return self._seed
        if dist.get_world_size() < 2:
            return self._seed
        heads = [
            as_real(_local(p).detach()).reshape(-1)[:8].to("cpu", torch.float32)
            for group in self.param_groups
            for p in group["params"]
        ]
        digest = hashlib.sha256(torch.cat(heads).numpy().tobytes()).digest()
        return int.from_bytes(digest[:8], "little") % 2**63

    @contextlib.contextmanager
    def _own_random_stream(self) -> Iterator[None]:
        """Draw the rounding noise from this optimizer's own stream (seeded by ``seed``), never
        from the global one: the model's random draws (dropout, diffusion noise) then match an
        fp32 run's step for step. torchastic draws with ``randint_like`` from the global RNG,
        so the global state is swapped for ours around the step and restored after it."""
        if not self._rng_states:  # first step: the devices the parameters live on
            self._cuda_devices = self._parameter_cuda_devices()
        devices = self._cuda_devices
        with torch.random.fork_rng(devices=devices):
            if not self._rng_states:
                self._seed = self._first_seed()
                seed_torch(self._seed, devices)  # the parameters' devices only: fork_rng
                # puts back just those, and torch.manual_seed reseeded every GPU
            else:
                torch.set_rng_state(self._rng_states["cpu"])
                for position, index in enumerate(devices):
                    saved = _saved_cuda_stream(self._rng_states, index, devices)
                    if saved is not None:
                        torch.cuda.set_rng_state(saved, index)
                    else:  # a checkpoint written on other devices: a fresh stream here, by
                        # the weights in a process group and by the device's place among the
                        # model's (rank r's cuda:r seeded by r rounded otherwise; a review)
                        with torch.cuda.device(index):
                            torch.cuda.manual_seed(self._first_seed() + position)
            yield
            self._rng_states = {"cpu": torch.get_rng_state()}
            for index in devices:
                self._rng_states[f"cuda:{index}"] = torch.cuda.get_rng_state(index)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._own_random_stream():
            for group in self.param_groups:
                updated = [param for param in group["params"] if param.grad is not None]
                for chunk in chunks(updated, self._chunk_key):
                    self._update(chunk, group)
        return loss


class StochasticAdamW(_StochasticOptimizer):
    """torch.optim.AdamW / Adam semantics with stochastic rounding (and Kahan) for bf16 params.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        decoupled_weight_decay: True for AdamW (decay the weight by ``lr * weight_decay``),
            False for Adam (add ``weight_decay * weight`` to the gradient).
        kahan: keep a bf16 compensation buffer per bf16 parameter.
        state_bits: 32 (moments in the parameter's dtype) or 8 (8-bit moments,
            ``autoprec.eight_bit_states``).
        seed: seed of the optimizer's own random stream for the rounding noise (None: torch's
            seed, ``torch.initial_seed()``, as ``torch.manual_seed`` set it).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        kahan: bool = False,
        state_bits: int = 32,
        seed: int | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0 but got {lr}, {eps}, {weight_decay}."
            )
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1) but got {betas}.")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults, kahan=kahan, state_bits=state_bits, seed=seed)

    def _chunk_key(self, param: torch.Tensor) -> Hashable:
        """Device, dtype and step count (a parameter without a gradient at some step counts
        fewer steps, and Adam's bias correction differs with it)."""
        step = self.state[param].get("step", 0)
        return param.device, param.dtype, float(step)

    def _update(self, chunk: list[torch.Tensor], group: dict[str, Any]) -> None:
        if any(param.grad.is_sparse for param in chunk):  # as torch's Adam and AdamW
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients, please consider "
                "SparseAdam instead"
            )
        for param in chunk:
            state = self.state[param]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                self._new_moment(param, group, "exp_avg")
                self._new_moment(param, group, "exp_avg_sq")
            state["step"] += 1
        step = float(self.state[chunk[0]]["step"])
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]

        grad = gather([param.grad for param in chunk])
        weight = self._start_weights(chunk, group)
        if weight_decay:
            if group["decoupled_weight_decay"]:
                weight.mul_(1 - lr * weight_decay)
            else:
                grad.add_(weight, alpha=weight_decay)
        exp_avg = self._read_moments(chunk, group, "exp_avg").mul_(beta1)
        exp_avg.add_(grad, alpha=1 - beta1)
        exp_avg_sq = self._read_moments(chunk, group, "exp_avg_sq").mul_(beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))

        self._write_moments(chunk, group, "exp_avg", exp_avg)
        self._write_moments(chunk, group, "exp_avg_sq", exp_avg_sq)
        self._finish_weights(chunk, weight)


class StochasticSGD(_StochasticOptimizer):
    """torch.optim.SGD semantics (momentum, dampening, nesterov, L2 weight decay) with
    stochastic rounding (and Kahan) for bf16 parameters and their momentum buffers.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        kahan: keep a bf16 compensation buffer per bf16 parameter.
        state_bits: 32 (moments in the parameter's dtype) or 8 (8-bit moments,
            ``autoprec.eight_bit_states``).
        seed: seed of the optimizer's own random stream for the rounding noise (None: torch's
            seed, ``torch.initial_seed()``, as ``torch.manual_seed`` set it).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        kahan: bool = False,
        state_bits: int = 32,
        seed: int | None = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, momentum and weight_decay must be >= 0 but got {lr}, {momentum}, "
                f"{weight_decay}."
            )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening.")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults, kahan=kahan, state_bits=state_bits, seed=seed)

    def _chunk_key(self, param: torch.Tensor) -> Hashable:
        """Device, dtype and whether the momentum buffer exists (torch starts it from the
        first gradient)."""
        return param.device, param.dtype, self._has_moment(param, "momentum_buffer")

    def _update(self, chunk: list[torch.Tensor], group: dict[str, Any]) -> None:
        momentum = group["momentum"]
        # A sparse gradient (nn.Embedding(sparse=True)) made dense: torch's SGD gives the same
        # weights (its sparse momentum buffer sums to the dense one; rows without a gradient
        # and without momentum stay exactly as they are, rounding an unchanged fp32 value
        # included); the dense copy is this mode's cost, and the trial measures it.
        grad = gather([p.grad.to_dense() if p.grad.is_sparse else p.grad for p in chunk])
        weight = self._start_weights(chunk, group)
        if group["weight_decay"]:
            grad.add_(weight, alpha=group["weight_decay"])
        if momentum:
            if not self._has_moment(chunk[0], "momentum_buffer"):
                buffer = grad.clone()
                for param in chunk:
                    self._new_moment(param, group, "momentum_buffer")
            else:
                buffer = self._read_moments(chunk, group, "momentum_buffer").mul_(momentum)
                buffer.add_(grad, alpha=1 - group["dampening"])
            grad = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            self._write_moments(chunk, group, "momentum_buffer", buffer)
        weight.add_(grad, alpha=-group["lr"])
        self._finish_weights(chunk, weight)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP2), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def pin_rounding_seed(optimizer: torch.optim.Optimizer, seed: int) -> None:
    """Seed a stochastic-rounding optimizer's stream with ``seed`` at its first step, as
    ``seed=`` would have (any other optimizer: nothing to do). Trials pin their run's seed."""
    if isinstance(optimizer, _StochasticOptimizer):
        optimizer._seed, optimizer._seed_given = seed % 2**63, True


def _saved_cuda_stream(
    states: dict[str, torch.Tensor], index: int, devices: list[int]
) -> torch.Tensor | None:
    """The saved CUDA stream for device ``index``: its own, or, on one device, a checkpoint's
    only one. Under DDP rank 0 saves ``cuda:0``'s and rank r resumes on ``cuda:r``: a fresh
    stream there seeded by the index made every rank round otherwise (found by a review)."""
    own = states.get(f"cuda:{index}")
    if own is not None:
        return own
    saved = [state for key, state in states.items() if key.startswith("cuda:")]
    return saved[0] if len(saved) == 1 and len(devices) == 1 else None
