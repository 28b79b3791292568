"""Exports: exact equivalents or a clear refusal. Checked against the real libraries where
they are installed (accelerate, transformers, torch FSDP2)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from autoprec._imports import is_installed
from autoprec.errors import ExportError, MissingBackendError
from autoprec.profile import Profile, profile_for
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from tests.conftest import make_hardware


def _profile(**spec: object):
    return profile_for(ModeSpec(**spec))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "lightning", "accelerate", "hf"),
    [
        ("fp32", "32-true", "no", {"bf16": False, "fp16": False, "tf32": False}),
        ("amp_bf16", "bf16-mixed", "bf16", {"bf16": True, "fp16": False}),
        ("amp_fp16", "16-mixed", "fp16", {"bf16": False, "fp16": True}),
    ],
)
def test_expressible_modes(mode: str, lightning: str, accelerate: str, hf: dict) -> None:
    # proven on a GPU: a CPU-proven amp_fp16 is refused (its flags train otherwise there)
    profile = profile_for(ModeSpec(mode=mode), hardware=make_hardware("A100"))  # type: ignore[arg-type]
    assert profile.to_lightning() == {"precision": lightning}
    assert profile.to_accelerate() == {"mixed_precision": accelerate}
    assert profile.to_hf_training_args() == hf


def test_bf16_pure_is_lightnings_bf16_true() -> None:
    assert _profile(mode="bf16_pure").to_lightning() == {"precision": "bf16-true"}


def test_bf16_pure_of_a_model_with_complex_weights_is_not_bf16_true() -> None:
    """bf16-true's module.to(bfloat16) drops a complex weight's imaginary part (torch only
    warns); autoprec's bf16_pure keeps it complex."""
    from autoprec.layers import scan_model

    class Spectral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.modes = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
            self.out = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out((x.to(torch.complex64) @ self.modes).real)

    model = Spectral()
    profile = profile_for(ModeSpec(mode="bf16_pure"), model_layers=scan_model(model))
    loaded = Profile.model_validate_json(profile.model_dump_json())
    with pytest.raises(ExportError, match=r"imaginary part .*found: modes.*AutoprecPrecision"):
        loaded.to_lightning()
    plain = profile_for(ModeSpec(mode="bf16_pure"), model_layers=scan_model(nn.Linear(4, 4)))
    assert plain.to_lightning() == {"precision": "bf16-true"}


def test_fp32_exports_of_a_model_with_convolutions_refuse_cudnns_tf32() -> None:
    """Lightning's 32-true, Accelerate's "no" and an fp32 FSDP2 policy leave cuDNN's TF32 at
    torch's default (on): a conv net's fp32 profile exported there ran its convolutions in
    TF32, where autoprec's fp32 turns it off."""
    from autoprec.layers import scan_model

    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(4))
    conv(torch.randn(1, 3, 8, 8))
    rnn = nn.GRU(4, 8)
    profile = profile_for(ModeSpec(mode="fp32"), model_layers=scan_model(conv))
    loaded = Profile.model_validate_json(profile.model_dump_json())
    assert loaded.model is not None and loaded.model.cudnn_kinds == ("conv",)
    for export in (loaded.to_lightning, loaded.to_accelerate, loaded.to_fsdp2):
        with pytest.raises(ExportError, match=r"convolutions would run in TF32.*allow_tf32 = Fa"):
            export()
    assert loaded.to_hf_training_args()["tf32"] is False  # the Trainer turns cuDNN's off too
    recurrent = profile_for(ModeSpec(mode="fp32"), model_layers=scan_model(rnn))
    with pytest.raises(ExportError, match=r"recurrent layers \(LSTM, GRU, RNN\) would run"):
        recurrent.to_lightning()
    amp = profile_for(ModeSpec(mode="amp_bf16"), model_layers=scan_model(conv))
    assert amp.to_lightning() == {"precision": "bf16-mixed"}  # autocast runs them in bf16
    linear = profile_for(ModeSpec(mode="fp32"), model_layers=scan_model(nn.Linear(4, 4)))
    assert linear.to_lightning() == {"precision": "32-true"}
    older = profile.model_dump(mode="json")
    del older["model"]["cudnn_kinds"]  # a profile written before the field: loads, exports
    assert Profile.model_validate(older).to_lightning() == {"precision": "32-true"}


def test_bf16_pure_proven_with_accumulation_is_not_bf16_true() -> None:
    """bf16-true sums micro-batches in bf16 .grad; autoprec's bf16_pure sums them in fp32."""
    recipe = TrainingRecipe(optimizer=lambda p: torch.optim.AdamW(p), grad_accumulation_steps=2)
    profile = profile_for(ModeSpec(mode="bf16_pure"), recipe=recipe.summary(nn.Linear(4, 2)))
    with pytest.raises(ExportError, match=r"proven with 2 micro-batches.*AutoprecPrecision"):
        profile.to_lightning()


@pytest.mark.parametrize(
    ("spec", "export", "message"),
    [
        (
            {"mode": "bf16_kahan"},
            "to_lightning",
            "Lightning has no precision setting for bf16_kahan",
        ),
        ({"mode": "tf32"}, "to_lightning", "no TF32 setting"),
        ({"mode": "fp8_te"}, "to_lightning", "keeps bf16 weights and TE's default recipe"),
        ({"mode": "bf16_sr"}, "to_accelerate", "no mixed_precision setting for bf16_sr"),
        ({"mode": "bf16_pure"}, "to_hf_training_args", "adamw_anyprecision"),
        ({"mode": "fp8_torchao"}, "to_hf_training_args", "has no FP8 flag"),
        (
            {"mode": "amp_fp16"},
            "to_fsdp2",
            r"param_dtype=torch\.float32.*dtype=torch\.float16\).*ShardedGradScaler",
        ),
        ({"mode": "amp_bf16"}, "to_fsdp2", r"norms, softmax and the loss .*torch\.autocast"),
        ({"mode": "fp32", "compile": True}, "to_fsdp2", "proven compiled"),
        ({"mode": "amp_bf16", "optimizer_bits": 8}, "to_lightning", "configure_optimizers"),
        (
            {"mode": "amp_bf16", "keep_fp32": ("lm_head",)},
            "to_accelerate",
            r"cannot keep modules \['lm_head'\] in fp32",
        ),
        ({"mode": "fp8_te", "fp8_recipe": "te_current"}, "to_accelerate", "no current-scaling"),
        ({"mode": "fp8_torchao", "emulate": True}, "to_accelerate", "emulates FP8"),
    ],
)
def test_inexpressible_modes_are_refused_clearly(spec: dict, export: str, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        getattr(_profile(**spec), export)()


def test_keep_fp32_can_be_dropped_on_request() -> None:
    profile = _profile(mode="amp_bf16", keep_fp32=("lm_head",))
    assert profile.to_lightning(ignore_keep_fp32=True) == {"precision": "bf16-mixed"}
    assert _profile(mode="fp32", keep_fp32=("x",)).to_accelerate() == {"mixed_precision": "no"}


def test_8bit_optimizer_in_hf_trainer() -> None:
    """The Trainer's 8-bit optimizer keeps nn.Embedding states in 32 bits (found by a hunt):
    refused unless the model has none."""
    profile = _profile(mode="amp_bf16", optimizer_bits=8)
    with pytest.raises(ExportError, match=r"keeps every nn\.Embedding weight's Adam states"):
        profile.to_hf_training_args()
    args = profile.to_hf_training_args(no_embeddings=True)
    assert args == {"bf16": True, "fp16": False, "optim": "adamw_bnb_8bit"}


def _proven_with(optimizer: Callable[..., torch.optim.Optimizer], **spec: object) -> Profile:
    model = nn.Sequential(nn.Linear(8, 8))
    recipe = TrainingRecipe(optimizer=optimizer).summary(model)
    return profile_for(ModeSpec(**spec), recipe=recipe)  # type: ignore[arg-type]


def test_8bit_exports_name_the_class_the_recipe_was_proven_with() -> None:
    sgd = _proven_with(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), mode="fp32", optimizer_bits=8
    )
    for export in ("to_lightning", "to_accelerate", "to_fsdp2"):
        with pytest.raises(ExportError, match=r"bitsandbytes\.optim\.SGD8bit"):
            getattr(sgd, export)()
    with pytest.raises(ExportError, match=r"proven with torch\.optim\.sgd:SGD .*SGD8bit"):
        sgd.to_hf_training_args()  # the Trainer's adamw_bnb_8bit would be another optimizer
    adam = _proven_with(lambda p: torch.optim.Adam(p), mode="fp32", optimizer_bits=8)
    with pytest.raises(ExportError, match=r"bitsandbytes\.optim\.Adam8bit "):
        adam.to_lightning()
    with pytest.raises(ExportError, match=r"proven with torch\.optim\.adam:Adam "):
        adam.to_hf_training_args()
    adamw = _proven_with(lambda p: torch.optim.AdamW(p), mode="amp_bf16", optimizer_bits=8)
    assert adamw.to_hf_training_args(no_embeddings=True)["optim"] == "adamw_bnb_8bit"
    with pytest.raises(ExportError, match=r"bitsandbytes\.optim\.AdamW8bit"):
        adamw.to_accelerate()
    with pytest.raises(ExportError, match="the bitsandbytes 8-bit class of your optimizer"):
        _profile(mode="fp32", optimizer_bits=8).to_lightning()  # no recipe recorded


def test_fsdp2_policy_is_accepted_by_torch() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(**_profile(mode="fp32").to_fsdp2())
    assert policy.param_dtype == torch.float32 and policy.reduce_dtype == torch.float32


def test_accelerate_fp8_te_without_transformer_engine() -> None:
    pytest.importorskip("accelerate")
    if is_installed("transformer_engine"):
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(MissingBackendError, match=r"pip install 'autoprec\[te\]'"):
        _profile(mode="fp8_te").to_accelerate()


def test_accelerate_fp8_recipes_are_complete() -> None:
    pytest.importorskip("accelerate")
    if not is_installed("transformer_engine"):
        pytest.skip("accelerate's TERecipeKwargs needs transformer_engine (not installed)")
    settings = _profile(mode="fp8_te", fp8_recipe="te_delayed_e4m3").to_accelerate()
    (handler,) = settings["kwargs_handlers"]
    assert settings["mixed_precision"] == "fp8"
    assert (
        handler.fp8_format,
        handler.amax_history_len,
        handler.amax_compute_algo,
        handler.margin,
    ) == ("E4M3", 1024, "max", 0)


def test_accelerate_refuses_a_te_field_it_would_not_hand_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a hunt: Accelerate hands TE only the TERecipeKwargs fields that differ from its
    own defaults, so amax_compute_algo='most_recent' (Accelerate's default, not TE's 'max') was
    dropped and TE ran 'max'."""
    pytest.importorskip("accelerate")
    import accelerate.utils.dataclasses as accelerate_dataclasses

    from autoprec.specs import TeDelayedScaling

    # TERecipeKwargs checks for TE when built; what it hands on does not need TE
    monkeypatch.setattr(accelerate_dataclasses, "is_transformer_engine_available", lambda: True)

    def exported(algo: str, history: int) -> dict:
        delayed = TeDelayedScaling(amax_compute_algo=algo, amax_history_len=history)  # type: ignore[arg-type]
        return _profile(mode="fp8_te", te_delayed_scaling=delayed).to_accelerate()

    (handler,) = exported("max", 16)["kwargs_handlers"]
    assert handler.to_kwargs()["amax_compute_algo"] == "max"
    for history in (1024, 16):
        with pytest.raises(ExportError, match=r"amax_compute_algo='most_recent' \(would run as"):
            exported("most_recent", history)


def test_accelerate_fp8_torchao() -> None:
    pytest.importorskip("accelerate")
    ao = _profile(mode="fp8_torchao", fp8_recipe="torchao_rowwise").to_accelerate()
    assert type(ao["kwargs_handlers"][0]).__name__ == "AORecipeKwargs"


def test_accelerator_trains_with_the_export() -> None:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, **_profile(mode="amp_bf16").to_accelerate())
    assert str(accelerator.mixed_precision) == "bf16"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.randn(64, 16)
    losses = []
    for _ in range(20):
        loss = model(data).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and seen[0] == torch.bfloat16


def test_hf_training_arguments_take_the_export(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, **_profile(mode="amp_bf16").to_hf_training_args()
    )
    assert args.bf16 is True and args.fp16 is False


@pytest.mark.parametrize(
    ("mode", "weights"),
    [("fp32", torch.float32), ("amp_bf16", torch.float32), ("bf16_pure", torch.bfloat16)],
)
def test_lightning_fabric_trains_with_the_export(mode: str, weights: torch.dtype) -> None:
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", devices=1, **_profile(mode=mode).to_lightning())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.randn(64, 16)
    losses = []
    for _ in range(20):
        loss = model(data).float().pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert next(model.parameters()).dtype == weights
    assert seen[0] == (torch.float32 if mode == "fp32" else torch.bfloat16)


def test_hf_trainer_trains_with_the_export(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (16, 16))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=4,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        **_profile(mode="amp_bf16").to_hf_training_args(),
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    output = trainer.train()
    assert output.global_step == 4
    assert args.bf16 is True  # (an 8-bit profile is refused for a model with embeddings)


def test_fsdp2_under_autocast_is_amp_bf16_and_its_bf16_policy_is_not(
    single_process_group: None,
) -> None:
    """The route amp_bf16's refusal gives (an fp32 policy under autocast) computes what the
    trials measured; the bf16 policy the export used to return computes the loss in bf16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 50))

    inputs, target = torch.randn(8, 16), torch.randint(0, 50, (8,))

    def loss_of(net: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(net(inputs), target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = loss_of(model())
    losses = []
    for policy, under_autocast in (
        (MixedPrecisionPolicy(**_profile(mode="fp32").to_fsdp2()), True),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), False),
    ):
        sharded = model()
        # on a CPU mesh: FSDP2's default mesh on a machine with a GPU would move it to CUDA
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
            loss = loss_of(sharded)
        loss.backward()
        assert all(
            p.grad is not None and p.grad.dtype == torch.float32 for p in sharded.parameters()
        )
        losses.append(loss)
    exact, bf16_policy = losses
    assert exact.dtype == torch.float32 and torch.equal(exact.detach(), autocast.detach())
    assert bf16_policy.dtype == torch.bfloat16  # the loss itself computed in bf16
    assert not torch.equal(bf16_policy.detach().float(), autocast.detach())


def test_exports_carry_compile_and_the_profiles_fp8_layers() -> None:
    compiled = {"mode": "amp_bf16", "compile": True}
    assert _profile(**compiled).to_hf_training_args()["torch_compile"] is True
    with pytest.raises(ExportError, match="no compile flag"):
        _profile(**compiled).to_lightning()
    pytest.importorskip("accelerate")
    assert _profile(**compiled).to_accelerate()["dynamo_backend"] == "inductor"
    fp32 = _profile(mode="fp32", compile=True)  # Accelerate would turn TF32 on
    with pytest.raises(ExportError, match="turns TF32 matmuls on"):
        fp32.to_accelerate()
    with pytest.raises(ExportError, match="turns TF32 matmuls on"):
        fp32.to_hf_training_args()
    assert _profile(mode="fp32").to_accelerate() == {"mixed_precision": "no"}
    ao = _profile(mode="fp8_torchao", fp8_skip=("head",), fp8_layers="all").to_accelerate()
    convert = ao["kwargs_handlers"][0].module_filter_func
    assert convert(torch.nn.Linear(64, 64), "body") and not convert(torch.nn.Linear(64, 64), "head")
    assert not convert(torch.nn.Linear(60, 64), "body")  # dims FP8 kernels cannot take


def test_lightnings_plugin_without_lightning_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a hunt: ``from autoprec.integrations.lightning import AutoprecPrecision``
    without Lightning raised a bare ``No module named 'lightning'``; the exports, which need
    no Lightning, still work."""
    import sys

    import autoprec.integrations
    from autoprec.integrations import lightning

    for name in [n for n in sys.modules if n.split(".")[0] == "lightning"] + ["lightning"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "autoprec.integrations.lightning_trainer", raising=False)
    monkeypatch.delattr(autoprec.integrations, "lightning_trainer", raising=False)
    with pytest.raises(MissingBackendError, match=r"AutoprecPrecision needs Lightning 2\.x"):
        lightning.AutoprecPrecision  # noqa: B018
    with pytest.raises(ImportError, match=r"pip install lightning"):  # the usual fallback
        from autoprec.integrations.lightning import tune_module  # noqa: F401
    assert _profile(mode="amp_bf16").to_lightning()["precision"] == "bf16-mixed"
