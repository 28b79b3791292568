from __future__ import annotations

import dataclasses

import pytest
import torch

import autoprec
from autoprec.cpu_info import AutocastCheck
from autoprec.eligibility import (
    Situation,
    mode_eligibility,
    optimizer_8bit_eligibility,
)
from autoprec.layers import scan_model
from autoprec.specs import MODE_NAMES
from examples import raw_param_mlp, small_convnet, tiny_gpt
from tests.conftest import CPU, make_backends, make_hardware

ALL_BACKENDS = make_backends("all")


def situation(*gpus: str, layers=None, backends=ALL_BACKENDS, cpu=CPU) -> Situation:
    hardware = make_hardware(*gpus, cpu=cpu)
    return Situation(
        hardware=hardware, device=hardware.resolve_device(None), layers=layers, backends=backends
    )


def eligible_modes(s: Situation) -> set[str]:
    return {mode for mode in MODE_NAMES if mode_eligibility(mode, s).eligible}


BF16 = {"amp_bf16", "bf16_pure", "bf16_sr", "bf16_kahan", "bf16_sr_kahan"}


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("V100", {"fp32", "amp_fp16"}),
        ("T4", {"fp32", "amp_fp16"}),
        ("A100", {"fp32", "tf32", "amp_fp16", *BF16}),
        ("RTX3090", {"fp32", "tf32", "amp_fp16", *BF16}),
        ("RTX4090", {"fp32", "tf32", "amp_fp16", *BF16, "fp8_te", "fp8_torchao"}),
        ("L4", {"fp32", "tf32", "amp_fp16", *BF16, "fp8_te", "fp8_torchao"}),
        ("H100", set(MODE_NAMES)),
        ("H200", set(MODE_NAMES)),
        ("B200", set(MODE_NAMES)),
    ],
)
def test_modes_by_gpu_with_every_backend(gpu: str, expected: set[str]) -> None:
    assert eligible_modes(situation(gpu)) == expected


def test_reasons_name_what_was_found() -> None:
    a100 = situation("A100")
    assert mode_eligibility("fp8_torchao", a100).reasons == (
        "fp8_torchao needs compute capability >= 8.9 (found: NVIDIA A100-SXM4-80GB, 8.0)",
    )
    v100 = mode_eligibility("amp_bf16", situation("V100"))
    assert v100.reasons == (
        "amp_bf16 needs compute capability >= 8.0 (found: Tesla V100-SXM2-32GB, 7.0)",
    )


def test_cpu_verdicts() -> None:
    cpu = situation()
    assert eligible_modes(cpu) == {"fp32", "amp_fp16", *BF16}
    tf32 = mode_eligibility("tf32", cpu)
    assert tf32.reasons == (
        "tf32 needs a CUDA GPU with compute capability >= 8.0 (found: CPU only, torch 2.13.0+cpu)",
    )
    fp16 = mode_eligibility("amp_fp16", cpu)
    assert fp16.eligible and not fp16.worth_trying
    assert any("no fast fp16 kernels" in note for note in fp16.notes)
    fp8 = mode_eligibility("fp8_torchao", cpu)
    assert any("emulate=True" in note for note in fp8.notes)


def test_cpu_without_working_bf16_autocast() -> None:
    cpu = CPU.model_copy(
        update={
            "autocast": (
                AutocastCheck(dtype="bfloat16", works=False, error="no bf16 kernel"),
                AutocastCheck(dtype="float16", works=True),
            )
        }
    )
    verdict = mode_eligibility("bf16_kahan", situation(cpu=cpu))
    assert verdict.reasons == (
        "bf16_kahan needs bfloat16 autocast on this CPU (found: no bf16 kernel)",
    )


@pytest.mark.parametrize(
    ("native_bf16", "worth_trying"), [(False, False), (True, True), (None, True)]
)
def test_a_cpu_without_bf16_instructions_expects_bf16_modes_slow(
    native_bf16: bool | None, worth_trying: bool
) -> None:
    """On a 2-core AMD EPYC without avx512_bf16, amp_bf16's step took 13.7x fp32's and every
    bf16 trial ran until the budget cut it: bf16 there is possible, not worth trying first
    (as amp_fp16 on a CPU). Flags that cannot be read (None) say nothing."""
    cpu = CPU.model_copy(update={"native_bf16": native_bf16})
    for mode in sorted(BF16):
        verdict = mode_eligibility(mode, situation(cpu=cpu))
        assert verdict.eligible and verdict.worth_trying == worth_trying, mode
        slow = [n for n in verdict.notes if "has no bf16 instructions" in n]
        assert bool(slow) != worth_trying, mode
        if slow:
            assert "avx512_bf16" in slow[0] and f"expect {mode} to be far slower" in slow[0]
    # a GPU computes bf16 itself, whatever the host CPU lacks
    assert mode_eligibility("amp_bf16", situation("A100", cpu=cpu)).worth_trying


def test_the_cpus_bf16_instructions_are_read_from_its_flags() -> None:
    from autoprec.cpu_info import _native_bf16

    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f {}\n"
    assert _native_bf16(x86.format("avx512_bf16 avx512vl")) is True
    assert _native_bf16(x86.format("amx_bf16 amx_tile")) is True
    assert _native_bf16(x86.format("avx512vl")) is False  # AVX-512 without its bf16 part
    assert _native_bf16("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n") is True
    assert _native_bf16("processor\t: 0\nFeatures\t: fp asimd\n") is False
    assert _native_bf16("processor\t: 0\n") is None  # no flags: unknown, not "absent"


ARM_CPUINFO = (
    "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd atomics cpuid{}\n"
    "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {}\n"
)


def test_an_arm_cpu_is_named_by_its_core_not_aarch64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arm Linux prints no "model name": every Arm CPU was "aarch64", so a CPU profile proven
    on a Graviton3 (bf16) applied on a Graviton2 (none) without a word (found by a hunt)."""
    from autoprec.cpu_info import _cpu_model_name
    from autoprec.profile import HardwareFingerprint

    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    graviton2 = ARM_CPUINFO.format("", "0xd0c")
    graviton3 = ARM_CPUINFO.format(" sve bf16 i8mm", "0xd40")
    assert _cpu_model_name(graviton2) == "Arm Neoverse-N1 (CPU implementer 0x41, part 0xd0c)"
    assert _cpu_model_name(graviton3) == "Arm Neoverse-V1 (CPU implementer 0x41, part 0xd40)"
    other = ARM_CPUINFO.format("", "0xabc").replace("0x41", "0x61")
    assert _cpu_model_name(other) == "aarch64 (CPU implementer 0x61, part 0xabc)"
    assert _cpu_model_name("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n") == "AMD EPYC 7B13"

    fingerprint = HardwareFingerprint(
        device_kind="cpu", torch_version="2.13.0+cpu", cpu_model="aarch64"
    )
    proven = fingerprint.model_copy(update={"cpu_native_bf16": True})
    running = fingerprint.model_copy(update={"cpu_native_bf16": False})
    assert proven.differences(running) == [
        "cpu_native_bf16: proven on a CPU with bf16 instructions, running on one without "
        "(without them amp_bf16 measured 13.7x fp32's step time)"
    ]
    assert fingerprint.differences(running) == []  # a profile that did not record it


@pytest.mark.parametrize(
    ("mode", "backend", "extra"),
    [
        ("bf16_sr", "torchastic", "lowbit"),
        ("bf16_kahan", "optimi", "lowbit"),
        ("fp8_torchao", "torchao", "torchao"),
        ("fp8_te", "transformer_engine", "te"),
    ],
)
def test_missing_backend_names_the_extra(mode: str, backend: str, extra: str) -> None:
    others = [
        name
        for name in ("torchastic", "optimi", "torchao", "transformer_engine", "bitsandbytes")
        if name != backend
    ]
    verdict = mode_eligibility(mode, situation("H100", backends=make_backends(*others)))  # type: ignore[arg-type]
    assert verdict.reasons == (
        f"{mode} needs {backend} (found: not installed; pip install 'autoprec[{extra}]')",
    )


def test_sr_kahan_needs_both_backends() -> None:
    verdict = mode_eligibility("bf16_sr_kahan", situation("H100", backends=make_backends()))
    assert len(verdict.reasons) == 2


def test_broken_backend_is_a_reason() -> None:
    backends = tuple(
        b.model_copy(update={"import_error": "transformer_engine failed to import (OSError: x)"})
        if b.name == "transformer_engine"
        else b
        for b in ALL_BACKENDS
    )
    verdict = mode_eligibility("fp8_te", situation("H100", backends=backends))
    assert verdict.reasons == (
        "fp8_te needs a working transformer_engine (found: transformer_engine failed to import "
        "(OSError: x))",
    )


def test_fp8_model_fit() -> None:
    conv = situation("H100", layers=scan_model(*small_convnet.make_model()))
    verdict = mode_eligibility("fp8_torchao", conv)
    assert verdict.reasons == (
        "fp8_torchao needs plain nn.Linear layers with both dimensions divisible by 16 "
        "(found: none of 1: 1 with a dimension not divisible by 16)",
    )
    raw = mode_eligibility(
        "fp8_te", situation("H100", layers=scan_model(*raw_param_mlp.make_model()))
    )
    assert raw.eligible and not raw.worth_trying
    assert any("only 14% of forward FLOPs" in note for note in raw.notes)
    gpt = mode_eligibility("fp8_te", situation("H100", layers=scan_model(*tiny_gpt.make_model())))
    assert gpt.eligible and not gpt.worth_trying
    assert any("Linears are small" in note for note in gpt.notes)
    # AMP accelerates the conv net: no model-fit objection
    assert mode_eligibility("amp_bf16", conv).worth_trying


def test_rowwise_note_on_ada() -> None:
    verdict = mode_eligibility("fp8_torchao", situation("L4"))
    assert any("rowwise scaling is tried from compute capability 9.0" in n for n in verdict.notes)
    assert not any("rowwise" in n for n in mode_eligibility("fp8_torchao", situation("H100")).notes)


def test_optimizer_8bit() -> None:
    assert optimizer_8bit_eligibility(situation(backends=make_backends())).reasons == (
        "optimizer_bits=8 needs bitsandbytes (found: not installed; pip install 'autoprec[bnb]')",
    )
    gpt = optimizer_8bit_eligibility(situation(layers=scan_model(*tiny_gpt.make_model())))
    assert gpt.worth_trying and "saves about 2.7 MiB" in gpt.notes[0]


def test_8bit_states_save_nothing_on_frozen_weights() -> None:
    """Found by a hunt: a LoRA-style model (a frozen 512x512 base, a small trainable head) was
    told 8-bit states save 1.5 MiB, counting the frozen base, which has no optimizer state."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 16))
    model[0].requires_grad_(False)
    layers = scan_model(model, torch.randn(2, 512))
    assert layers.parameters_in_large_tensors == 512 * 16  # the head's weight alone
    verdict = optimizer_8bit_eligibility(situation(layers=layers))
    said = " ".join(verdict.notes)
    assert "saves about 0.0 MiB" in said and "(8,192 trainable parameters" in said


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="Unknown mode 'fp64'"):
        mode_eligibility("fp64", situation())  # type: ignore[arg-type]


def test_a_model_with_nothing_to_train_is_worth_no_trial() -> None:
    # the probe offered every mode (and 8-bit states) for a frozen model that tune and check
    # refuse, with no finding saying why
    from autoprec.eligibility import (
        mode_eligibility,
        optimizer_8bit_eligibility,
        situations_for_model,
    )

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).requires_grad_(False)
    layers = scan_model(model, torch.randn(2, 8))
    assert any(f.startswith("none of the model's 88 parameters trains") for f in layers.findings)
    situation = dataclasses.replace(situations_for_model(model)[0], layers=layers)
    verdict = mode_eligibility("amp_bf16", situation)
    assert verdict.eligible and not verdict.worth_trying
    assert any("no trainable parameters" in note for note in verdict.notes)
    assert not optimizer_8bit_eligibility(situation).worth_trying


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_whose_weights_are_not_fp32_is_worth_no_trial(dtype: torch.dtype) -> None:
    # tune, check and apply refuse it; the probe offered every mode for it ("worth a trial
    # here: fp32, amp_bf16, ...") and told a float64 model only "pass model.float()" (a hunt)
    from autoprec.eligibility import situations_for_model

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    report = autoprec.probe(model, torch.randn(2, 8, dtype=dtype))
    assert not [m.name for m in report.modes if m.worth_trying]
    verdict = next(m for m in report.modes if m.name == "amp_bf16")
    assert any("weights are not fp32" in note for note in verdict.notes)
    advice = "float64 is wider than every mode" if dtype == torch.float64 else "model.float()"
    assert advice in report.layers.findings[0]
    situation = dataclasses.replace(situations_for_model(model.float())[0], layers=report.layers)
    assert not optimizer_8bit_eligibility(situation).worth_trying
    assert not mode_eligibility("bf16_sr", situation).worth_trying


def test_fp8_refusal_names_why_the_linears_do_not_fit() -> None:
    """Found by a hunt: HF Conv1D layers and weight-normed Linears of 4096x4096 were refused
    for "dimensions not divisible by 16"; a root weight_norm Linear's weight was raw_param."""
    from torch import nn
    from torch.nn.utils.parametrizations import weight_norm

    normed = nn.Sequential(weight_norm(nn.Linear(64, 64)), weight_norm(nn.Linear(64, 64)))
    verdict = mode_eligibility("fp8_torchao", situation("H100", layers=scan_model(normed)))
    assert verdict.reasons == (
        "fp8_torchao needs plain nn.Linear layers with both dimensions divisible by 16 "
        "(found: none of 2: 2 with a computed weight (weight_norm, spectral_norm), which a "
        "swap cannot take)",
    )
    from transformers.pytorch_utils import Conv1D

    gpt2_style = nn.Sequential(Conv1D(64, 32), Conv1D(32, 64))
    verdict = mode_eligibility("fp8_te", situation("H100", layers=scan_model(gpt2_style)))
    assert "(found: none of 2: 2 HF Conv1D, which FP8 swaps do not convert)" in verdict.reasons[0]
    root = scan_model(weight_norm(nn.Linear(32, 32)))
    assert {share.kind: share.parameters for share in root.by_kind if share.parameters} == {
        "linear": 32 * 32 + 32 + 32  # weight_g, weight_v and the bias: all the Linear's
    }
