"""Running state: buffers the forward pass updates in training, kept fp32 under pure bf16; and
the gate's check of state outside the optimizer that a trial holds in bf16."""

from __future__ import annotations

import copy
import warnings
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import autoprec
import autoprec.trial
from autoprec.candidates import CandidateList, candidate_specs, with_user_keep_fp32
from autoprec.drift import judge
from autoprec.drift_outside_state import changed_state, outside_state_reasons
from autoprec.errors import OptimizerRebuiltWarning
from autoprec.fingerprint import Fp32Runs, load_references, references_path, save_references
from autoprec.layer_keep import RUNNING_STATE_REASON
from autoprec.layers import scan_model
from autoprec.recipe import TrainingRecipe
from autoprec.run_setup import TF32_KEEP_NOTE, setup_notes
from autoprec.running_state import running_buffers
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.trial_records import StateDigest, TrialResult
from examples import mean_teacher, running_stats
from tests.test_fingerprint import _fingerprint


class Counting(nn.Module):
    """Replaces one buffer by a new tensor and creates another on its first training call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("fixed", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen = self.seen + 1  # a new tensor object
            if not hasattr(self, "lazy"):
                self.register_buffer("lazy", x.mean(0))
        return nn.functional.dropout(self.linear(x) * self.fixed, 0.5, self.training)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_running_buffers_finds_what_training_updates_and_restores_the_model() -> None:
    model = nn.Sequential(Counting(), nn.BatchNorm1d(4), running_stats.RunningStandardizer(4))
    model[2].eval()  # the user's own flags come back as they were
    flags = [module.training for module in model.modules()]
    example = torch.randn(8, 4) + 3
    before, rng = _state(model), torch.get_rng_state()
    buffer = model[0].seen

    found = running_buffers(model, example)

    assert found == ("0.seen", "1.running_mean", "1.running_var", "2.mean", "2.var")
    assert "0.fixed" not in found and "1.num_batches_tracked" not in found  # unchanged / int
    after = model.state_dict()
    assert after.keys() == before.keys()  # the lazy buffer made by the forward is gone
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert model[0].seen is buffer  # the tensor object the forward replaced is back
    assert [module.training for module in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's draws are undone


def test_running_buffers_restores_the_model_when_the_forward_fails() -> None:
    class FailsInTraining(running_stats.RunningStandardizer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if self.training:
                raise RuntimeError("no training here")
            return out

    model = nn.Sequential(FailsInTraining(4)).eval()
    with pytest.raises(RuntimeError, match="no training here"):
        running_buffers(model, torch.randn(8, 4) + 3)
    assert torch.equal(model[0].mean, torch.zeros(4)) and not model[0].training


def test_running_buffers_skips_models_without_floating_buffers_and_meta_models() -> None:
    calls = []
    model = nn.Linear(4, 4)
    model.register_forward_hook(lambda *_: calls.append(1))
    assert running_buffers(model, torch.randn(2, 4)) == ()
    assert calls == []  # no second forward pass for a model with nothing to find
    with torch.device("meta"):
        meta, _ = running_stats.make_model()
    assert running_buffers(meta, torch.randn(2, 16, device="meta")) == ()


def test_probe_keeps_running_statistics_fp32_for_pure_bf16_only() -> None:
    model, example = running_stats.make_model()
    mix = scan_model(model, example)
    assert mix.running_buffers == ("0.mean", "0.var")
    kept = {keep.fqn: keep.reason for keep in mix.keep_fp32}
    assert kept["0"].startswith(RUNNING_STATE_REASON) and "(mean, var)" in kept["0"]
    assert any("training updates buffers of 0 " in finding for finding in mix.findings)
    specs = candidate_specs(autoprec.probe(model, example)).specs
    by_mode = {spec.mode: spec for spec in specs}
    for mode in ("bf16_pure", "bf16_sr", "bf16_kahan", "bf16_sr_kahan"):
        assert by_mode[mode].keep_fp32 == ("0",)
    assert by_mode["amp_bf16"].keep_fp32 == ()  # autocast keeps buffers fp32 anyway


class _AveragingLinear(nn.Linear):
    """A Linear that keeps a running average of its inputs (a buffer its forward updates)."""

    def __init__(self, features: int, out_features: int) -> None:
        super().__init__(features, out_features)
        self.register_buffer("average", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.average.lerp_(x.mean(0), 0.01)
        return super().forward(x)


def test_a_kept_norm_is_named_once_and_a_first_layer_keeps_both_reasons() -> None:
    first = _AveragingLinear(8, 16)
    model = nn.Sequential(first, nn.BatchNorm1d(16), nn.Linear(16, 16), nn.Linear(16, 2))
    mix = scan_model(model, torch.randn(4, 8))
    reasons = [(keep.fqn, keep.reason.split(":")[0]) for keep in mix.keep_fp32]
    assert ("1", "normalisation") in reasons and ("1", RUNNING_STATE_REASON) not in reasons
    assert ("0", "first layer") in reasons and ("0", RUNNING_STATE_REASON) in reasons
    specs = candidate_specs(autoprec.probe(model, torch.randn(4, 8))).specs
    pure = next(spec for spec in specs if spec.mode == "bf16_sr")
    assert pure.keep_fp32 == ("1", "0")  # each module once


def test_spectral_norms_vectors_are_not_running_statistics() -> None:
    # recomputed from the weight by every forward, not averaged: in bf16 they cost nothing
    # (benchmarks.spectral_norm_rounding), so pure bf16 keeps neither spectral norm in fp32
    hook = nn.utils.spectral_norm(nn.Linear(8, 16))
    parametrized = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))
    model = nn.Sequential(hook, nn.GELU(), parametrized, _AveragingLinear(16, 2))
    example = torch.randn(4, 8)
    before = {name: b.clone() for name, b in model.named_buffers()}
    assert running_buffers(model, example) == ("3.average",)
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())
    mix = scan_model(model, example)
    running = [keep.fqn for keep in mix.keep_fp32 if keep.reason.startswith(RUNNING_STATE_REASON)]
    assert running == ["3"]
    specs = candidate_specs(autoprec.probe(model, example)).specs
    pure = next(spec for spec in specs if spec.mode == "bf16_sr")
    assert "0" not in pure.keep_fp32  # the hook's Linear trains in bf16 (it was kept fp32)
    assert "3" in pure.keep_fp32


def test_spectral_norms_vectors_are_told_apart_without_torchs_private_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``parametrizations._SpectralNorm`` is private: were a torch release to rename it, the
    probe read every model with buffers as AttributeError; its shape tells it apart then."""
    parametrized = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))
    model = nn.Sequential(parametrized, _AveragingLinear(16, 2))
    monkeypatch.delattr(nn.utils.parametrizations, "_SpectralNorm")
    assert running_buffers(model, torch.randn(4, 16)) == ("1.average",)


def _spectral_normed(style: str) -> nn.Module:
    norm = {
        "hook": nn.utils.spectral_norm,
        "parametrization": nn.utils.parametrizations.spectral_norm,
    }
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), norm[style](nn.Linear(32, 32)), nn.ReLU(), nn.Linear(32, 4)
    )


@pytest.mark.parametrize("style", ["hook", "parametrization"])
def test_the_gate_does_not_reject_pure_bf16_for_spectral_norms_vectors(style: str) -> None:
    # the probe leaves them bf16 on purpose; the state check then rejected every pure-bf16
    # mode on a spectral-normed model for holding them in bf16 (found by a hunt)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator))
        for _ in range(24)
    ]
    report = autoprec.check(
        _spectral_normed(style),
        batches,
        steps=20,
        loss_fn=nn.functional.mse_loss,
        modes=["bf16_sr", "bf16_kahan"],
    )
    for verdict in report.verdicts:
        assert verdict.status == "safe", verdict.reasons


def test_the_probe_and_prepare_leave_spectral_norms_vectors_where_they_were() -> None:
    # reading a parametrized weight runs one power iteration in place: the scan moved them
    # (the hook's weight is an attribute its forward sets: reading it runs nothing)
    model = _spectral_normed("parametrization")
    before = {name: b.clone() for name, b in model.named_buffers()}
    assert len(before) == 2
    autoprec.probe(model)
    autoprec.probe(model, torch.randn(2, 16))
    autoprec.prepare(
        autoprec.ModeSpec(mode="amp_bf16"), model, torch.optim.AdamW(model.parameters())
    )
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())


def test_probe_says_what_it_cannot_keep_or_could_not_find() -> None:
    class OwnBuffer(running_stats.RunningStandardizer):
        def __init__(self) -> None:
            super().__init__(4)
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(super().forward(x))

    mix = scan_model(OwnBuffer(), torch.randn(8, 4))
    assert mix.running_buffers == ("mean", "var")
    assert not any(keep.reason.startswith(RUNNING_STATE_REASON) for keep in mix.keep_fp32)
    assert any("the model's own buffers (mean, var)" in finding for finding in mix.findings)

    class TrainingFails(OwnBuffer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                raise ValueError("eval only")
            return super().forward(x)

    mix = scan_model(TrainingFails(), torch.randn(8, 4))
    assert mix.running_buffers == () and mix.running_buffers_error == "ValueError: eval only"
    assert any("a training-mode forward failed (ValueError" in f for f in mix.findings)


def test_check_judges_pure_bf16_with_the_running_statistics_kept_fp32() -> None:
    model, _ = running_stats.make_model()
    report = autoprec.check(
        model,
        running_stats.make_batches(count=24),
        loss_fn=running_stats.loss_fn,
        steps=20,
        modes=["bf16_sr"],
    )
    verdict = report.verdict("bf16_sr")
    assert verdict.spec.keep_fp32 == ("0",)
    assert not any(reason.startswith("state outside") for reason in verdict.reasons)
    assert model[0].mean.dtype == torch.float32 and torch.equal(model[0].mean, torch.zeros(16))


def test_the_kept_standardiser_keeps_every_update_under_bf16_sr() -> None:
    def trained(spec: autoprec.ModeSpec) -> torch.Tensor:
        model, _ = running_stats.make_model()
        with warnings.catch_warnings():  # no scheduler to rebind: plan.optimizer is stepped
            warnings.simplefilter("ignore", OptimizerRebuiltWarning)
            plan = autoprec.prepare(spec, model, torch.optim.AdamW(model.parameters()))
        for x, y in running_stats.make_batches(count=60):
            with plan.autocast():
                loss = running_stats.loss_fn(plan.model(x), y)
            plan.step(loss)
        return model[0].mean.float()

    fp32 = trained(autoprec.ModeSpec(mode="fp32"))
    kept = trained(autoprec.ModeSpec(mode="bf16_sr", keep_fp32=("0",)))
    rounded = trained(autoprec.ModeSpec(mode="bf16_sr"))
    # kept: it reads the model's fp32 inputs, not the bf16 cast the rest of the model sees
    assert torch.equal(kept, fp32)
    assert (rounded - fp32).abs().max() > 0.01  # nearest rounding already lags at 60 steps


def test_check_rejects_pure_bf16_holding_an_ema_teacher_in_bf16() -> None:
    report = autoprec.check(
        mean_teacher.make_model()[0],
        mean_teacher.make_batches(),
        train_step=mean_teacher.train_step,
        steps=20,
        modes=["bf16_sr", "amp_bf16"],
    )
    (reason,) = [r for r in report.verdict("bf16_sr").reasons if r.startswith("state outside")]
    assert "held in bfloat16: training changes teacher.0.weight, teacher.0.bias" in reason
    assert "teacher.2.bias (buffers" in reason and "running_state_rounding" in reason
    amp = report.verdict("amp_bf16")  # autocast leaves the teacher fp32
    assert not any(r.startswith("state outside") for r in amp.reasons)
    assert "Keep it in fp32: tune(..., keep_fp32=['teacher.0', 'teacher.2'])" in reason


@pytest.mark.parametrize(
    ("optimizer", "mode"), [("adamw", "bf16_sr"), ("sgd", "bf16_sr"), ("adagrad", "bf16_pure")]
)
def test_an_ema_teacher_the_optimizer_holds_but_never_steps_is_state_outside_it(
    optimizer: str, mode: str
) -> None:
    """Found by a hunt: a teacher left ``requires_grad=True`` and so inside the optimizer's
    groups (which skip a parameter without a gradient) escaped the check, and bf16_sr was
    accepted while its bf16 EMA moved the teacher 8% as far as fp32's in 600 steps. SGD
    without momentum keeps no state for any parameter, Adagrad fills it for every one at
    construction (a review: it was accepted): the gradients the steps saw decide."""
    model = mean_teacher.make_model()[0]
    model.teacher.requires_grad_(True)
    factories = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
        "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
        "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
    }
    common = {
        "train_step": mean_teacher.train_step,
        "steps": 20,
        "optimizer": factories[optimizer],
        "progress": False,
    }
    report = autoprec.check(model, mean_teacher.make_batches(), modes=[mode], **common)
    (reason,) = [r for r in report.verdict(mode).reasons if r.startswith("state outside")]
    assert "training changes teacher.0.weight, teacher.0.bias, teacher.2.weight" in reason
    assert "weights no loss reaches" in reason
    assert "copied whole (a target network copied from the online one) loses nothing" in reason
    assert "Keep it in fp32: tune(..., keep_fp32=['teacher.0', 'teacher.2'])" in reason
    kept = autoprec.check(
        model, mean_teacher.make_batches(), modes=[mode], keep_fp32=["teacher"], **common
    )
    assert not [r for r in kept.verdict(mode).reasons if r.startswith("state outside")]


def test_amp_fp16s_settle_passes_leave_a_trainable_teacher_where_it_was() -> None:
    """Found by a review: the loss-scale settle runs the train_step (8 batches, no optimizer
    step) and put back only buffers and parameters the optimizer does not hold, so a teacher
    left trainable started the amp_fp16 trial 8 EMA updates ahead of the reference."""
    model = mean_teacher.make_model()[0]
    with torch.no_grad():
        for parameter in model.teacher.parameters():
            parameter.add_(0.1)  # a teacher not equal to the student: its EMA moves it
    model.teacher.requires_grad_(True)
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-2),
        train_step=mean_teacher.train_step,
    )
    teachers = []
    settle = autoprec.trial.settle

    def watched(loop: object, *args: object) -> object:
        teacher = loop.plan.model.teacher[0].weight  # type: ignore[attr-defined]
        before = teacher.detach().clone()
        stopped = settle(loop, *args)
        teachers.append(float((teacher.detach() - before).abs().max()))
        return stopped

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autoprec.trial, "settle", watched)
        batches = mean_teacher.make_batches()
        run_trial(ModeSpec(mode="amp_fp16"), model, batches, recipe=recipe, steps=4)
    assert teachers == [0.0]


def test_amp_fp16s_settle_passes_leave_a_train_steps_own_optimizer_where_it_was() -> None:
    """Found by a hunt: a GAN's train_step steps its critic's Adam itself; the settle passes
    put the critic's weights back but not that Adam's state, and the amp_fp16 trial began at
    its step 18 where every fp32 run began at 0."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(8, 8), "d": torch.nn.Linear(8, 1)})
    critics: dict[int, torch.optim.Optimizer] = {}

    def train_step(plan: autoprec.PrecisionPlan, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gan = plan.model
        critic = critics.setdefault(id(gan), torch.optim.Adam(gan["d"].parameters(), lr=1e-3))
        x, _ = batch
        with plan.autocast():
            fake = gan["g"](x)
            critic_loss = gan["d"](fake.detach()).float().mean() - gan["d"](x).float().mean()
        critic.zero_grad()
        critic_loss.backward()
        critic.step()
        with plan.autocast():
            return -gan["d"](gan["g"](x)).float().mean()

    def critic_steps(gan: torch.nn.Module) -> int:  # over its weight and bias
        return sum(int(entry["step"]) for entry in critics[id(gan)].state.values())

    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3), train_step=train_step
    )
    counts = _read_after_settle(model, recipe, critic_steps)
    assert counts == [0]  # 18 before: 9 passes, each stepping weight and bias


def _read_after_settle(model: torch.nn.Module, recipe: TrainingRecipe, read: Any) -> list[Any]:
    """``read(trial model)`` right after amp_fp16's settle passes, in a 4-step trial."""
    seen = []
    settle = autoprec.trial.settle

    def watched(loop: Any, *args: Any) -> Any:
        stopped = settle(loop, *args)
        seen.append(read(loop.plan.model))
        return stopped

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autoprec.trial, "settle", watched)
        result = run_trial(
            ModeSpec(mode="amp_fp16"), model, mean_teacher.make_batches(), recipe=recipe, steps=4
        )
    assert result.record.failure is None, result.record.failure
    return seen


def test_amp_fp16s_settle_passes_leave_a_count_kept_on_the_model_where_it_was() -> None:
    """Found by a hunt: a DQN's train_step counts its calls on the model and copies its target
    network every 20; the settle passes advanced the count, and the amp_fp16 trial copied its
    target 8 steps before every other run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model.calls, model.scale = 0, 1.0  # type: ignore[assignment]

    def train_step(plan: autoprec.PrecisionPlan, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        plan.model.calls += 1
        plan.model.scale *= 0.5
        x, y = batch
        with plan.autocast():
            return torch.nn.functional.mse_loss(plan.model(x).float(), y[:, :1])

    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-2), train_step=train_step
    )

    def read(trained: Any) -> tuple[int, float, bool]:
        return trained.calls, trained.scale, trained.training

    seen = _read_after_settle(model, recipe, read)
    assert seen == [(0, 1.0, True)]


def test_amp_fp16s_settle_leaves_lazy_and_tensor_counts_and_a_critics_scheduler_as_fp32() -> None:
    """A review: a count created on first use (getattr(model, "calls", 0) + 1), a count kept
    as a tensor attribute, and a train_step's own critic scheduler were left 8-9 calls on."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(8, 8), "d": torch.nn.Linear(8, 1)})
    model.ticks = torch.zeros((), dtype=torch.long)  # type: ignore[assignment]
    critics: dict[int, tuple[torch.optim.Optimizer, Any, Any]] = {}

    def train_step(plan: autoprec.PrecisionPlan, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gan = plan.model
        gan.calls = getattr(gan, "calls", 0) + 1
        gan.ticks += 1
        if id(gan) not in critics:
            critic = torch.optim.SGD(gan["d"].parameters(), lr=1e-3)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(critic, patience=100)
            critics[id(gan)] = (critic, torch.optim.lr_scheduler.StepLR(critic, 4, 0.1), plateau)
        critic, schedule, plateau = critics[id(gan)]
        x, _ = batch
        with plan.autocast():
            critic_loss = gan["d"](gan["g"](x).detach()).float().mean()
        critic.zero_grad()
        critic_loss.backward()
        critic.step()
        schedule.step()
        plateau.step(float(critic_loss.detach()))  # a subclass with a step of its own
        with plan.autocast():
            return -gan["d"](gan["g"](x)).float().mean()

    def read(trained: Any) -> tuple[Any, int, int, int]:
        _, schedule, plateau = critics[id(trained)]
        calls = getattr(trained, "calls", None)
        return calls, int(trained.ticks), schedule.last_epoch, plateau.last_epoch

    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-2), train_step=train_step
    )
    assert _read_after_settle(model, recipe, read) == [(None, 0, 0, 0)]


def test_amp_fp16s_settle_leaves_another_threads_optimizer_alone() -> None:
    """A review: the optimizer step hook is process-wide; a background thread's Adam, stepped
    while a check ran, was rolled back to its state before."""
    import threading

    from autoprec.trial_loop import optimizers_kept

    weight = torch.nn.Parameter(torch.ones(4))
    other = torch.optim.Adam([weight], lr=1e-3)

    def step_other() -> None:
        for _ in range(5):
            weight.grad = torch.ones(4)
            other.step()

    with optimizers_kept():
        thread = threading.Thread(target=step_other)
        thread.start()
        thread.join()
    assert int(other.state[weight]["step"]) == 5


def test_a_parameter_some_steps_reach_is_not_state_outside_the_optimizer() -> None:
    """A head the loss reaches on every fifth step only (a mixture's rarely routed expert) is
    stepped by the optimizer: not state outside it, under SGD without momentum too (no
    optimizer state tells), nor one reached only at steps between the gradient reads."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"body": torch.nn.Linear(8, 4), "rare": torch.nn.Linear(4, 4, bias=False)}
    )
    calls = [0]

    def train_step(plan: autoprec.PrecisionPlan, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        calls[0] += 1
        with plan.autocast():
            out = plan.model["body"](x)
            if plan.model.training and calls[0] % 5 == 2:
                out = out + plan.model["rare"](out)
        return torch.nn.functional.mse_loss(out.float(), y)

    report = autoprec.check(
        model,
        mean_teacher.make_batches(),
        train_step=train_step,
        steps=20,
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-2),
        modes=["bf16_sr"],
        progress=False,
    )
    verdict = report.verdict("bf16_sr")
    assert not [r for r in verdict.reasons if r.startswith("state outside")], verdict.reasons


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.d = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.g(z)


def test_a_gans_second_optimizer_steps_state_outside_autoprecs() -> None:
    """docs/tune.md: a discriminator stepped by the train_step's own optimizer, autoprec given
    the generator's: pure bf16 holding it in bf16 is rejected naming keep_fp32, which passes."""
    torch.manual_seed(0)
    model = _Gan()
    batches = [(torch.randn(32, 4), torch.randn(32, 2) * 0.5 + 1) for _ in range(16)]
    # by the copy itself, weakly: an id() is reused by a later copy, whose discriminator a
    # dict by id stepped with the last copy's optimizer (its weights never moved)
    discriminator_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def train_step(plan: autoprec.PrecisionPlan, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        z, real = batch
        gan = plan.model
        if gan not in discriminator_optimizers:  # one per copy autoprec trains
            discriminator_optimizers[gan] = torch.optim.Adam(gan.d.parameters(), lr=1e-3)
        optimizer = discriminator_optimizers[gan]
        if gan.training:
            with plan.autocast():
                fake = gan(z).detach()
                loss = nn.functional.softplus(-gan.d(real)).mean()
                loss = loss + nn.functional.softplus(gan.d(fake)).mean()
            loss.float().backward()
            optimizer.step()
            optimizer.zero_grad()
        with plan.autocast():
            return nn.functional.softplus(-gan.d(gan(z))).mean().float()

    def checked(keep: list[str] | None) -> autoprec.QualityReport:
        return autoprec.check(
            model,
            batches,
            train_step=train_step,
            steps=30,
            modes=["bf16_sr"],
            optimizer=torch.optim.Adam(model.g.parameters(), lr=1e-3),
            keep_fp32=keep,
            progress=False,
        )

    reasons = checked(None).verdict("bf16_sr").reasons
    (reason,) = [r for r in reasons if r.startswith("state outside")]
    assert "training changes d.0.weight, d.0.bias, d.2.weight, d.2.bias" in reason
    assert "keep_fp32=['d.0', 'd.2']" in reason
    kept = checked(["d"]).verdict("bf16_sr")
    assert kept.status == "safe", kept.reasons


def test_keep_fp32_keeps_an_ema_teacher_in_fp32_from_the_trial_to_apply() -> None:
    model, _ = mean_teacher.make_model()
    batches = mean_teacher.make_batches()
    common = {"train_step": mean_teacher.train_step, "modes": ["bf16_sr"], "keep_fp32": ["teacher"]}
    kept = autoprec.check(model, batches, steps=20, **common).verdict("bf16_sr")
    assert kept.spec.keep_fp32 == ("teacher",) and kept.status == "safe", kept.reasons
    result = autoprec.tune(
        model, batches, budget_minutes=0.3, objective="memory", progress=False, **common
    )
    assert result.chosen.mode == "bf16_sr" and result.chosen.keep_fp32 == ("teacher",)
    model = mean_teacher.make_model()[0]
    with pytest.warns(OptimizerRebuiltWarning):  # bf16_sr steps a StochasticAdamW
        plan = result.profile.apply(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    assert {p.dtype for p in plan.model.teacher.parameters()} == {torch.float32}
    assert {p.dtype for p in plan.model.student.parameters()} == {torch.bfloat16}


def test_user_keep_fp32_joins_every_candidate_that_lowers_precision() -> None:
    specs = (
        ModeSpec(mode="fp32"),
        ModeSpec(mode="tf32"),
        ModeSpec(mode="amp_bf16"),
        ModeSpec(mode="bf16_sr", keep_fp32=("norm", "head")),
        ModeSpec(mode="fp8_torchao", fp8_skip=("head",)),
    )
    candidates = CandidateList(specs=specs, skipped=())
    kept = with_user_keep_fp32(candidates, ("head", "teacher"))
    assert [spec.keep_fp32 for spec in kept.specs] == [
        (),
        (),  # fp32 keeps everything; tf32 has no per-module setting (a note says so)
        ("head", "teacher"),
        ("norm", "head", "teacher"),  # the probe's first, each once
        ("head", "teacher"),  # in fp32: FP8's own skips (bf16 autocast) are apart
    ]
    assert kept.specs[4].fp8_skip == ("head",)
    assert with_user_keep_fp32(candidates, ()) is candidates
    # where tf32 is a candidate (a GPU), the result's notes say it did not keep them
    setup = SimpleNamespace(
        fresh_batches=False, keep_fp32=("head",), candidates=kept, user_model=torch.nn.Linear(2, 2)
    )
    assert setup_notes(setup) == (TF32_KEEP_NOTE,)  # type: ignore[arg-type]
    assert setup_notes(SimpleNamespace(**{**vars(setup), "keep_fp32": ()})) == ()  # type: ignore[arg-type]


def _digests(**named: tuple[str, float]) -> dict[str, StateDigest]:
    return {name: StateDigest(dtype, total, abs(total)) for name, (dtype, total) in named.items()}


def test_state_check_flags_only_changed_fp32_state_held_narrower() -> None:
    reference = TrialResult(record=None)  # type: ignore[arg-type]
    reference.outside_state = [
        _digests(a=("torch.float32", 1.0), b=("torch.float32", 1.0), c=("torch.float64", 1.0)),
        _digests(a=("torch.float32", 2.0), b=("torch.float32", 1.0), c=("torch.float64", 2.0)),
    ]
    assert changed_state(reference) == ["a", "c"]
    trial = TrialResult(record=None)  # type: ignore[arg-type]
    trial.outside_state = [_digests(a=("torch.float16", 1.0), b=("torch.bfloat16", 1.0))]
    (reason,) = outside_state_reasons(trial, reference)
    assert reason.startswith("state outside the optimizer held in float16: training changes a ")
    trial.outside_state = [_digests(a=("torch.float32", 1.0), b=("torch.bfloat16", 1.0))]
    assert outside_state_reasons(trial, reference) == []  # b never changed; a kept fp32
    assert outside_state_reasons(trial, TrialResult(record=None)) == []  # type: ignore[arg-type]
    # float64 state held in bf16 (a running mean kept in double): found by a hunt, it passed
    trial.outside_state = [_digests(a=("torch.float32", 1.0), c=("torch.bfloat16", 1.0))]
    (reason,) = outside_state_reasons(trial, reference)
    assert reason.startswith("state outside the optimizer held in bfloat16: training changes c ")


def test_check_rejects_an_ema_teacher_left_trainable_but_out_of_the_optimizer() -> None:
    """Found by a hunt: a mean teacher left with requires_grad=True (a common oversight), out
    of the optimizer and moved only by train_step's EMA, escaped the state check (it digested
    frozen parameters only) and bf16_sr was accepted holding it in bf16."""
    model, _ = mean_teacher.make_model()
    model.teacher.requires_grad_(True)
    report = autoprec.check(
        model,
        mean_teacher.make_batches(),
        train_step=mean_teacher.train_step,
        optimizer=torch.optim.AdamW(model.student.parameters(), lr=1e-3),
        steps=20,
        modes=["bf16_sr"],
    )
    reasons = report.verdict("bf16_sr").reasons
    assert any(r.startswith("state outside the optimizer held in bfloat16") for r in reasons)


def test_trials_record_outside_state_and_the_reference_cache_keeps_it(tmp_path) -> None:
    model, _ = running_stats.make_model()
    batches = running_stats.make_batches(count=6)
    optimizer = torch.optim.AdamW(model.parameters())
    recipe = TrainingRecipe(optimizer=optimizer, loss_fn=running_stats.loss_fn)
    runs = [
        run_trial(autoprec.ModeSpec(mode="fp32"), model, batches, recipe=recipe, steps=4, seed=s)
        for s in (0, 1)
    ]
    start, _first_step, _end = runs[0].outside_state  # before, after the first step, after
    assert set(start) == {"0.mean", "0.var"} and start["0.mean"].dtype == "torch.float32"
    assert changed_state(runs[0]) == ["0.mean", "0.var"]
    assert torch.equal(model[0].mean, torch.zeros(16))  # the trial trained a copy
    pure = run_trial(autoprec.ModeSpec(mode="bf16_pure"), model, batches, recipe=recipe, steps=4)
    assert pure.outside_state[0]["0.mean"].dtype == "torch.bfloat16"
    assert judge(pure, runs[0], runs[1]).reasons[-1].startswith("state outside the optimizer")
    path = references_path(f"sqlite:///{tmp_path / 'x.db'}", "s")
    save_references(path, _fingerprint(), Fp32Runs(*runs))
    loaded = load_references(path, _fingerprint())
    assert loaded is not None and loaded.reference.outside_state == runs[0].outside_state


def test_check_under_a_train_step_keeps_the_running_statistics_fp32_too() -> None:
    # under train_step the probe's scan ran no forward, so the standardiser it keeps in fp32
    # under loss_fn was held in bf16 and the mode rejected for it; the scan now calls the
    # model with what train_step passes plan.model
    model, _ = running_stats.make_model()
    before = copy.deepcopy(model.state_dict())

    def train_step(plan, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return running_stats.loss_fn(plan.model(input=x), y)  # called by keyword

    report = autoprec.check(
        _KeywordInput(model),
        running_stats.make_batches(count=24),
        train_step=train_step,
        steps=20,
        modes=["bf16_sr"],
    )
    verdict = report.verdict("bf16_sr")
    assert verdict.spec.keep_fp32 == ("net.0",)
    assert not any(reason.startswith("state outside") for reason in verdict.reasons)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


class _KeywordInput(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.net(input)


class _PairModel(torch.nn.Module):
    """Takes one argument, a pair of tensors; counts its calls in a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = running_stats.RunningStandardizer(8)
        self.head = torch.nn.Linear(16, 1)
        self.calls = 0

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        return self.head(torch.cat([self.norm(pair[0]), pair[1]], dim=1))


class _Reassigning(nn.Module):
    """A running mean its forward assigns anew (``self.mean = ...``), as many codebases do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("mean", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return self.linear(x - self.mean)


def test_the_probe_gives_a_reassigned_buffer_its_own_tensor_back() -> None:
    # the FLOP scan put back the values only: the slot kept the scan's new tensor, so a
    # reference the user held no longer tracked the model (found by a hunt)
    model = nn.Sequential(_Reassigning(), nn.Linear(16, 4))
    held = model[0].mean
    mix = autoprec.probe(model, torch.randn(4, 16)).layers
    assert mix is not None and mix.running_buffers == ("0.mean",)
    assert model[0].mean is held and torch.equal(held, torch.zeros(16))


def _pair_batches() -> list:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(16):
        a, b = (
            torch.randn(32, 8, generator=generator) * 3 + 2,
            torch.randn(32, 8, generator=generator),
        )
        batches.append(((a, b), a.sum(1, keepdim=True) + b[:, :1]))
    return batches


def test_the_scan_calls_a_one_argument_tuple_input_as_training_does_and_never_the_users_model() -> (
    None
):
    # ((a, b), y) with a loss_fn trains model((a, b)); the scan called model(a, b), failed,
    # and found no running statistics to keep; and without a device it ran its forwards on the
    # user's own model (here: its call counter moved)
    model = _PairModel()
    report = autoprec.check(
        model,
        _pair_batches(),
        loss_fn=lambda output, target: torch.nn.functional.mse_loss(output.float(), target),
        steps=20,
        modes=["bf16_sr"],
    )
    assert report.verdict("bf16_sr").spec.keep_fp32 == ("norm",)
    assert model.calls == 0


class _CountingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def test_the_scan_leaves_a_forward_with_side_effects_off_the_users_model() -> None:
    model = _CountingModel()
    batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(12)]
    autoprec.check(
        model,
        batches,
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        steps=20,
        modes=["amp_bf16"],
    )
    assert model.calls == 0


def test_the_way_out_names_state_on_the_root_beside_a_submodules() -> None:
    """Found by a hunt: with state on the root and in a submodule, the advice named only the
    submodule's keep_fp32, and following it still got the mode rejected."""
    from autoprec.drift_outside_state import _way_out

    advice = _way_out(["teacher.0.weight", "target_mean"])
    assert "keep_fp32=['teacher.0']" in advice
    assert "target_mean on the model's root module cannot be kept apart" in advice
    assert "root module" not in _way_out(["teacher.0.weight"])
