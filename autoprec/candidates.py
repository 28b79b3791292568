"""ProbeReport -> the ordered list of ModeSpecs worth a trial (reference first).

Order is the search order, so the budget goes to the most promising first: on FP8 GPUs the FP8
modes, then bf16 AMP and the compensated pure-bf16 modes; on CPUs bf16 first. 8-bit optimizer
variants follow their compute modes. Modes the probe found possible but not worth a trial (fp16
on a CPU, FP8 on tiny Linears) come last; ineligible ones are returned separately with reasons.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec._wording import first_names
from autoprec.eligibility import Situation, mode_eligibility, mxfp8_reason
from autoprec.layer_keep import FP8_SKIP_REASONS, PURE_BF16_KEEP_REASONS
from autoprec.layer_kinds import BNB_MIN_8BIT_SIZE, MXFP8_BLOCK, fp8_worthwhile
from autoprec.probing import ProbeReport
from autoprec.specs import MODE_NAMES, ModeName, ModeSpec, matches_keep_fp32

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
    "bf16_sr",
    "fp8_torchao",
    "fp8_te",
)


class Skipped(BaseModel):
    """A requested mode that cannot run here, and why."""

    model_config = FROZEN_RECORD

    spec: ModeSpec
    reasons: tuple[str, ...]


def _merged(skipped: list[Skipped]) -> tuple[Skipped, ...]:
    """One entry a spec, in first-seen order, with every reason once: a mode whose own backend
    and 8-bit states are both missing was listed twice (``Leave bf16_sr+8bit-optim,
    bf16_sr+8bit-optim out of the modes``; found by a hunt)."""
    reasons: dict[ModeSpec, dict[str, None]] = {}
    for entry in skipped:
        reasons.setdefault(entry.spec, {}).update(dict.fromkeys(entry.reasons))
    return tuple(Skipped(spec=spec, reasons=tuple(said)) for spec, said in reasons.items())


class CandidateList(BaseModel):
    model_config = FROZEN_RECORD

    specs: tuple[ModeSpec, ...]
    """The reference (fp32) first, then the rest in search order."""
    skipped: tuple[Skipped, ...]


def _fp8_recipes(mode: ModeName, report: ProbeReport) -> list[str]:
    gpu = None if report.device == "cpu" else report.hardware.gpu(int(report.device[5:]))
    capability = gpu.capability if gpu else (0, 0)
    if mode == "fp8_torchao":
        return ["torchao_tensorwise"] + (["torchao_rowwise"] if capability >= (9, 0) else [])
    mxfp8 = gpu is not None and mxfp8_reason(gpu) is None  # 10.x and 11.x: TE's range
    return ["te_delayed_hybrid", "te_current"] + (["te_mxfp8"] if mxfp8 else [])


def _fp8_skip(report: ProbeReport) -> tuple[str, ...]:
    layers = report.layers
    if layers is None:
        return ()
    return layers.kept_for(FP8_SKIP_REASONS)


def no_fp8_layer(spec: ModeSpec, report: ProbeReport) -> str | None:
    """Why an FP8 spec would run no layer in FP8 on the scanned model (its verdict and speed
    would be bf16 autocast's under an FP8 label), or None when some Linear converts (or no
    scan says)."""
    layers = report.layers
    if layers is None or not spec.mode.startswith("fp8") or not layers.fp8_compatible_linears:
        return None
    fitting = layers.fp8_compatible_linears
    # a Linear the scan's forward never called (nn.MultiheadAttention passes out_proj's
    # weight to its own function): swapped for an FP8 Linear, it would never run as one
    uncalled = [linear.fqn for linear in fitting if linear.flops == 0]
    left_out = [
        linear.fqn
        for linear in fitting
        if linear.fqn not in uncalled
        and matches_keep_fp32(linear.fqn, spec.fp8_skip + spec.keep_fp32)
    ]
    # MXFP8 scales blocks of 32: a Linear of 16 x 48 fits the other recipes, not this one
    unblocked = [
        linear.fqn
        for linear in fitting
        if spec.fp8_recipe == "te_mxfp8"
        and linear.fqn not in uncalled + left_out
        and (linear.in_features % MXFP8_BLOCK or linear.out_features % MXFP8_BLOCK)
    ]
    recipe = (spec.fp8_recipe or "torchao_tensorwise").removeprefix("torchao_")
    small = [
        linear.fqn
        for linear in fitting
        if linear.fqn not in left_out + unblocked
        and linear.fqn not in uncalled
        and spec.fp8_layers == "worthwhile"
        and not fp8_worthwhile(linear.in_features, linear.out_features, recipe)
    ]
    if len(uncalled) + len(left_out) + len(unblocked) + len(small) < len(fitting):
        return None
    parts = []
    if uncalled:
        parts.append(
            f"{first_names(uncalled, 4)} never called as "
            "a module in the scan's forward (their weight is read by another module's "
            "function, as nn.MultiheadAttention reads out_proj's)"
        )
    if left_out:
        parts.append(
            f"{first_names(left_out, 4)} kept out of FP8 "
            "(fp8_skip: the first and last layers, as FP8 training runs them, or keep_fp32)"
        )
    if unblocked:
        parts.append(
            f"{first_names(unblocked, 4)} with a dimension not divisible by {MXFP8_BLOCK}, "
            "MXFP8's block"
        )
    if small:
        parts.append(
            f"{first_names(small, 4)} too small for FP8 to "
            f"pay by torchao's {recipe} rule (fp8_layers='all' converts them)"
        )
    return (
        f"{spec.label} would run no layer in FP8 (found: {len(fitting)} Linear(s) FP8 kernels "
        f"take: {'; '.join(parts)}), so its verdict would be bf16 autocast's (amp_bf16)"
    )


def _with_fp8_layers(spec: ModeSpec, report: ProbeReport) -> ModeSpec:
    """An fp8_torchao spec whose ``"worthwhile"`` layers are none, but whose fitting Linears
    are too small to pay, with ``fp8_layers="all"``: the trial then measures FP8 on them (the
    probe expects it slower; a trial of no FP8 layer would time bf16 autocast)."""
    if spec.fp8_layers != "worthwhile" or no_fp8_layer(spec, report) is None:
        return spec
    every = spec.model_copy(update={"fp8_layers": "all"})
    return every if no_fp8_layer(every, report) is None else spec


def _keep_fp32(mode: ModeName, report: ProbeReport) -> tuple[str, ...]:
    layers = report.layers
    if layers is None or mode.startswith("fp8"):  # FP8 keeps layers out of FP8 instead
        return ()
    if mode.startswith("bf16"):
        return layers.kept_for(PURE_BF16_KEEP_REASONS)
    return ()


def _specs_for(mode: ModeName, report: ProbeReport) -> list[ModeSpec]:
    keep = _keep_fp32(mode, report)
    if mode.startswith("fp8"):
        skip = _fp8_skip(report)
        return [
            ModeSpec(mode=mode, fp8_recipe=recipe, fp8_skip=skip)  # type: ignore[arg-type]
            for recipe in _fp8_recipes(mode, report)
        ]
    return [ModeSpec(mode=mode, keep_fp32=keep)]


def with_user_keep_fp32(
    candidates: CandidateList, patterns: tuple[str, ...], report: ProbeReport | None = None
) -> CandidateList:
    """Every candidate that lowers precision (autocast, pure bf16, FP8) also keeps the user's
    ``keep_fp32`` patterns in fp32, after the probe's own; fp32 and tf32 are left as they are
    (fp32 keeps everything; tf32 has no per-module setting). An FP8 candidate whose every
    Linear they keep is skipped with the reason (found by a hunt: it ran, and failed, after
    the fp32 runs, where a named mode is refused before any run; None: no scan to check)."""
    if not patterns:
        return candidates
    specs, skipped = [], list(candidates.skipped)
    for spec in candidates.specs:
        if spec.mode not in ("fp32", "tf32"):
            keep = tuple(dict.fromkeys((*spec.keep_fp32, *patterns)))
            spec = spec.model_copy(update={"keep_fp32": keep})
        reason = None if report is None else no_fp8_layer(spec, report)
        if reason is None:
            specs.append(spec)
        else:
            skipped.append(Skipped(spec=spec, reasons=(reason,)))
    return candidates.model_copy(update={"specs": tuple(specs), "skipped": tuple(skipped)})


EIGHT_BIT_SUFFIX = "+8bit-optim"


def _label_hint(label: str) -> str:
    """What to pass for a trial's label copied from a report (``fp8_torchao+tensorwise``):
    its mode, with ``+8bit-optim`` where the label holds it; ``compiled`` is ``compile=``'s
    (a hunt, then a review: the first hint dropped the 8-bit states)."""
    parts = label.split("+")
    mode = parts[0] + (EIGHT_BIT_SUFFIX if EIGHT_BIT_SUFFIX.lstrip("+") in parts else "")
    hint = f" {label!r} is a trial's label (its mode and knobs): pass {mode!r}"
    if "compiled" in parts:
        hint += ", and compile=True (CLI: --compile) for compiled runs"
    return hint + "; tune() and check() try its variants themselves."


def _parse_modes(modes: Sequence[str]) -> tuple[set[str], set[str]]:
    """(compute modes, modes wanted with 8-bit optimizer states) from canonical names and
    ``<mode>+8bit-optim`` labels."""
    if isinstance(modes, str):
        raise TypeError(
            f"modes must be a list of mode names, e.g. [{modes!r}], not the string {modes!r}."
        )
    if not modes:
        raise ValueError(
            "modes is empty: name the modes to run (e.g. ['amp_bf16', 'bf16_sr']), or pass "
            "None for every mode."
        )
    plain: set[str] = set()
    eight_bit: set[str] = set()
    for name in modes:
        if not isinstance(name, str):  # (found by a hunt: a bare AttributeError on None)
            raise TypeError(
                f"modes holds {name!r}: each entry must be a mode name, a string such as "
                "'amp_bf16' or 'bf16_sr+8bit-optim'."
            )
        base = name.removesuffix(EIGHT_BIT_SUFFIX)
        (eight_bit if name.endswith(EIGHT_BIT_SUFFIX) else plain).add(base)
    known = set(MODE_NAMES)
    unknown = sorted(
        [m for m in plain if m not in known]
        + [m + EIGHT_BIT_SUFFIX for m in eight_bit if m not in EIGHT_BIT_MODES]
    )
    if unknown:
        with_8bit = ", ".join(m + EIGHT_BIT_SUFFIX for m in EIGHT_BIT_MODES)
        # a label copied from a report ("fp8_torchao+tensorwise"): name its mode (a hunt)
        hint = "".join(_label_hint(m) for m in unknown if m.split("+")[0] in known)
        raise ValueError(
            f"Unknown mode(s) {unknown}; modes: {', '.join(MODE_NAMES)}; with 8-bit optimizer "
            f"states: {with_8bit}.{hint}"
        )
    return plain, eight_bit


def candidate_specs(report: ProbeReport, modes: Sequence[str] | None = None) -> CandidateList:
    """The specs to try, in order, for what ``report`` found.

    Args:
        modes: exactly these modes (fp32 is always the reference): canonical names, and
            ``<mode>+8bit-optim`` for a mode with 8-bit optimizer states (without ``modes``,
            the 8-bit variant of every eligible mode is tried too). A requested mode that
            cannot run here is returned in ``skipped`` with its reasons.
    """
    if modes is None:
        wanted, wanted_8bit = set(MODE_NAMES), set(EIGHT_BIT_MODES)
    else:
        wanted, wanted_8bit = _parse_modes(modes)
    preference = CPU_PREFERENCE if report.device == "cpu" else GPU_PREFERENCE
    verdicts = {verdict.name: verdict for verdict in report.modes}
    promising: list[ModeSpec] = []
    doubtful: list[ModeSpec] = []
    skipped: list[Skipped] = []
    for mode in preference:
        verdict = verdicts[mode]
        if mode not in wanted | wanted_8bit:
            continue
        if not verdict.eligible:
            named_8bit = modes is not None and mode in wanted_8bit
            for bits in ([32] if mode in wanted else []) + ([8] if named_8bit else []):
                spec = ModeSpec(mode=mode, optimizer_bits=bits)
                skipped.append(Skipped(spec=spec, reasons=verdict.reasons))
            continue
        for spec in _specs_for(mode, report):
            spec = _with_fp8_layers(spec, report)
            if (reason := no_fp8_layer(spec, report)) is not None:
                skipped.append(Skipped(spec=spec, reasons=(reason,)))
            else:
                (promising if verdict.worth_trying else doubtful).append(spec)
    for mode in sorted(wanted - set(preference) - {"fp32"}):  # requested, never eligible here
        skipped.append(Skipped(spec=ModeSpec(mode=mode), reasons=verdicts[mode].reasons))  # type: ignore[arg-type]
    if modes is not None:
        for mode in sorted(wanted_8bit - set(preference) - {"fp32"}):
            spec = ModeSpec(mode=mode, optimizer_bits=8)  # type: ignore[arg-type]
            skipped.append(Skipped(spec=spec, reasons=verdicts[mode].reasons))
    if modes is None:  # by default, 8-bit states where the probe expects them to pay
        useful = report.optimizer_8bit.eligible and report.optimizer_8bit.worth_trying
        eight_bit = _eight_bit_specs(report, promising, wanted_8bit if useful else set(), [])
    else:
        eight_bit = _eight_bit_specs(report, promising + doubtful, wanted_8bit, skipped)
    # a doubtful mode's 8-bit variant after it: both are expected slow here
    doubted = {spec.mode for spec in doubtful}
    doubtful_8bit = [spec for spec in eight_bit if spec.mode in doubted]
    eight_bit = [spec for spec in eight_bit if spec.mode not in doubted]
    if modes is not None:  # a mode named only with +8bit-optim runs only with 8-bit states
        promising = [s for s in promising if s.mode in wanted]
        doubtful = [s for s in doubtful if s.mode in wanted]
    return CandidateList(
        specs=(ModeSpec(mode="fp32"), *promising, *eight_bit, *doubtful, *doubtful_8bit),
        skipped=_merged(skipped),
    )


def _eight_bit_specs(
    report: ProbeReport, eligible: list[ModeSpec], wanted: set[str], skipped: list[Skipped]
) -> list[ModeSpec]:
    """The 8-bit optimizer-state variants of the wanted, eligible modes (in their order); none
    where no trainable tensor is large enough for an 8-bit state (:func:`no_8bit_state`)."""
    verdict = report.optimizer_8bit
    if not wanted:
        return []
    reasons = verdict.reasons or tuple(filter(None, [no_8bit_state(report)]))
    if reasons:
        for mode in sorted(wanted):
            spec = ModeSpec(mode=mode, optimizer_bits=8)  # type: ignore[arg-type]
            skipped.append(Skipped(spec=spec, reasons=reasons))
        return []
    bases = [ModeSpec(mode="fp32")] if "fp32" in wanted else []
    return [
        spec.model_copy(update={"optimizer_bits": 8})
        for spec in bases + eligible
        if spec.mode in wanted and spec.mode in EIGHT_BIT_MODES
    ]


def no_8bit_state(report: ProbeReport) -> str | None:
    """Why no state would be 8-bit on the scanned model, or None: with no trainable tensor of
    ``BNB_MIN_8BIT_SIZE`` elements every state stays 32-bit (bitsandbytes' ``min_8bit_size``), and
    check() called the ``+8bit-optim`` variants safe having run the base mode (found by a hunt
    on a VQ-VAE). A profile applied by hand still runs them (``apply`` is not refused)."""
    layers = report.layers
    if layers is None or not layers.trainable_parameters or layers.parameters_in_large_tensors:
        return None
    return (
        f"8-bit optimizer states keep no state in 8 bit here: no trainable tensor has "
        f"{BNB_MIN_8BIT_SIZE} elements or more (bitsandbytes' min_8bit_size), so every state "
        "stays 32-bit and it would train as its base mode"
    )


SCREEN_ORDER: tuple[ModeName, ...] = (
    "amp_bf16", "amp_fp16", "bf16_pure", "bf16_sr", "bf16_kahan", "bf16_sr_kahan",
    "fp8_torchao", "fp8_te", "tf32",
)  # fmt: skip


def _screen_specs_for(
    mode: ModeName, report: ProbeReport, situation: Situation
) -> tuple[list[ModeSpec], tuple[str, ...]]:
    """(specs whose numerics run here, reasons when none do)."""
    verdict = next(v for v in report.modes if v.name == mode)
    if verdict.eligible:
        specs = _specs_for(mode, report)
    elif mode != "fp8_torchao":
        return [], verdict.reasons
    else:
        emulated = mode_eligibility(mode, dataclasses.replace(situation, emulate_fp8=True))
        if not emulated.eligible:
            return [], emulated.reasons
        skip = _fp8_skip(report)
        specs = [ModeSpec(mode=mode, fp8_recipe="torchao_tensorwise", emulate=True, fp8_skip=skip)]
    if mode == "fp8_torchao":  # the screen: FP8 numerics on every layer its kernels take
        specs = [spec.model_copy(update={"fp8_layers": "all"}) for spec in specs]
    converting = [spec for spec in specs if no_fp8_layer(spec, report) is None]
    if specs and not converting:
        return [], (no_fp8_layer(specs[0], report) or "",)
    return converting, ()


def screen_specs(
    report: ProbeReport, situation: Situation, modes: Sequence[str] | None = None
) -> CandidateList:
    """Every mode whose numerics run here, for the quality screen (``autoprec check``): speed
    plays no part, and fp8_torchao runs emulated where the hardware has no FP8. ``skipped``: the
    modes whose numerics cannot run here (TF32 and Transformer Engine need their GPU), with
    reasons. ``modes`` as in :func:`candidate_specs`."""
    if modes is None:
        wanted, wanted_8bit = set(SCREEN_ORDER), set(EIGHT_BIT_MODES)
    else:
        wanted, wanted_8bit = _parse_modes(modes)
        if wanted <= {"fp32"} and not wanted_8bit:
            raise ValueError(
                f"modes {', '.join(modes)} leave nothing to check: fp32 is the reference every "
                "mode is judged against. Name the modes to check, or pass None for every mode."
            )
    specs: list[ModeSpec] = []
    skipped: list[Skipped] = []
    for mode in SCREEN_ORDER:
        if mode not in wanted | wanted_8bit:
            continue
        runnable, reasons = _screen_specs_for(mode, report, situation)
        specs.extend(runnable)
        if reasons and (modes is not None or mode in wanted):
            named_8bit = modes is not None and mode in wanted_8bit
            for bits in ([32] if mode in wanted else []) + ([8] if named_8bit else []):
                spec = ModeSpec(mode=mode, optimizer_bits=bits)
                skipped.append(Skipped(spec=spec, reasons=reasons))
    # by default too, the 8-bit variant of every mode checked that cannot run is listed: a
    # screen of every mode left them out without a word where bitsandbytes was missing (found
    # by a hunt); a mode not checked at all is listed once, with its own reasons
    checked = {"fp32", *(spec.mode for spec in specs)}
    listed = wanted_8bit if modes is not None else wanted_8bit & checked
    eight_bit = _eight_bit_specs(report, specs, listed, skipped)
    specs = [spec for spec in specs if spec.mode in wanted]
    return CandidateList(
        specs=(ModeSpec(mode="fp32"), *specs, *eight_bit), skipped=_merged(skipped)
    )
