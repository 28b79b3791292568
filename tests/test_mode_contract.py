"""Every mode keeps autoprec.testing.ModeContract; modes this machine cannot run are skipped with
their own reasons (after their refusal was checked)."""

from __future__ import annotations

from autoprec.specs import ModeSpec
from autoprec.testing import ModeContract


class TestFp32(ModeContract):
    spec = ModeSpec(mode="fp32")


class TestFp32With8BitStates(ModeContract):
    spec = ModeSpec(mode="fp32", optimizer_bits=8)


class TestTf32(ModeContract):
    spec = ModeSpec(mode="tf32")


class TestAmpFp16(ModeContract):
    spec = ModeSpec(mode="amp_fp16")


class TestAmpBf16(ModeContract):
    spec = ModeSpec(mode="amp_bf16")


class TestAmpBf16With8BitStates(ModeContract):
    spec = ModeSpec(mode="amp_bf16", optimizer_bits=8)


class TestBf16Pure(ModeContract):
    spec = ModeSpec(mode="bf16_pure")


class TestBf16PureWith8BitStates(ModeContract):
    spec = ModeSpec(mode="bf16_pure", optimizer_bits=8)


class TestBf16Sr(ModeContract):
    spec = ModeSpec(mode="bf16_sr")


class TestBf16Kahan(ModeContract):
    spec = ModeSpec(mode="bf16_kahan")


class TestBf16SrKahan(ModeContract):
    spec = ModeSpec(mode="bf16_sr_kahan")


class TestFp8TorchaoEmulated(ModeContract):
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")


class TestFp8TorchaoRowwiseEmulated(ModeContract):
    spec = ModeSpec(
        mode="fp8_torchao", fp8_recipe="torchao_rowwise", emulate=True, fp8_layers="all"
    )


class TestFp8Torchao(ModeContract):
    spec = ModeSpec(mode="fp8_torchao", fp8_layers="all")


class TestFp8Te(ModeContract):
    spec = ModeSpec(mode="fp8_te")
