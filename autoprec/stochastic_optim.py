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
parts as two real numbers.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from autoprec._imports import require
from autoprec.random_streams import seed_torch
from autoprec.weight_dtypes import as_real


class _StochasticOptimizer(torch.optim.Optimizer, abc.ABC):
    """What both optimizers share: the rounding writes, the Kahan compensation, the step loop
    over parameters, and the rounding noise drawn from the optimizer's own random stream,
    saved in its state dict."""

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], *, kahan: bool, seed: int | None
    ) -> None:
        self._copy_stochastic = require("torchastic").stochastic_optim.copy_stochastic_
        # None: torch's seed (torch.manual_seed's, a trial's run seed), read without a draw;
        # a fixed 0 made every seed of `tune --seed` round with the same noise
        self._seed = (torch.initial_seed() if seed is None else seed) % 2**63
        self._rng_states: dict[str, torch.Tensor] = {}
        self._cuda_devices: list[int] = []
        super().__init__(params, {**defaults, "kahan": kahan})

    @abc.abstractmethod
    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """Update one parameter (it has a gradient) with its group's options, in fp32
        arithmetic, writing bf16 tensors back through ``_write`` / ``_finish_weight``."""

    def _write(self, target: torch.Tensor, value: torch.Tensor) -> None:
        if target.dtype == torch.bfloat16:
            self._copy_stochastic(target, value)
        else:
            as_real(target).copy_(value)

    def _start_weight(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The weight in fp32, plus its Kahan compensation when the group keeps one (created
        at the first step, and after loading the state of an optimizer without one)."""
        state = self.state[param]
        if group["kahan"] and param.dtype == torch.bfloat16 and "compensation" not in state:
            state["compensation"] = torch.zeros_like(param)
        weight = as_real(param).float()
        compensation = state.get("compensation")
        if compensation is not None:
            weight.add_(compensation.float())
        return weight

    def _finish_weight(self, param: torch.Tensor, weight: torch.Tensor) -> None:
        """Write the updated fp32 weight back, keeping what rounding lost as compensation."""
        self._write(param, weight)
        compensation = self.state[param].get("compensation")
        if compensation is not None:
            compensation.copy_(weight - param.float())

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the rounding stream (``"rounding_rng"``): a run resumed
        from a checkpoint draws the rounding noise an uninterrupted run would draw, not the
        stream's start again (which would repeat the first steps' noise)."""
        state = super().state_dict()
        state["rounding_rng"] = {device: rng.clone() for device, rng in self._rng_states.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer state and, when the checkpoint carries one, the rounding
        stream (checkpoints of torch's own AdamW have none: the stream starts from ``seed``)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("rounding_rng", None) or {}
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch's own groups lack our options ("kahan")
            for key, value in self.defaults.items():
                group.setdefault(key, value)
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
                seed_torch(self._seed, devices)  # the parameters' devices only: fork_rng
                # puts back just those, and torch.manual_seed reseeded every GPU
            else:
                torch.set_rng_state(self._rng_states["cpu"])
                for index in devices:
                    saved = self._rng_states.get(f"cuda:{index}")
                    if saved is not None:
                        torch.cuda.set_rng_state(saved, index)
                    else:  # a checkpoint written on other devices: a fresh stream here
                        with torch.cuda.device(index):
                            torch.cuda.manual_seed(self._seed + index)
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
                for param in group["params"]:
                    if param.grad is not None:
                        self._update(param, group)
        return loss


class StochasticAdamW(_StochasticOptimizer):
    """torch.optim.AdamW / Adam semantics with stochastic rounding (and Kahan) for bf16 params.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        decoupled_weight_decay: True for AdamW (decay the weight by ``lr * weight_decay``),
            False for Adam (add ``weight_decay * weight`` to the gradient).
        kahan: keep a bf16 compensation buffer per bf16 parameter.
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
        super().__init__(params, defaults, kahan=kahan, seed=seed)

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = float(state["step"])
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if param.grad.is_sparse:  # as torch's Adam and AdamW
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients, please consider "
                "SparseAdam instead"
            )

        grad = as_real(param.grad).float()
        weight = self._start_weight(param, group)
        if weight_decay:
            if group["decoupled_weight_decay"]:
                weight.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(weight, alpha=weight_decay)
        exp_avg = as_real(state["exp_avg"]).float().mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq = as_real(state["exp_avg_sq"]).float().mul_(beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))

        self._write(state["exp_avg"], exp_avg)
        self._write(state["exp_avg_sq"], exp_avg_sq)
        self._finish_weight(param, weight)


class StochasticSGD(_StochasticOptimizer):
    """torch.optim.SGD semantics (momentum, dampening, nesterov, L2 weight decay) with
    stochastic rounding (and Kahan) for bf16 parameters and their momentum buffers.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        kahan: keep a bf16 compensation buffer per bf16 parameter.
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
        super().__init__(params, defaults, kahan=kahan, seed=seed)

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        momentum = group["momentum"]
        # A sparse gradient (nn.Embedding(sparse=True)) made dense: torch's SGD gives the same
        # weights (its sparse momentum buffer sums to the dense one; rows without a gradient
        # and without momentum stay exactly as they are, rounding an unchanged fp32 value
        # included); the dense copy is this mode's cost, and the trial measures it.
        grad = as_real(param.grad.to_dense() if param.grad.is_sparse else param.grad).float()
        weight = self._start_weight(param, group)
        if group["weight_decay"]:
            grad = grad.add(weight, alpha=group["weight_decay"])
        if momentum:
            if state.get("momentum_buffer") is None:
                buffer = grad.clone()
                state["momentum_buffer"] = torch.zeros_like(param)
            else:
                buffer = as_real(state["momentum_buffer"]).float().mul_(momentum)
                buffer.add_(grad, alpha=1 - group["dampening"])
            grad = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            self._write(state["momentum_buffer"], buffer)
        weight.add_(grad, alpha=-group["lr"])
        self._finish_weight(param, weight)
