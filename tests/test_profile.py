from __future__ import annotations

import json
import math
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

import autoprec
from autoprec.display import print_profile
from autoprec.drift_blind_spots import FP16_LATE_GROWTH
from autoprec.errors import (
    HardwareMismatchWarning,
    ModelMismatchWarning,
    ProfileError,
    RecipeMismatchWarning,
    UnprovenProfileWarning,
)
from autoprec.layers import scan_model
from autoprec.profile import (
    SCHEMA_VERSION,
    Evidence,
    HardwareFingerprint,
    ModelFingerprint,
    Profile,
    TrialFigures,
    load_profile,
    profile_for,
    published_schema,
)
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from examples import tiny_gpt
from tests.conftest import make_hardware

PROFILES = Path(__file__).parents[1] / "profiles"


MEASURED = Evidence(
    trial_steps=50,
    trial_count=3,
    budget_seconds=60.0,
    budget_used_seconds=30.0,
    reference=TrialFigures(samples_per_second=100.0, state_bytes=4_000_000, final_loss=2.1),
    chosen=TrialFigures(samples_per_second=150.0, state_bytes=4_000_000, final_loss=2.1),
)
"""Evidence for the profiles of tests about the file, not about where it came from."""


def _profile(**spec: object) -> Profile:
    return profile_for(ModeSpec(**spec), evidence=MEASURED)  # type: ignore[arg-type]


def test_a_profile_without_evidence_warns_and_strict_refuses(tmp_path: Path) -> None:
    """Found by a hunt: a hand-written profile naming this machine (the bundled CPU example)
    loaded exactly as a tuned one; only `autoprec show` told them apart."""
    written = profile_for(ModeSpec(mode="amp_bf16"), note="hand-written").save(tmp_path / "h.json")
    with pytest.warns(UnprovenProfileWarning, match=r"amp_bf16 profile carries no evidence \(its"):
        load_profile(written)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_profile(written)
    assert caught[0].filename == __file__  # pointing at the caller's line
    with pytest.raises(ProfileError, match=r"carries no evidence.*Run `autoprec tune`"):
        load_profile(written, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_profile(_profile(mode="amp_bf16").save(tmp_path / "t.json"), strict=True)


def test_round_trip_with_evidence(tmp_path: Path) -> None:
    evidence = MEASURED.model_copy(
        update={
            "trial_count": 6,
            "budget_used_seconds": 41.5,
            "chosen": TrialFigures(
                samples_per_second=180.0, state_bytes=2_000_000, final_loss=2.11
            ),
            "drift": {"loss_gap_in_noise_units": 0.4, "update_fraction": 0.99},
            "blind_spots": (FP16_LATE_GROWTH,),
        }
    )
    profile = profile_for(
        ModeSpec(mode="amp_fp16", keep_fp32=("lm_head",)),
        model_layers=scan_model(*tiny_gpt.make_model()),
        evidence=evidence,
    )
    path = profile.save(tmp_path / "nested" / "p.json")
    assert load_profile(path) == profile
    assert profile.model is not None and profile.model.model_class == "TinyGPT"
    assert len(profile.model.layer_mix_digest) == 16
    console = Console(width=240, record=True)
    print_profile(load_profile(path), console=console)
    shown = console.export_text()
    assert "not seen by a short trial" in shown and "fp16's range was checked" in shown
    # found by a hunt: a resumed run's profile read "11 trials of 300 steps, 2 s used"
    assert profile.evidence is not None
    resumed_evidence = profile.evidence.model_copy(
        update={"trial_count": 11, "trials_from_study": 7, "budget_used_seconds": 2.0}
    )
    resumed = profile.model_copy(update={"evidence": resumed_evidence})
    console = Console(width=240, record=True)
    print_profile(load_profile(resumed.save(tmp_path / "resumed.json")), console=console)
    shown = console.export_text()
    assert "11 trials of " in shown
    assert "(7 from an earlier run of the study), 2 s used by the last run" in shown


def test_infinite_figures_survive_the_file(tmp_path: Path) -> None:
    # written as null: clip_grad_norm=inf ("measure the norm, clip nothing") read back as None
    # (no clipping: strict apply with inf refused), an inf drift figure made the file unloadable
    model = nn.Linear(4, 4)
    recipe = TrainingRecipe(
        optimizer=torch.optim.AdamW(model.parameters()), clip_grad_norm=math.inf
    ).summary(model)
    evidence = Evidence(
        trial_steps=10,
        trial_count=2,
        reference=TrialFigures(final_loss=1.0),
        chosen=TrialFigures(final_loss=1.0),
        drift={"loss_ratio": math.inf},
    )
    profile = profile_for(ModeSpec(mode="amp_bf16"), recipe=recipe, evidence=evidence)
    assert profile.recipe is not None and profile.recipe.clip_grad_norm == math.inf
    loaded = load_profile(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    assert loaded.recipe is not None and loaded.recipe.clip_grad_norm == math.inf


def test_a_profile_saved_again_keeps_its_permissions(tmp_path: Path) -> None:
    # an atomic replace made a 0600 profile 0644 (world-readable) on every save
    path = _profile(mode="amp_bf16").save(tmp_path / "p.json")
    path.chmod(0o600)
    _profile(mode="bf16_sr").save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_profile(path).spec.mode == "bf16_sr"


def test_a_profile_under_a_file_is_refused_with_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile' is a file, not a folder"):  # FileExistsError
        _profile(mode="amp_bf16").save(tmp_path / "afile" / "p.json")


def test_profiles_of_an_earlier_schema_still_load(tmp_path: Path) -> None:
    data = json.loads(_profile(mode="amp_bf16").model_dump_json())
    data["schema_version"] = 2  # before evidence.blind_spots
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    assert load_profile(path).schema_version == 2
    # saved again, it is in today's format and says so (found by a hunt: it kept version 2
    # with today's fields); the autoprec that proved it stays named
    again = load_profile(path).save(tmp_path / "again.json")
    saved = json.loads(again.read_text())
    assert saved["schema_version"] == SCHEMA_VERSION
    assert saved["autoprec_version"] == data["autoprec_version"]


def test_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.json"
    _profile(mode="fp32").save(path)
    original = path.read_text()

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        _profile(mode="amp_bf16").save(path)
    assert path.read_text() == original  # the old profile is intact
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"schema_version": 1, "spec": {"mode": "fp32"', r"is not valid JSON \(line 1, column"),
        ("[1, 2]", "must hold a JSON object, not list"),
        ("", "is not valid JSON"),
    ],
)
def test_corrupt_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message) as caught:
        load_profile(path)
    assert str(path) in str(caught.value)


def test_hand_edited_invalid_field_names_the_field(tmp_path: Path) -> None:
    data = json.loads(_profile(mode="fp32").model_dump_json())
    data["spec"]["mode"] = "fp64"
    data["spec"]["optimizer_bits"] = 4
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert "spec.mode: Input should be 'fp32'" in message and "(got 'fp64')" in message
    assert "spec.optimizer_bits: Input should be 32 or 8" in message
    assert "\n" not in message  # one short paragraph, not a pydantic wall


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("lr_points", [{"role": "constant", "lrs": []}], "recipe.lr_points.0.lrs: Tuple should"),
        (  # found by a hunt: loaded, then `show` and apply() failed with a bare IndexError
            "lr_points",
            [{"role": "peak", "lrs": [1e-3], "momenta": []}],
            "recipe.lr_points.0.momenta: Tuple should have at least 1 item",
        ),
        (
            "lr_points",
            [{"role": "peak", "lrs": [1e-3, 1e-4], "momenta": [0.9]}],
            "momenta holds 1 values for 2 groups' lrs: one per group",
        ),
        ("grad_accumulation_steps", 0, "recipe.grad_accumulation_steps: Input should be greater"),
        ("clip_grad_norm", -1.0, "recipe.clip_grad_norm: Input should be greater than 0"),
    ],
)
def test_a_hand_edited_recipe_is_refused_on_load_naming_the_field(
    tmp_path: Path, field: str, value: object, said: str
) -> None:
    """An empty lr list crashed `show` and apply() with IndexError; accumulation 0 or a
    negative clip loaded, and failed only at apply() naming neither the file nor the field."""
    model = nn.Linear(4, 2)
    recipe = TrainingRecipe(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    data = json.loads(
        profile_for(ModeSpec(mode="fp32"), recipe=recipe.summary(model)).model_dump_json()
    )
    data["recipe"][field] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=re.escape(said)) as caught:
        load_profile(path)
    assert str(path) in str(caught.value)


def test_missing_field_and_missing_file(tmp_path: Path) -> None:
    data = json.loads(_profile(mode="fp32").model_dump_json())
    del data["hardware"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="hardware: Field required"):
        load_profile(path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nowhere.json")


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    data = json.loads(_profile(mode="fp32").model_dump_json())
    data["schema_version"] = SCHEMA_VERSION + 1
    data["something_new"] = True
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        ProfileError, match=f"schema version {SCHEMA_VERSION + 1}.*Upgrade autoprec"
    ):
        load_profile(path)


def test_other_hardware_warns_and_strict_refuses(tmp_path: Path) -> None:
    h100 = profile_for(ModeSpec(mode="amp_bf16"), hardware=make_hardware("H100"), evidence=MEASURED)
    path = h100.save(tmp_path / "h100.json")
    with pytest.warns(HardwareMismatchWarning, match="gpu_name: proven on 'NVIDIA H100 80GB HBM3'"):
        load_profile(path)
    with pytest.raises(ProfileError, match="proven on other hardware"):
        load_profile(path, strict=True)
    here = _profile(mode="amp_bf16").save(tmp_path / "here.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(here, strict=True)


def test_apply_judges_every_device_a_split_model_is_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by a hunt: apply() compared the profile's hardware with the first parameter's
    device alone; a model split over an H100 and an A100 passed as proven."""
    import autoprec.profile as profile_module

    mixed = make_hardware("H100", "A100")
    monkeypatch.setattr(profile_module, "detect_hardware", lambda: mixed)
    proven = profile_for(ModeSpec(mode="amp_bf16"), hardware=mixed, evidence=MEASURED)
    loaded = load_profile(proven.save(tmp_path / "h100.json"), strict=True)
    model = torch.nn.Linear(16, 16)
    monkeypatch.setattr(profile_module, "model_devices", lambda model: ("cuda:0", "cuda:1"))
    with pytest.raises(ProfileError, match=r"the model's device \(cuda:1\): .*gpu_name"):
        loaded.apply(model, torch.optim.AdamW(model.parameters()), strict=True)
    assert model.weight.dtype == torch.float32 and not model._forward_pre_hooks


def test_the_hardware_is_judged_where_the_model_trains(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by a hunt: loading compared the profile with cuda:0 alone (one proven on the H100
    at cuda:1 beside an A100 was refused there; one proven on a CPU was refused on a machine
    with a GPU), and apply() never looked at the device the model is on."""
    import autoprec.profile as profile_module

    mixed = make_hardware("A100", "H100")
    monkeypatch.setattr(profile_module, "detect_hardware", lambda: mixed)
    h100 = profile_for(
        ModeSpec(mode="amp_bf16"), hardware=mixed, device="cuda:1", evidence=MEASURED
    )
    cpu = profile_for(ModeSpec(mode="amp_bf16"), hardware=make_hardware(), evidence=MEASURED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each has a device like its own here
        on_h100 = load_profile(h100.save(tmp_path / "h100.json"), strict=True)
        on_cpu = load_profile(cpu.save(tmp_path / "cpu.json"), strict=True)
        model = torch.nn.Linear(16, 16)  # on the CPU
        on_cpu.apply(model, torch.optim.AdamW(model.parameters()), strict=True)
    model = torch.nn.Linear(16, 16)
    said = r"than the model's device \(cpu\): device_kind: .* cuda:1 is like the one proven"
    with pytest.raises(ProfileError, match=said):
        on_h100.apply(model, torch.optim.AdamW(model.parameters()), strict=True)
    assert model.weight.dtype == torch.float32 and not model._forward_pre_hooks
    with pytest.warns(HardwareMismatchWarning, match=said):
        on_h100.apply(model, torch.optim.AdamW(model.parameters()))
    monkeypatch.setattr(profile_module, "detect_hardware", lambda: make_hardware("A100"))
    with pytest.warns(HardwareMismatchWarning, match="gpu_name: proven on 'NVIDIA H100 80GB HBM3'"):
        load_profile(tmp_path / "h100.json")  # no device like it: said once, at load


def test_a_cpu_profile_from_another_cpu_or_torch_release_warns() -> None:
    # only the device kind, GPU and capability were compared: a CPU profile proven on a Xeon
    # with AMX under torch 2.4 loaded here under strict=True without a word
    here = HardwareFingerprint.from_hardware(make_hardware())
    other = here.model_copy(update={"cpu_model": "Intel Xeon 8480+", "torch_version": "2.4.0+cpu"})
    assert other.differences(here) == [
        f"cpu_model: proven on 'Intel Xeon 8480+', running on {here.cpu_model!r}",
        "torch_version: proven on '2.4.0+cpu', running on '2.13.0+cpu'",
    ]
    assert here.model_copy(update={"torch_version": "2.13.1+cpu"}).differences(here) == []


def test_differences_between_gpus() -> None:
    a100 = HardwareFingerprint.from_hardware(make_hardware("A100"))
    h100 = HardwareFingerprint.from_hardware(make_hardware("H100"))
    assert a100.differences(h100) == [
        "gpu_name: proven on 'NVIDIA A100-SXM4-80GB', running on 'NVIDIA H100 80GB HBM3'",
        "capability: proven on (8, 0), running on (9, 0)",
    ]
    # on a machine without a GPU: "running on none", not "running on None"
    cpu = HardwareFingerprint.from_hardware(make_hardware())
    assert h100.differences(cpu) == [
        "device_kind: proven on 'cuda', running on 'cpu'",
        "gpu_name: proven on 'NVIDIA H100 80GB HBM3', running on none",
        "capability: proven on (9, 0), running on none",
    ]


BUNDLED = sorted(p for p in PROFILES.glob("*.json") if p.name != "profile.schema.json")


def test_profiles_are_bundled() -> None:
    assert len(BUNDLED) >= 3


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_bundled_profiles_are_valid(path: Path) -> None:
    with (
        warnings.catch_warnings(),
        pytest.warns(UnprovenProfileWarning, match="Hand-written example"),
    ):
        warnings.simplefilter("ignore", HardwareMismatchWarning)  # proven elsewhere
        profile = load_profile(path)
    assert profile.schema_version == SCHEMA_VERSION
    assert profile.model_dump_json(indent=2) + "\n" == path.read_text(), "not canonical"


def test_schema_file_is_fresh() -> None:
    on_disk = json.loads((PROFILES / "profile.schema.json").read_text())
    assert on_disk == published_schema(), (
        "profiles/profile.schema.json is stale: "
        "run `autoprec schema > profiles/profile.schema.json`"
    )


def test_the_schema_allows_what_a_profile_writes_for_non_finite_floats() -> None:
    """A profile tuned with clip_grad_norm=inf (measure only) holds "Infinity", which the
    published schema refused (only a number): found by a hunt."""
    clip = published_schema()["$defs"]["RecipeSummary"]["properties"]["clip_grad_norm"]
    allowed = json.dumps(clip)
    assert '"Infinity"' in allowed and '"type": "number"' in allowed


def test_apply_returns_a_plan() -> None:
    model, _ = tiny_gpt.make_model()
    import torch

    plan = _profile(mode="amp_bf16").apply(
        model, torch.optim.AdamW(model.parameters()), grad_accumulation_steps=2
    )
    assert isinstance(plan, autoprec.PrecisionPlan) and plan.grad_accumulation_steps == 2


def _tuned_for_tiny_gpt(**recipe: object) -> Profile:
    from autoprec.recipe import TrainingRecipe

    model, _ = tiny_gpt.make_model()
    return profile_for(
        ModeSpec(mode="bf16_pure", keep_fp32=("ln_f", "blocks.*.ln_*")),
        model_layers=scan_model(model),
        recipe=TrainingRecipe(**recipe).summary(model),  # type: ignore[arg-type]
    )


def test_applying_to_another_model_warns_and_strict_refuses() -> None:
    import torch
    from torch import nn

    profile = _tuned_for_tiny_gpt()
    mlp = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    with pytest.warns(ModelMismatchWarning) as caught:
        profile.apply(mlp, torch.optim.AdamW(mlp.parameters(), lr=3e-4))
    message = str(caught[0].message)
    assert "class: proven on TinyGPT, applied to Sequential" in message
    assert "keep_fp32 patterns match no module: ln_f, blocks.*.ln_*" in message
    other = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    with pytest.raises(ProfileError, match="proven for another model"):
        profile.apply(other, torch.optim.AdamW(other.parameters(), lr=3e-4), strict=True)
    assert all(p.dtype == torch.float32 for p in other.parameters())  # refused before converting
    model, _ = tiny_gpt.make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own model and recipe: no warning
        profile.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4), strict=True)


def test_an_fp8_skip_pattern_that_matches_nothing_is_said() -> None:
    """Found by a hunt: an fp8_skip pattern that matched nothing was silent, and the layer it
    meant ran in FP8; only keep_fp32 patterns were checked."""
    from autoprec.profile import profile_for

    model, _ = tiny_gpt.make_model()
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all", fp8_skip=("lm_hed",))
    with pytest.warns(ModelMismatchWarning, match="fp8_skip patterns match no module: lm_hed"):
        plan = profile_for(spec).apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    assert plan.spec.fp8_skip == ()  # said, and left out: prepare() refuses it from a user


def test_a_pattern_naming_a_second_name_is_said_as_such() -> None:
    """Found by a hunt: a profile's keep_fp32 pattern naming a module by its second name was
    reported as "match no module", a typo, where it names the module another way."""
    from autoprec.profile import profile_for

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model.alias = model[0]
    with pytest.warns(ModelMismatchWarning, match=r"'alias', a second name of the module '0'"):
        profile_for(ModeSpec(mode="amp_bf16", keep_fp32=("alias",))).check_model(
            model, strict=False
        )


# dynamo reads .grad of the non-leaf tensors a graph break hands to the resumed frame
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_compiled_wrapper_is_converted_inside_and_stays_the_model_to_call() -> None:
    # apply() matched keep_fp32 against "_orig_mod.*" names: kept LayerNorms were cast to bf16,
    # with a ModelMismatchWarning that the profile was proven on another model
    profile = _tuned_for_tiny_gpt()
    model, tokens = tiny_gpt.make_model()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=3e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = profile.apply(compiled, optimizer, strict=True)
    assert plan.model is compiled
    assert model.ln_f.weight.dtype == model.blocks[0].ln_1.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    loss = plan.model(tokens[:, :-1], tokens[:, 1:])
    plan.step(loss.float())
    assert torch.isfinite(loss) and model.ln_f.weight.dtype == torch.float32
    # a profile proven compiled does not compile the user's compiled model a second time
    model, _ = tiny_gpt.make_model()
    compiled = torch.compile(model, backend="eager")
    spec = ModeSpec(mode="amp_bf16", compile=True)
    plan = profile_for(spec).apply(compiled, torch.optim.AdamW(compiled.parameters()))
    assert plan.model is compiled and "forward" not in vars(model)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (  # AttributeError: 'AdamW' object has no attribute 'named_modules'
            lambda profile, model, optimizer: profile.apply(optimizer, model),
            TypeError,
            r"model must be a torch\.nn\.Module but got AdamW \(the arguments are swapped\?\)",
        ),
        (
            lambda profile, model, optimizer: profile.apply(model, None),
            TypeError,
            r"optimizer must be a torch\.optim\.Optimizer but got NoneType",
        ),
        (  # TypeError: '<' not supported between instances of 'int' and 'str'
            lambda profile, model, optimizer: profile.apply(
                model, optimizer, clip_grad_norm="Recipe"
            ),
            TypeError,
            r'in apply\(\), "recipe" for the tuned recipe\'s\) but got \'Recipe\'',
        ),
        (
            lambda profile, model, optimizer: profile.apply(
                model, optimizer, grad_accumulation_steps="4"
            ),
            TypeError,
            "grad_accumulation_steps must be a whole number",
        ),
    ],
)
def test_apply_refuses_arguments_of_the_wrong_kind_before_converting(
    call, error: type, message: str
) -> None:
    profile = _tuned_for_tiny_gpt()
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with pytest.raises(error, match=message):
        call(profile, model, optimizer)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_apply_takes_accumulation_and_clipping_from_the_tuned_recipe() -> None:
    import torch

    profile = _tuned_for_tiny_gpt(grad_accumulation_steps=4, clip_grad_norm=1.0)
    assert profile.recipe is not None and profile.recipe.grad_accumulation_steps == 4
    loaded = Profile.model_validate_json(profile.model_dump_json())
    model, _ = tiny_gpt.make_model()
    plan = loaded.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    assert (plan.grad_accumulation_steps, plan.clip_grad_norm) == (4, 1.0)
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with pytest.warns(
        RecipeMismatchWarning, match="grad_accumulation_steps: proven at 4, applied with 1"
    ) as caught:
        plan = loaded.apply(model, optimizer, grad_accumulation_steps=1)
    assert plan.grad_accumulation_steps == 1
    # the warning names the line that called apply() (it named its caller's caller)
    assert caught[0].filename == __file__
    # None is no clipping (it meant "the recipe's", so no clipping could not be asked for)
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with pytest.warns(
        RecipeMismatchWarning, match=r"clip_grad_norm: proven at 1\.0, applied with None"
    ):
        plan = loaded.apply(model, optimizer, clip_grad_norm=None)
    assert plan.clip_grad_norm is None


def test_under_a_scheduler_apply_compares_the_learning_rates_the_schedule_reaches() -> None:
    import torch
    from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, OneCycleLR

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> OneCycleLR:
        return OneCycleLR(optimizer, 3e-3, total_steps=total_steps)

    profile = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=one_cycle,
        total_steps=2000,
    )
    profile = Profile.model_validate_json(profile.model_dump_json())  # as loaded from a file
    # OneCycleLR sets the lr and beta1 itself: the optimizer's own lr is not the run's
    for lr in (1e-3, 5e-2):
        model, _ = tiny_gpt.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            profile.apply(model, optimizer, one_cycle(optimizer, 2000), strict=True)
    others = [
        (lambda o: OneCycleLR(o, 3e-4, total_steps=2000), "the applied schedule reaches lr 0.0003"),
        (
            lambda o: OneCycleLR(o, 3e-3, total_steps=2000, cycle_momentum=False),
            "reaches lr 0.003 (momentum/β1 0.9),",  # AdamW's own beta1 against the cycled one
        ),
        (lambda o: OneCycleLR(o, 3e-3, total_steps=500), "could not be stepped on a copy"),
    ]
    for make_scheduler, difference in others:
        model, _ = tiny_gpt.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with pytest.warns(RecipeMismatchWarning) as caught:
            profile.apply(model, optimizer, make_scheduler(optimizer))
        message = str(caught[0].message)
        assert "learning rates: proven at lr 0.003 (momentum/β1 0.85)" in message
        assert difference in message, message
    # a cosine run: the same schedule built before apply() matches, a constant profile does not
    cosine = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=lambda optimizer: CosineAnnealingLR(optimizer, T_max=2000),
        total_steps=2000,
    )
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cosine.apply(model, optimizer, CosineAnnealingLR(optimizer, T_max=2000), strict=True)
    # a schedule that leaves the momentum alone leaves it to the group's comparison
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.999))
    with pytest.warns(RecipeMismatchWarning, match=r"betas: proven at \(0\.9, 0\.999\)"):
        cosine.apply(model, optimizer, CosineAnnealingLR(optimizer, T_max=2000))
    constant = _tuned_for_tiny_gpt(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(RecipeMismatchWarning, match="schedule: proven without one .*LambdaLR"):
        constant.apply(model, optimizer, LambdaLR(optimizer, lambda step: 0.5**step))


def test_a_profile_whose_floor_an_earlier_rule_chose_matches_its_own_schedule() -> None:
    """Found by a hunt: every profile written before 2026-11-28 took its floor one step
    earlier (step 179 of a 200-step cosine, today 180), and applied with its own optimizer
    and schedule warned of a mismatch (refused under strict). The proven lrs at the proven
    steps are the applied schedule's: it matches; another schedule still does not."""
    import math

    import torch
    from torch.optim.lr_scheduler import LambdaLR

    def cosine(optimizer: torch.optim.Optimizer, floor: float = 0.0) -> LambdaLR:
        return LambdaLR(
            optimizer, lambda s: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * s / 200))
        )

    profile = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=cosine,
        total_steps=200,
    )
    assert profile.recipe is not None
    peak, floor = profile.recipe.lr_points
    assert floor.schedule_step == 180
    earlier = 1e-3 * 0.5 * (1 + math.cos(math.pi * 179 / 200))  # the old rule's floor
    old_floor = floor.model_copy(update={"schedule_step": 179, "lrs": (earlier,)})
    recipe = profile.recipe.model_copy(update={"lr_points": (peak, old_floor)})
    old = Profile.model_validate_json(
        profile.model_copy(update={"recipe": recipe}).model_dump_json()
    )
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old.apply(model, optimizer, cosine(optimizer), strict=True)
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(RecipeMismatchWarning, match="the applied schedule reaches"):
        old.apply(model, optimizer, cosine(optimizer, floor=0.1))


def test_a_schedule_cycling_a_momentum_the_proven_one_left_alone_still_differs() -> None:
    """Found by a review: the fallback for profiles whose floor an earlier rule chose
    compared lrs at the proven steps and dropped the momenta the proven points did not carry:
    OneCycleLR's default cycle_momentum, applied to a recipe proven without it, matched."""
    import torch

    from autoprec.recipe import TrainingRecipe
    from autoprec.recipe_match import recipe_differences

    model = torch.nn.Linear(4, 4)

    def sgd(params: object) -> torch.optim.SGD:
        return torch.optim.SGD(params, lr=0.1, momentum=0.95)  # type: ignore[arg-type]

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int, **options: object) -> object:
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=0.1,
            total_steps=total_steps,
            **options,  # type: ignore[arg-type]
        )

    proven = TrainingRecipe(
        optimizer=sgd,
        scheduler=lambda o, total_steps: one_cycle(o, total_steps, cycle_momentum=False),
        total_steps=200,
    ).summary(model)
    optimizer = sgd(model.parameters())
    differences = recipe_differences(
        proven, optimizer, one_cycle(optimizer, 200), grad_accumulation_steps=1, clip_grad_norm=None
    )
    assert (
        differences and "the applied schedule reaches lr 0.1 (momentum/β1 0.85)" in (differences[0])
    )


def test_a_scheduled_profile_applied_without_a_schedule_says_so() -> None:
    """Found by a hunt: without a scheduler, apply() compared the optimizer's lr with the proven
    optimizer's constructor lr, which a OneCycleLR run never trains at. A constant lr 100x the
    proven peak passed; one exactly at the peak was warned about."""
    from torch.optim.lr_scheduler import OneCycleLR

    profile = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        scheduler=lambda optimizer: OneCycleLR(optimizer, 1e-4, total_steps=1000),
        total_steps=1000,
    )
    for lr in (1e-2, 1e-4):
        model, _ = tiny_gpt.make_model()
        with pytest.warns(RecipeMismatchWarning) as caught:
            profile.apply(model, torch.optim.AdamW(model.parameters(), lr=lr))
        message = str(caught[0].message)
        assert "schedule: proven with" in message and "applied without one" in message
        assert "lr: proven at 0.01" not in message
    model, _ = tiny_gpt.make_model()  # a scheduler built on it before apply(): not this case
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    OneCycleLR(optimizer, 1e-4, total_steps=1000)
    with warnings.catch_warnings(record=True) as caught_all:
        warnings.simplefilter("always")
        profile.apply(model, optimizer)
    assert not any("applied without one" in str(w.message) for w in caught_all)


def test_a_scheduler_applied_mid_run_is_compared_from_where_it_stands() -> None:
    import torch
    from torch.optim.lr_scheduler import CosineAnnealingLR

    cosine = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=lambda optimizer: CosineAnnealingLR(optimizer, T_max=2000),
        total_steps=2000,
    )
    floor = cosine.recipe.lr_points[-1] if cosine.recipe is not None else None
    assert floor is not None and floor.role == "floor" and floor.schedule_step is not None

    def stepped(
        t_max: int, steps: int
    ) -> tuple[nn.Module, torch.optim.Optimizer, CosineAnnealingLR]:
        model, _ = tiny_gpt.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = CosineAnnealingLR(optimizer, T_max=t_max)
        for _ in range(steps):  # the run so far, in fp32, before switching to the profile
            optimizer.step()
            scheduler.step()
        return model, optimizer, scheduler

    # the proven schedule, switched to half-way (and past its floor): no warning, strict passes
    for steps in (1000, floor.schedule_step + 1):
        model, optimizer, scheduler = stepped(2000, steps)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cosine.apply(model, optimizer, scheduler, strict=True)
    # another schedule half-way: its floor is not the proven one
    model, optimizer, scheduler = stepped(4000, 1000)
    with pytest.warns(RecipeMismatchWarning, match="the applied schedule reaches lr 0.000") as w:
        cosine.apply(model, optimizer, scheduler)
    assert f"at step {floor.schedule_step} of 2000" in str(w[0].message)
    # a run already past the proven length
    model, optimizer, scheduler = stepped(2000, 2500)
    with pytest.warns(RecipeMismatchWarning, match="at step 2500, past the proven run's 2000"):
        cosine.apply(model, optimizer, scheduler)


def test_apply_refuses_a_total_steps_that_is_not_a_run_length() -> None:
    """Found by a hunt: total_steps="200" (from a config file) raised a bare TypeError, 0 and -5
    were blamed on the scheduler, and one given without a scheduler was dropped unsaid."""
    profile = _profile(mode="amp_bf16")
    for wrong in ("200", 0, -5, 2.5, True):
        model, _ = tiny_gpt.make_model()
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match=r"total_steps must be a positive int .* but got"):
            profile.apply(model, optimizer, total_steps=wrong)  # type: ignore[arg-type]
    model, _ = tiny_gpt.make_model()
    with pytest.warns(RecipeMismatchWarning, match="no scheduler was passed"):
        profile.apply(model, torch.optim.AdamW(model.parameters()), total_steps=20000)


def test_a_non_finite_group_option_matches_itself_after_a_file_round_trip() -> None:
    """Prodigy's growth_rate=inf is written "Infinity" and read back as that string: apply()
    of the loaded profile with the very optimizer warned "proven at Infinity, applied with
    inf", and strict=True refused it; a NaN option never matched (found by a hunt)."""
    from autoprec.recipe_match import _group_differences

    proven = ({"lr": 1e-3, "growth_rate": "Infinity", "d_coef": math.nan},)
    applied = [{"lr": 1e-3, "growth_rate": math.inf, "d_coef": math.nan}]
    assert _group_differences(proven, applied, set()) == []
    applied[0]["growth_rate"] = 10.0
    assert _group_differences(proven, applied, set()) == [
        "growth_rate: proven at Infinity, applied with 10"
    ]


def test_a_profile_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """An editor's UTF-8 byte-order mark was called "not valid JSON ... it may be truncated.
    Re-run autoprec tune", throwing the edit away (found by a hunt)."""
    path = tmp_path / "edited.json"
    _profile(mode="amp_bf16").save(path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_profile(path).spec.mode == "amp_bf16"


def test_apply_compares_the_schedule_over_the_runs_own_length() -> None:
    """Found by a hunt: the schedule was stepped through the proven run's length only, so a run
    10x longer (a trainer's max_steps), ending near lr 0 against the proven floor, passed
    unnamed. apply(total_steps=...) steps it through the run's own length and says it."""
    import torch
    from torch.optim.lr_scheduler import CosineAnnealingLR

    def cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> CosineAnnealingLR:
        return CosineAnnealingLR(optimizer, T_max=total_steps)

    profile = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=cosine,
        total_steps=200,
    )
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the proven length: nothing to say
        profile.apply(model, optimizer, cosine(optimizer, 200), total_steps=200)
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # a schedule built for 200 steps run for 2000: it cycles back up, the run's own floor moves
    with pytest.warns(
        RecipeMismatchWarning, match="total_steps: proven over 200, applied over 2000"
    ):
        profile.apply(model, optimizer, cosine(optimizer, 200), total_steps=2000)


def _small_model() -> nn.Module:
    import torch

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _proven_under(scheduler: Any, lr: float) -> Profile:
    """A bf16_sr profile proven under AdamW at ``lr`` and ``scheduler`` over 100 steps (no
    trial run: the recipe's summary alone)."""
    import torch

    from autoprec.layers import scan_model
    from autoprec.profile import profile_for
    from autoprec.recipe import TrainingRecipe

    model = _small_model()
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        scheduler=scheduler,
        total_steps=100,
    )
    return profile_for(
        ModeSpec(mode="bf16_sr"), recipe=recipe.summary(model), model_layers=scan_model(model)
    )


def test_a_chained_scheduler_applied_mid_run_is_compared_from_where_it_stands() -> None:
    """Found by a hunt: a ChainedScheduler keeps no last_epoch of its own, so the proven run
    resumed at step 40 was compared from step 0 and strict=True refused it."""
    import torch
    from torch.optim import lr_scheduler

    def chained(optimizer: torch.optim.Optimizer) -> lr_scheduler.ChainedScheduler:
        warm = lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=10)
        return lr_scheduler.ChainedScheduler([warm, lr_scheduler.ExponentialLR(optimizer, 0.97)])

    profile = _proven_under(chained, lr=1e-3)
    model = _small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = chained(optimizer)
    for _ in range(40):
        optimizer.step()
        scheduler.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeMismatchWarning)
        profile.apply(model, optimizer, scheduler, strict=True)


def test_a_constant_scheduled_momentum_matches_itself_and_reading_a_schedule_copies_no_state() -> (
    None
):
    """Found by a hunt: OneCycleLR with a constant momentum of 0.8 (AdamW's own beta1 0.9) was
    recorded with it, but apply() kept applied momenta only when they varied, so the proven
    recipe mismatched itself; and reading the schedule deep-copied the optimizer's state (a
    mid-run switch's Adam moments, doubled on their device)."""
    import torch
    from torch.optim import lr_scheduler

    from autoprec import recipe_match

    def one_cycle(optimizer: torch.optim.Optimizer) -> lr_scheduler.OneCycleLR:
        return lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-2, total_steps=100, base_momentum=0.8, max_momentum=0.8
        )

    profile = _proven_under(one_cycle, lr=1e-2)
    assert profile.recipe is not None
    assert any(point.momenta is not None for point in profile.recipe.lr_points)
    model = _small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # Adam moments to copy, or not
    copied: list[int] = []
    deepcopy = recipe_match.copy.deepcopy

    def counting(value: object, memo: dict | None = None) -> object:
        result = deepcopy(value, memo)
        if isinstance(result, tuple) and isinstance(result[0], torch.optim.Optimizer):
            copied.append(sum(len(state) for state in result[0].state.values()))
        return result

    recipe_match.copy.deepcopy = counting  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecipeMismatchWarning)
            profile.apply(model, optimizer, one_cycle(optimizer), strict=True)
    finally:
        recipe_match.copy.deepcopy = deepcopy  # type: ignore[assignment]
    assert copied == [0]


def test_applying_under_another_recipe_warns_and_strict_refuses() -> None:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    profile = _tuned_for_tiny_gpt(
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    )
    profile = Profile.model_validate_json(profile.model_dump_json())  # as loaded from a file
    cases = [
        (
            lambda p: torch.optim.AdamW(p, lr=3e-5, betas=(0.9, 0.95)),
            "lr: proven at 0.003, applied with 3e-05",
        ),
        (
            lambda p: torch.optim.AdamW(p, lr=3e-3),
            "betas: proven at (0.9, 0.95), applied with (0.9, 0.999)",
        ),
        (
            lambda p: torch.optim.SGD(p, lr=3e-3),
            "optimizer: proven with torch.optim.adamw:AdamW, applied with torch.optim.sgd:SGD",
        ),
    ]
    for make_optimizer, difference in cases:
        model, _ = tiny_gpt.make_model()
        with pytest.warns(RecipeMismatchWarning) as caught:
            profile.apply(model, make_optimizer(model.parameters()))
        assert difference in str(caught[0].message)
        assert "proven under another training recipe" in str(caught[0].message)
    model, _ = tiny_gpt.make_model()
    with pytest.raises(ProfileError, match=r"lr: proven at 0\.003"):
        profile.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3), strict=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before converting
    model, _ = tiny_gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    LambdaLR(optimizer, lambda step: min(1.0, step / 100))  # lr is 0 until it steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same recipe: kernel flags do not count, and the
        profile.apply(model, optimizer, strict=True)  # lr is read from initial_lr


def test_version_1_profiles_still_load(tmp_path: Path) -> None:
    data = json.loads((PROFILES / "example-cpu-amp_bf16.json").read_text())
    data["schema_version"] = 1
    del data["recipe"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HardwareMismatchWarning)
        warnings.simplefilter("ignore", UnprovenProfileWarning)  # a hand-written example
        assert load_profile(path).recipe is None


@pytest.mark.parametrize("version", [0, -1, "1", True, None, 1.5])
def test_schema_versions_below_1_or_not_integers_are_refused(
    tmp_path: Path, version: object
) -> None:
    data = json.loads((PROFILES / "example-cpu-amp_bf16.json").read_text())
    data["schema_version"] = version
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="integer version from 1 to"):
        load_profile(path)


def test_an_unknown_field_names_the_autoprec_that_wrote_it(tmp_path: Path) -> None:
    data = json.loads((PROFILES / "example-cpu-amp_bf16.json").read_text())
    data["autoprec_version"] = "9.1.0"
    data["calibration"] = {"new": True}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"written by autoprec 9\.1\.0; upgrade autoprec"):
        load_profile(path)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_files_respect_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        path = _profile(mode="amp_bf16").save(tmp_path / "p.json")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == mode


def test_save_through_a_link_writes_its_target_and_refuses_what_is_not_a_file(
    tmp_path: Path,
) -> None:
    """A link was replaced by a regular file; /dev/null (as root) by a profile."""
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    _profile(mode="amp_bf16").save(link)
    assert link.is_symlink() and load_profile(real).spec.mode == "amp_bf16"
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match=r"pipe\.json' is a pipe, not a file.*Give a file name"):
        _profile(mode="fp32").save(pipe)
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe.json", "real.json"]


def test_a_read_only_profile_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt: a chmod 444 profile was replaced (a rename needs only the folder's
    permission) and the CLI said "wrote". (os.access is faked: these tests run as root, for
    whom every file is writable.)"""
    from autoprec._files import check_writable

    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0o444)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "locked.json")
    with pytest.raises(ValueError, match=r"locked\.json' is read-only: autoprec will not"):
        _profile(mode="amp_bf16").save(locked)
    with pytest.raises(ValueError, match=r"is read-only"):
        check_writable(locked)
    assert locked.read_text() == "{}"
    _profile(mode="amp_bf16").save(tmp_path / "open.json")  # a writable file is replaced


def test_check_writable_proves_a_file_can_be_made_and_leaves_nothing(tmp_path: Path) -> None:
    """A long run's output path is tried before the run: a probe file in the nearest folder
    that exists, removed; no folder is made for a path whose folders do not exist yet."""
    from autoprec._files import check_writable

    deep = tmp_path / "a" / "b" / "p.json"
    assert check_writable(deep) == deep
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"file' is a file, not a folder"):
        check_writable(tmp_path / "file" / "p.json")
    with pytest.raises(ValueError, match=r"making a file in '/proc' fails"):
        check_writable("/proc/p.json")


def test_the_layer_mix_digest_reads_as_before_the_recurrent_kind() -> None:
    # a new layer kind changed every model's digest: every profile saved before warned
    # "layer mix differs" on the model it was proven for (values from before that kind)
    tiny = ModelFingerprint.from_layers(scan_model(*tiny_gpt.make_model()))
    gru = ModelFingerprint.from_layers(
        scan_model(nn.GRU(8, 16, batch_first=True), torch.randn(2, 3, 8))
    )
    assert (tiny.layer_mix_digest, gru.layer_mix_digest) == ("2ef6a754246b8379", "75d417e927e4225f")


def test_byte_counts_below_a_gibibyte_print_in_mebibytes() -> None:
    # a 17 MiB peak printed "peak 0.0 GiB" in the profile table on an H200
    from autoprec.display import format_bytes

    assert format_bytes(int(16.93 * 2**20)) == "16.9 MiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(None) == "?"
    # as printed (a hunt): 1 GiB less 16 KiB read "1024.0 MiB"
    assert format_bytes(2**30 - 2**14) == "1.0 GiB"
    assert format_bytes(2**30 - 2**17) == "1023.9 MiB"


def test_files_beside_a_profile_keep_a_dotted_name() -> None:
    """--out runs/v1.2 wrote runs/v1.trials.json and study 'v1', which runs/v1.3 then shared
    (refused as another run's study)."""
    from pathlib import Path

    from autoprec.cli import beside_profile, profile_stem

    assert beside_profile(Path("runs/v1.2"), ".trials.json") == Path("runs/v1.2.trials.json")
    assert beside_profile(Path("runs/x.json"), ".study.db") == Path("runs/x.study.db")
    assert (profile_stem(Path("runs/llama-3.1")), profile_stem(Path("x.json"))) == (
        "llama-3.1",
        "x",
    )


def test_show_names_the_states_a_pure_bf16_mode_keeps() -> None:
    # a bf16_kahan profile showed "optimizer states 32-bit" while its Adam moments are bf16
    from autoprec.display import optimizer_states

    assert optimizer_states(ModeSpec(mode="bf16_kahan")) == (
        "bf16, rounded to nearest (as the weights); Adam's second moment fp32"
    )
    assert (
        optimizer_states(ModeSpec(mode="bf16_pure")) == "bf16, rounded to nearest (as the weights)"
    )
    assert optimizer_states(ModeSpec(mode="bf16_sr")).startswith("bf16, stochastically")
    assert optimizer_states(ModeSpec(mode="bf16_pure", optimizer_bits=8)).startswith("8-bit")
    sr_8bit = optimizer_states(ModeSpec(mode="bf16_sr", optimizer_bits=8))
    assert sr_8bit == "8-bit (bitsandbytes' format, in autoprec's stochastic-rounding optimizer)"
    assert optimizer_states(ModeSpec(mode="amp_bf16")) == "32-bit"


@pytest.mark.filterwarnings("ignore::autoprec.errors.OptimizerRebuiltWarning")
def test_a_clip_at_plan_step_is_compared_with_the_proven_recipe() -> None:
    """The README's loop clips at plan.step(loss, clip_grad_norm=1.0); a profile tuned without
    clipping never said so (apply() compares only its own arguments)."""
    import warnings

    import torch

    profile = _tuned_for_tiny_gpt()  # no clipping
    model, tokens = tiny_gpt.make_model()
    plan = profile.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))

    def step(clip: float) -> None:
        with plan.autocast():
            loss = plan.model(tokens, tokens)
        plan.step(loss, clip_grad_norm=clip)

    with pytest.warns(
        RecipeMismatchWarning, match=r"proven at None \(no clipping\), applied with 1.0"
    ) as caught:
        step(1.0)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeMismatchWarning)
        step(1.0)  # once
    clipped = _tuned_for_tiny_gpt(clip_grad_norm=1.0)
    model, tokens = tiny_gpt.make_model()
    plan = clipped.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeMismatchWarning)
        step(1.0)  # the proven clip: nothing to say
    # found by a hunt: the first matching step turned the comparison off for good, so a
    # later step with another clip said nothing
    with pytest.warns(RecipeMismatchWarning, match=r"proven at 1\.0, applied with 5\.0"):
        step(5.0)
    # math.inf measures only: no clipping, as the profile without clipping was proven
    model, tokens = tiny_gpt.make_model()
    plan = profile.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeMismatchWarning)
        step(math.inf)
    # and apply() reads None and inf alike (found by a hunt: strict=True refused a profile
    # proven at inf, measuring only, applied with None)
    measured = _tuned_for_tiny_gpt(clip_grad_norm=math.inf)
    model, tokens = tiny_gpt.make_model()
    measured.apply(
        model, torch.optim.AdamW(model.parameters(), lr=3e-4), clip_grad_norm=None, strict=True
    )


def test_a_cpu_proven_amp_fp16_profile_is_not_exported_to_flags_that_train_otherwise() -> None:
    """Found by a hunt: on a CPU, Lightning's "16-mixed" runs bf16 and Accelerate's and the HF
    Trainer's fp16 run fp32; the exports promise nothing approximated silently."""
    from autoprec.errors import ExportError

    profile = _profile(mode="amp_fp16")
    assert profile.hardware.device_kind == "cpu"
    for export, said in [
        (profile.to_lightning, "AutoprecPrecision"),
        (profile.to_accelerate, r"profile.apply"),
        (profile.to_hf_training_args, "apply_profile"),
    ]:
        with pytest.raises(ExportError, match=f"proven on a CPU.*{said}"):
            export()


def test_applys_optimizer_warnings_point_at_the_line_calling_apply() -> None:
    """The rebuilt-optimizer and outside-optimizer warnings name the caller's line, as the
    profile's own warnings do: the second pointed at profile.py's apply() (stacklevel counted
    from prepare(), one frame short)."""
    from autoprec.errors import OptimizerRebuiltWarning, OutsideOptimizerWarning

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model[1].parameters(), lr=1e-3)  # model[0]: another's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _profile(mode="bf16_sr").apply(model, optimizer)
    categories = {warning.category: warning.filename for warning in caught}
    assert categories.keys() >= {OptimizerRebuiltWarning, OutsideOptimizerWarning}, caught
    assert categories[OptimizerRebuiltWarning] == __file__
    assert categories[OutsideOptimizerWarning] == __file__


def test_a_warning_points_at_the_first_line_outside_autoprec_however_deep_it_is_raised() -> None:
    """warn_caller walks past every autoprec frame: called here it names this line; raised
    under apply() -> check_model() -> _refuse_or_warn() it names the line calling apply()."""
    import sys

    from torch import nn

    from autoprec._warnings import warn_caller

    profile = _tuned_for_tiny_gpt()
    mlp = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_caller("here", UserWarning)
        line = sys._getframe().f_lineno - 1
        profile.apply(mlp, torch.optim.AdamW(mlp.parameters(), lr=3e-4))
        apply_line = sys._getframe().f_lineno - 1
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    mismatch = [w for w in caught if issubclass(w.category, ModelMismatchWarning)]
    assert mismatch, caught
    assert all((w.filename, w.lineno) == (__file__, apply_line) for w in mismatch)


def test_json_nested_past_the_recursion_limit_or_a_huge_number_is_a_profile_error(
    tmp_path: Path,
) -> None:
    """Found by a hunt: RecursionError (the CLI's show and report printed a traceback) and a
    bare ValueError about 4300 digits that named no file."""
    deep, huge = tmp_path / "deep.json", tmp_path / "huge.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    huge.write_text('{"schema_version": ' + "9" * 5001 + "}")
    for path in (deep, huge):
        with pytest.raises(ProfileError, match=rf"{path.name}' is JSON autoprec cannot read"):
            load_profile(path)
