"""tune() for real on CPU: small tasks, budgets of seconds."""

from __future__ import annotations

import copy
import math
import os
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import torch

import autoprec
from autoprec.drift_blind_spots import BF16_CONVERGED_COST, BF16_WEIGHT_AVERAGE
from autoprec.model_copies import CompiledForward
from autoprec.outcomes import TrialOutcome
from autoprec.report import outcomes_from_study
from autoprec.run_inputs import resolve_compile, uncompiled_model
from autoprec.search_events import SearchEvent
from autoprec.specs import ModeSpec
from autoprec.tune_result import eager_fp8_advice
from autoprec.tuning import tune
from examples import tasks, tiny_gpt


def _loader(task: tasks.Task) -> list:
    return task.batches + task.heldout


def test_memory_objective_picks_an_accepted_lean_mode_and_rejects_lost_updates() -> None:
    task = tasks.regression(lr=1e-4)
    before = copy.deepcopy(task.model.state_dict())
    result = tune(
        task.model,
        _loader(task),
        budget_minutes=0.75,
        loss_fn=task.mse,
        optimizer=task.optimizer,
        objective="memory",
        modes=["bf16_pure", "bf16_kahan", "bf16_sr", "amp_bf16"],
    )
    statuses = {o.label: o.status for o in result.trials}
    assert statuses["bf16_pure"] == "rejected"
    pure = next(o for o in result.trials if o.label == "bf16_pure")
    assert any(r.startswith("updates lost to rounding") for r in pure.reasons)
    # bf16_kahan passes (its second moment is fp32) but holds 2 bytes more per weight
    assert statuses["bf16_kahan"] == "accepted"
    assert statuses["bf16_sr"] == "accepted"
    assert result.chosen.mode == "bf16_sr"  # leanest that passed
    assert result.profile.evidence is not None
    assert (
        result.profile.evidence.chosen.state_bytes < result.profile.evidence.reference.state_bytes
    )
    # the CPU memory objective counts what autograd saves for backward too
    assert all(o.memory_kind == "state_and_activations" for o in result.trials)
    chosen = next(o for o in result.trials if o.label == "bf16_sr")
    assert chosen.activation_bytes and chosen.memory_bytes == (
        chosen.state_bytes + chosen.activation_bytes
    )
    assert result.profile.evidence.chosen.activation_bytes == chosen.activation_bytes
    assert result.profile.evidence.drift["update_fraction"] == pytest.approx(1.0, abs=0.05)
    # none known for stochastic rounding's trial; its bf16 weights carry the EMA note
    assert result.profile.evidence.blind_spots == (BF16_CONVERGED_COST, BF16_WEIGHT_AVERAGE)
    # the user's model is unchanged
    assert all(torch.equal(v, task.model.state_dict()[k]) for k, v in before.items())
    assert not task.optimizer.state
    assert "bf16_sr" in result.summary() and "rejected" in result.summary()


def test_falls_back_to_fp32_when_every_candidate_drifts() -> None:
    task = tasks.regression(lr=1e-4)
    result = tune(
        task.model,
        _loader(task),
        budget_minutes=0.5,
        loss_fn=task.mse,
        optimizer=task.optimizer,
        objective="memory",
        modes=["bf16_pure", "bf16_pure+8bit-optim"],
    )
    assert result.chosen.mode == "fp32"
    # bf16_pure and its 8-bit-optimizer variant both lose their updates
    assert [o.label for o in result.trials] == ["bf16_pure", "bf16_pure+8bit-optim"]
    assert {o.status for o in result.trials} == {"rejected"}
    assert result.profile.note and result.profile.note.startswith("No candidate was accepted")
    assert "bf16_pure: rejected" in result.profile.note


def test_budget_is_a_hard_wall() -> None:
    model, _ = tiny_gpt.make_model()
    batches = tiny_gpt.make_batches(count=16)
    start = time.monotonic()
    # 0.4 minutes: at 0.25 a loaded CI machine (fp32 step 0.0365 s, ~1 s of copying per run)
    # leaves under 40 steps' time for 10 runs, which is refused as too small (gc_pauses was)
    result = tune(model, batches, budget_minutes=0.4)
    wall = time.monotonic() - start
    assert wall <= 24 * 1.05, f"{wall:.1f} s for a 24 s budget"
    assert result.budget.used_seconds <= 24 * 1.05
    assert result.budget.trial_steps >= 20
    # trials under 40 steps say so: the movement check misread one at 20-30 on the ground truth
    short = [note for note in result.checks_not_run if note.startswith("trials ran")]
    assert bool(short) == (result.budget.trial_steps < 40), (result.budget.trial_steps, short)


def test_short_trials_get_a_note_with_the_budget_for_40_steps() -> None:
    from autoprec.run_setup import short_trial_notes

    (note,) = short_trial_notes(20, tuned=True)
    assert "trials ran 20 steps" in note and "2.0x this one" in note
    assert short_trial_notes(40, tuned=True) == () == short_trial_notes(300, tuned=True)
    (check_note,) = short_trial_notes(30, tuned=False)
    assert "steps=40 or more" in check_note


def _interrupt_after(count: int, done: list[str]) -> Callable[[SearchEvent], None]:
    """An on_event that records finished candidates in ``done`` and stops the run (Ctrl-C)
    after ``count`` of them."""

    def interrupt(event: SearchEvent) -> None:
        if event.kind == "done":
            done.append(event.label)
            if len(done) == count:
                raise KeyboardInterrupt

    return interrupt


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_resume_skips_finished_candidates(tmp_path: Path, kind: str) -> None:
    # a file path is an Optuna journal file (for many workers on one node); it was passed to
    # Optuna as a URL and refused ("Could not parse SQLAlchemy URL"), though documented
    model, _ = tiny_gpt.make_small_model()
    batches = tiny_gpt.make_small_batches()
    storage = (
        f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "j" / "s.log")
    )
    done: list[str] = []
    interrupt_after_two = _interrupt_after(2, done)

    with pytest.raises(KeyboardInterrupt):
        tune(
            model,
            batches,
            budget_minutes=1,
            storage=storage,
            study_name="s",
            modes=["amp_bf16", "bf16_kahan", "bf16_sr"],
            on_event=interrupt_after_two,
        )
    events: list[SearchEvent] = []
    result = tune(
        model,
        batches,
        budget_minutes=1,
        storage=storage,
        study_name="s",
        modes=["amp_bf16", "bf16_kahan", "bf16_sr"],
        on_event=events.append,
    )
    kinds = {e.label: e.kind for e in events if e.kind != "start"}
    assert result.budget.reference_reused
    assert kinds[done[0]] == "skip" and kinds[done[1]] == "skip"
    assert kinds["bf16_sr"] == "done"
    assert {o.label for o in result.trials} == {"amp_bf16", "bf16_kahan", "bf16_sr"}  # exactly
    # counted as run now: bf16_sr alone (the reference, its noise run and two modes were read
    # back; they counted as run, "5 trials" for one)
    noise = result.budget.fp32_noise_runs
    assert (result.budget.trials_run, result.budget.trials_from_study) == (1, 3 + noise)
    assert result.profile.evidence is not None
    assert result.profile.evidence.trial_count == 4 + noise
    outcomes, chosen, _ = outcomes_from_study(storage, None)  # `autoprec report` reads it
    assert chosen == result.chosen.label and len(outcomes) == 4


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, b: tune(m, [], budget_minutes=1), ValueError, "loader yielded no batches"),
        (  # an exhausted generator: the message says what that is
            lambda m, b: tune(m, iter(()), budget_minutes=1),
            ValueError,
            "already consumed yields none",
        ),
        (  # an empty DataLoader was told to "pass a list or a DataLoader"
            lambda m, b: tune(
                m,
                torch.utils.data.DataLoader(list(range(3)), batch_size=4, drop_last=True),
                budget_minutes=1,
            ),
            ValueError,
            "this DataLoader's dataset has 3 samples; drop_last drops a last batch under",
        ),
        (
            lambda m, b: tune(m, b, budget_minutes=0),
            ValueError,
            r"budget_minutes must be a positive, finite number of minutes up to 1e\+07 but got 0",
        ),
        (lambda m, b: tune(m, b, budget_minutes=-2), ValueError, "must be a positive"),
        (  # it crashed converting infinity to an int
            lambda m, b: tune(m, b, budget_minutes=math.inf),
            ValueError,
            "finite number of minutes up to 1e\\+07 but got inf",
        ),
        (  # torch's bare "Overflow when unpacking long long"; a float seed reached the profile
            lambda m, b: tune(m, b, budget_minutes=1, seed=2**64 - 1),
            ValueError,
            r"seed must be an integer .* the noise runs use seed \+ 1\), not 18446744073709551615",
        ),
        (lambda m, b: tune(m, b, budget_minutes=1, seed=1.5), ValueError, "not 1.5"),
        (  # it failed inside autoprec after the 300-step reference, "please report it"
            lambda m, b: tune(m, b, budget_minutes=1, eval_fn=42),
            TypeError,
            r"eval_fn must be a function eval_fn\(model\) -> float, not int",
        ),
        (
            lambda m, b: tune(torch.nn.ReLU(), b, budget_minutes=1),
            ValueError,
            "model has no parameters",
        ),
        (
            lambda m, b: tune(m, [torch.zeros(2, 3, 4)], budget_minutes=1),
            ValueError,
            r"fp32 reference failed at step 0: .*Check that the loader's batches fit the model",
        ),
        (lambda m, b: tune(m, 42, budget_minutes=1), TypeError, "iterable of batches"),
        (
            lambda m, b: tune(m, b, budget_minutes=1, objective="fastest"),
            ValueError,
            "objective must be one of",
        ),
        (lambda m, b: tune(m, b, budget_minutes=1, modes=["fp64"]), ValueError, "Unknown mode"),
        (lambda m, b: tune(m, b, budget_minutes=1, modes=[]), ValueError, "modes is empty"),
        (  # a dict of DriftThresholds fields is accepted; a typo in one is named
            lambda m, b: tune(m, b, budget_minutes=1, thresholds={"min_update_frac": 0.5}),
            ValueError,
            "thresholds: min_update_frac: Extra inputs are not permitted",
        ),
        (
            lambda m, b: tune(m, b, budget_minutes=1, thresholds=0.5),
            TypeError,
            "thresholds must be a DriftThresholds or a dict of its fields, not float",
        ),
        (  # a typo in a keep_fp32 name fails before anything trains, naming the modules
            lambda m, b: tune(m, b, budget_minutes=1, keep_fp32=["lm_haed"]),
            ValueError,
            r"keep_fp32 pattern 'lm_haed' matches no module of TinyGPT \(its modules: wte, wpe, "
            r"blocks, blocks.0, .* and 3 more\). Did you mean 'lm_head'\?",
        ),
        (
            lambda m, b: tune(m, b, budget_minutes=1, keep_fp32="lm_head"),
            TypeError,
            "keep_fp32 must be a list of module-name patterns",
        ),
        (
            lambda m, b: tune(m, b, budget_minutes=1, keep_fp32=[""]),
            ValueError,
            "the whole model cannot be kept",
        ),
        (  # "*" kept everything: every mode was fp32 under its name, and called safe
            lambda m, b: tune(m, b, budget_minutes=1, keep_fp32=["*"]),
            ValueError,
            r"keep_fp32 \['\*'\] keeps every trainable parameter of TinyGPT in fp32",
        ),
    ],
)
def test_clear_errors(call, error: type, message: str) -> None:
    model, _ = tiny_gpt.make_small_model()
    with pytest.raises(error, match=message):
        call(model, tiny_gpt.make_small_batches())


def test_result_profile_round_trips(tmp_path: Path) -> None:
    model, _ = tiny_gpt.make_small_model()
    result = tune(model, tiny_gpt.make_small_batches(), budget_minutes=0.25, modes=["amp_bf16"])
    path = result.profile.save(tmp_path / "p.json")
    loaded = autoprec.load_profile(path, strict=True)
    assert loaded.spec == result.chosen and loaded.evidence == result.profile.evidence
    assert type(result).model_validate_json(result.model_dump_json()) == result


def _cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> object:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=1e-5)


def test_a_decaying_schedule_rejects_pure_bf16_at_its_floor_lr() -> None:
    # at the constant peak lr 1e-3 pure bf16 keeps its updates; the cosine's tail does not
    task = tasks.regression(lr=1e-3)
    common = {
        "loss_fn": task.mse,
        "optimizer": task.optimizer,
        "modes": ["bf16_pure"],
        "objective": "memory",  # judged whatever its speed
    }
    peak_only = tune(task.model, _loader(task), budget_minutes=0.3, **common)
    at_peak = peak_only.trials[0]
    assert at_peak.drift["update_fraction"] > 0.9
    assert not any(r.startswith("updates lost") for r in at_peak.reasons)
    scheduled = tune(
        task.model,
        _loader(task),
        budget_minutes=0.3,
        scheduler=_cosine,
        total_steps=3000,
        **common,
    )
    pure = scheduled.trials[0]
    assert pure.label == "bf16_pure" and pure.status == "rejected"
    assert any(
        r.startswith("updates lost to rounding at lr 3.42e-05, the schedule's floor at step 2700")
        for r in pure.reasons
    ), pure.reasons
    assert scheduled.chosen.mode == "fp32"
    recipe = scheduled.profile.recipe
    assert recipe is not None and recipe == scheduled.recipe
    assert recipe.scheduler == "tests.test_tuning:_cosine" and recipe.total_steps == 3000
    assert [p.role for p in recipe.lr_points] == ["peak", "floor"]


def test_an_lr_zeroed_by_a_warmup_scheduler_is_an_error_not_a_pass() -> None:
    task = tasks.regression()
    torch.optim.lr_scheduler.LambdaLR(task.optimizer, lambda step: min(1.0, step / 100))
    with pytest.raises(ValueError, match=r"learning rate is 0.*scheduler="):
        tune(
            task.model,
            _loader(task),
            budget_minutes=0.3,
            loss_fn=task.mse,
            optimizer=task.optimizer,
        )


def test_a_reference_that_does_not_move_is_an_error() -> None:
    frozen, _ = tiny_gpt.make_small_model()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        tune(frozen, tiny_gpt.make_small_batches(), budget_minutes=0.3)
    task = tasks.regression()

    def detached(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # the loss never reaches the parameters
        return (output.detach() - target).pow(2).mean().requires_grad_()

    with pytest.raises(ValueError, match="did not change any weight"):
        tune(task.model, _loader(task), budget_minutes=0.3, loss_fn=detached, modes=["amp_bf16"])


def test_tune_leaves_the_global_rngs_as_it_found_them() -> None:
    import random

    import numpy

    task = tasks.regression()
    dataset = torch.utils.data.TensorDataset(
        torch.cat([b[0] for b in task.batches]), torch.cat([b[1] for b in task.batches])
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)
    torch.manual_seed(123)
    random.seed(5)
    numpy.random.seed(7)
    expected = (torch.rand(3), random.random(), numpy.random.rand())
    torch.manual_seed(123)
    random.seed(5)
    numpy.random.seed(7)
    optuna.logging.set_verbosity(optuna.logging.INFO)  # and the caller's optuna log level
    tune(task.model, loader, budget_minutes=0.5, loss_fn=task.mse, modes=["amp_bf16"])
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), numpy.random.rand()) == expected[1:]
    assert optuna.logging.get_verbosity() == optuna.logging.INFO


def test_a_first_tune_in_a_fresh_process_leaves_pythons_random_alone() -> None:
    # importing the progress display (rich) draws from Python's random; it was imported
    # before the RNG states were saved, so a process's first tune() moved random's state
    script = (
        "import random\n"
        "from examples import tasks\n"
        "import autoprec\n"
        "task = tasks.regression()\n"
        "random.seed(5)\n"
        "autoprec.tune(task.model, task.batches + task.heldout, budget_minutes=0.3,"
        " loss_fn=task.mse, modes=['amp_bf16'], progress=False)\n"
        "print(random.random())\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    random.seed(5)
    assert float(done.stdout.strip().splitlines()[-1]) == random.random()


def test_a_study_refuses_to_resume_for_another_run(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    model, _ = tiny_gpt.make_small_model()
    batches = tiny_gpt.make_small_batches()
    common = {"budget_minutes": 0.3, "storage": storage, "study_name": "s"}
    first = tune(model, batches, modes=["amp_bf16"], **common)
    assert not first.budget.reference_reused
    changes = [
        ({"objective": "memory"}, r"objective \(speed -> memory\)"),
        ({"modes": ["bf16_kahan"]}, "candidates"),
        ({"optimizer": lambda p: torch.optim.AdamW(p, lr=5e-5)}, r"recipe \(.*optimizer_groups"),
        ({"seed": 3}, r"seed \(0 -> 3\)"),
        ({"keep_fp32": ["lm_head"]}, r"keep_fp32 \(\[\] -> \['lm_head'\]\)"),
    ]
    for change, message in changes:
        options = {"modes": ["amp_bf16"], **change}
        with pytest.raises(
            ValueError, match=f"study 's' in .* holds outcomes of another run.*{message}"
        ):
            tune(model, batches, **{**common, **options})
    other_model, _ = tiny_gpt.make_model(seed=1, **tiny_gpt.SMALL)
    with pytest.raises(ValueError, match=r"model \(other weights or data\).*--study NAME"):
        tune(other_model, batches, modes=["amp_bf16"], **common)
    with pytest.raises(ValueError, match=r"batches \(other weights or data\)"):
        tune(model, tiny_gpt.make_small_batches()[::-1], modes=["amp_bf16"], **common)
    # on a CPU, another thread count is another machine (found by a hunt: its speeds were
    # reused); a budget that fits whatever the thread count does to the step on a busy
    # machine (0.3 minutes did not, at 0.43 s a step: the budget's refusal came first)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(ValueError, match=r"another run \(budget_minutes.*; hardware differ\)"):
            tune(model, batches, modes=["amp_bf16"], **{**common, "budget_minutes": 3.0})
    finally:
        torch.set_num_threads(threads)
    # a new study in the same file runs; the original resumes with its stored reference
    fresh = tune(
        model, batches, objective="memory", modes=["amp_bf16"], **{**common, "study_name": "t"}
    )
    assert not fresh.budget.reference_reused
    again = tune(model, batches, modes=["amp_bf16"], **common)
    assert again.budget.reference_reused
    assert again.reference.final_loss == first.reference.final_loss


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _regression_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 1)) for _ in range(10)]


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def test_a_study_whose_reference_failed_takes_the_fixed_rerun(tmp_path: Path) -> None:
    """The fingerprint was recorded before the fp32 reference ran: when it failed (a diverging
    lr), the study held no outcome, yet the re-run with the lr fixed was refused as another
    run's, and only a new --out or study name went on."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    common = {"budget_minutes": 0.2, "storage": storage, "study_name": "s", "loss_fn": _mse}
    big = [(10 * x, 10 * y) for x, y in _regression_batches()]

    def sgd(lr: float) -> Callable[..., torch.optim.Optimizer]:
        return lambda params: torch.optim.SGD(params, lr=lr)

    with pytest.raises(ValueError, match="The fp32 reference failed"):
        tune(_Regressor(), big, modes=["amp_bf16"], optimizer=sgd(10.0), **common)
    result = tune(_Regressor(), big, modes=["amp_bf16"], optimizer=sgd(1e-3), **common)
    assert not result.budget.reference_reused
    with pytest.raises(ValueError, match="holds outcomes of another run"):  # now it holds some
        tune(_Regressor(), big, modes=["amp_bf16"], optimizer=sgd(1e-2), **common)


def test_a_loss_without_gradient_is_named_as_such() -> None:
    def detached(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _mse(output.detach(), target)

    with pytest.raises(ValueError, match="The loss has no gradient") as caught:
        tune(_Regressor(), _regression_batches(), budget_minutes=0.2, loss_fn=detached)
    assert "batches fit the model" not in str(caught.value)


@pytest.mark.parametrize(
    ("loss_fn", "found"),
    [
        (lambda output, target: (output - target).square(), r"a tensor of shape \(16, 1\)"),
        (lambda output, target: (_mse(output, target), output), "a tuple of 2"),
    ],
)
def test_a_loss_that_is_not_one_number_says_what_it_was(loss_fn: object, found: str) -> None:
    with pytest.raises(
        ValueError, match=rf"loss_fn\(output, target\) returned {found}, not a "
    ) as e:
        tune(_Regressor(), _regression_batches(), budget_minutes=0.2, loss_fn=loss_fn)
    # the message says what to do; "check that the loader's batches fit" would mislead
    assert "batches fit the model" not in str(e.value)
    if "tuple" in found:  # a (loss, logs) pair: "reduce it to one number" did not fit
        assert "return the loss tensor alone" in str(e.value)


def test_a_model_that_cannot_be_copied_names_the_attribute() -> None:
    import threading

    model = _Regressor()
    model.lock = threading.Lock()  # type: ignore[attr-defined]
    # refused before anything runs, with or without a device (the probe's scan copies it)
    for device in (None, "cpu"):
        with pytest.raises(TypeError, match=r"copy\.deepcopy.*attribute lock \(lock\) cannot"):
            tune(model, _regression_batches(), budget_minutes=0.2, loss_fn=_mse, device=device)


def test_a_model_holding_a_tensor_with_history_is_told_to_drop_it() -> None:
    """A mixture-of-experts keeps its aux_loss from the last forward: the advice was about
    locks, files and loggers (found by a hunt)."""
    model = _Regressor()
    model.aux_loss = model(torch.randn(2, 8)).pow(2).mean()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"aux_loss holds a tensor with autograd history.*None"):
        tune(model, _regression_batches(), budget_minutes=0.2, loss_fn=_mse)
    # in a list and in a buffer too (a review: they were told about locks and loggers)
    model.aux_loss = [model(torch.randn(2, 8)).sum()]  # type: ignore[attr-defined]
    model.linear.register_buffer("last", model(torch.randn(2, 8)))
    with pytest.raises(TypeError, match=r"aux_loss, linear\.last hold a tensor with autograd"):
        tune(model, _regression_batches(), budget_minutes=0.2, loss_fn=_mse)


def test_a_references_cache_that_cannot_be_written_warns_and_the_tune_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the references cache (torch.save's RuntimeError) ended the run with a
    traceback (found by a review); the cache only saves a resumed run's fp32 runs."""
    import autoprec.tuning as tuning

    def full(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed")

    monkeypatch.setattr(tuning, "save_references", full)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.warns(UserWarning, match=r"Could not store the fp32 reference runs.*goes on"):
        result = tune(_Regressor(), _regression_batches(), budget_minutes=0.2, loss_fn=_mse,
                      modes=["amp_bf16"], storage=storage)  # fmt: skip
    assert [t.label for t in result.trials] == ["amp_bf16"] and result.profile is not None


def test_a_model_with_torchs_old_weight_norm_hook_is_told_the_form_that_copies() -> None:
    # the hook's computed weight cannot be deep-copied; the advice was about locks and loggers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook form
        model = torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(4, 8)))
    model.append(torch.nn.Linear(8, 1))
    with pytest.raises(TypeError, match=r"0 use torch\.nn\.utils\.weight_norm.*parametrizations"):
        tune(model, _regression_batches(), budget_minutes=0.2, loss_fn=_mse)


def test_an_optimizer_factory_returning_a_lightning_dict_says_what_to_return() -> None:
    def configure(params: object) -> dict:
        return {"optimizer": torch.optim.AdamW(params), "lr_scheduler": None}  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"returned a dict .Lightning.s configure_optimizers"):
        tune(
            _Regressor(),
            _regression_batches(),
            budget_minutes=0.2,
            loss_fn=_mse,
            optimizer=configure,
        )
    with pytest.raises(TypeError, match="a Lightning-style dict or list is not an optimizer"):
        tune(_Regressor(), _regression_batches(), budget_minutes=0.2, optimizer={"optimizer": 1})  # type: ignore[arg-type]


def test_a_tuple_batch_without_a_loss_says_how_the_model_was_called() -> None:
    with pytest.raises(ValueError, match=r"called model\(\*batch\) with all 2 elements") as caught:
        tune(_Regressor(), _regression_batches(), budget_minutes=0.2)
    assert "--loss" in str(caught.value) and "positional argument" in str(caught.value)


def test_a_meta_model_and_an_unusable_device_are_refused_up_front() -> None:
    with torch.device("meta"):
        meta = _Regressor()
    with pytest.raises(ValueError, match=r"meta device .*to_empty"):
        tune(meta, _regression_batches(), budget_minutes=0.2, loss_fn=_mse, device="cpu")
    # a torch.func ensemble's meta template beside real weights: to_empty() would erase them
    ensemble = _Regressor()
    ensemble.template = meta  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"parameters are on the meta device") as caught:
        tune(ensemble, _regression_batches(), budget_minutes=0.2, loss_fn=_mse)
    assert "to_empty" not in str(caught.value) and "template." in str(caught.value)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda:0', but this torch .* CPU build|sees"):
            tune(_Regressor(), _regression_batches(), budget_minutes=0.2, device="cuda:0")
    with pytest.raises(ValueError, match="'cpu' or 'cuda:N'"):
        tune(_Regressor(), _regression_batches(), budget_minutes=0.2, device="tpu")


def test_a_rocm_build_may_name_its_gpu_as_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ROCm build of torch has no CUDA version but names its AMD GPUs "cuda": it was refused
    as "a CPU build without CUDA" (found by a hunt)."""
    from autoprec.run_inputs import check_device

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda")
    check_device("cuda:0")
    with pytest.raises(ValueError, match=r"device='cuda:1', but torch sees 1 CUDA device"):
        check_device("cuda:1")
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ValueError, match="CPU build without CUDA or ROCm"):
        check_device("cuda:0")


def test_a_model_in_bf16_is_refused_and_left_as_it_is() -> None:
    model = _Regressor().to(torch.bfloat16)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"not fp32 \(torch\.bfloat16 in .*model\.float\(\)"):
        tune(model, _regression_batches(), budget_minutes=0.2, loss_fn=_mse)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_requested_mode_that_cannot_run_here_is_an_error(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'new' / 'study.db'}"
    with pytest.raises(
        autoprec.UnsupportedModeError, match="fp8_te: fp8_te needs a CUDA GPU"
    ) as caught:
        tune(
            _Regressor(),
            _regression_batches(),
            budget_minutes=0.2,
            loss_fn=_mse,
            modes=["amp_bf16", "fp8_te"],
            storage=storage,
        )
    assert caught.value.reasons and not (tmp_path / "new").exists()  # nothing created


def test_tune_refusing_torchaos_fp8_for_the_hardware_points_to_the_screen() -> None:
    """Found by a hunt: tune's refusal of fp8_torchao on a machine without FP8 said only "run
    them where they can", where check() screens FP8's quality here, emulated."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(4)]
    kwargs = {"budget_minutes": 0.2, "loss_fn": _mse}
    with pytest.raises(autoprec.UnsupportedModeError, match=r"autoprec check --modes fp8_torchao"):
        tune(model, batches, modes=["fp8_torchao"], **kwargs)
    with pytest.raises(autoprec.UnsupportedModeError) as caught:  # TE: no emulation to screen
        tune(model, batches, modes=["fp8_te"], **kwargs)
    assert "autoprec check" not in str(caught.value)
    with pytest.raises(autoprec.UnsupportedModeError) as caught:  # no Linear FP8 could convert
        tune(_Regressor(), _regression_batches(), modes=["fp8_torchao"], **kwargs)
    assert "autoprec check" not in str(caught.value)


def test_compiled_tune_writes_a_compiled_profile_that_trains(tmp_path: Path) -> None:
    """compile=True: the reference and the candidate train compiled (graphs built in their
    warm-up), the winner's profile records it, and apply() compiles the model the same way."""
    task = tasks.regression(lr=1e-2, batches=30)
    result = tune(
        task.model,
        task.batches,
        budget_minutes=3,
        loss_fn=task.mse,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        modes=["fp32", "amp_bf16"],
        compile=True,
        progress=False,
    )
    assert result.reference.spec.compile and all(t.spec.compile for t in result.trials)
    assert result.profile.spec.compile and result.profile.spec.label.endswith("+compiled")
    path = result.profile.save(tmp_path / "compiled.json")
    model = copy.deepcopy(task.model)
    plan = autoprec.load_profile(path).apply(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert plan.model is model and isinstance(model.forward, CompiledForward)
    assert hasattr(model.forward.compiled, "_torchdynamo_orig_callable")
    losses = []
    for x, y in task.batches[:20]:
        with plan.autocast():
            loss = task.mse(plan.model(x), y)
        plan.step(loss)
        losses.append(float(loss.detach()))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def test_compile_auto_follows_the_users_model() -> None:
    model = tasks.regression().model
    assert uncompiled_model(model) == (model, False)
    assert uncompiled_model(torch.compile(model)) == (model, True)
    assert resolve_compile("auto", True) and not resolve_compile("auto", False)
    assert resolve_compile(True, False) and not resolve_compile(False, True)
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        resolve_compile("yes", False)


def test_fp8_that_lost_on_speed_eager_gets_compile_advice() -> None:
    def outcome(spec: ModeSpec, status: str, reason: str) -> TrialOutcome:
        return TrialOutcome(spec=spec, status=status, reasons=(reason,))

    fp8 = ModeSpec(mode="fp8_torchao")
    slower = "slower than amp_bf16: 1.40x its step time on the same 40 steps"
    (advice,) = eager_fp8_advice([outcome(fp8, "pruned", slower)])
    assert "fp8_torchao+tensorwise ran eager and lost on speed" in advice
    assert "compile=True" in advice
    compiled = fp8.model_copy(update={"compile": True})
    assert eager_fp8_advice([outcome(compiled, "pruned", slower)]) == ()
    assert eager_fp8_advice([outcome(fp8, "rejected", "held-out loss +0.1 worse")]) == ()
    # accepted, and slower than the chosen mode (the README's first H100 figures: 524
    # samples/s against amp_bf16's 1417) got no advice; found by a hunt
    accepted = outcome(fp8, "accepted", "").model_copy(update={"samples_per_second": 524.0})
    winner = outcome(ModeSpec(mode="amp_bf16"), "accepted", "")
    winner = winner.model_copy(update={"samples_per_second": 1417.0})
    (advice,) = eager_fp8_advice([accepted, winner], winner)
    assert "fp8_torchao+tensorwise ran eager and lost on speed" in advice
    assert eager_fp8_advice([accepted, winner], accepted) == ()  # it won
    te = outcome(ModeSpec(mode="fp8_te"), "pruned", slower)
    assert eager_fp8_advice([te]) == ()  # Transformer Engine fuses its own casts


def test_an_eval_fn_failing_in_one_mode_is_a_failed_trial_not_a_rejection() -> None:
    # a failure that says nothing about numerics (here the user's eval_fn; likewise a
    # compiler error) used to end as "rejected", as if the gate had judged the mode
    task = tasks.regression(lr=1e-3)

    def eval_fn(model: torch.nn.Module) -> float:
        if next(model.parameters()).dtype != torch.float32:
            raise TypeError("needs fp32 weights")
        return 0.5

    result = tune(
        task.model,
        _loader(task),
        budget_minutes=0.3,
        loss_fn=task.mse,
        optimizer=task.optimizer,
        eval_fn=eval_fn,
        objective="memory",  # leaner than fp32: never pruned for speed
        modes=["bf16_sr"],
    )
    (trial,) = result.trials
    assert trial.status == "failed"
    assert trial.reasons == ("eval failed: eval_fn(model) raised TypeError: needs fp32 weights",)
    assert result.chosen.mode == "fp32"


def test_tune_leaves_batches_a_model_changes_in_place_as_they_were() -> None:
    class Halves(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.mul_(0.5))

    task = tasks.regression(lr=1e-3)
    batches = _loader(task)
    before = [x.clone() for x, _ in batches]
    result = tune(
        Halves(), batches, budget_minutes=0.3, loss_fn=task.mse, modes=["amp_bf16"],
        objective="memory",
    )  # fmt: skip
    assert all(torch.equal(x, b) for (x, _), b in zip(batches, before, strict=True))
    assert any("changes its input batches in place" in n for n in result.checks_not_run)
    assert "note: the model (or loss_fn / train_step) changes" in result.summary()


class _HalvesItsInputWhenEvaluated(torch.nn.Module):
    """Scales its input batch in place in eval mode only (``x.mul_(0.5)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x if self.training else x.mul_(0.5))


def test_a_resumed_study_keeps_reading_fresh_batches_for_a_model_that_changes_them(
    tmp_path: Path,
) -> None:
    # a resumed tune reuses the stored fp32 runs, whose held-out passes found the changes: it
    # read the batches as they were and so let the model halve them under every candidate
    task = tasks.regression(lr=1e-3)
    batches = task.batches[:8] + task.heldout
    before = copy.deepcopy(batches)
    common = {
        "loss_fn": task.mse, "budget_minutes": 0.3, "modes": ["bf16_sr"], "objective": "memory",
        "storage": str(tmp_path / "study.log"), "study_name": "s", "progress": False,
    }  # fmt: skip

    def interrupt_at_the_candidate(event: SearchEvent) -> None:
        if event.kind == "start" and event.label == "bf16_sr":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune(_HalvesItsInputWhenEvaluated(), batches, on_event=interrupt_at_the_candidate, **common)
    resumed = tune(_HalvesItsInputWhenEvaluated(), batches, **common)
    assert resumed.budget.reference_reused
    assert any("changes its input batches in place" in n for n in resumed.checks_not_run)
    assert resumed.chosen.mode == "bf16_sr", resumed.summary()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, before, strict=True))


def test_the_budget_a_too_small_budget_asks_for_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--budget 0.01` was told "Give at least 0.01 minutes": the advice left out what each run
    costs beyond its steps and was rounded down. Given what it asks for, calibration passes."""
    import re
    import types

    from autoprec import run_setup

    step, calibration = 0.5, 4.0  # 5 calibration steps of 0.5 s and 1.5 s of copying/converting
    monkeypatch.setattr(
        run_setup, "calibration_run", lambda setup: run_setup.Calibration(step, calibration, False)
    )

    def setup_for(budget_minutes: float) -> object:
        return types.SimpleNamespace(
            candidates=types.SimpleNamespace(specs=[None] * 3),
            deadline=budget_minutes * 60,
            clock=lambda: calibration,  # started at 0, calibration just ended
            compile=False,
            tail_seconds=0.0,
        )

    with pytest.raises(ValueError, match=r"too small.*Give at least") as raised:
        run_setup.calibrate(setup_for(0.5), 0.5)  # type: ignore[arg-type]
    # the CLI names its own flag: "--budget 0.5 is too small", not "budget_minutes=0.5"
    assert isinstance(raised.value, autoprec.BudgetTooSmallError)
    assert str(raised.value).startswith("budget_minutes=0.5 is too small: one fp32 step")
    # what a run costs beyond its steps is named: under compile it is most of the advice
    assert "about 1.5 s beyond its steps (copying, converting; calibration's)" in str(raised.value)
    assert raised.value.naming("--budget").startswith("--budget 0.5 is too small: one fp32")
    # copied and pickled whole (a tune in a process pool reports it, not a broken pool)
    import pickle

    for copied in (copy.copy(raised.value), pickle.loads(pickle.dumps(raised.value))):
        assert type(copied) is type(raised.value) and str(copied) == str(raised.value)
    asked = float(re.search(r"Give at least ([\d.]+) minutes", str(raised.value)).group(1))  # type: ignore[union-attr]
    assert asked > 0.5
    steps, _ = run_setup.calibrate(setup_for(asked), asked)  # type: ignore[arg-type]
    assert steps >= run_setup.MIN_TRIAL_STEPS
    # and enough for every run's shortest trial (5 runs: 3 candidates, the reference among
    # them, the noise run and the paired one)
    overhead = calibration - run_setup.CALIBRATION_STEPS * step
    left = (asked * 60 - calibration - 5 * overhead) * (1 - run_setup.BUDGET_RESERVE)
    assert left >= 5 * run_setup.MIN_TRIAL_STEPS * step * 1.5  # the old advice left 26 s of 60


@pytest.mark.parametrize(("draws_random", "runs", "noise_runs"), [(False, 5, 2), (True, 6, 3)])
def test_a_too_small_budget_counts_the_noise_runs_it_plans(
    monkeypatch: pytest.MonkeyPatch, draws_random: bool, runs: int, noise_runs: int
) -> None:
    """The error names every run the budget must hold: a model with random draws gets the
    nudged fp32 run beside the paired one, and the advice counts it."""
    import types

    from autoprec import run_setup

    monkeypatch.setattr(
        run_setup, "calibration_run", lambda setup: run_setup.Calibration(0.5, 4.0, draws_random)
    )
    setup = types.SimpleNamespace(
        candidates=types.SimpleNamespace(specs=[None] * 3),
        deadline=30.0,
        clock=lambda: 4.0,
        compile=True,
        tail_seconds=0.0,
    )
    with pytest.raises(autoprec.BudgetTooSmallError) as raised:
        run_setup.calibrate(setup, 0.5)  # type: ignore[arg-type]
    assert (
        f"each of {runs} runs (the fp32 reference, its {noise_runs} noise runs and every "
        "candidate)" in str(raised.value)
    )
    assert "(copying, converting, compiling; calibration's)" in str(raised.value)


class _SlowStep(torch.nn.Module):
    calls = 0  # on the class: tune trains copies

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        time.sleep(self.seconds)
        return self.linear(x)


def test_the_calibration_stops_at_the_deadline() -> None:
    """Found by a hunt: the calibration ran its five steps whatever the budget, so a model of
    1.5 s steps was refused after 10.9 s of a 6 s budget. It stops at the deadline now and the
    refusal still asks for a budget that holds every run."""
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    model = _SlowStep(0.5)  # five steps: 2.5 s; the budget: 1.2 s
    _SlowStep.calls = 0
    with pytest.raises(autoprec.BudgetTooSmallError, match=r"one fp32 step takes.*Give at least"):
        tune(model, batches, budget_minutes=0.02, loss_fn=torch.nn.functional.mse_loss)
    # the probe's forward and the calibration's first step; it ran all five (6 calls) before
    assert _SlowStep.calls <= 3


class _CallbackStop(Exception):
    pass


@pytest.mark.parametrize("run", ["tune", "check"])
@pytest.mark.parametrize("phase", ["reference", "trial"])
def test_an_on_event_error_in_a_step_event_stops_the_run(run: str, phase: str) -> None:
    # an exception raised by on_event on a "step" event (a progress callback's own bug, or a
    # deliberate stop) was swallowed as a failed fp32 reference or a failed trial
    task = tasks.regression(lr=1e-2)

    def on_event(event: SearchEvent) -> None:
        in_trial = event.in_search
        if event.kind == "step" and in_trial == (phase == "trial"):
            raise _CallbackStop(f"{event.label} at step {event.step}")

    kwargs = {"loss_fn": task.mse, "optimizer": task.optimizer, "on_event": on_event}
    with pytest.raises(_CallbackStop):
        if run == "tune":
            tune(task.model, _loader(task), budget_minutes=0.3, modes=["amp_bf16"], **kwargs)
        else:
            autoprec.check(task.model, _loader(task), steps=20, modes=["amp_bf16"], **kwargs)


def test_a_storage_without_a_study_name_resumes_its_study(tmp_path: Path) -> None:
    # Optuna names a study at random when no name is given: a run given only a storage
    # started a new study on every call and never resumed
    model, _ = tiny_gpt.make_small_model()
    batches = tiny_gpt.make_small_batches()
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    done: list[str] = []
    interrupt_after_one = _interrupt_after(1, done)

    modes = ["amp_bf16", "bf16_sr"]
    with pytest.raises(KeyboardInterrupt):
        tune(
            model,
            batches,
            budget_minutes=1,
            storage=storage,
            modes=modes,
            on_event=interrupt_after_one,
        )
    events: list[SearchEvent] = []
    result = tune(
        model, batches, budget_minutes=1, storage=storage, modes=modes, on_event=events.append
    )
    assert result.budget.reference_reused
    assert {e.label: e.kind for e in events if e.kind != "start"}[done[0]] == "skip"
    import optuna

    assert optuna.get_all_study_names(storage=storage) == ["autoprec"]


def test_setup_time_is_not_counted_as_the_fp32_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt: the budget's reference phase was "everything since the start but the
    calibration steps", so setup before calibration counted as fp32 runs, and a resumed run
    that read its fp32 runs from the study still printed seconds of them."""
    from autoprec import tuning

    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    calibrate = tuning.calibrate

    def slow_setup(setup: object, budget_minutes: float) -> object:
        offset[0] += 30.0  # 30 s of setup (probe, copies) before the calibration steps
        return calibrate(setup, budget_minutes)  # type: ignore[arg-type]

    monkeypatch.setattr(tuning, "calibrate", slow_setup)
    task = tasks.regression(lr=1e-2)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    common = {"loss_fn": task.mse, "modes": ["amp_bf16"], "storage": storage, "clock": clock}
    first = tune(task.model, _loader(task), budget_minutes=2, **common)  # type: ignore[arg-type]
    again = tune(task.model, _loader(task), budget_minutes=2, **common)  # type: ignore[arg-type]
    assert again.budget.reference_reused and not first.budget.reference_reused
    assert first.budget.calibration_seconds >= 30 and again.budget.calibration_seconds >= 30
    assert again.budget.reference_seconds < 30 <= first.budget.calibration_seconds


def test_a_storage_of_several_studies_asks_which_to_resume(tmp_path: Path) -> None:
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    for name in ("run-a", "run-b"):
        made = optuna.create_study(storage=storage, study_name=name)
        made.set_user_attr("fingerprint", {"of": name})  # as autoprec's studies carry
    task = tasks.regression(lr=1e-2)
    with pytest.raises(ValueError, match=r"holds 2 autoprec studies \(run-a, run-b\).*study_nam"):
        tune(task.model, _loader(task), budget_minutes=0.3, loss_fn=task.mse, storage=storage)


def test_a_study_of_your_own_in_the_storage_is_never_written_to(tmp_path: Path) -> None:
    """Found by a hunt: a storage holding one study of the user's (single-objective, no
    trials) was adopted as the study to resume: autoprec's attributes and trials were written
    into it, every trial ended FAIL (two values for one objective) and ran again on resume."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(storage=storage, study_name="my-hpo", direction="minimize")
    task = tasks.regression(lr=1e-2)
    common = {"budget_minutes": 0.3, "loss_fn": task.mse, "modes": ["amp_bf16"]}
    tune(task.model, _loader(task), storage=storage, **common)  # type: ignore[arg-type]
    assert sorted(optuna.get_all_study_names(storage=storage)) == ["autoprec", "my-hpo"]
    mine = optuna.load_study(study_name="my-hpo", storage=storage)
    assert mine.user_attrs == {} and mine.trials == []
    with pytest.raises(ValueError, match=r"'my-hpo' in .* is not an autoprec study"):
        tune(task.model, _loader(task), storage=storage, study_name="my-hpo", **common)  # type: ignore[arg-type]
    mine = optuna.load_study(study_name="my-hpo", storage=storage)
    assert mine.user_attrs == {} and mine.trials == []


def test_a_study_name_with_a_slash_keeps_its_references_beside_the_storage(tmp_path: Path) -> None:
    # "exp/1" named a folder in the references file's path: "Invalid name ..." after the
    # calibration, every time the study was resumed
    task = tasks.regression(lr=1e-2)
    storage = f"sqlite:///{tmp_path / 'x.db'}"
    for reused in (False, True):
        result = tune(
            task.model,
            _loader(task),
            budget_minutes=0.3,
            loss_fn=task.mse,
            modes=["amp_bf16"],
            storage=storage,
            study_name="exp/1",
        )
        assert result.budget.reference_reused is reused
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".pt"] == [
        "x.db.exp%2F1.references.pt"
    ]


def test_the_best_so_far_follows_the_balanced_objective() -> None:
    from autoprec.search import better

    reference = TrialOutcome(
        spec=ModeSpec(mode="fp32"), status="accepted", samples_per_second=100.0, memory_bytes=1000
    )
    fast = TrialOutcome(
        spec=ModeSpec(mode="amp_bf16"),
        status="accepted",
        samples_per_second=150.0,
        memory_bytes=1000,
    )
    lean = TrialOutcome(
        spec=ModeSpec(mode="bf16_sr"), status="accepted", samples_per_second=120.0, memory_bytes=500
    )
    assert better(lean, fast, "balanced", reference)  # 1.2 x 2 beats 1.5 x 1
    assert better(fast, lean, "speed", reference)


def test_the_first_step_after_warm_up_is_timed_alone() -> None:
    # a mode far slower than fp32 was stopped for the budget only after a whole window (up to
    # 10 steps): a 30 s budget took 58 s when fp16 ran 3.5 s a step on a CPU
    from autoprec.recipe import TrainingRecipe
    from autoprec.trial import run_trial

    task = tasks.regression(lr=1e-2)
    seen: list[int] = []

    def stop(progress):  # type: ignore[no-untyped-def]
        seen.append(progress.step)

    record = run_trial(
        ModeSpec(mode="fp32"),
        task.model,
        task.batches,
        recipe=TrainingRecipe(optimizer=task.optimizer, loss_fn=task.mse),
        steps=40,
        stop=stop,
    ).record
    # each warm-up step is a window of its own too: the budget is checked after each
    assert [(w.first_step, w.steps) for w in record.windows[:4]] == [(0, 1), (1, 1), (2, 1), (3, 7)]
    assert [w.warmup for w in record.windows[:4]] == [True, True, False, False]
    assert seen[:3] == [0, 1, 2]


class _SlowForward(torch.nn.Module):
    """The model, each forward at least ``seconds`` long: a mode far slower than fp32."""

    def __init__(self, inner: torch.nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.inner(inputs)


@pytest.mark.parametrize("mode", ["fp32", "amp_fp16"])
def test_a_mode_far_too_slow_for_the_time_left_stops_in_its_warm_up(mode: str) -> None:
    """On a CPU amp_fp16's passes of examples.small_convnet took 15 s (fp32's step 0.11 s): its
    loss-scale pass and two warm-up steps ran before any budget check, and a 60 s budget took
    86 s. Each pass now counts: the budget stops a run whose remaining steps, each as slow as
    its fastest pass so far, would take over twice the time left, from two passes on (one may
    be a stall; alone it stops the run only when it took longer than all the time left) —
    amp_fp16 after two of its loss-scale passes (it settles on the trial's first batches),
    before any step, an eager mode without such passes after its two warm-up steps."""
    from autoprec.recipe import TrainingRecipe
    from autoprec.search import make_stop_check
    from autoprec.trial import run_trial
    from autoprec.trial_records import TrialResult
    from autoprec.tune_result import trial_outcome

    task = tasks.regression(lr=1e-2)
    slow = _SlowForward(task.model, 0.05)
    recipe = TrainingRecipe(optimizer=task.optimizer, loss_fn=task.mse)

    def trial(deadline: float, steps: int) -> TrialResult:  # a clock standing still at 0
        stop = make_stop_check(None, "speed", deadline=deadline, clock=lambda: 0.0)
        return run_trial(
            ModeSpec(mode=mode), slow, task.batches, recipe=recipe, steps=steps, stop=stop
        )

    record = trial(deadline=0.5, steps=40).record  # 0.5 s left: 40 x 0.05 s is past twice it
    ran = 0 if mode == "amp_fp16" else 2
    assert [(w.first_step, w.steps, w.warmup) for w in record.windows] == [
        (step, 1, True) for step in range(ran)
    ], record.windows
    reason = record.stopped or ""
    assert reason.startswith(f"budget: {40 - ran} more steps of at least "), reason
    assert float(reason.split()[7]) >= 0.05 and "(its fastest pass in warm-up)" in reason
    assert record.steps_run == ran
    # the deadline checked before the loss-scale pass too: stopped before a step, the trial has
    # no optimizer state and no memory figure (its weights alone read as the leanest mode)
    result = trial(deadline=0.0, steps=40)
    assert result.record.stopped == (
        "budget: the deadline passed during warm-up, "
        + ("40 steps left" if mode == "amp_fp16" else "39 steps left")
    )
    memory = trial_outcome(result, None, "cpu").memory_bytes
    assert (memory is None) == (mode == "amp_fp16"), memory
    if mode == "amp_fp16":  # its loss-scale pass alone took longer than the 0.01 s left
        stopped = trial(deadline=0.01, steps=40).record
        assert stopped.windows == () and stopped.stopped is not None, stopped.stopped
        assert stopped.stopped.startswith("budget: 40 more steps of at least ")
    record = trial(deadline=1000.0, steps=4).record  # time enough: it runs to its end
    assert record.stopped is None and record.steps_run == 4, record.stopped


def test_a_candidates_gate_notes_reach_the_table_and_the_profile() -> None:
    """tune() kept each verdict's reasons but dropped its notes ("weight decay never applies"),
    which check() shows; the README promises them in the verdict and the result."""
    model, _ = tiny_gpt.make_small_model()
    result = tune(
        model,
        tiny_gpt.make_small_batches(),
        budget_minutes=0.4,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01),
        objective="memory",
        modes=["bf16_pure"],
    )
    (pure,) = result.trials
    assert pure.status == "accepted", pure.reasons
    decay = [note for note in pure.notes if note.startswith("weight decay never applies")]
    assert decay and decay[0] in result.summary()
    assert result.chosen.mode == "bf16_pure"
    assert result.profile.evidence is not None and decay[0] in result.profile.evidence.notes
    assert not set(result.checks_not_run) & set(result.profile.evidence.notes)


def test_the_fp32_fallback_note_names_every_candidate_and_what_became_of_it() -> None:
    from autoprec.outcomes import TrialOutcome
    from autoprec.tune_result import fallback_note

    reference = TrialOutcome(spec=ModeSpec(mode="fp32"), status="accepted", seconds=1.0)

    def outcome(mode: str, status: str, reason: str, seconds: float = 1.0) -> TrialOutcome:
        return TrialOutcome(
            spec=ModeSpec(mode=mode),
            status=status,
            reasons=(reason,),
            seconds=seconds,  # type: ignore[arg-type]
        )

    failed = [outcome("amp_bf16", "failed", "boom"), outcome("bf16_kahan", "failed", "oom")]
    note = fallback_note(reference, reference, failed)
    assert note is not None and note.startswith("No candidate was accepted")  # not "passed"
    budget = "budget: the next steps would pass the deadline"
    never = [outcome("amp_bf16", "rejected", "drift"), outcome("bf16_sr", "pruned", budget, 0.0)]
    note = fallback_note(reference, reference, never)
    assert note is not None and "bf16_sr: not run (budget" in note  # it was left out
    cut = [outcome("amp_bf16", "rejected", "drift"), outcome("bf16_sr", "pruned", budget)]
    note = fallback_note(reference, reference, cut)  # there was no note at all
    assert note is not None and "amp_bf16: rejected (drift)" in note and "bf16_sr: pruned" in note
    accepted = [outcome("amp_bf16", "accepted", "")]
    assert fallback_note(reference, reference, accepted) is None  # accepted but slower
    # counted first: a CPU without bf16 kernels pruned every candidate for speed or budget,
    # and the note read as if the drift gate had refused them all
    slow = "slower than fp32: 13.70x its step time on the same 21 steps"
    demo = [
        outcome("amp_bf16", "pruned", slow),
        outcome("bf16_kahan", "pruned", slow),
        outcome("bf16_sr", "pruned", budget),
        outcome("amp_fp16", "pruned", budget, 0.0),
    ]
    note = fallback_note(reference, reference, demo)
    assert note is not None and note.startswith(
        "No candidate was accepted (2 pruned as slower than fp32, 1 cut by the budget, 1 not run "
        "for the budget, none rejected by the drift gate); this is the fp32 reference."
    )
    note = fallback_note(reference, reference, cut)
    assert note is not None and "(1 rejected by the drift gate, 1 cut by the budget)" in note
    # cut when already slower than the best: more budget would not have made it win on speed
    paced = f"{budget}, at 13.7x fp32's step time"
    demo[2] = outcome("bf16_sr", "pruned", paced)
    demo.append(outcome("bf16_pure", "pruned", paced))
    note = fallback_note(reference, reference, demo)
    assert note is not None and note.startswith(
        "No candidate was accepted (2 pruned as slower than fp32, 2 cut by the budget when "
        "already slower than fp32, 1 not run for the budget, none rejected by the drift gate)"
    )
    # found by a hunt: a budget that held the fp32 runs and no candidate read like any run
    from autoprec.tune_result import BudgetReport

    spent = BudgetReport(
        budget_seconds=60, used_seconds=58, calibration_seconds=10, reference_seconds=36,
        search_seconds=12, trial_steps=20, fp32_step_seconds=0.5, trials_run=3, trials_not_run=2,
    )  # fmt: skip
    starved = [outcome("amp_bf16", "pruned", budget), outcome("bf16_sr", "pruned", budget, 0.0)]
    note = fallback_note(reference, reference, starved, spent)
    assert note is not None and note.endswith(
        "The budget ended before any candidate was judged: calibration and the fp32 runs took "
        "46 s of its 60 s, and one run takes about 12 s; a budget of 1.2 minutes or more gives "
        "each of the 2 candidates a trial (with another study: --study NAME / study_name=, as "
        "a study holds its budget)."
    )  # (10 + 36 + 2 x 12) s = 70 s
    assert "ended before" not in (fallback_note(reference, reference, demo, spent) or "")
    assert "ended before" not in (fallback_note(reference, reference, never, spent) or "")


def test_budgets_of_numpy_numbers_and_paths_as_storage_are_taken(tmp_path: Path) -> None:
    """Found by a hunt: np.float32(0.5) minutes was refused ("must be a positive, finite
    number", which it is) while True passed as 1 minute; budget_minutes=1e307 overflowed; a
    pathlib.Path storage failed after calibration with a bare TypeError."""
    import numpy as np

    from autoprec.run_inputs import check_budget, checked_storage

    check_budget(np.float32(0.5), "speed")
    check_budget(np.int64(2), "speed")
    for wrong in (True, 1e307, float("nan")):
        with pytest.raises(ValueError, match="budget_minutes must be a positive"):
            check_budget(wrong, "speed")
    assert checked_storage(tmp_path / "s.journal") == str(tmp_path / "s.journal")
    with pytest.raises(TypeError, match="storage must be an Optuna storage URL or a file path"):
        checked_storage(3)


def test_a_foreign_sqlite_database_is_refused_untouched(tmp_path: Path) -> None:
    """Optuna created its 12 tables inside another application's SQLite database (found by a
    hunt): such a database is refused before anything is written."""
    import sqlite3

    from autoprec.search import StorageRefused, create_study

    path = tmp_path / "inventory.db"
    with sqlite3.connect(path) as database:
        database.execute("CREATE TABLE items (name TEXT)")
    before = path.read_bytes()
    for storage in (str(path), f"sqlite:///{path}"):
        with pytest.raises(StorageRefused, match=r"another application \(its tables: items\)"):
            create_study(storage, None)
        assert path.read_bytes() == before
    create_study(f"sqlite:///{tmp_path / 'new.db'}", None)  # a new file: a new study
    create_study(f"sqlite:///{tmp_path / 'new.db'}", None)  # and Optuna's own resumes


def test_keep_fp32_patterns_in_another_order_are_the_same_setting() -> None:
    """Found by a hunt: keep_fp32 was fingerprinted in the order given, so resuming a study
    with the same names reordered was refused as another run."""
    from autoprec.run_inputs import checked_keep_fp32

    model, _ = tiny_gpt.make_small_model()
    assert checked_keep_fp32(model, ["ln_f", "blocks.0"]) == checked_keep_fp32(
        model, ["blocks.0", "ln_f", "ln_f"]
    )


def test_a_keep_fp32_pattern_naming_a_second_name_points_at_the_first() -> None:
    """A module registered twice (``head = blocks[-1]``) is listed once by named_modules(),
    under its first name: keep_fp32 ``head`` matched nothing, and the refusal listed names
    without saying which one was meant."""
    from autoprec.run_inputs import checked_keep_fp32

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model.add_module("head", model[1])
    with pytest.raises(ValueError, match=r"'head', a second name of the module '1'.* Use '1'"):
        checked_keep_fp32(model, ["head"])
    assert checked_keep_fp32(model, ["1"]) == ("1",)


@pytest.mark.unfrozen
@pytest.mark.parametrize("run", ["tune", "check"])
@pytest.mark.parametrize("callers_freeze", [False, True])
def test_the_callers_objects_stay_out_of_the_collectors_walks_while_it_runs(
    run: str, callers_freeze: bool
) -> None:
    """A full collection walked every object of the caller's process during a run (tiny_gpt
    beside 1.5M objects: 4.1 s of a 15 s budget, and test_budget_is_a_hard_wall failed at
    15.8 s inside the suite). They are frozen while it runs and unfrozen however it ends; a
    caller's own freeze is left alone."""
    import gc

    task = tasks.regression(lr=1e-2)
    seen: list[int] = []

    def on_event(event: SearchEvent) -> None:
        if event.kind == "step":
            seen.append(gc.get_freeze_count())
            raise _CallbackStop("seen")

    kwargs = {"loss_fn": task.mse, "optimizer": task.optimizer, "on_event": on_event}
    if callers_freeze:
        gc.freeze()
    before = gc.get_freeze_count()
    try:
        with pytest.raises(_CallbackStop):
            if run == "tune":
                tune(task.model, _loader(task), budget_minutes=0.3, modes=["amp_bf16"], **kwargs)
            else:
                autoprec.check(task.model, _loader(task), steps=20, modes=["amp_bf16"], **kwargs)
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    if callers_freeze:  # theirs left: nothing more frozen, nothing unfrozen (a frozen
        # object whose last reference goes is freed all the same)
        assert 0 < seen[0] <= before and 0 < after <= before
    else:
        assert before == 0 and seen[0] > 0 and after == 0


@pytest.mark.unfrozen
def test_garbage_made_while_the_callers_objects_are_frozen_is_collected() -> None:
    import gc
    import weakref

    from autoprec.collector import callers_objects_frozen

    class Node:
        pass

    kept = Node()
    with callers_objects_frozen():
        assert gc.get_freeze_count() > 0
        cycle = Node()
        cycle.self = cycle  # type: ignore[attr-defined]
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0 and kept is not None
    gc.disable()
    try:  # a caller who turned the collector off keeps it off, nothing frozen
        with callers_objects_frozen():
            assert gc.get_freeze_count() == 0 and not gc.isenabled()
    finally:
        gc.enable()


def test_the_probe_judges_the_device_the_trials_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a hunt: the probe judged the machine's first GPU, not the trials' device:
    ``device="cpu"`` beside an H100 tried tf32 and FP8 on the CPU, and the profile said it was
    proven on the H100."""
    import autoprec.probing as probing
    from autoprec.recipe import TrainingRecipe, default_optimizer
    from autoprec.run_setup import setup_run
    from autoprec.search_events import EventSink
    from tests.conftest import make_hardware

    monkeypatch.setattr(probing, "detect_hardware", lambda: make_hardware("H100"))
    model, _ = tiny_gpt.make_small_model()
    setup = setup_run(
        model,
        tiny_gpt.make_small_batches(),
        TrainingRecipe(optimizer=default_optimizer),
        modes=None,
        device="cpu",
        eval_fn=None,
        seed=0,
        budget_seconds=60.0,
        deadline=math.inf,
        clock=time.monotonic,
        thresholds=None,
        events=EventSink(None, started=0.0, budget_seconds=60.0, clock=time.monotonic),
    )
    assert setup.report.device == "cpu"
    modes = {spec.mode for spec in setup.candidates.specs}
    assert "tf32" not in modes and "fp8_torchao" not in modes and "amp_bf16" in modes
    # found by a hunt: device= naming the model's own device held a second copy all run
    # (trials copy the trial model; the user's is never trained)
    assert setup.trial_model is model


def test_device_names_the_models_own_device_or_another() -> None:
    from autoprec.run_setup import _already_on

    model = torch.nn.Linear(2, 2)
    assert _already_on(model, None) and _already_on(model, "cpu")
    assert not _already_on(model, "cuda:0") and not _already_on(model, "cuda:1")


def test_a_run_that_took_the_study_over_while_references_were_saved_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt: another run took the empty study over while this one saved its fp32
    references (after its last check), and this run went on to adopt that run's outcomes."""
    import autoprec.tuning as tuning_module

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    save = tuning_module.save_references

    def taken_over_meanwhile(cache, fingerprint, runs, steps) -> None:
        save(cache, fingerprint, runs, steps)
        other = fingerprint.model_copy(update={"seed": 99}).model_dump(mode="json")
        optuna.load_study(study_name="s", storage=storage).set_user_attr("fingerprint", other)

    monkeypatch.setattr(tuning_module, "save_references", taken_over_meanwhile)
    model, _ = tiny_gpt.make_small_model()
    with pytest.raises(ValueError, match=r"Another run took over the study .*seed \(99 -> 0\)"):
        tune(
            model,
            tiny_gpt.make_small_batches(),
            budget_minutes=0.5,
            storage=storage,
            study_name="s",
            modes=["amp_bf16"],
            progress=False,
        )
    assert optuna.load_study(study_name="s", storage=storage).get_trials() == []


def test_a_loader_slower_than_the_budget_is_refused_while_it_is_read() -> None:
    """Found by a hunt: a loader of 2 s a batch was read whole (16 batches), and tune() refused
    the budget 33 s into a 15 s one. Reading stops when the budget ends, and says so."""
    now = [0.0]

    def slow_loader():
        for batch in tiny_gpt.make_small_batches():
            now[0] += 10.0  # each batch takes 10 s
            yield batch

    model, _ = tiny_gpt.make_small_model()
    with pytest.raises(
        autoprec.BudgetTooSmallError,
        match=r"budget_minutes=0.25 is too small to read the loader's batches: 2 took 20 s",
    ):
        tune(model, slow_loader(), budget_minutes=0.25, clock=lambda: now[0], progress=False)
    assert now[0] == 20.0  # stopped at the end of the budget, not after all 64


def test_a_budget_too_small_for_the_fp32_runs_is_refused_at_calibration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a hunt: a budget that held 40 fp32 steps in all passed calibration, and the
    noise runs then ran out of it (7.4 s into 7.8) with no budget named. The reference and
    its noise runs must fit at the measured pace, and the refusal says what budget would."""
    import types

    from autoprec import run_setup

    monkeypatch.setattr(
        run_setup, "calibration_run", lambda setup: run_setup.Calibration(0.5, 4.0, False)
    )

    def setup_for(deadline: float) -> object:
        return types.SimpleNamespace(
            candidates=types.SimpleNamespace(specs=[None] * 3),
            deadline=deadline,
            clock=lambda: 4.0,
            compile=False,
            tail_seconds=0.0,
        )

    # 31 s left; the 3 fp32 runs need 3 x (1.5 s + 20 steps of 0.5 s) = 34.5 s
    with pytest.raises(autoprec.BudgetTooSmallError, match=r"Give at least"):
        run_setup.calibrate(setup_for(35.0), 35 / 60)  # type: ignore[arg-type]
    steps, _ = run_setup.calibrate(setup_for(45.0), 45 / 60)  # type: ignore[arg-type]
    assert steps == run_setup.MIN_TRIAL_STEPS  # 41 s left: the fp32 runs fit


def test_the_retiming_is_not_charged_the_eval_fn_it_does_not_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a hunt: calibration's overhead holds eval_fn's time, and the re-timing
    charged it twice per contender, though its runs call no eval_fn: a 2 s eval_fn skipped
    the re-timing with 7 s left."""
    import types

    import autoprec.tuning as tuning_module

    charged: list[float] = []

    def confirm_speed(*args: object) -> tuple[list[TrialOutcome], TrialOutcome, None]:
        charged.append(args[-1])  # type: ignore[arg-type]
        return [], args[1], None  # type: ignore[return-value]

    monkeypatch.setattr(tuning_module, "confirm_speed", confirm_speed)
    from autoprec import run_setup

    monkeypatch.setattr(
        run_setup, "calibration_run", lambda setup: run_setup.Calibration(0.5, 4.0, False)
    )
    setup = types.SimpleNamespace(
        candidates=types.SimpleNamespace(specs=[None] * 3), compile=False,
        deadline=100.0, clock=lambda: 4.0, tail_seconds=1.0,  # calibration's eval_fn: 1 s
    )  # fmt: skip
    run_setup.calibrate(setup, 100 / 60)  # type: ignore[arg-type]
    assert setup.run_overhead_seconds == 1.5  # 4 s, 5 steps of 0.5 s: 1 s of it eval_fn's
    setup.tail_seconds = 9.0  # a later run's slower eval_fn moves the reserve, not this
    reference = TrialOutcome(spec=autoprec.ModeSpec(mode="fp32"), status="accepted")
    tuning_module._confirmed_speed(setup, "speed", [], reference, 20)  # type: ignore[arg-type]
    assert charged == [0.5]  # copying and converting; not the 1 s eval_fn


def test_runs_reserve_the_slowest_eval_fn_tail_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a hunt: the stop checks reserved calibration's eval_fn time alone, and an
    eval_fn slower after its first call (a cache filled, a data set loaded) carried runs past
    the budget. Every run's tail now raises the reserve, and the search reads it before each
    candidate."""
    import autoprec.search as search_module
    from autoprec.recipe import TrainingRecipe
    from autoprec.run_setup import setup_run
    from autoprec.search_events import EventSink

    calls: list[float] = []

    def eval_fn(model: torch.nn.Module) -> float:
        time.sleep(0.0 if not calls else 0.3)  # fast on its first call only
        calls.append(1.0)
        return 0.0

    task = tasks.regression(lr=1e-3)
    setup = setup_run(
        task.model, task.batches[:8] + task.heldout, TrainingRecipe(loss_fn=task.mse),
        modes=["amp_bf16"], device=None, eval_fn=eval_fn, seed=0, budget_seconds=60.0,
        deadline=math.inf, clock=time.monotonic, thresholds=None,
        events=EventSink(None, started=0.0, budget_seconds=60.0, clock=time.monotonic),
    )  # fmt: skip
    setup.run(setup.reference_spec, 4, eval_fn=eval_fn)
    first = setup.tail_seconds
    assert first < 0.3
    setup.run(setup.reference_spec, 4, eval_fn=eval_fn)
    assert setup.tail_seconds >= 0.3
    slowest = setup.tail_seconds
    setup.run(setup.reference_spec, 4)  # no eval_fn: the reserve stays the slowest
    assert setup.tail_seconds == slowest
    reserved: list[float] = []
    made = search_module.make_stop_check

    def spying(*args: object) -> object:
        reserved.append(args[-1])  # type: ignore[arg-type]
        return made(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(search_module, "make_stop_check", spying)
    tails = iter([2.0, 5.0])
    holder = [0.5]

    def runner(spec: autoprec.ModeSpec, stop: object) -> TrialOutcome:
        holder[0] = next(tails)  # this run's eval_fn was slower
        return TrialOutcome(spec=spec, status="rejected", reasons=("drift",))

    study = search_module.create_study(None, None)
    candidates = [autoprec.ModeSpec(mode="amp_bf16"), autoprec.ModeSpec(mode="bf16_sr")]
    search_module.search(
        candidates, runner, study=study, objective="speed", deadline=math.inf,
        expected_trial_seconds=1.0, tail_seconds=lambda: holder[0],
    )  # fmt: skip
    assert reserved == [0.5, 2.0]


def test_a_study_storage_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt: an unwritable storage failed only after calibration, and a read-only
    study file in a writable folder was blamed on the folder. (os.access is faked: the tests
    run as root, for whom every file is writable.)"""
    study = tmp_path / "study.db"
    study.write_bytes(b"")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "study.db")
    read: list[int] = []

    def loader() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index, batch in enumerate(_regression_batches()):
            read.append(index)
            yield batch

    with pytest.raises(ValueError, match=r"study\.db' is read-only: a tune writes its trials"):
        tune(_Regressor(), loader(), budget_minutes=0.2, loss_fn=_mse, storage=f"sqlite:///{study}")
    with pytest.raises(ValueError, match=r"making a file in '/proc' fails"):
        tune(_Regressor(), loader(), budget_minutes=0.2, loss_fn=_mse, storage="/proc/j.log")
    assert read == []  # refused before a batch was read
