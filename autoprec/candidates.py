"""ProbeReport -> the ordered list of ModeSpecs worth a trial (reference first).

Order is the search order, so the budget goes to the most promising first: on FP8 GPUs the FP8
modes, then bf16 AMP and the compensated pure-bf16 modes; on CPUs bf16 first. 8-bit optimizer
variants follow their compute modes. Modes the probe found possible but not worth a trial (fp16
on a CPU, FP8 on tiny Linears) come last; ineligible ones are returned separately with reasons.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from autoprec.probing import ProbeReport
from autoprec.specs import MODE_NAMES, ModeName, ModeSpec

GPU_PREFERENCE: tuple[ModeName, ...] = (
    "fp8_torchao", "fp8_te", "amp_bf16", "bf16_kahan", "bf16_sr_kahan", "bf16_sr", "tf32",
    "amp_fp16", "bf16_pure",
)  # fmt: skip
CPU_PREFERENCE: tuple[ModeName, ...] = (
    "amp_bf16", "bf16_kahan", "bf16_sr_kahan", "bf16_sr", "bf16_pure", "amp_fp16",
)  # fmt: skip
EIGHT_BIT_MODES: tuple[ModeName, ...] = (
    "fp32",
    "tf32",
    "amp_bf16",
    "amp_fp16",
    "bf16_pure",
    "fp8_torchao",
    "fp8_te",
)


class Skipped(BaseModel):
    """A requested mode that cannot run here, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: ModeSpec
    reasons: tuple[str, ...]


class CandidateList(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    specs: tuple[ModeSpec, ...]
    """The reference (fp32) first, then the rest in search order."""
    skipped: tuple[Skipped, ...]


def _fp8_recipes(mode: ModeName, report: ProbeReport) -> list[str]:
    gpu = None if report.device == "cpu" else report.hardware.gpu(int(report.device[5:]))
    capability = gpu.capability if gpu else (0, 0)
    if mode == "fp8_torchao":
        return ["torchao_tensorwise"] + (["torchao_rowwise"] if capability >= (9, 0) else [])
    return ["te_delayed_hybrid", "te_current"] + (["te_mxfp8"] if capability >= (10, 0) else [])


def _keep_fp32(mode: ModeName, report: ProbeReport) -> tuple[str, ...]:
    layers = report.layers
    if layers is None:
        return ()
    if mode.startswith("fp8"):
        return tuple(keep.fqn for keep in layers.keep_fp32)
    if mode.startswith("bf16"):
        wanted = ("normalisation", "embedding")
        return tuple(k.fqn for k in layers.keep_fp32 if k.reason.startswith(wanted))
    return ()


def _specs_for(mode: ModeName, report: ProbeReport) -> list[ModeSpec]:
    keep = _keep_fp32(mode, report)
    if mode.startswith("fp8"):
        return [
            ModeSpec(mode=mode, fp8_recipe=recipe, keep_fp32=keep)  # type: ignore[arg-type]
            for recipe in _fp8_recipes(mode, report)
        ]
    return [ModeSpec(mode=mode, keep_fp32=keep)]


def candidate_specs(report: ProbeReport, modes: list[str] | None = None) -> CandidateList:
    """The specs to try, in order, for what ``report`` found.

    Args:
        modes: restrict to these canonical mode names (fp32 is always the reference; its 8-bit
            variant only when "fp32" is listed). A requested mode that cannot run here is
            returned in ``skipped`` with its reasons.
    """
    if modes is not None:
        unknown = sorted(set(modes) - set(MODE_NAMES))
        if unknown:
            raise ValueError(f"Unknown mode(s) {unknown}; modes: {', '.join(MODE_NAMES)}.")
    wanted = set(MODE_NAMES if modes is None else modes)
    preference = CPU_PREFERENCE if report.device == "cpu" else GPU_PREFERENCE
    verdicts = {verdict.name: verdict for verdict in report.modes}
    promising: list[ModeSpec] = []
    doubtful: list[ModeSpec] = []
    skipped: list[Skipped] = []
    for mode in preference:
        verdict = verdicts[mode]
        if mode not in wanted:
            continue
        if not verdict.eligible:
            skipped.append(Skipped(spec=ModeSpec(mode=mode), reasons=verdict.reasons))
            continue
        (promising if verdict.worth_trying else doubtful).extend(_specs_for(mode, report))
    for mode in sorted(wanted - set(preference) - {"fp32"}):  # requested, never eligible here
        skipped.append(Skipped(spec=ModeSpec(mode=mode), reasons=verdicts[mode].reasons))  # type: ignore[arg-type]
    eight_bit: list[ModeSpec] = []
    if report.optimizer_8bit.eligible and report.optimizer_8bit.worth_trying:
        eight_bit = [
            spec.model_copy(update={"optimizer_bits": 8})
            for spec in ([ModeSpec(mode="fp32")] if "fp32" in wanted else []) + promising
            if spec.mode in EIGHT_BIT_MODES
        ]
    return CandidateList(
        specs=(ModeSpec(mode="fp32"), *promising, *eight_bit, *doubtful),
        skipped=tuple(skipped),
    )
