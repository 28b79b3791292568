from __future__ import annotations

import pytest
from pydantic import ValidationError

from autoprec.specs import MODE_DESCRIPTIONS, MODE_NAMES, ModeSpec, matches_keep_fp32


def test_canonical_names_are_stable() -> None:
    assert MODE_NAMES == (
        "fp32",
        "tf32",
        "amp_fp16",
        "amp_bf16",
        "bf16_pure",
        "bf16_sr",
        "bf16_kahan",
        "bf16_sr_kahan",
        "fp8_te",
        "fp8_torchao",
    )
    assert set(MODE_DESCRIPTIONS) == set(MODE_NAMES)


def test_spec_labels() -> None:
    assert ModeSpec(mode="amp_bf16", optimizer_bits=8).label == "amp_bf16+8bit-optim"
    assert ModeSpec(mode="fp8_torchao", fp8_recipe="torchao_rowwise", emulate=True).label == (
        "fp8_torchao+rowwise+emulated"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "fp8_te", "fp8_recipe": "torchao_rowwise"}, "belongs to mode 'fp8_torchao'"),
        ({"mode": "amp_bf16", "emulate": True}, "emulate=True applies only to 'fp8_torchao'"),
        ({"mode": "fp64"}, "Input should be 'fp32'"),
        ({"mode": "fp32", "optimizer_bits": 4}, "Input should be 32 or 8"),
        ({"mode": "fp32", "colour": "red"}, "Extra inputs are not permitted"),
        ({"mode": "tf32", "keep_fp32": ("head",)}, "keep_fp32 does not apply to 'tf32'"),
    ],
)
def test_invalid_specs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModeSpec(**kwargs)


def test_spec_is_frozen() -> None:
    spec = ModeSpec(mode="fp32")
    with pytest.raises(ValidationError):
        spec.mode = "tf32"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fqn", "patterns", "kept"),
    [
        ("blocks.0.mlp.0", ("blocks.0.mlp",), True),
        ("blocks.0.mlp.0", ("blocks.*.mlp",), True),  # a glob naming the container
        ("blocks.1.ln_1", ("blocks.*.ln_*",), True),
        ("blocks.1.attn.c_attn", ("blocks.*.ln_*",), False),
        ("blocks.0.mlpx.0", ("blocks.*.mlp",), False),
        ("head", ("head",), True),
        ("heads.0", ("head",), False),
    ],
)
def test_keep_fp32_patterns_keep_what_is_inside_a_matched_module(
    fqn: str, patterns: tuple[str, ...], kept: bool
) -> None:
    assert matches_keep_fp32(fqn, patterns) is kept
