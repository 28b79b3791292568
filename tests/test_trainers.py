"""Tuning and training inside the trainers people use: Hugging Face Trainer, Lightning Trainer.

Real libraries (the ``integrations`` extra), tiny models, a few steps each.
"""

from __future__ import annotations

import copy
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoprec
from autoprec.errors import PrecisionSwitchWarning, RecipeMismatchWarning
from autoprec.profile import Profile
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning.pytorch")

from lightning.fabric.utilities.warnings import PossibleUserWarning  # noqa: E402

from autoprec.integrations.hf import apply_profile, trainer_recipe, tune_trainer  # noqa: E402
from autoprec.integrations.lightning import (  # noqa: E402
    AutoprecPrecision,
    module_recipe,
    tune_module,
)

SPECS = [
    ModeSpec(mode="amp_bf16"),
    ModeSpec(mode="bf16_kahan", keep_fp32=("lm_head",)),
    ModeSpec(mode="fp8_torchao", fp8_recipe="torchao_tensorwise", emulate=True, fp8_layers="all"),
]


def _gpt2_trainer(tmp_path: Path, **arguments: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    options = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    options.update(arguments)
    args = transformers.TrainingArguments(**options)
    return transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens]
    )


def _profile_for(spec: ModeSpec, tuned: Profile) -> Profile:
    return tuned.model_copy(update={"spec": spec})


@pytest.fixture(scope="module")
def hf_tuned(tmp_path_factory: pytest.TempPathFactory) -> Any:
    trainer = _gpt2_trainer(tmp_path_factory.mktemp("hf"))
    before = copy.deepcopy(trainer.model.state_dict())
    result = tune_trainer(trainer, budget_minutes=0.5, modes=["amp_bf16"], progress=False)
    return trainer, result, before


def test_tune_trainer_reads_the_trainers_recipe(hf_tuned: Any) -> None:
    trainer, result, before = hf_tuned
    recipe = result.recipe
    group = recipe.optimizer_groups[0]
    assert recipe.optimizer == "torch.optim.adamw:AdamW" and group["lr"] == 1e-3
    assert "cosine" in str(recipe.scheduler) and recipe.total_steps == 6
    assert recipe.grad_accumulation_steps == 2 and recipe.clip_grad_norm == 1.0
    assert {t.label for t in result.trials} == {"amp_bf16"}
    assert trainer.optimizer is None and trainer.lr_scheduler is None  # nothing left behind
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name])


def test_tune_trainer_uses_an_overridden_compute_loss(tmp_path: Path) -> None:
    class Doubled(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, **kwargs: Any) -> Any:
            return 2 * model(**inputs).loss

    plain = _gpt2_trainer(tmp_path)
    custom = Doubled(model=plain.model, args=plain.args, train_dataset=plain.train_dataset)
    assert "train_step" not in trainer_recipe(plain)  # the model's own loss: outputs compared
    recipe = trainer_recipe(custom)
    assert "train_step" in recipe
    # the logits the model returned to compute_loss are what the output check compares
    from autoprec.trial import run_trial

    result = run_trial(
        ModeSpec(mode="fp32"),
        plain.model,
        batches := list(plain.get_train_dataloader())[:2],
        recipe=TrainingRecipe(**recipe),
        steps=2,
        heldout=batches,
    )
    assert result.heldout_outputs and all(out is not None for out in result.heldout_outputs)
    assert result.heldout_outputs[0].shape[-1] == plain.model.config.vocab_size


def test_a_compute_loss_func_is_the_trials_loss(tmp_path: Path) -> None:
    # Trainer(compute_loss_func=...) was not read: trials trained on the model's own loss
    plain = _gpt2_trainer(tmp_path)
    own = transformers.Trainer(
        model=plain.model,
        args=plain.args,
        train_dataset=plain.train_dataset,
        compute_loss_func=lambda outputs, labels, num_items_in_batch=None: (
            outputs.logits.abs().mean()
        ),
    )
    assert "train_step" in trainer_recipe(own)


def test_tune_trainer_trains_with_checkpointing_and_neftune_as_train_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Trainer.train() switches both on before its first step; the model tune() trained had
    # neither (speed and memory of another loop, numerics without NEFTune's noise)
    trainer = _gpt2_trainer(tmp_path, neftune_noise_alpha=5.0, activation_checkpointing=True)
    seen: dict[str, Any] = {}

    def tune(model: Any, loader: Any, **options: Any) -> None:
        seen["checkpointing"] = model.is_activation_checkpointing
        seen["noise"] = getattr(model.get_input_embeddings(), "neftune_noise_alpha", None)

    monkeypatch.setattr("autoprec.tuning.tune", tune)
    tune_trainer(trainer, budget_minutes=0.1)
    assert seen == {"checkpointing": True, "noise": 5.0}
    embeddings = trainer.model.get_input_embeddings()  # and as it was afterwards
    assert not trainer.model.is_activation_checkpointing and not embeddings._forward_hooks
    assert not hasattr(embeddings, "neftune_noise_alpha")


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.label)
def test_apply_profile_trains_with_the_trainer(
    spec: ModeSpec, hf_tuned: Any, tmp_path: Path
) -> None:
    trainer = _gpt2_trainer(tmp_path)
    reference = _gpt2_trainer(tmp_path)  # the schedule an fp32 Trainer.train() ends at
    reference.train()
    dtypes: list[torch.dtype] = []
    block = trainer.model.transformer.h[0]
    block.mlp.c_fc.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    start = block.mlp.c_fc.weight.detach().float().clone()
    plan = apply_profile(trainer, _profile_for(spec, hf_tuned[1].profile))
    # pure bf16's fp32 sums of the 2 micro-batches live outside .grad: under DDP the Trainer's
    # no_sync() on the first reduced the last alone (found by a review); it synchronises each
    synchronises = type(trainer.accelerator.no_sync(model=trainer.model)).__name__ == "nullcontext"
    assert synchronises == (spec.mode == "bf16_kahan")
    output = trainer.train()
    assert trainer.state.global_step == 6 and torch.isfinite(torch.tensor(output.training_loss))
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(
        reference.lr_scheduler.get_last_lr()[0]
    )  # the scheduler drove the plan's optimizer
    assert not torch.equal(block.mlp.c_fc.weight.detach().float(), start)  # it trained
    assert dtypes and all(dtype == torch.bfloat16 for dtype in dtypes), dtypes  # the mode's
    if spec.mode == "fp8_torchao":  # GPT-2's one nn.Linear (lm_head) runs in FP8
        assert type(trainer.model.lm_head).__name__ == "Float8Linear"


class _ScheduleFreeLike(torch.optim.SGD):
    """schedulefree's protocol: train()/eval() switch the weights the optimizer exposes."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=1e-3)
        self.calls: list[str] = []

    def train(self) -> None:
        self.calls.append("train")

    def eval(self) -> None:
        self.calls.append("eval")


def test_the_trainers_optimizer_shows_train_and_eval_only_when_the_plans_has_them() -> None:
    """Found by a hunt: the Trainer calls optimizer.train()/.eval() for schedule-free
    optimizers; the wrapper hid them, so one never entered train mode."""
    from autoprec.integrations.hf import PlanOptimizer

    model = nn.Linear(4, 4)
    free = _ScheduleFreeLike(model.parameters())
    wrapped = PlanOptimizer(autoprec.prepare(ModeSpec(mode="fp32"), model, free))
    wrapped.train()
    wrapped.eval()
    assert free.calls == ["train", "eval"]
    plain = nn.Linear(4, 4)
    adamw = torch.optim.AdamW(plain.parameters())
    hidden = PlanOptimizer(autoprec.prepare(ModeSpec(mode="fp32"), plain, adamw))
    assert not hasattr(hidden, "train") and not hasattr(hidden, "eval")


@pytest.mark.parametrize("mode", ["fp32", "amp_fp16", "bf16_pure"])
def test_the_trainer_logs_the_plans_gradient_norm(mode: str, tmp_path: Path) -> None:
    """The Trainer measured grad_norm from .grad before the plan's step: loss-scaled under
    amp_fp16 (logged inf), not yet written back under pure bf16 with accumulation (logged 0).
    fp32 logs what a plain Trainer logs."""
    from autoprec.profile import profile_for

    logged = {"logging_steps": 1}
    plain = _gpt2_trainer(tmp_path / "plain", **logged)
    plain.train()
    trainer = _gpt2_trainer(tmp_path / "plan", **logged)
    plan = apply_profile(trainer, profile_for(ModeSpec(mode=mode)))
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 6 and float(plan.last_grad_norm) == pytest.approx(norms[-1], rel=1e-6)
    if mode == "fp32":
        expected = [h["grad_norm"] for h in plain.state.log_history if "grad_norm" in h]
        assert norms == pytest.approx(expected, rel=1e-5)
    else:  # finite where the step was taken (fp16 skips its first steps on overflow)
        assert all(0 < norm < 1e3 for norm in norms[-2:]), norms


@pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes on a CPU
def test_the_trainers_optimizer_adds_a_group_as_the_plans_does(tmp_path: Path) -> None:
    """Found by a hunt: a group added through trainer.optimizer after apply_profile skipped
    the plan optimizer's translation: torch Adam's L2 weight_decay went into bitsandbytes'
    Adam8bit as decoupled decay; and the Trainer's backward dropped its keyword arguments."""
    from autoprec.profile import profile_for

    pytest.importorskip("bitsandbytes")
    trainer = _gpt2_trainer(tmp_path)
    head = nn.Linear(32, 32)
    trainer.optimizer = torch.optim.Adam(trainer.model.parameters(), lr=1e-3)
    apply_profile(trainer, profile_for(ModeSpec(mode="fp32", optimizer_bits=8)))
    with pytest.raises(ValueError, match="applies weight_decay as an L2 gradient term"):
        trainer.optimizer.add_param_group({"params": list(head.parameters()), "weight_decay": 0.5})
    trainer.optimizer.add_param_group({"params": list(head.parameters()), "weight_decay": 0.0})
    assert trainer.optimizer.param_groups[-1]["params"][0] is head.weight
    loss = head(torch.randn(2, 32)).pow(2).sum()
    trainer.accelerator.backward(loss, retain_graph=True)
    trainer.accelerator.backward(loss)  # the graph was kept: retain_graph reached it


def test_an_fp32_trainer_checkpoint_resumes_under_a_kahan_profile(
    hf_tuned: Any, tmp_path: Path
) -> None:
    """Switching a Trainer run mid-way: its fp32 checkpoint (AdamW's state included) resumes
    into the plan's torch-optimi optimizer, translated (the Trainer's load was refused)."""
    first = _gpt2_trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-4"
    assert (checkpoint / "optimizer.pt").exists()
    trainer = _gpt2_trainer(tmp_path)
    spec = ModeSpec(mode="bf16_kahan", keep_fp32=("lm_head",))
    plan = apply_profile(trainer, _profile_for(spec, hf_tuned[1].profile))
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 6
    group = plan.optimizer.param_groups[0]
    assert int(group["step"]) == 6  # 4 loaded, 2 resumed
    weight = trainer.model.transformer.h[0].mlp.c_fc.weight
    assert weight.dtype == torch.bfloat16
    assert plan.optimizer.state[weight]["exp_avg"].dtype == torch.bfloat16
    assert plan.optimizer.state[weight]["exp_avg_sq"].dtype == torch.float32  # kahan_adamw


def test_a_kahan_trainer_checkpoint_resumes_under_an_amp_profile(
    hf_tuned: Any, tmp_path: Path
) -> None:
    """The way back: a checkpoint the plan's torch-optimi optimizer wrote (bf16_kahan) resumes
    into the Trainer's own torch AdamW under an amp_bf16 profile, its moments read back into
    torch's layout. torch's load took it and the first step failed with KeyError: 'step'."""
    first = _gpt2_trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    kahan = ModeSpec(mode="bf16_kahan", keep_fp32=("lm_head",))
    with pytest.warns(RecipeMismatchWarning, match="learning rates"):  # 4 steps, not 6
        apply_profile(first, _profile_for(kahan, hf_tuned[1].profile))
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-4"
    trainer = _gpt2_trainer(tmp_path)
    plan = apply_profile(trainer, _profile_for(ModeSpec(mode="amp_bf16"), hf_tuned[1].profile))
    with pytest.warns(PrecisionSwitchWarning, match="written by a plan for bf16_kahan"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 6
    assert type(plan.optimizer) is torch.optim.AdamW
    weight = trainer.model.transformer.h[0].mlp.c_fc.weight
    state = plan.optimizer.state[weight]
    assert int(state["step"]) == 6  # 4 loaded, 2 resumed
    assert state["exp_avg_sq"].dtype == torch.float32 and bool(state["exp_avg_sq"].any())


def test_a_trainer_checkpoint_carries_the_fp16_loss_scale(tmp_path: Path) -> None:
    """optimizer.pt held only the inner optimizer's state: an amp_fp16 run resumed with its
    scale back at 65536 and skipped steps again. It now carries the plan's state too, and a
    plain torch AdamW still loads it."""
    from autoprec.integrations.hf import PLAN_STATE_KEY
    from autoprec.profile import profile_for

    def settled(plan: Any) -> Any:  # a scale settled below the start, as on real models
        state = plan.mode.state_dict()
        plan.mode.load_state_dict({**state, "scaler": {**state["scaler"], "scale": 1024.0}})
        return plan

    profile = profile_for(ModeSpec(mode="amp_fp16"))  # no recipe to compare
    whole = _gpt2_trainer(tmp_path / "whole")
    whole_plan = settled(apply_profile(whole, profile))
    whole.train()
    first = _gpt2_trainer(tmp_path / "first", save_strategy="steps", save_steps=4)
    settled(apply_profile(first, profile))
    first.train()
    checkpoint = tmp_path / "first" / "out" / "checkpoint-4"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved[PLAN_STATE_KEY]["mode"]["scaler"]["scale"] == 1024.0
    trainer = _gpt2_trainer(tmp_path / "resumed")
    plan = apply_profile(trainer, profile)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 6
    assert plan.mode.steps == whole_plan.mode.steps == 6  # 4 loaded, 2 resumed
    assert plan.mode.state_dict()["scaler"] == whole_plan.mode.state_dict()["scaler"]
    plain = _gpt2_trainer(tmp_path / "plain").create_optimizer()  # a Trainer's own AdamW
    plain.load_state_dict(saved)
    assert int(next(iter(plain.state.values()))["step"]) == 4


def test_a_trainer_that_clips_otherwise_than_the_profile_was_tuned_is_named(
    hf_tuned: Any, tmp_path: Path
) -> None:
    """max_grad_norm=0 (no clipping) against a profile tuned at 1.0: it warned nothing, and
    the plan clipped at 1.0 all the same (apply() took None for "the recipe's")."""
    trainer = _gpt2_trainer(tmp_path, max_grad_norm=0.0)
    with pytest.warns(
        RecipeMismatchWarning,
        match=r"clip_grad_norm: proven at 1\.0, applied with None \(no clipping\)",
    ):
        plan = apply_profile(trainer, hf_tuned[1].profile)
    assert plan.clip_grad_norm is None  # the Trainer's setting, not the profile's


def test_apply_profile_leaves_the_callers_arguments_and_refuses_a_second_call(
    hf_tuned: Any, tmp_path: Path
) -> None:
    """The plan clips, so the Trainer's max_grad_norm goes to 0: that was set on the caller's
    own TrainingArguments, and a second Trainer built on them trained unclipped. A second
    apply_profile converted the converted model again and named a scheduler the first built."""
    trainer = _gpt2_trainer(tmp_path)
    args = trainer.args
    plan = apply_profile(trainer, _profile_for(SPECS[0], hf_tuned[1].profile))
    assert args.max_grad_norm == 1.0 and trainer.args.max_grad_norm == 0.0
    assert plan.clip_grad_norm == 1.0
    with pytest.raises(ValueError, match=r"already called on this Trainer .*amp_bf16"):
        apply_profile(trainer, _profile_for(SPECS[1], hf_tuned[1].profile))
    assert trainer.optimizer.plan is plan  # left as the first call made it
    trainer.train()
    assert trainer.state.global_step == 6
    # after train() Accelerate wraps the plan's optimizer: the refusal blamed a scheduler
    with pytest.raises(ValueError, match=r"already called on this Trainer .*amp_bf16"):
        apply_profile(trainer, _profile_for(SPECS[1], hf_tuned[1].profile))


def test_apply_profile_refuses_a_trainer_built_with_model_init(
    hf_tuned: Any, tmp_path: Path
) -> None:
    """train() rebuilds the model and optimizer from model_init: the profile's were thrown
    away and the run trained fp32, unclipped, without a word (found by a hunt)."""
    built = _gpt2_trainer(tmp_path)
    trainer = transformers.Trainer(
        model_init=lambda: built.model, args=built.args, train_dataset=built.train_dataset
    )
    with pytest.raises(ValueError, match=r"built with model_init.*model=model_init\(\)"):
        apply_profile(trainer, _profile_for(SPECS[0], hf_tuned[1].profile))
    assert trainer.args.max_grad_norm == 1.0  # refused before anything changed


def test_apply_profile_refuses_the_trainers_own_mixed_precision(
    hf_tuned: Any, tmp_path: Path
) -> None:
    trainer = _gpt2_trainer(tmp_path, bf16=True)
    with pytest.raises(ValueError, match="bf16/fp16 on"):
        apply_profile(trainer, _profile_for(SPECS[0], hf_tuned[1].profile))


class _Regression(lightning.LightningModule):
    def __init__(self, form: str = "dict") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss)  # no Trainer during trials: quietly ignored
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        if self.form == "optimizer":
            return optimizer
        if self.form == "lists":
            return [optimizer], [scheduler]
        if self.form == "two":
            return [optimizer, torch.optim.SGD(self.parameters(), lr=0.1)]
        if self.form == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"},
            }
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _loader() -> Any:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=generator)
    data = torch.utils.data.TensorDataset(x, torch.sin(x[:, :16]))
    return torch.utils.data.DataLoader(data, batch_size=16)


def _lightning_trainer(
    plugins: list[Any] | None = None, clip: float | None = 1.0, max_steps: int = 6
) -> Any:
    return lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins or [],
        accumulate_grad_batches=2,
        gradient_clip_val=clip,
    )


@pytest.fixture(scope="module")
def lightning_tuned() -> Any:
    module = _Regression()
    result = tune_module(
        module, _loader(), budget_minutes=0.4, trainer=_lightning_trainer(),
        modes=["amp_bf16"], progress=False,
    )  # fmt: skip
    return module, result


def test_tune_module_reads_the_modules_recipe(lightning_tuned: Any) -> None:
    _, result = lightning_tuned
    recipe = result.recipe
    assert recipe.optimizer == "torch.optim.adamw:AdamW" and recipe.total_steps == 6
    assert recipe.grad_accumulation_steps == 2 and recipe.clip_grad_norm == 1.0
    assert "configure_optimizers" in str(recipe.scheduler)
    assert result.trials[0].status != "failed", result.trials[0].reasons


@pytest.mark.parametrize("form", ["optimizer", "lists", "dict"])
def test_every_configure_optimizers_form(form: str) -> None:
    recipe = module_recipe(_Regression(form), _loader(), _lightning_trainer())
    assert isinstance(recipe["optimizer"], torch.optim.AdamW)
    assert ("scheduler" in recipe) == (form != "optimizer")


class _Stepped(_Regression):
    def __init__(self, frequency: int, interval: str = "step") -> None:
        super().__init__("dict")
        self.frequency = frequency
        self.interval = interval

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.99)
        config = {"scheduler": scheduler, "interval": self.interval, "frequency": self.frequency}
        return {"optimizer": optimizer, "lr_scheduler": config}


def test_the_schedule_is_read_as_lightning_steps_it() -> None:
    # the scheduler's `frequency` and the Trainer's `limit_train_batches` were ignored: an
    # ExponentialLR stepped every 10 of 1000 steps was judged at 0.99^900 (1.2e-7), where the
    # run never goes below 0.99^99 (3.7e-4); 5 batches of 10 epochs read as 16 per epoch
    # (found by a later hunt: Lightning tests the frequency against the micro-batch index in
    # the epoch, which restarts every epoch: every 10 of 16 batches is once an epoch, 62 times
    # in 1000 steps, not 100)
    trainer = lightning.Trainer(max_steps=1000, accelerator="cpu", logger=False)
    module = _Stepped(frequency=10)
    recipe = module_recipe(module, _loader(), trainer)
    assert recipe["total_steps"] == 62
    read = TrainingRecipe(**{k: v for k, v in recipe.items() if k != "train_step"})
    assert read.lr_points(module)[-1].lr > 0.99**62 * 1e-3
    limited = lightning.Trainer(
        max_epochs=10, limit_train_batches=5, accelerator="cpu", logger=False
    )
    assert module_recipe(_Stepped(frequency=1), _loader(), limited)["total_steps"] == 50
    shared = lightning.Trainer(
        max_epochs=2, limit_train_batches=0.5, accelerator="cpu", logger=False
    )
    assert module_recipe(_Stepped(frequency=1), _loader(), shared)["total_steps"] == 16


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's: workers, no validation
@pytest.mark.parametrize(
    ("frequency", "accumulation", "max_steps", "max_epochs", "limit"),
    [(2, 2, 16, -1, 1.0), (10, 1, 40, -1, 1.0), (3, 2, -1, 2, 1.0), (3, 2, 20, -1, 7)],
)
def test_the_scheduler_steps_read_are_the_ones_lightning_takes(
    frequency: int, accumulation: int, max_steps: int, max_epochs: int, limit: float
) -> None:
    """Counted against real fits: the frequency divides the micro-batch index of the epoch
    (1-based, restarting each epoch), and an epoch's last partial accumulation steps too."""

    def trainer() -> Any:
        return lightning.Trainer(
            max_steps=max_steps, max_epochs=max_epochs, accumulate_grad_batches=accumulation,
            limit_train_batches=limit, accelerator="cpu", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    read = module_recipe(_Stepped(frequency), _loader(), trainer())["total_steps"]
    fitted = trainer()
    fitted.fit(_Stepped(frequency), _loader())
    assert read == fitted.lr_scheduler_configs[0].scheduler.last_epoch


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's: workers, no validation
@pytest.mark.parametrize(
    ("interval", "max_steps", "max_epochs"),
    [("step", 1000, 2), ("epoch", 40, -1), ("epoch", 32, -1), ("epoch", 1000, 3)],
)
def test_the_run_length_is_read_as_lightning_ends_it(
    interval: str, max_steps: int, max_epochs: int
) -> None:
    """max_epochs ending a run before max_steps was ignored (1000 steps read where 32 ran),
    and an epoch scheduler was counted for the epoch max_steps cuts short, which Lightning
    does not step it after (3 read, 2 taken; found by a hunt). 16 optimizer steps an epoch."""

    def trainer() -> Any:
        return lightning.Trainer(
            max_steps=max_steps, max_epochs=max_epochs, accelerator="cpu", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    read = module_recipe(_Stepped(1, interval), _loader(), trainer())["total_steps"]
    fitted = trainer()
    fitted.fit(_Stepped(1, interval), _loader())
    assert read == fitted.lr_scheduler_configs[0].scheduler.last_epoch


class _NoBatchIdx(_Regression):
    def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)


class _SizedByTheTrainer(_Regression):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=total)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def test_a_training_step_without_batch_idx_runs_as_lightning_runs_it() -> None:
    """Found by a hunt: Lightning passes batch_idx only to a training_step that takes it;
    trials called training_step(batch, 0), a TypeError."""
    module = _NoBatchIdx()
    recipe = module_recipe(module, _loader(), _lightning_trainer())
    batch = next(iter(_loader()))
    loss = recipe["train_step"](types.SimpleNamespace(model=module), batch)
    assert loss.shape == () and torch.isfinite(loss)


def test_configure_optimizers_sized_by_the_trainer_is_read_with_the_trainer_given() -> None:
    """Found by a hunt: configure_optimizers reading self.trainer.estimated_stepping_batches
    failed with "not attached to a Trainer" on the module tune_module is given."""
    module = _SizedByTheTrainer()
    recipe = module_recipe(module, _loader(), _lightning_trainer(max_steps=40))
    assert recipe["total_steps"] == 40
    scheduler = recipe["scheduler"](torch.optim.AdamW(module.parameters(), lr=1e-3))
    assert scheduler.total_steps == 40
    assert module._trainer is None  # nothing left attached
    with pytest.raises(ValueError, match=r"reads self\.trainer .*pass trainer= to tune_module"):
        module_recipe(_SizedByTheTrainer(), _loader())


def test_an_accumulation_schedule_is_refused_by_tune_module_and_the_plugin(
    lightning_tuned: Any,
) -> None:
    """Found by a hunt: a GradientAccumulationScheduler sets the accumulation at each epoch
    start, after the plan was built for 1: pure bf16 then summed micro-batches in bf16."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def trainer(plugins: list[Any]) -> Any:
        return lightning.Trainer(
            max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
            callbacks=[GradientAccumulationScheduler({0: 4, 1: 2})],
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"changes it by epoch \(\{0: 4, 1: 2\}\)"):
        module_recipe(_Regression(), _loader(), trainer([]))
    profile = _profile_for(ModeSpec(mode="bf16_pure"), lightning_tuned[1].profile)
    with pytest.raises(ValueError, match=r"constant Trainer\(accumulate_grad_batches=N\)"):
        trainer([AutoprecPrecision(profile)]).fit(_Regression(), _loader())


def test_two_optimizers_are_refused() -> None:
    with pytest.raises(ValueError, match="2 optimizers"):
        module_recipe(_Regression("two"), _loader())


def test_a_plateau_scheduler_is_refused_with_the_way_out() -> None:
    # Lightning's usual ReduceLROnPlateau on "val_loss": its lrs cannot be read ahead; the
    # error names scheduler=None, which judges the module at its starting lr
    module, loader = _Regression("plateau"), _loader()
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.*scheduler=None"):
        tune_module(module, loader, budget_minutes=0.2, trainer=_lightning_trainer(),
                    modes=["amp_bf16"], progress=False)  # fmt: skip
    result = tune_module(  # 0.4: at 0.2 a busy CI machine pruned the one trial for the budget
        module, loader, budget_minutes=0.4, trainer=_lightning_trainer(), modes=["amp_bf16"],
        progress=False, objective="memory", scheduler=None,
    )  # fmt: skip
    assert result.recipe.scheduler is None and result.trials[0].status == "accepted"


def test_a_scheduler_without_a_length_is_refused() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        module_recipe(_Regression("dict"), _loader())


class _ChildNamedModule(_Regression):
    """Its network is the attribute ``module``, the name DDP gives what it wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.module = self.net
        del self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_the_plugin_converts_a_lightning_module_with_a_child_named_module() -> None:
    """The plugin took any model's ``module`` attribute for DDP's wrapped LightningModule: it
    converted the child alone, found no Trainer (accumulation 1 instead of 2, so pure bf16's
    fp32 gradient sums were off) and matched keep_fp32 against the child's names."""
    from autoprec import profile_for

    spec = ModeSpec(mode="bf16_pure", keep_fp32=("module.2",))  # the LayerNorm
    plugin = AutoprecPrecision(profile_for(spec))
    lit = _ChildNamedModule()
    _lightning_trainer([plugin], clip=None).fit(lit, _loader())
    assert plugin.plan is not None and plugin.plan.model is lit
    assert plugin.plan.grad_accumulation_steps == 2
    assert lit.module[2].weight.dtype == torch.float32
    assert lit.module[0].weight.dtype == torch.bfloat16


def test_the_plugin_refuses_to_convert_weights_inside_a_strategys_wrapper() -> None:
    """Lightning connects the plugin after DDP wrapped the module: pure bf16 then cast the
    weights DDP's buckets were built for (with keep_fp32 the fit failed in DDP's reducer) and
    its input cast rounded training_step's targets to bf16 (found by a hunt, with a real
    single-process DDP fit). A stand-in wrapper: DDP's ``module`` attribute."""
    from autoprec import profile_for

    lit = _Regression()
    wrapper = nn.Module()
    wrapper.module = lit
    for mode in ("bf16_pure", "bf16_sr", "fp8_torchao"):
        plugin = AutoprecPrecision(profile_for(ModeSpec(mode=mode, emulate=mode == "fp8_torchao")))
        with pytest.raises(ValueError, match=f"cannot run {mode}.* under Module: Lightning hands"):
            plugin.connect(wrapper, [torch.optim.AdamW(lit.parameters())], [])
    assert {p.dtype for p in lit.parameters()} == {torch.float32}
    plugin = AutoprecPrecision(profile_for(ModeSpec(mode="amp_bf16", keep_fp32=("net.2",))))
    plugin.connect(wrapper, [torch.optim.AdamW(lit.parameters())], [])  # weights stay fp32
    assert plugin.plan is not None and plugin.plan.model is lit


def test_the_plugin_names_a_trainer_that_clips_otherwise(lightning_tuned: Any) -> None:
    """Lightning clips (gradient_clip_val); the plugin passed apply() no clipping at all, so
    a Trainer without clipping under a profile tuned at 1.0 went unnamed."""
    profile = lightning_tuned[1].profile
    trainer = _lightning_trainer([AutoprecPrecision(profile)], clip=None)
    with pytest.warns(RecipeMismatchWarning, match=r"proven at 1\.0, applied with None"):
        trainer.fit(_Regression(), _loader())


def test_the_plugin_names_a_trainer_that_clips_by_value(lightning_tuned: Any) -> None:
    """Clipping by value counted as 'no norm clipping', so a profile tuned without clipping
    went unnamed under a Trainer clipping every gradient to 0.01."""
    profile = lightning_tuned[1].profile
    trainer = _lightning_trainer([AutoprecPrecision(profile)], clip=0.01)
    trainer.gradient_clip_algorithm = "value"
    with pytest.warns(RecipeMismatchWarning) as caught:  # and the norm: proven at 1.0, not here
        trainer.fit(_Regression(), _loader())
    said = [str(warning.message) for warning in caught]
    assert any("clips gradients by value (gradient_clip_val=0.01" in text for text in said), said


@pytest.mark.parametrize(
    "spec",
    [*SPECS[:1], ModeSpec(mode="bf16_kahan", keep_fp32=("net.3",)), SPECS[2]],
    ids=lambda spec: spec.label,
)
def test_the_plugin_trains_any_profile_under_automatic_optimization(
    spec: ModeSpec, lightning_tuned: Any
) -> None:
    module = _Regression()
    dtypes: list[torch.dtype] = []
    module.net[1].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    trainer = _lightning_trainer(
        [AutoprecPrecision(_profile_for(spec, lightning_tuned[1].profile))]
    )
    trainer.fit(module, _loader())
    assert trainer.global_step == 6  # max_steps reached: the run ends
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3)
    assert dtypes and all(dtype == torch.bfloat16 for dtype in dtypes), dtypes
    if spec.mode == "fp8_torchao":
        assert [type(m).__name__ for m in module.net if isinstance(m, nn.Linear)] == [
            "Float8Linear",
            "Float8Linear",
        ]
    plugin = trainer.precision_plugin
    assert isinstance(plugin, AutoprecPrecision) and plugin.plan is not None
    assert plugin.plan.optimizer is trainer.optimizers[0]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's: workers, no validation
def test_the_plugin_compares_the_schedule_over_the_trainers_run(lightning_tuned: Any) -> None:
    """Found by a hunt: tuned with max_steps=6 and trained with max_steps=60, the run's StepLR
    ends far below the proven floor, and nothing was said: the schedule was stepped through
    the proven 6 steps only."""
    profile = _profile_for(ModeSpec(mode="amp_bf16"), lightning_tuned[1].profile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lightning_trainer([AutoprecPrecision(profile)], max_steps=60).fit(_Regression(), _loader())
    said = [str(w.message) for w in caught if issubclass(w.category, RecipeMismatchWarning)]
    assert any("total_steps: proven over 6, applied over 60" in message for message in said)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lightning_trainer([AutoprecPrecision(profile)]).fit(_Regression(), _loader())
    assert not [w for w in caught if issubclass(w.category, RecipeMismatchWarning)]
    # found by a later hunt: a run given by max_epochs had no length when the plugin connects
    # (the loader is not loaded yet), and 10 epochs, 80 steps, went unwarned
    by_epochs = lightning.Trainer(
        max_epochs=10, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
        gradient_clip_val=1.0, plugins=[AutoprecPrecision(profile)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_epochs.fit(_Regression(), _loader())
    said = [str(w.message) for w in caught if issubclass(w.category, RecipeMismatchWarning)]
    assert any("total_steps: proven over 6, applied over 80" in message for message in said)


class _Evaluated(_Regression):
    """Test and predict steps that record whether they ran under bf16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.autocast_seen: list[bool] = []

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return self(batch[0])


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's: no validation loop, workers
def test_the_plugin_tests_and_predicts_after_fit_under_the_plan(lightning_tuned: Any) -> None:
    """Found by a hunt: fit() then test(), validate() or predict() on the same Trainer failed
    with "This model was already converted by autoprec": Lightning connects the plugin again
    with the optimizers fit kept, and the plugin applied the profile a second time."""
    module = _Evaluated()
    profile = _profile_for(ModeSpec(mode="amp_bf16"), lightning_tuned[1].profile)
    trainer = _lightning_trainer([AutoprecPrecision(profile)])
    trainer.fit(module, _loader())
    trainer.test(module, _loader())
    trainer.predict(module, _loader())
    assert module.autocast_seen and all(module.autocast_seen)  # amp_bf16's autocast
    fresh = _lightning_trainer([AutoprecPrecision(profile)])
    with pytest.warns(UserWarning, match="AutoprecPrecision has no plan on this Trainer"):
        fresh.test(_Evaluated(), _loader())  # never fit here: said, not silently fp32


class _OwnBackward(_Regression):
    """A module whose backward hook scales its loss to 0: every gradient must be 0."""

    def __init__(self) -> None:
        super().__init__()
        self.backward_calls = 0
        self.gradient_sums: list[float] = []

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_calls += 1
        (loss * 0).backward(*args, **kwargs)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.gradient_sums.append(sum(float(p.grad.abs().sum()) for p in self.parameters()))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_plugin_runs_the_modules_own_backward_hook(lightning_tuned: Any) -> None:
    """Found by a hunt: the plugin ran the mode's backward itself, so an overridden
    LightningModule.backward never ran (weights moved 0.0112 where Lightning's own precision
    plugins move them 0) and manual_backward's arguments (retain_graph) were dropped."""
    module = _OwnBackward()
    profile = _profile_for(ModeSpec(mode="amp_fp16"), lightning_tuned[1].profile)
    trainer = _lightning_trainer([AutoprecPrecision(profile)], clip=None)
    trainer.fit(module, _loader())
    assert module.backward_calls == 12  # 6 steps x 2 micro-batches
    assert module.gradient_sums == [0.0] * 6


def test_a_skipped_training_step_under_amp_fp16_leaves_the_next_step_unscaled_by_it() -> None:
    """training_step returning None (Lightning's skip) unscaled the fp16 gradients with no step
    after it: the next step was never unscaled and failed in GradScaler (AssertionError; with
    accumulation, the stale unscale let every later step run on scaled gradients)."""
    from autoprec.profile import profile_for

    module = _Regression(form="optimizer")
    steps = module.training_step
    module.training_step = lambda batch, batch_idx: (
        None if batch_idx == 1 else steps(batch, batch_idx)
    )
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=1e-3)
    start = [p.detach().clone() for p in module.parameters()]
    plugin = AutoprecPrecision(profile_for(ModeSpec(mode="amp_fp16")))  # no recipe to compare
    trainer = lightning.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`training_step` returned `None`", UserWarning)
        trainer.fit(module, _loader())
    assert trainer.global_step == 6
    assert plugin.plan is not None and plugin.plan.mode.steps == 5  # the skipped batch: none
    assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), start, strict=True))


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.filterwarnings("ignore::autoprec.errors.RecipeMismatchWarning")  # 10 of 6
def test_an_fp32_lightning_checkpoint_resumes_under_a_kahan_profile(
    lightning_tuned: Any, tmp_path: Path
) -> None:
    """Switching a Lightning run mid-way: its fp32 checkpoint (AdamW's state included) resumes
    under the plugin's bf16_kahan plan, the optimizer state translated into torch-optimi's."""
    first = _lightning_trainer()
    first.fit(_Regression(), _loader())
    path = tmp_path / "fp32.ckpt"
    first.save_checkpoint(path)
    spec = ModeSpec(mode="bf16_kahan", keep_fp32=("net.3",))
    plugin = AutoprecPrecision(_profile_for(spec, lightning_tuned[1].profile))
    trainer = _lightning_trainer([plugin], max_steps=10)
    module = _Regression()
    trainer.fit(module, _loader(), ckpt_path=path)
    assert trainer.global_step == 10
    optimizer = trainer.optimizers[0]
    assert optimizer is plugin.plan.optimizer and int(optimizer.param_groups[0]["step"]) == 10
    assert optimizer.state[module.net[0].weight]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore::autoprec.errors.RecipeMismatchWarning")  # 10 of 6
def test_a_kahan_lightning_checkpoint_resumes_under_an_amp_profile(
    lightning_tuned: Any, tmp_path: Path
) -> None:
    """The way back under Lightning: a checkpoint written by the plugin's bf16_kahan plan
    (torch-optimi's state) resumes under an amp_bf16 plugin in the module's own torch AdamW."""
    kahan = ModeSpec(mode="bf16_kahan", keep_fp32=("net.3",))
    first = _lightning_trainer([AutoprecPrecision(_profile_for(kahan, lightning_tuned[1].profile))])
    first.fit(_Regression(), _loader())
    path = tmp_path / "kahan.ckpt"
    first.save_checkpoint(path)
    amp = ModeSpec(mode="amp_bf16")
    plugin = AutoprecPrecision(_profile_for(amp, lightning_tuned[1].profile))
    trainer = _lightning_trainer([plugin], max_steps=10)
    module = _Regression()
    with warnings.catch_warnings():
        # pytest.warns re-emits the others: Lightning's note that the loader is not resumable
        warnings.simplefilter("ignore", PossibleUserWarning)
        with pytest.warns(PrecisionSwitchWarning, match="written by a plan for bf16_kahan"):
            trainer.fit(module, _loader(), ckpt_path=path)
    assert trainer.global_step == 10
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.AdamW
    state = optimizer.state[module.net[0].weight]
    assert int(state["step"]) == 10 and state["exp_avg"].dtype == torch.float32


class _LargeLoss(nn.Module):
    """A loss so large that fp16's scaled gradients overflow at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        return {"loss": (self.linear(x).float() ** 2).sum() * 100.0}


class _Inputs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        return {"x": torch.randn(8, generator=generator) * 30, "labels": torch.zeros(1)}


def test_a_step_the_plans_loss_scaler_skips_holds_the_trainers_schedule(tmp_path: Path) -> None:
    """Found by a hunt: the Trainer steps its scheduler only when Accelerate says the optimizer
    step was not skipped, which Accelerate reads from its own GradScaler; the plan's replaced
    it, so every skipped fp16 step still advanced the schedule (8 skipped of 8: lr 1e-3 -> 0).
    With torch's unfused AdamW a plain fp16 Trainer holds the lr (a fused one, which the
    scaler always calls, advances it in both)."""
    from autoprec.profile import profile_for

    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8,
        learning_rate=1e-3, lr_scheduler_type="linear", report_to=[], save_strategy="no",
        use_cpu=True, optim="adamw_torch", logging_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(model=_LargeLoss(), args=args, train_dataset=_Inputs())
    plan = apply_profile(trainer, profile_for(ModeSpec(mode="amp_fp16")))
    trainer.train()
    assert plan.mode.skipped_steps == plan.mode.steps == 8
    assert trainer.lr_scheduler.last_epoch == 0
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


class _Manual(_Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]


def test_tune_module_refuses_manual_optimization_with_the_way_out() -> None:
    """Found by a hunt: the first trial failed with "Manual is not attached to a Trainer ...
    Check that the loader's batches fit the model"."""
    with pytest.raises(ValueError, match=r"manual optimization .*train_step="):
        tune_module(_Manual(), _loader(), budget_minutes=0.2, trainer=_lightning_trainer())
