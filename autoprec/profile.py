"""Profile: the versioned JSON artifact, proven on named hardware, loaded in two lines.

    plan = autoprec.load_profile("profiles/example-cpu-amp_bf16.json").apply(model, optimizer)

Saving is atomic (temporary file + rename); loading validates and turns every problem into a
one-paragraph :class:`~autoprec.errors.ProfileError` naming the file, the field and the issue.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, ValidationError
from torch import nn

from autoprec._files import read_json, write_text_atomically
from autoprec._models import FROZEN_RECORD
from autoprec._version import __version__
from autoprec._warnings import warn_caller
from autoprec.eligibility import model_devices
from autoprec.errors import (
    ExportError,
    HardwareMismatchWarning,
    ModelMismatchWarning,
    ProfileError,
    RecipeMismatchWarning,
    UnprovenProfileWarning,
    check_flag,
    field_errors,
)
from autoprec.hardware import HardwareInfo, detect_hardware
from autoprec.integrations import CUDNN_KINDS
from autoprec.integrations.accelerate import accelerate_settings
from autoprec.integrations.fsdp2 import fsdp2_policy_args
from autoprec.integrations.hf_trainer import hf_training_args
from autoprec.integrations.lightning import lightning_settings
from autoprec.layer_kinds import second_name_refusal
from autoprec.layers import LayerMix, scan_model
from autoprec.model_copies import inside_compile_wrapper
from autoprec.plan import (
    PrecisionPlan,
    check_model_and_optimizer,
    check_step_settings,
    prepare,
)
from autoprec.recipe import RecipeSummary
from autoprec.recipe_match import recipe_differences
from autoprec.specs import ModeSpec, matches_keep_fp32

SCHEMA_VERSION = 4
"""Bump on any change that an older autoprec could not read correctly. 2: ``recipe``;
3: ``evidence.blind_spots``; 4: ``recipe.lr_points[].momenta``."""


def _refuse_or_warn(message: str, category: type[Warning], *, strict: bool) -> None:
    """Raise, or warn pointing at the user's line."""
    if strict:
        raise ProfileError(message)
    warn_caller(message, category)


class HardwareFingerprint(BaseModel):
    """Where a profile was proven."""

    model_config = FROZEN_RECORD

    device_kind: Literal["cpu", "cuda"]
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    driver_version: str | None = None
    torch_version: str
    cuda_runtime: str | None = None
    cpu_model: str
    cpu_native_bf16: bool | None = None
    """Whether the CPU has bf16 instructions (``CpuInfo.native_bf16``); None where unread and
    in profiles written before it was recorded."""

    @classmethod
    def from_hardware(
        cls, hardware: HardwareInfo, device: str | None = None
    ) -> HardwareFingerprint:
        chosen = hardware.resolve_device(device)
        gpu = None if chosen == "cpu" else hardware.gpu(int(chosen.split(":")[1]))
        return cls(
            device_kind="cpu" if gpu is None else "cuda",
            gpu_name=None if gpu is None else gpu.name,
            capability=None if gpu is None else gpu.capability,
            driver_version=hardware.driver_version,
            torch_version=hardware.torch_version,
            cuda_runtime=hardware.torch_cuda_runtime,
            cpu_model=hardware.cpu.model_name,
            cpu_native_bf16=hardware.cpu.native_bf16,
        )

    def differences(self, other: HardwareFingerprint) -> list[str]:
        """What differs between this (the proven) and ``other`` (the current) hardware."""
        fields = ["device_kind", "gpu_name", "capability"]
        if self.device_kind == other.device_kind == "cpu":
            fields.append("cpu_model")  # a CPU's bf16 speed is its own (AMX, avx512_bf16, none)
        found = []
        for field in fields:
            proven, current = getattr(self, field), getattr(other, field)
            if proven != current:
                found.append(f"{field}: proven on {_shown(proven)}, running on {_shown(current)}")
        bf16 = (self.cpu_native_bf16, other.cpu_native_bf16)
        if "cpu_model" in fields and None not in bf16 and bf16[0] != bf16[1]:
            with_or_not = ["with" if has else "without" for has in bf16]
            found.append(
                f"cpu_native_bf16: proven on a CPU {with_or_not[0]} bf16 instructions, running "
                f"on one {with_or_not[1]} (without them amp_bf16 measured 13.7x fp32's step time)"
            )
        if _minor(self.torch_version) != _minor(other.torch_version):
            # kernels and autocast's op lists change between torch releases
            found.append(
                f"torch_version: proven on {self.torch_version!r}, running on "
                f"{other.torch_version!r}"
            )
        return found


def _minor(version: str) -> str:
    """A torch version's release, major.minor ("2.13.0+cpu" -> "2.13")."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _shown(value: object) -> str:
    """A fingerprint field for a message: ``none`` where there is none (no GPU)."""
    return "none" if value is None else repr(value)


def _digested_kinds(layers: LayerMix) -> list[tuple[str, int]]:
    """Parameters by kind as the layer-mix digest has read them since profiles recorded it:
    recurrent layers (a kind of their own since) counted with raw parameters, so a profile
    proven before still matches the model it was proven for."""
    counts = {share.kind: share.parameters for share in layers.by_kind}
    counts["raw_param"] = counts.get("raw_param", 0) + counts.pop("recurrent", 0)
    return [(kind, parameters) for kind, parameters in counts.items()]


class ModelFingerprint(BaseModel):
    """Which model a profile was proven for."""

    model_config = FROZEN_RECORD

    model_class: str
    parameters: int
    layer_mix_digest: str
    """sha256 (first 16 hex digits) of the parameter counts by kind and the Linear shapes."""
    complex_parameters: tuple[str, ...] = ()
    """Trainable complex parameters: pure bf16 keeps them complex; an export whose cast would
    drop their imaginary part is refused."""
    cudnn_kinds: tuple[str, ...] = ()
    """The model's layer kinds cuDNN runs ("conv", "recurrent"): an fp32 export whose framework
    leaves cuDNN's TF32 on is refused. Empty in profiles written before 2026-11-26."""

    @classmethod
    def from_layers(cls, layers: LayerMix) -> ModelFingerprint:
        payload = json.dumps(
            {
                "kinds": _digested_kinds(layers),
                "linears": [(lin.in_features, lin.out_features) for lin in layers.linears],
            }
        )
        return cls(
            model_class=layers.model_class,
            parameters=layers.parameters,
            layer_mix_digest=hashlib.sha256(payload.encode()).hexdigest()[:16],
            complex_parameters=layers.complex_parameters,
            cudnn_kinds=tuple(k for k in CUDNN_KINDS if layers.kind(k).parameters),  # type: ignore[arg-type]
        )

    def differences(self, other: ModelFingerprint) -> list[str]:
        """What differs between this (the proven) and ``other`` (the current) model."""
        found = []
        if self.model_class != other.model_class:
            found.append(f"class: proven on {self.model_class}, applied to {other.model_class}")
        if self.parameters != other.parameters:
            found.append(
                f"parameters: proven on {self.parameters:,}, applied to {other.parameters:,}"
            )
        elif self.layer_mix_digest != other.layer_mix_digest:
            found.append("layer mix: the layer kinds or Linear shapes differ")
        return found


class TrialFigures(BaseModel):
    """What one measured trial showed."""

    model_config = FROZEN_RECORD

    samples_per_second: float | None = None
    median_step_seconds: float | None = None
    peak_memory_bytes: int | None = None
    state_bytes: int | None = None
    """Exact bytes of parameters, gradients and optimizer state."""
    activation_bytes: int | None = None
    """CPU, eager: bytes autograd saved for backward in one micro-batch."""
    final_loss: float | None = None


class Evidence(BaseModel):
    """Why this mode was chosen: reference vs chosen figures and the drift measured."""

    model_config = FROZEN_RECORD

    trial_steps: int = Field(ge=1)
    trial_count: int = Field(ge=1)
    """Every trial the choice rests on, those a resumed study held included."""
    trials_from_study: int = Field(0, ge=0)
    """Of ``trial_count``, the trials an earlier run of the study ran: ``budget_used_seconds``
    is the last run's time only (a resumed profile read "11 trials, 2 s used")."""
    budget_seconds: float | None = None
    budget_used_seconds: float | None = None
    """Seconds the last run used (of its ``budget_seconds``)."""
    reference: TrialFigures
    chosen: TrialFigures
    drift: dict[str, float] = Field(default_factory=dict)
    """Drift metrics of the chosen mode against the fp32 reference (name -> value)."""
    fp8_layers: tuple[str, ...] = ()
    """The modules the chosen mode's trial ran in FP8 (FP8 modes; its filters decided which)."""
    blind_spots: tuple[str, ...] = ()
    """What the trials could not show for this mode: harm measured (or reported) to appear only
    after a longer run, with its figures (see autoprec.drift_blind_spots)."""
    notes: tuple[str, ...] = ()
    """What the drift gate found in the chosen mode without rejecting it, and checks it could
    not run ("weight decay never applies: ..."); those every mode shares are in the tune
    result's ``checks_not_run``."""


def _naming_nothing(patterns: tuple[str, ...], names: list[str]) -> list[str]:
    """The ``patterns`` that match none of the module ``names``."""
    return [p for p in patterns if not any(matches_keep_fp32(fqn, (p,)) for fqn in names)]


def _patterns_reaching(spec: ModeSpec, model: nn.Module) -> ModeSpec:
    """``spec`` without the ``keep_fp32`` / ``fp8_skip`` patterns that name no module of
    ``model`` under any name, which ``check_model`` warned of (``prepare()`` refuses them: a
    hand-written pattern naming nothing is a typo; a profile's is a model that differs)."""
    inner = inside_compile_wrapper(model)
    modules = (model if inner is None else inner).named_modules(remove_duplicate=False)
    names = [fqn for fqn, _ in modules if fqn]
    fields = ("keep_fp32", "fp8_skip")
    nothing = {field: _naming_nothing(getattr(spec, field), names) for field in fields}
    if not any(nothing.values()):
        return spec
    kept = {f: tuple(p for p in getattr(spec, f) if p not in nothing[f]) for f in fields}
    return spec.model_copy(update=kept)


class Profile(BaseModel):
    """A precision recipe, the hardware it was proven on and the evidence."""

    model_config = FROZEN_RECORD

    schema_version: int = SCHEMA_VERSION
    autoprec_version: str = __version__
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    spec: ModeSpec
    hardware: HardwareFingerprint
    model: ModelFingerprint | None = None
    evidence: Evidence | None = None
    recipe: RecipeSummary | None = None
    """The training recipe the evidence was measured under (optimizer, lr legs, accumulation,
    clipping); ``apply()`` takes its accumulation and clipping unless told otherwise."""
    note: str | None = None
    """Free text, e.g. "hand-written example, not measured"."""

    # -- files --------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON atomically: a crash never leaves a half-written file. The
        file carries this autoprec's ``schema_version``: it is written in today's format,
        whichever a loaded profile came in (found by a hunt: a version-1 profile saved again
        held version-4 fields under version 1, which an older autoprec then refused without
        its "upgrade" advice). ``autoprec_version`` stays the one that proved it."""
        current = self.model_copy(update={"schema_version": SCHEMA_VERSION})
        return write_text_atomically(path, current.model_dump_json(indent=2) + "\n")

    # -- use ----------------------------------------------------------------------------------

    def check_hardware(self, current: HardwareFingerprint | None = None, *, strict: bool) -> None:
        """Warn (or with ``strict``, refuse) when running on other hardware than proven on:
        ``current``, or, by default, every device of this machine (the model may train on
        any of them; ``apply()`` checks the one it is on). A hunt found cuda:0 alone judged:
        a profile proven on the H100 at cuda:1 beside an A100 was refused there."""
        if current is None:
            hardware = detect_hardware()
            if self._matching_device(hardware) is not None:
                return
            current = HardwareFingerprint.from_hardware(hardware)
        differences = self.hardware.differences(current)
        if not differences:
            return
        message = (
            f"This {self.spec.label} profile was proven on other hardware: "
            + "; ".join(differences)
            + ". Its speed and drift evidence may not hold here; re-run `autoprec tune`."
        )
        _refuse_or_warn(message, HardwareMismatchWarning, strict=strict)

    def _matching_device(self, hardware: HardwareInfo) -> str | None:
        """The first device of ``hardware`` the profile was proven on hardware like, or None."""
        devices = ["cpu"] + [f"cuda:{gpu.index}" for gpu in hardware.gpus if gpu.usable_by_torch]
        for device in devices:
            here = HardwareFingerprint.from_hardware(hardware, device)
            if not self.hardware.differences(here):
                return device
        return None

    def _check_model_device(self, model: nn.Module, *, strict: bool) -> None:
        """Warn (or refuse) when ``model`` sits on another device than the one proven, where
        this machine has one like it (without one, loading the profile said so)."""
        hardware = detect_hardware()
        matching = self._matching_device(hardware)
        if matching is None:
            return
        for device in model_devices(model):  # a model split over GPUs: each of them
            here = HardwareFingerprint.from_hardware(hardware, device)
            differences = self.hardware.differences(here)
            if differences:
                message = (
                    f"This {self.spec.label} profile was proven on other hardware than the "
                    f"model's device ({device}): " + "; ".join(differences) + f". This "
                    f"machine's {matching} is like the one proven: move the model there "
                    f"before apply(), or re-run `autoprec tune` on {device}."
                )
                _refuse_or_warn(message, HardwareMismatchWarning, strict=strict)

    def check_evidence(self, *, strict: bool) -> None:
        """Warn (or with ``strict``, refuse) when the profile carries no evidence: written by
        hand or by ``profile_for``, its mode was never trained against fp32 on any model, and a
        hand-written profile naming this machine loaded exactly as a tuned one (found by a
        hunt: the bundled CPU example)."""
        if self.evidence is not None:
            return
        said = f" (its note: {self.note!r})" if self.note else ""
        _refuse_or_warn(
            f"This {self.spec.label} profile carries no evidence{said}: autoprec tune did not "
            "measure it, so nothing shows that its mode keeps your model's quality. Run "
            "`autoprec tune` (or `autoprec check`) on your model and use the profile it writes.",
            UnprovenProfileWarning,
            strict=strict,
        )

    def check_model(self, model: nn.Module, *, strict: bool) -> None:
        """Warn (or with ``strict``, refuse) when ``model`` is not the one the profile was
        proven for: another class or size, or ``keep_fp32`` / ``fp8_skip`` patterns that match
        no module.
        A ``torch.compile(model)`` wrapper is checked by the model inside it, as tune saw it."""
        inner = inside_compile_wrapper(model)  # explicit: an empty nn.Sequential is falsy
        model = model if inner is None else inner
        differences = []
        if self.model is not None:
            differences = self.model.differences(ModelFingerprint.from_layers(scan_model(model)))
        names = [fqn for fqn, _ in model.named_modules() if fqn]
        for field in ("keep_fp32", "fp8_skip"):  # an fp8_skip that matched nothing ran in FP8
            unmatched = _naming_nothing(getattr(self.spec, field), names)
            # a second name is no typo: said as prepare() refuses it (found by a hunt)
            second_names = [second_name_refusal(model, p, field) for p in unmatched]
            differences += [said for said in second_names if said]
            unmatched = [p for p, said in zip(unmatched, second_names, strict=True) if not said]
            if unmatched:
                differences.append(f"{field} patterns match no module: {', '.join(unmatched)}")
        if not differences:
            return
        message = (
            f"This {self.spec.label} profile was proven for another model: "
            + "; ".join(differences)
            + ". Its drift evidence does not cover this model; run `autoprec tune` for it."
        )
        _refuse_or_warn(message, ModelMismatchWarning, strict=strict)

    def apply(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        grad_accumulation_steps: int | None = None,
        clip_grad_norm: float | Literal["recipe"] | None = "recipe",
        strict: bool = False,
        total_steps: int | None = None,
    ) -> PrecisionPlan:
        """Set ``model``, ``optimizer`` and ``scheduler`` up for this profile (see
        ``plan.prepare``): the scheduler is rebound to ``plan.optimizer`` when the mode rebuilds
        the optimizer.

        Args:
            grad_accumulation_steps: defaults to the recipe the profile was tuned under (1
                for profiles without one).
            clip_grad_norm: the gradient norm ``plan.step()`` clips to; ``"recipe"`` (the
                default) takes the tuned recipe's, ``None`` clips nothing.
            strict: refuse (ProfileError) a model on another device than the hardware the
                profile was proven on, where this machine has a device like it
                (``HardwareMismatchWarning``), a model other than the one the profile was
                proven for (``ModelMismatchWarning``), or another optimizer class, group
                hyper-parameters (lr, betas, ...), accumulation or clipping than the recipe it
                was tuned under (``RecipeMismatchWarning``), instead of warning.
            total_steps: the scheduler's steps over the run you apply it to (default: the
                proven run's): the schedule is compared over that length, and another length
                is said (a run 10x longer ends at another lr than the one proven; the trainer
                integrations pass their own).
        """
        check_model_and_optimizer(model, optimizer)
        check_flag(strict, "strict")
        _check_total_steps(total_steps, scheduler)
        recipe = self.recipe
        if grad_accumulation_steps is None:
            grad_accumulation_steps = recipe.grad_accumulation_steps if recipe else 1
        if clip_grad_norm == "recipe":
            clip_grad_norm = recipe.clip_grad_norm if recipe is not None else None
        check_step_settings(grad_accumulation_steps, clip_grad_norm)
        self._check_model_device(model, strict=strict)
        self.check_model(model, strict=strict)
        if recipe is not None:
            differences = recipe_differences(
                recipe,
                optimizer,
                scheduler,
                grad_accumulation_steps=grad_accumulation_steps,
                clip_grad_norm=clip_grad_norm,
                total_steps=total_steps,
            )
            if differences:
                message = (
                    f"This {self.spec.label} profile was proven under another training recipe: "
                    + "; ".join(differences)
                    + ". Its drift evidence does not cover this recipe (rounding losses depend "
                    "on the lr); run `autoprec tune` (or `autoprec check`) with it."
                )
                _refuse_or_warn(message, RecipeMismatchWarning, strict=strict)
        plan = prepare(
            _patterns_reaching(self.spec, model),  # the others were just warned of
            model,
            optimizer,
            scheduler,
            grad_accumulation_steps=grad_accumulation_steps,
            clip_grad_norm=clip_grad_norm,
        )
        if recipe is not None:
            plan.proven_clip = (recipe.clip_grad_norm,)
        return plan

    # -- exports ------------------------------------------------------------------------------

    def _refuse_cpu_fp16(self, target: str, instead: str) -> None:
        """amp_fp16 proven on a CPU exports to flags that train otherwise there: Lightning's
        "16-mixed" runs bf16 on a CPU, Accelerate and the HF Trainer run fp32 (found by a
        hunt; the exports promise nothing approximated silently)."""
        if self.spec.mode == "amp_fp16" and self.hardware.device_kind == "cpu":
            raise ExportError(
                f"This amp_fp16 profile was proven on a CPU, where {target} does not run fp16 "
                f"autocast with loss scaling as the profile did. Use {instead}, which runs it "
                "as proven."
            )

    def to_lightning(self, *, ignore_keep_fp32: bool = False) -> dict[str, Any]:
        """``Trainer(**profile.to_lightning())`` or ``Fabric(**...)`` arguments."""
        self._refuse_cpu_fp16(
            "Lightning's '16-mixed' (bf16 on a CPU)", "AutoprecPrecision(profile)"
        )
        return lightning_settings(
            self.spec,
            ignore_keep_fp32=ignore_keep_fp32,
            recipe=self.recipe,
            complex_parameters=() if self.model is None else self.model.complex_parameters,
            cudnn_kinds=self._cudnn_kinds,
        )

    def to_accelerate(self, *, ignore_keep_fp32: bool = False) -> dict[str, Any]:
        """``Accelerator(**profile.to_accelerate())`` arguments."""
        self._refuse_cpu_fp16(
            "Accelerate's fp16 (fp32 on a CPU)", "profile.apply(model, optimizer)"
        )
        return accelerate_settings(
            self.spec,
            ignore_keep_fp32=ignore_keep_fp32,
            recipe=self.recipe,
            cudnn_kinds=self._cudnn_kinds,
        )

    def to_hf_training_args(
        self, *, ignore_keep_fp32: bool = False, no_embeddings: bool = False
    ) -> dict[str, Any]:
        """``TrainingArguments(..., **profile.to_hf_training_args())`` fields; an 8-bit
        profile needs ``no_embeddings=True`` (the Trainer keeps embeddings' states 32-bit)."""
        self._refuse_cpu_fp16(
            "the Trainer's fp16=True (fp32 on a CPU)", "apply_profile(trainer, profile)"
        )
        return hf_training_args(
            self.spec,
            ignore_keep_fp32=ignore_keep_fp32,
            recipe=self.recipe,
            no_embeddings=no_embeddings,
        )

    def to_fsdp2(self, *, ignore_keep_fp32: bool = False) -> dict[str, Any]:
        """``MixedPrecisionPolicy(**profile.to_fsdp2())`` arguments."""
        return fsdp2_policy_args(
            self.spec,
            ignore_keep_fp32=ignore_keep_fp32,
            recipe=self.recipe,
            cudnn_kinds=self._cudnn_kinds,
        )

    @property
    def _cudnn_kinds(self) -> tuple[str, ...]:
        return () if self.model is None else self.model.cudnn_kinds


def profile_for(
    spec: ModeSpec,
    *,
    model_layers: LayerMix | None = None,
    hardware: HardwareInfo | None = None,
    device: str | None = None,
    evidence: Evidence | None = None,
    recipe: RecipeSummary | None = None,
    note: str | None = None,
) -> Profile:
    """A Profile for ``spec`` on this machine (or the given hardware facts)."""
    hardware = hardware or detect_hardware()
    return Profile(
        spec=spec,
        hardware=HardwareFingerprint.from_hardware(hardware, device),
        model=None if model_layers is None else ModelFingerprint.from_layers(model_layers),
        evidence=evidence,
        recipe=recipe,
        note=note,
    )


def load_profile(path: str | os.PathLike[str], *, strict: bool = False) -> Profile:
    """Read and validate a profile; warn when this hardware differs from where it was proven.

    Args:
        path: the JSON file ``autoprec tune`` (or ``Profile.save``) wrote.
        strict: refuse (ProfileError) instead of warning on a hardware mismatch
            (``HardwareMismatchWarning``) or a profile without evidence, one written by hand
            and never trained against fp32 (``UnprovenProfileWarning``).
    """
    check_flag(strict, "strict")
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
        raise TypeError(  # pathlib's "expected str, bytes or os.PathLike" named no argument
            f"path must be the profile's file path (a str or a Path), not {type(path).__name__}."
        )
    file = Path(path)
    data = read_json(file, "Profile", error=ProfileError, advice=" Re-run `autoprec tune`.")
    if not isinstance(data, dict):
        raise ProfileError(
            f"Profile {str(file)!r} must hold a JSON object, not {type(data).__name__}."
        )
    if "profile" in data and "trials" in data:
        raise ProfileError(
            f"{str(file)!r} is a tune run's trials file (*.trials.json), not a profile. Show "
            "the profile written beside it (the --out file), or draw this one with "
            "`autoprec report`."
        )
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ProfileError(
            f"Profile {str(file)!r} has schema_version {version!r}; autoprec profiles carry an "
            f"integer version from 1 to {SCHEMA_VERSION}. Is this a profile written by "
            "`autoprec tune`?"
        )
    if version > SCHEMA_VERSION:
        raise ProfileError(
            f"Profile {str(file)!r} has schema version {version}; autoprec {__version__} reads "
            f"up to version {SCHEMA_VERSION}. Upgrade autoprec to load it."
        )
    try:
        profile = Profile.model_validate(data)
    except ValidationError as error:
        writer = data.get("autoprec_version")
        unknown = any(item["type"] == "extra_forbidden" for item in error.errors())
        hint = (
            f" Fields unknown to autoprec {__version__}: the file was written by autoprec "
            f"{writer}; upgrade autoprec to read it."
            if unknown and writer and writer != __version__
            else ""
        )
        raise ProfileError(
            f"Profile {str(file)!r} is invalid: {field_errors(error)}.{hint}"
        ) from None
    profile.check_hardware(strict=strict)
    profile.check_evidence(strict=strict)
    return profile


def _check_total_steps(total_steps: object, scheduler: object) -> None:
    """Refuse a ``total_steps`` that is not a positive int (a "200" from a config file raised
    a bare TypeError; 0 or -5 were blamed on the scheduler: found by a hunt), and say when it
    is given without a scheduler, whose schedule it is the length of."""
    if total_steps is None:
        return
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(
            f"total_steps must be a positive int (the optimizer steps of the run you apply "
            f"the profile to) but got {total_steps!r}."
        )
    if scheduler is None:
        warn_caller(
            f"total_steps={total_steps} is the length of a schedule, and no scheduler was "
            "passed to apply(): nothing is compared over it. Pass your scheduler too.",
            RecipeMismatchWarning,
        )


NON_FINITE = {"enum": ["Infinity", "-Infinity", "NaN"]}
"""How a profile writes a non-finite float (``ser_json_inf_nan="strings"``)."""


def _allowing_non_finite(schema: Any) -> Any:
    """``schema`` with every number also allowing the strings a profile writes for inf and nan:
    a profile tuned with ``clip_grad_norm=inf`` (measure only) or holding an inf drift figure
    failed validation against the schema autoprec publishes (found by a hunt)."""
    if isinstance(schema, list):
        return [_allowing_non_finite(each) for each in schema]
    if not isinstance(schema, dict):
        return schema
    walked = {key: _allowing_non_finite(value) for key, value in schema.items()}
    if walked.get("type") == "number":
        return {"anyOf": [walked, NON_FINITE]}
    return walked


def published_schema() -> dict[str, Any]:
    """The profile's JSON schema as ``autoprec schema`` prints it (profiles/profile.schema.json):
    pydantic's, with the strings a profile writes for non-finite floats allowed."""
    return _allowing_non_finite(Profile.model_json_schema())  # type: ignore[no-any-return]
