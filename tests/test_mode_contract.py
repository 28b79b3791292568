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


def test_the_contract_fails_a_broken_mode_under_python_O() -> None:
    """Found by a hunt: the contract's checks were plain asserts, which pytest does not rewrite
    in an installed module and ``python -O`` strips: a mode drawing from the global RNG passed
    there."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import itertools, torch
        import autoprec.testing as contract
        from autoprec.specs import ModeSpec

        class Broken(contract.ModeContract):
            spec = ModeSpec(mode="amp_bf16")

        counter = itertools.count()  # as a mode drawing from the global RNG: every reading differs
        contract._global_rng_states = lambda: [torch.tensor([next(counter)])]
        try:
            Broken().test_leaves_the_global_rng_alone()
        except AssertionError as error:
            print("failed:", error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "failed: the mode drew from the global RNG" in done.stdout
