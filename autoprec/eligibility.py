"""Which precision modes can run here, and which are worth a trial: reasons as data.

Every rule returns short reasons ending in what was found, e.g. ``"fp8_torchao needs compute
capability >= 8.9 (found: NVIDIA A100-SXM4-80GB, 8.0)"``. An empty reason list means eligible.
The same strings appear in ``autoprec probe``, in refusals of ``prepare`` and in test skips.
Notes are advisory: they never block a mode, but may mark it as not worth a trial.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel
from torch import nn

from autoprec._imports import BACKENDS, BackendStatus, backend_status, install_hint
from autoprec._models import FROZEN_RECORD
from autoprec.cpu_info import NATIVE_BF16_FLAGS
from autoprec.hardware import (
    FORMAT_MIN_CAPABILITY,
    FormatName,
    GpuInfo,
    HardwareInfo,
    detect_hardware,
)
from autoprec.layer_kinds import BNB_MIN_8BIT_SIZE, FP8_DIM_MULTIPLE
from autoprec.layers import LayerMix, scan_model
from autoprec.specs import MODE_NAMES, ModeName

FP8_MIN_FLOP_SHARE = 0.3
"""Below this share of forward FLOPs in FP8-compatible Linears, FP8 is not worth a trial."""

BYTES_SAVED_PER_8BIT_PARAMETER = 6
"""Adam keeps two fp32 states (8 bytes); 8-bit states take 2 bytes (plus tiny block scales)."""


class Eligibility(BaseModel):
    """Whether a mode (or knob) can run here, and whether it is worth a trial."""

    model_config = FROZEN_RECORD

    reasons: tuple[str, ...]
    """Why it cannot run here; empty when it can."""
    notes: tuple[str, ...]
    """Advisory facts (expected gain, risks, what the drift gate will check)."""
    worth_trying: bool

    @property
    def eligible(self) -> bool:
        return not self.reasons


@dataclass
class _Verdict:
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    doubtful: bool = False

    def doubt(self, note: str) -> None:
        self.notes.append(note)
        self.doubtful = True

    def done(self) -> Eligibility:
        return Eligibility(
            reasons=tuple(self.reasons),
            notes=tuple(self.notes),
            worth_trying=not self.reasons and not self.doubtful,
        )


@dataclass(frozen=True)
class Situation:
    """The facts the rules read: machine, chosen device, model scan, installed backends."""

    hardware: HardwareInfo
    device: str
    layers: LayerMix | None
    backends: tuple[BackendStatus, ...]
    emulate_fp8: bool = False
    """Judge fp8_torchao as emulated: FP8 numerics without FP8 hardware."""

    @property
    def gpu(self) -> GpuInfo | None:
        if self.device == "cpu":
            return None
        return self.hardware.gpu(int(self.device.split(":")[1]))

    def found_device(self) -> str:
        if self.gpu is not None:
            return self.gpu.label
        return f"CPU only, torch {self.hardware.torch_version}"

    def backend(self, name: str) -> BackendStatus | None:
        return next((backend for backend in self.backends if backend.name == name), None)


def _needs_gpu_format(verdict: _Verdict, what: str, fmt: FormatName, situation: Situation) -> None:
    major, minor = FORMAT_MIN_CAPABILITY[fmt]
    gpu = situation.gpu
    if gpu is None:
        verdict.reasons.append(
            f"{what} needs a CUDA GPU with compute capability >= {major}.{minor} "
            f"(found: {situation.found_device()})"
        )
    elif not gpu.supports(fmt) and gpu.rocm_arch is not None:
        verdict.reasons.append(
            f"{what} is not supported on AMD GPUs by autoprec yet: its rule follows NVIDIA "
            f"compute capabilities (found: {gpu.label}, a ROCm build of torch). Try amp_bf16."
        )
    elif not gpu.supports(fmt):
        verdict.reasons.append(
            f"{what} needs compute capability >= {major}.{minor} (found: {gpu.label})"
        )


def _needs_backends(
    verdict: _Verdict, what: str, names: Iterable[str], situation: Situation
) -> None:
    for name in names:
        status = situation.backend(name)
        if status is None or not status.installed:
            verdict.reasons.append(
                f"{what} needs {name} (found: not installed; {install_hint(name)})"
            )
        elif status.import_error is not None:
            verdict.reasons.append(f"{what} needs a working {name} (found: {status.import_error})")


def _needs_low_precision(verdict: _Verdict, what: str, dtype: str, situation: Situation) -> None:
    """bf16/fp16 compute: a capable GPU, or a CPU where autocast in that dtype runs."""
    if situation.gpu is not None:
        _needs_gpu_format(
            verdict, what, "bf16" if dtype == "bfloat16" else "fp16_tensor_cores", situation
        )
        return
    cpu = situation.hardware.cpu
    check = next((c for c in cpu.autocast if c.dtype == dtype), None)
    if check is None:
        verdict.reasons.append(f"{what} needs {dtype} on this CPU (found: not checked)")
    elif not check.works:
        verdict.reasons.append(f"{what} needs {dtype} autocast on this CPU (found: {check.error})")


def _fp8_model_fit(verdict: _Verdict, what: str, layers: LayerMix | None) -> None:
    if layers is None:
        verdict.notes.append("no model scanned: whether FP8 fits the model is unknown")
        return
    if not layers.linears:
        verdict.reasons.append(
            f"{what} swaps nn.Linear layers (found: none in {layers.model_class})"
        )
        return
    compatible = layers.fp8_compatible_linears
    if not compatible:
        verdict.reasons.append(
            f"{what} needs plain nn.Linear layers with both dimensions divisible by "
            f"{FP8_DIM_MULTIPLE} (found: none of {len(layers.linears)}: {_unfit(layers)})"
        )
        return
    share = layers.fp8_eligible_flop_share
    if share is not None and share < FP8_MIN_FLOP_SHARE:
        verdict.doubt(
            f"only {share * 100:.0f}% of forward FLOPs are in FP8-compatible Linears: "
            "little to gain"
        )
    if not any(linear.fp8_worthwhile for linear in compatible):
        largest = max(compatible, key=lambda linear: linear.in_features * linear.out_features)
        verdict.doubt(
            f"FP8-compatible Linears are small (largest {largest.in_features}x"
            f"{largest.out_features}): casting and scaling overhead likely exceeds the gain"
        )
    raw = layers.kind("raw_param").flop_share
    if raw:
        verdict.notes.append(
            f"{raw * 100:.0f}% of FLOPs are matmuls on raw nn.Parameter tensors, which FP8 "
            "module swapping cannot reach"
        )
    recurrent = layers.kind("recurrent").flop_share
    if recurrent:
        verdict.notes.append(
            f"{recurrent * 100:.0f}% of FLOPs are in recurrent layers (LSTM, GRU, RNN), which FP8 "
            "module swapping cannot reach"
        )


def _unfit(layers: LayerMix) -> str:
    """Why the Linears do not fit FP8, each cause counted (every one was blamed on its
    dimensions: an HF Conv1D GPT-2 of 4096x2048 layers "not divisible by 16")."""
    dims = f"with a dimension not divisible by {FP8_DIM_MULTIPLE}"
    counts = dict.fromkeys([*_UNFIT_CAUSES.values(), dims], 0)
    for linear in layers.linears:
        flag = next((flag for flag in _UNFIT_CAUSES if getattr(linear, flag)), None)
        counts[_UNFIT_CAUSES[flag] if flag else dims] += 1
    return "; ".join(f"{count} {cause}" for cause, count in counts.items() if count)


_UNFIT_CAUSES = {
    "already_fp8": "already converted to FP8 (torchao Float8Linear): pass the model before "
    "converting it, and autoprec converts what its profile says",
    "hf_conv1d": "HF Conv1D, which FP8 swaps do not convert",
    "bnb_4bit": "bitsandbytes 4-bit, which FP8 does not convert",
    "computed_weight": "with a computed weight (weight_norm, spectral_norm), which a swap "
    "cannot take",
    "swap_drops": "with a forward, methods, tensors, attributes or hooks of its own (a LoRA "
    "Linear), which a swap would drop",
    "under_transform": "called under torch.vmap or another torch.func transform, where FP8 "
    "swaps cannot run",
}
"""``LinearInfo`` flags that keep a Linear out of FP8 whatever its dimensions, as said."""


def _first_names(names: tuple[str, ...]) -> str:
    """The first three names, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _needs_real_parameters(
    verdict: _Verdict, what: str, library: str, layers: LayerMix | None
) -> None:
    """bitsandbytes and torch-optimi update complex parameters wrongly, without an error.
    torch's optimizers (and autoprec's stochastic-rounding ones) update a complex parameter's
    real and imaginary parts as two real numbers. Measured on our CPU machines (complex64
    (64, 80) weight, 3 AdamW steps at lr 1e-2, no weight decay): torch moved the imaginary
    parts by 0.017 on average, torch-optimi by 0.0045, bitsandbytes (32- and 8-bit) by 0.56;
    ``tests/test_optim.py`` fails when either library starts to update them as torch does."""
    if layers is None or not layers.complex_parameters:
        return
    names = layers.complex_parameters
    verdict.reasons.append(
        f"{what} updates complex parameters unlike torch's optimizers ({library} does not "
        "treat their real and imaginary parts as two real numbers, and trains them wrongly "
        f"without an error) (found: {len(names)} complex trainable parameter(s): "
        f"{_first_names(names)})"
    )


def _takes_no_sparse_gradients(verdict: _Verdict, what: str, layers: LayerMix | None) -> None:
    """bitsandbytes' 8-bit optimizers fail at their first step on a sparse gradient
    (0.50.2 on our CPU machines, SGD8bit, any table size: "RuntimeError: unsupported memory
    format option Contiguous")."""
    if layers is None or not layers.sparse_gradient_modules:
        return
    verdict.reasons.append(
        f"{what}: bitsandbytes' 8-bit optimizers cannot take sparse gradients (found: "
        f"sparse=True in {_first_names(layers.sparse_gradient_modules)}); pass sparse=False "
        "to train them with 8-bit states"
    )


def _fp32(situation: Situation, verdict: _Verdict) -> None:
    verdict.notes.append("the reference every other mode is measured against")


def _tf32(situation: Situation, verdict: _Verdict) -> None:
    _needs_gpu_format(verdict, "tf32", "tf32", situation)


def _amp_fp16(situation: Situation, verdict: _Verdict) -> None:
    _needs_low_precision(verdict, "amp_fp16", "float16", situation)
    layers = situation.layers
    if layers is not None and layers.complex_parameters:
        verdict.reasons.append(
            "amp_fp16: torch's GradScaler cannot unscale complex gradients (its "
            "_amp_foreach_non_finite_check_and_unscale_ is not implemented for ComplexFloat, "
            "on CPU and CUDA: pytorch/pytorch#58228) (found: "
            f"{len(layers.complex_parameters)} complex trainable parameter(s): "
            f"{_first_names(layers.complex_parameters)})"
        )
    if situation.gpu is None and layers is not None and layers.lstm_modules:
        verdict.reasons.append(
            'amp_fp16 on a CPU: oneDNN has no fp16 LSTM (torch raises "could not create a '
            'primitive descriptor for the LSTM forward") (found: '
            f"{len(layers.lstm_modules)} nn.LSTM: {_first_names(layers.lstm_modules)}); "
            "amp_bf16 runs it, and amp_fp16 on a CUDA GPU"
        )
    if situation.gpu is None and not verdict.reasons:
        verdict.doubt(
            "PyTorch has no fast fp16 kernels on most CPUs: expect amp_fp16 to be far slower "
            "than fp32 here"
        )
    verdict.notes.append("dynamic loss scaling; forward activations above 65504 overflow")


def _amp_bf16(situation: Situation, verdict: _Verdict) -> None:
    _needs_low_precision(verdict, "amp_bf16", "bfloat16", situation)
    _slow_bf16_on_this_cpu(verdict, "amp_bf16", situation)


def _slow_bf16_on_this_cpu(verdict: _Verdict, what: str, situation: Situation) -> None:
    """A CPU without bf16 instructions runs PyTorch's bf16 kernels far slower than fp32 (see
    CpuInfo.native_bf16): worth a trial only after the modes that can win, as amp_fp16 on a CPU.
    On one, every bf16 trial of `make demo` ran until the budget cut it, and the 8-bit
    variants of fp32 never ran."""
    cpu = situation.hardware.cpu
    if situation.gpu is not None or verdict.reasons or cpu.native_bf16 is not False:
        return
    verdict.doubt(
        f"this CPU has no bf16 instructions (none of {', '.join(sorted(NATIVE_BF16_FLAGS))} "
        f"among its flags): expect {what} to be far slower than fp32 here (amp_bf16 ran 13.7x "
        "fp32's step time on a 2-core AMD EPYC without them)"
    )


def _pure_bf16(mode: ModeName, backends: tuple[str, ...]) -> Callable[[Situation, _Verdict], None]:
    def rule(situation: Situation, verdict: _Verdict) -> None:
        _needs_low_precision(verdict, mode, "bfloat16", situation)
        _needs_backends(verdict, mode, backends, situation)
        _slow_bf16_on_this_cpu(verdict, mode, situation)
        if mode == "bf16_kahan":
            _needs_real_parameters(verdict, mode, "torch-optimi", situation.layers)
        if mode == "bf16_pure":
            verdict.notes.append(
                "nearest rounding loses updates smaller than half a bf16 ulp (loss can look "
                "fine while outputs degrade); the drift gate measures lost updates"
            )

    return rule


MXFP8_CAPABILITIES = ((10, 0), (12, 0))
"""Transformer Engine runs MXFP8 training from compute capability 10.0 (Blackwell) and below
12.0: its ``_compute_mxfp8_support`` (TE 2.14, 2.15) says "MXFP8 (for all gemm layouts) is not
supported on 12.0+ architectures yet" (RTX 50xx, RTX PRO 6000, GB10)."""


def mxfp8_reason(gpu: GpuInfo | None) -> str | None:
    """Why the te_mxfp8 recipe cannot run on ``gpu``, or None (no GPU: the mode says so)."""
    if gpu is None:
        return None
    if gpu.rocm_arch is not None:  # torch reads gfx1100 as "11.0": no NVIDIA capability
        return (
            f"te_mxfp8 needs an NVIDIA GPU of compute capability 10.x or 11.x (found: {gpu.label})"
        )
    low, high = MXFP8_CAPABILITIES
    if gpu.capability < low:
        return f"te_mxfp8 needs compute capability >= 10.0 (found: {gpu.label})"
    if gpu.capability >= high:
        return (
            "te_mxfp8: Transformer Engine does not run MXFP8 training on compute capability "
            f'12.0 or above ("not supported on 12.0+ architectures yet"; found: {gpu.label}); '
            "use te_current or te_delayed_hybrid"
        )
    return None


def _fp8_te(situation: Situation, verdict: _Verdict) -> None:
    _needs_gpu_format(verdict, "fp8_te", "fp8", situation)
    _needs_backends(verdict, "fp8_te", ("transformer_engine",), situation)
    _fp8_model_fit(verdict, "fp8_te", situation.layers)
    gpu = situation.gpu
    if gpu is not None and gpu.rocm_arch is None and gpu.capability >= MXFP8_CAPABILITIES[0]:
        reason = mxfp8_reason(gpu)
        verdict.notes.append(reason or "MXFP8 recipe available (compute capability 10.x or 11.x)")


def _fp8_torchao(situation: Situation, verdict: _Verdict) -> None:
    if situation.emulate_fp8:
        _needs_backends(verdict, "fp8_torchao", ("torchao",), situation)
        _fp8_model_fit(verdict, "fp8_torchao", situation.layers)
        verdict.notes.append("emulated: FP8 numerics for quality screening, no speed figures")
        return
    _needs_gpu_format(verdict, "fp8_torchao", "fp8", situation)
    hardware_ok = not verdict.reasons
    _needs_backends(verdict, "fp8_torchao", ("torchao",), situation)
    _fp8_model_fit(verdict, "fp8_torchao", situation.layers)
    gpu = situation.gpu
    if gpu is not None and hardware_ok and gpu.capability < (9, 0):
        verdict.notes.append(
            f"rowwise scaling is tried from compute capability 9.0 (found: {gpu.label}): torch "
            "runs its rowwise kernel on 8.9 since 2.7, not yet measured by autoprec; tune tries "
            "tensorwise, and a profile or prepare() may name torchao_rowwise"
        )
    if not hardware_ok and len(verdict.reasons) == 1:
        verdict.notes.append(
            "fp8_torchao with emulate=True runs FP8 numerics on this machine: it screens "
            "quality only, never speed"
        )


_RULES: dict[ModeName, Callable[[Situation, _Verdict], None]] = {
    "fp32": _fp32,
    "tf32": _tf32,
    "amp_fp16": _amp_fp16,
    "amp_bf16": _amp_bf16,
    "bf16_pure": _pure_bf16("bf16_pure", ()),
    "bf16_sr": _pure_bf16("bf16_sr", ("torchastic",)),
    "bf16_kahan": _pure_bf16("bf16_kahan", ("optimi",)),
    "bf16_sr_kahan": _pure_bf16("bf16_sr_kahan", ("torchastic", "optimi")),
    "fp8_te": _fp8_te,
    "fp8_torchao": _fp8_torchao,
}


def mode_eligibility(mode: ModeName, situation: Situation) -> Eligibility:
    """Whether ``mode`` can run in ``situation``, with every reason and note."""
    if mode not in _RULES:
        raise ValueError(f"Unknown mode {mode!r}; modes: {', '.join(MODE_NAMES)}.")
    verdict = _Verdict()
    _RULES[mode](situation, verdict)
    _needs_something_to_train(verdict, situation.layers)
    _needs_fp32_weights(verdict, situation.layers)
    _needs_no_own_autocast(verdict, situation.layers)
    return verdict.done()


def _needs_fp32_weights(verdict: _Verdict, layers: LayerMix | None) -> None:
    """A model whose trainable weights are not fp32 (bf16, fp16, float64): tune, check and
    apply refuse it, so no mode is worth a trial (the probe offered every mode; found by a
    hunt)."""
    if layers is not None and layers.weights_not_fp32 is not None:
        verdict.doubt(
            f"the model's weights are not fp32 ({layers.weights_not_fp32}): tune, check and "
            "apply refuse it until it is passed in fp32 (the findings say how)"
        )


def _needs_no_own_autocast(verdict: _Verdict, layers: LayerMix | None) -> None:
    """A model whose forward enters an autocast of its own: tune and check refuse it, so no
    mode is worth a trial (the probe offered every mode: a review)."""
    if layers is not None and layers.forward_autocast is not None:
        verdict.doubt(
            f"the model's forward enters an autocast of its own ({layers.forward_autocast}): "
            "tune and check refuse it until that autocast is taken out (the findings say why)"
        )


def _needs_something_to_train(verdict: _Verdict, layers: LayerMix | None) -> None:
    """A model without trainable parameters: no trial can train it (tune and check refuse
    it), so no mode is worth one (the probe offered every mode)."""
    if layers is not None and not layers.trainable_parameters:
        verdict.doubt(
            "the model has no trainable parameters: there is nothing to train, and tune / "
            "check refuse it"
        )


def optimizer_8bit_eligibility(situation: Situation) -> Eligibility:
    """Whether 8-bit optimizer states (bitsandbytes) can run here and are worth a trial."""
    verdict = _Verdict()
    _needs_backends(verdict, "optimizer_bits=8", ("bitsandbytes",), situation)
    _needs_real_parameters(verdict, "optimizer_bits=8", "bitsandbytes", situation.layers)
    _takes_no_sparse_gradients(verdict, "optimizer_bits=8", situation.layers)
    _needs_something_to_train(verdict, situation.layers)
    _needs_fp32_weights(verdict, situation.layers)
    _needs_no_own_autocast(verdict, situation.layers)
    layers = situation.layers
    if layers is not None and layers.trainable_parameters:
        large = layers.parameters_in_large_tensors
        saved = large * BYTES_SAVED_PER_8BIT_PARAMETER / 2**20
        message = (
            f"saves about {saved:.1f} MiB of Adam state ({large:,} trainable parameters in "
            f"tensors of >= {BNB_MIN_8BIT_SIZE} elements)"
        )
        if large / layers.trainable_parameters < 0.5:
            verdict.doubt(message + ": most parameters sit in small tensors kept in 32 bit")
        else:
            verdict.notes.append(message)
    return verdict.done()


def model_devices(model: nn.Module) -> tuple[str, ...]:
    """``"cpu"`` or ``"cuda:N"`` for every device the model's parameters live on, in the order
    they first appear."""
    names: dict[str, None] = {}
    for parameter in model.parameters():
        device = parameter.device
        if device.type == "cuda":
            names[f"cuda:{device.index or 0}"] = None
        elif device.type == "cpu":
            names["cpu"] = None
        else:
            raise ValueError(f"autoprec trains on CPU or CUDA, but the model is on {device}.")
    if not names:
        raise ValueError("The model has no parameters: there is nothing to train.")
    return tuple(names)


def model_device(model: nn.Module) -> str:
    """``"cpu"`` or ``"cuda:N"``: where the model's parameters live, refused when they are
    split over several devices (``device_map="auto"``): a trial times, measures and judges
    one device, and had judged the first parameter's alone (found by a hunt)."""
    devices = model_devices(model)
    if len(devices) > 1:
        raise ValueError(
            f"The model's parameters are split over {', '.join(devices)} (a device_map?): "
            "autoprec times, measures and judges a trial on one device. Pass "
            f"device={devices[0]!r} (tune() and check() then train a copy there, if it fits), "
            "or tune a smaller configuration of the model on one device."
        )
    return devices[0]


def situations_for_model(model: nn.Module, *, emulate_fp8: bool = False) -> list[Situation]:
    """The facts about this machine and ``model`` (what it is made of), one for each device
    its parameters live on: a model split over two GPUs (a device_map) runs a mode on both,
    and had been judged on the first parameter's alone (found by a hunt). A model split over
    a CPU and a GPU is refused: a mode runs on one kind of device."""
    devices = model_devices(model)
    kinds = {device.split(":")[0] for device in devices}
    if len(kinds) > 1:
        raise ValueError(
            f"The model's parameters are split over {', '.join(devices)}: a precision mode "
            "runs on one kind of device (its autocast, its optimizer's kernels). Move the "
            "model to one kind of device before applying a mode."
        )
    hardware, layers = detect_hardware(), scan_model(model)
    backends = tuple(backend_status(name) for name in BACKENDS)
    return [
        Situation(
            hardware=hardware,
            device=device,
            layers=layers,
            backends=backends,
            emulate_fp8=emulate_fp8,
        )
        for device in devices
    ]
