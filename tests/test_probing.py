from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.probing import ProbeReport
from autoprec.specs import MODE_NAMES
from examples import tiny_gpt
from tests.conftest import make_backends, make_hardware


def test_probe_this_machine_without_a_model() -> None:
    report = autoprec.probe()
    assert [verdict.name for verdict in report.modes] == list(MODE_NAMES)
    assert report.layers is None
    assert report.verdict("fp32").eligible
    assert report.autoprec_version == autoprec.__version__
    assert {backend.name for backend in report.backends} == {
        "transformer_engine",
        "torchao",
        "bitsandbytes",
        "torchastic",
        "optimi",
    }


def test_probe_with_model_on_injected_h100() -> None:
    report = autoprec.probe(
        *tiny_gpt.make_model(), hardware=make_hardware("H100"), backends=make_backends("all")
    )
    assert report.device == "cuda:0"
    assert report.eligible_modes == MODE_NAMES
    assert report.layers is not None and report.layers.model_class == "TinyGPT"
    fp8 = report.verdict("fp8_te")
    assert fp8.eligible and not fp8.worth_trying
    assert report.optimizer_8bit.eligible


def test_a_compiled_model_is_probed_by_the_names_tune_uses() -> None:
    """probe named torch.compile's wrapper (OptimizedModule) and listed `_orig_mod.` names
    that tune and check then refused as keep_fp32 patterns."""
    import torch

    model, example = tiny_gpt.make_model()
    plain = autoprec.probe(model, example, backends=make_backends("none"))
    report = autoprec.probe(torch.compile(model), example, backends=make_backends("none"))
    assert report.layers is not None and report.layers.model_class == "TinyGPT"
    assert report.layers == plain.layers
    assert report.layers.keep_fp32 and not any(
        "_orig_mod" in k.fqn for k in report.layers.keep_fp32
    )


def test_report_round_trips_through_json() -> None:
    report = autoprec.probe(
        *tiny_gpt.make_model(),
        hardware=make_hardware("A100", "H100"),
        backends=make_backends("torchao"),
        device=1,
    )
    again = ProbeReport.model_validate_json(report.model_dump_json())
    assert again == report
    assert again.device == "cuda:1"


def test_unknown_mode_lookup() -> None:
    report = autoprec.probe(hardware=make_hardware(), backends=make_backends())
    with pytest.raises(ValueError, match="Unknown mode 'int8'"):
        report.verdict("int8")  # type: ignore[arg-type]


def test_probe_does_not_import_gpu_backends() -> None:
    import subprocess
    import sys

    code = (
        "import sys, autoprec; autoprec.probe(); "
        "print(sorted(m for m in ('torchao', 'bitsandbytes', 'torchastic', 'optimi', "
        "'transformer_engine', 'optuna', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_rocm_build_claims_fp16_and_bf16_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch on ROCm reports an MI250X (gfx90a, no FP8 hardware) as "capability 9.0": read as
    NVIDIA's, FP8 (tensorwise and rowwise) and TF32 were offered, and the Machine table said
    "CUDA runtime: none (CPU build)"."""
    import pynvml
    from rich.console import Console

    from autoprec.candidates import candidate_specs
    from autoprec.display_probe import print_probe_report
    from autoprec.eligibility import mxfp8_reason
    from autoprec.hardware import detect_hardware
    from autoprec.probing import probe
    from tests.conftest import CPU, FakeCuda, FakeNvml, FakeNvmlDevice

    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)
    mi250 = FakeNvmlDevice("AMD Instinct MI250X/MI250", (9, 0), gcn_arch="gfx90a:sramecc+:xnack-")
    hardware = detect_hardware(
        pynvml=FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound()),
        cuda=FakeCuda(devices=[mi250]),
        cpu=CPU,
    )
    report = probe(hardware=hardware, backends=make_backends("all"))
    assert report.verdict("amp_bf16").eligible and report.verdict("amp_fp16").eligible
    unnamed = FakeNvmlDevice("AMD Instinct MI250X/MI250", (9, 0))  # no gcnArchName
    (gpu,) = detect_hardware(pynvml=None, cuda=FakeCuda(devices=[unnamed]), cpu=CPU).gpus
    assert gpu.rocm_arch == "gfx?" and not gpu.supports("fp8")
    for mode in ("tf32", "fp8_torchao", "fp8_te"):
        (reason,) = [r for r in report.verdict(mode).reasons if "AMD" in r]
        assert "ROCm gfx90a" in reason and "Try amp_bf16" in reason
    assert not any(s.mode.startswith("fp8") for s in candidate_specs(report).specs)
    console = Console(record=True, width=200)
    print_probe_report(report, console=console)
    assert "ROCm/HIP runtime: 6.4.43482" in console.export_text()
    # torch reads gfx1100 as "11.0": fp8_te's verdict said "MXFP8 recipe available" (a hunt)
    navi = FakeNvmlDevice("AMD Radeon RX 7900 XTX", (11, 0), gcn_arch="gfx1100")
    hardware = detect_hardware(pynvml=None, cuda=FakeCuda(devices=[navi]), cpu=CPU)
    verdict = probe(hardware=hardware, backends=make_backends("all")).verdict("fp8_te")
    assert not verdict.eligible and not any("MXFP8" in note for note in verdict.notes)
    assert "ROCm gfx1100" in (mxfp8_reason(hardware.gpus[0]) or "")


def test_the_probe_leaves_the_callers_rng_and_buffers_as_they_were() -> None:
    """Found by a hunt: a forward that draws noise (a VAE) moved the caller's RNG, and a module
    updating its buffers on every call kept the eval-mode scan's update."""

    class Normaliser(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(4))
            self.register_buffer("count", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.count += 1
                self.mean += 0.05 * (x.mean(0) - self.mean)
            return x - self.mean

    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc = Normaliser(), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(x)) + torch.randn_like(x)

    model = Noisy()
    example = torch.ones(2, 4)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    autoprec.probe(model, example)
    assert torch.equal(torch.rand(3), expected)
    assert int(model.norm.count) == 0 and torch.equal(model.norm.mean, torch.zeros(4))


def test_the_cpu_autocast_check_ignores_the_callers_grad_mode_and_defaults() -> None:
    """Found by a hunt: under no_grad / inference_mode (a notebook cell) or a meta default
    device, the check failed and every autocast mode read as impossible."""
    from autoprec.cpu_info import check_cpu_autocast

    with torch.no_grad():
        assert check_cpu_autocast("bfloat16").works
    with torch.inference_mode():
        assert check_cpu_autocast("bfloat16").works
    with torch.device("meta"):
        assert check_cpu_autocast("bfloat16").works


def test_a_kept_root_is_named_in_the_probes_keep_lines() -> None:
    """Found by a hunt: a model that is itself a LayerNorm is kept whole, and the root's name
    is "", so the probe printed "pure bf16 keeps in fp32: none"."""
    import io

    from rich.console import Console

    from autoprec.display_probe import print_probe_report

    report = autoprec.probe(torch.nn.LayerNorm(64), torch.randn(4, 64))
    assert [keep.fqn for keep in report.layers.keep_fp32] == [""]
    buffer = io.StringIO()
    print_probe_report(report, console=Console(file=buffer, width=200))
    lines = [line for line in buffer.getvalue().splitlines() if "pure bf16 keeps" in line]
    assert lines and "the whole model (its root)" in lines[0], lines


def test_the_machine_table_says_whether_bf16_has_instructions_of_its_own() -> None:
    """ "bfloat16 works" hid a 14-17x slower step on a CPU without avx512_bf16 (said only in
    each bf16 mode's reasons); the row now says which CPU it is."""
    from rich.console import Console

    from autoprec.display_probe import _hardware
    from autoprec.hardware import detect_hardware
    from tests.conftest import CPU

    def row(native: bool | None) -> str:
        cpu = CPU.model_copy(update={"native_bf16": native})
        console = Console(record=True, width=200)
        console.print(_hardware(detect_hardware(pynvml=None, cpu=cpu), "cpu"))
        return next(line for line in console.export_text().splitlines() if "CPU autocast" in line)

    assert "bfloat16 works (no bf16 instructions: far slower than fp32), float16 works" in row(
        False
    )
    assert "bfloat16 works (native bf16 instructions), float16 works" in row(True)
    assert "bfloat16 works, float16 works" in row(None)


def test_mxfp8_is_offered_and_run_only_where_transformer_engine_runs_it() -> None:
    """Found by a hunt: te_mxfp8 had no capability check of its own (prepare() took it on an
    H100) and was offered on 12.x GPUs, where Transformer Engine refuses MXFP8 training ("not
    supported on 12.0+ architectures yet"); its Linears were checked for 16, not MXFP8's 32."""
    from torch import nn

    from autoprec.candidates import candidate_specs, no_fp8_layer
    from autoprec.eligibility import Situation
    from autoprec.modes import mode_for
    from autoprec.specs import ModeSpec

    model, example = tiny_gpt.make_model()
    mxfp8 = ModeSpec(mode="fp8_te", fp8_recipe="te_mxfp8")
    found = {}
    for gpu in ("H100", "B200", "RTX5090"):
        hardware = make_hardware(gpu)
        report = autoprec.probe(model, example, hardware=hardware, backends=make_backends("all"))
        recipes = {s.fp8_recipe for s in candidate_specs(report).specs if s.mode == "fp8_te"}
        situation = Situation(hardware, "cuda:0", report.layers, make_backends("all"))
        found[gpu] = ("te_mxfp8" in recipes, mode_for(mxfp8).requirements(situation))
    assert found["B200"] == (True, [])
    assert found["H100"] == (
        False,
        ["te_mxfp8 needs compute capability >= 10.0 (found: NVIDIA H100 80GB HBM3, 9.0)"],
    )
    offered, reasons = found["RTX5090"]
    assert not offered and reasons[0].startswith("te_mxfp8: Transformer Engine does not run")
    assert reasons[0].endswith(
        "found: NVIDIA GeForce RTX 5090, 12.0); use te_current or te_delayed_hybrid"
    )
    mode = mode_for(mxfp8)
    assert mode.module_filter_fn(nn.Linear(64, 64), "a")
    assert not mode.module_filter_fn(nn.Linear(48, 64), "b")  # fits 16, not MXFP8's 32
    assert mode_for(ModeSpec(mode="fp8_te")).module_filter_fn(nn.Linear(48, 64), "b")
    narrow = nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48))
    report = autoprec.probe(
        narrow, torch.randn(2, 48), hardware=make_hardware("B200"), backends=make_backends("all")
    )
    said = no_fp8_layer(mxfp8.model_copy(update={"fp8_layers": "all"}), report)
    assert said is not None and "0, 2 with a dimension not divisible by 32, MXFP8's block" in said


def test_probe_and_load_profile_name_an_argument_of_the_wrong_kind() -> None:
    """Found by a hunt: pathlib's "expected str, bytes or os.PathLike object, not int",
    "scan_model needs a torch.nn.Module" (an internal name), and an AttributeError."""
    with pytest.raises(TypeError, match=r"path must be the profile.s file path .* not int"):
        autoprec.load_profile(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module \(or None\), not list"):
        autoprec.probe([torch.nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hardware must be a HardwareInfo"):
        autoprec.probe(hardware="x")  # type: ignore[arg-type]


def test_flags_refuse_anything_but_true_or_false(tmp_path: Path) -> None:
    """Found by a hunt: ``strict="no"`` is truthy, and was taken as ``strict=True``."""
    from autoprec.profile import profile_for
    from autoprec.specs import ModeSpec

    profile = profile_for(ModeSpec(mode="amp_bf16"), hardware=make_hardware("A100"))
    path = tmp_path / "p.json"
    profile.save(path)
    with pytest.raises(TypeError, match=r"strict must be True or False, not 'no' \(str\)"):
        autoprec.load_profile(path, strict="no")  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="strict must be True or False, not 0"):
        profile.apply(model, torch.optim.AdamW(model.parameters()), strict=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ignore_keep_fp32 must be True or False"):
        profile.to_lightning(ignore_keep_fp32="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no_embeddings must be True or False"):
        profile.to_hf_training_args(no_embeddings=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="import_backends must be True or False"):
        autoprec.probe(import_backends=1)  # type: ignore[arg-type]
    assert profile.to_lightning(ignore_keep_fp32=True) == {"precision": "bf16-mixed"}


def test_a_run_in_another_thread_waits_for_the_one_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by a hunt: two check() calls in two threads mixed the global random streams (a
    paired noise run repeated the reference) and left an "ignore every warning" filter in the
    process. Runs take turns; one inside a run in its own thread (probe() in tune()) goes on."""
    import threading
    import warnings

    from autoprec.exclusive import one_run_at_a_time

    filters = list(warnings.filters)
    reports: list[object] = []
    with caplog.at_level("WARNING", logger="autoprec"):
        with one_run_at_a_time("tune()"):
            autoprec.probe(torch.nn.Linear(4, 4), torch.randn(2, 4))  # same thread: goes on
            other = threading.Thread(target=lambda: reports.append(autoprec.probe()))
            other.start()
            other.join(timeout=1.0)
            assert other.is_alive() and not reports  # waits while tune() runs
        other.join(timeout=60)
    assert len(reports) == 1
    assert "probe() waits for tune(), running in another thread" in caplog.text
    assert warnings.filters == filters
