"""The training recipe: validation, the learning rates trials train at, and its summary."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

from autoprec.recipe import FLOOR_QUANTILE, TrainingRecipe, scheduled_lr_note


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> object:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=1e-5)


def _warmup(optimizer: torch.optim.Optimizer) -> object:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 100))


def test_without_a_schedule_trials_train_at_the_optimizers_lrs() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-3},
            {"params": model[2].parameters(), "lr": 2e-3},
        ]
    )
    (point,) = TrainingRecipe(optimizer=optimizer).lr_points(model)
    assert point.role == "constant" and point.lrs == (1e-3, 2e-3)
    assert not optimizer.state  # the user's optimizer is never stepped


def test_reading_the_schedule_leaves_a_tensor_lr_alone() -> None:
    # schedulers write a tensor lr in place; the clone shared the user's tensor, which ended
    # at the schedule's floor (2.5e-9) and made the next tune() judge every mode at lr ~0
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    recipe = TrainingRecipe(optimizer=optimizer, scheduler=_cosine, total_steps=3000)
    first = recipe.lr_points(model)
    assert optimizer.param_groups[0]["lr"].item() == pytest.approx(1e-3)
    assert optimizer.defaults["lr"].item() == pytest.approx(1e-3)
    assert recipe.lr_points(model) == first and first[0].lr == pytest.approx(1e-3)


def _backbone_and_head(model: nn.Module, backbone_lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": backbone_lr},
            {"params": model[2].parameters(), "lr": 1e-2},
        ]
    )


def _head_warmup_then_cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> object:
    def head(step: int) -> float:
        decay = (step - 100) / (total_steps - 100)
        return step / 100 if step < 100 else 0.5 * (1 + math.cos(math.pi * decay))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda step: 1.0, head])


def test_every_groups_schedule_sets_the_legs_not_the_first_groups_alone() -> None:
    # group 0 alone was read: a constant backbone beside a warmed-up, decayed head gave one
    # leg at step 0, where the head's lr is 0 (it never trained in any trial), and no floor
    model = _model()
    optimizer = _backbone_and_head(model, 1e-4)
    recipe = TrainingRecipe(
        optimizer=optimizer, scheduler=_head_warmup_then_cosine, total_steps=1000
    )
    peak, floor = recipe.lr_points(model)
    assert peak.schedule_step == 100 and peak.lrs == pytest.approx((1e-4, 1e-2))
    assert floor.lrs[0] == 1e-4 and floor.lrs[1] < 0.05 * peak.lrs[1]


def test_a_first_group_at_lr_0_beside_a_scheduled_one_is_not_a_run_that_never_moves() -> None:
    model = _model()
    optimizer = _backbone_and_head(model, 0.0)
    recipe = TrainingRecipe(
        optimizer=optimizer, scheduler=_head_warmup_then_cosine, total_steps=1000
    )
    peak, floor = recipe.lr_points(model)
    assert peak.lrs == pytest.approx((0.0, 1e-2)) and floor.lrs[0] == 0.0 and floor.lrs[1] < 1e-3


def test_a_decaying_schedule_adds_a_floor_leg_at_its_tail() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = TrainingRecipe(optimizer=optimizer, scheduler=_cosine, total_steps=3000)
    peak, floor = recipe.lr_points(model)
    assert (peak.role, peak.lr, peak.schedule_step) == ("peak", 1e-3, 0)
    assert floor.role == "floor"
    # the 10th percentile of a cosine from 1e-3 to 1e-5: 3.4e-5, late in the run
    assert floor.lr == pytest.approx(3.44e-5, rel=0.01)
    assert floor.schedule_step == pytest.approx(3000 * (1 - FLOOR_QUANTILE), abs=2)
    assert "step 2700 of 3000" in floor.describe()  # the last 300 steps: 2700-2999
    assert optimizer.param_groups[0]["lr"] == 1e-3  # the user's optimizer is not scheduled


@pytest.mark.parametrize(
    ("make_scheduler", "floor_lr"),
    [
        (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 300, gamma=0.1), 1e-6),
        (lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, [900], gamma=0.01), 1e-5),
    ],
)
def test_the_floor_is_the_lr_the_last_tenth_of_a_step_schedule_runs_at(
    make_scheduler, floor_lr: float
) -> None:
    """Found by a hunt: the floor took the 101st lowest of 1000 lrs, one step too many, so a
    run whose lowest lr lasts exactly its last 100 steps was judged at step 899: at 10x that lr
    under StepLR, and under MultiStepLR([900]) on its peak leg alone (pure bf16 was called safe
    there while it lost 86% of its updates at the lr the run ends at)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    recipe = TrainingRecipe(optimizer=optimizer, scheduler=make_scheduler, total_steps=1000)
    peak, floor = recipe.lr_points(model)
    assert (peak.lr, floor.role) == (1e-3, "floor")
    assert floor.lr == pytest.approx(floor_lr) and floor.schedule_step >= 900


def test_a_warmup_and_linear_decays_floor_is_read_in_the_decay_not_the_warmup() -> None:
    """HF's warm-up + linear decay passes its 10th-percentile lr twice, at warm-up step 9 and
    at decay step 1810 of 2000: the floor was said "at step 9", and apply() compared a decay
    50x steeper there and found the same lr (found by a hunt). The floor is the last step at
    that lr: a steeper decay is named."""
    from autoprec.recipe_match import recipe_differences

    def warmup_linear(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: (s + 1) / 100 if s < 100 else (total_steps - s) / 1900
        )

    def steeper(optimizer: torch.optim.Optimizer) -> Any:  # the same warm-up, then to 1e-3x
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: (s + 1) / 100 if s < 100 else 1e-3 ** ((s - 100) / 1900)
        )

    model = _model()
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=warmup_linear,
        total_steps=2000,
    )
    peak, floor = recipe.lr_points(model)
    assert (peak.schedule_step, floor.schedule_step) == (99, 1810)
    assert floor.lr == pytest.approx(1e-4) and "step 1810 of 2000" in floor.describe()
    summary = recipe.summary(model)
    for make, warned in ((lambda o: warmup_linear(o, 2000), False), (steeper, True)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        found = recipe_differences(
            summary, optimizer, make(optimizer), grad_accumulation_steps=1, clip_grad_norm=None
        )
        assert bool(found) == warned, found


def test_a_one_cycle_floor_is_read_in_its_decay_and_an_old_warmup_floor_still_matches() -> None:
    """OneCycleLR's warm-up passes the floor's lr too, never exactly as its decay does: the
    floor was read at warm-up step 4 of 600, and apply() let OneCycleLR's three phases (a
    floor 7x lower) through (found by a hunt). The floor is the decay's first step at or below
    that lr; a profile written before, its floor at step 4, still matches its own schedule and
    now warns of the three phases."""
    from autoprec.recipe_match import recipe_differences

    def one_cycle(optimizer: torch.optim.Optimizer, **options: Any) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=2e-3, total_steps=600, **options
        )

    model = _model()
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3),
        scheduler=lambda optimizer, total_steps: one_cycle(optimizer),
        total_steps=600,
    )
    peak, floor = recipe.lr_points(model)
    assert peak.schedule_step == 179 and floor.schedule_step > 500
    assert floor.lr == pytest.approx(8.2e-5, rel=0.03)
    summary = recipe.summary(model)
    old = summary.model_copy(  # as the rule before read it: the warm-up's step 4
        update={"lr_points": (peak, floor.model_copy(update={"schedule_step": 4}))}
    )
    old = old.model_copy(update={"lr_points": _at_steps(recipe, model, old.lr_points)})
    for proven in (summary, old):
        for options, warned in (({}, False), ({"three_phase": True}, True)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
            found = recipe_differences(
                proven,
                optimizer,
                one_cycle(optimizer, **options),
                grad_accumulation_steps=1,
                clip_grad_norm=None,
            )
            assert bool(found) == warned, (proven.lr_points, options, found)


def test_a_profile_whose_floor_the_earlier_rule_read_matches_its_own_schedule() -> None:
    """A head frozen (lr 0) for its first 50 steps beside a warmed-up backbone: the rule before
    2026-11-29 read the floor at warm-up step 9 (the head at 0 there), today's at step 1810.
    The profile the earlier rule wrote warned of its own schedule (a review); it now matches,
    and a steeper decay still warns."""
    from autoprec.recipe import schedule_points, step_schedule
    from autoprec.recipe_match import recipe_differences

    def warmup_linear(step: int) -> float:
        return (step + 1) / 100 if step < 100 else (2000 - step) / 1900

    def frozen_first(step: int) -> float:
        return 0.0 if step < 50 else warmup_linear(step)

    def two_groups(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    recipe = TrainingRecipe(
        optimizer=two_groups,
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, [warmup_linear, frozen_first]),
        total_steps=2000,
    )
    optimizer = recipe.make_optimizer(model, model)
    lrs, _ = step_schedule(optimizer, recipe.make_scheduler(optimizer), 2000)
    earlier = schedule_points(lrs, None, 2000, floor_in_decay=False)
    assert earlier[1].schedule_step < 100 < recipe.lr_points(model)[1].schedule_step
    old = recipe.summary(model).model_copy(update={"lr_points": earlier})
    for steeper, warned in ((1.0, False), (3.0, True)):
        optimizer = two_groups(model.parameters())
        factors = [
            lambda s, power=steeper: warmup_linear(s) ** power,
            lambda s, power=steeper: frozen_first(s) ** power,
        ]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
        found = recipe_differences(
            old, optimizer, schedule, grad_accumulation_steps=1, clip_grad_norm=None
        )
        assert bool(found) == warned, found


def _at_steps(recipe: TrainingRecipe, model: nn.Module, points: tuple) -> tuple:
    """``points`` with the lrs and momenta ``recipe``'s schedule sets at their steps."""
    from autoprec.recipe import step_schedule

    optimizer = recipe.make_optimizer(model, model)
    lrs, momenta = step_schedule(optimizer, recipe.make_scheduler(optimizer), 600)
    return tuple(
        point.model_copy(
            update={"lrs": lrs[point.schedule_step], "momenta": momenta[point.schedule_step]}
        )
        for point in points
    )


def test_a_scheduler_function_gets_the_runs_length_whatever_its_second_argument_is_named() -> None:
    """Found by a hunt: `lambda opt, steps: CosineAnnealingLR(opt, steps)` was called with the
    optimizer alone and failed; only a parameter named total_steps received the run's length.
    A scheduler class is not handed it: StepLR's second argument is its step size."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    positional = TrainingRecipe(
        optimizer=optimizer,
        scheduler=lambda opt, steps: torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps),
        total_steps=1000,
    )
    made = positional.make_scheduler(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert made.T_max == 1000
    assert [point.role for point in positional.lr_points(model)] == ["peak", "floor"]
    as_class = TrainingRecipe(
        optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR, total_steps=1000
    )
    with pytest.raises(ValueError, match=r"called as StepLR\(optimizer\), raised TypeError"):
        as_class.make_scheduler(torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_a_one_cycle_schedule_sets_each_legs_momentum_too() -> None:
    # OneCycleLR cycles Adam's beta1 (SGD's momentum) against the lr: 0.85 at the peak lr, 0.95
    # at the floor; trials kept the optimizer's own 0.9 on every leg
    model = _model()

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> object:
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-2, total_steps=total_steps)

    for optimizer in (
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
    ):
        recipe = TrainingRecipe(optimizer=optimizer, scheduler=one_cycle, total_steps=1000)
        peak, floor = recipe.lr_points(model)
        assert peak.lr == pytest.approx(1e-2) and peak.momenta == pytest.approx((0.85,))
        assert floor.momenta is not None and floor.momenta[0] == pytest.approx(0.95, abs=0.01)
        assert "(momentum/β1 0.85)" in peak.describe()
    # a schedule that leaves the momentum alone records none
    plain = TrainingRecipe(optimizer=optimizer, scheduler=_cosine, total_steps=1000)
    assert all(p.momenta is None for p in plain.lr_points(model))
    assert TrainingRecipe(optimizer=optimizer).lr_points(model)[0].momenta is None


def test_a_warmup_peak_and_a_constant_tail_need_one_leg() -> None:
    model = _model()
    recipe = TrainingRecipe(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=_warmup, total_steps=2000
    )
    points = recipe.lr_points(model)
    assert [p.role for p in points] == ["peak"]
    assert points[0].lr == pytest.approx(0.1)


def test_an_lr_already_zeroed_by_a_warmup_scheduler_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    _warmup(optimizer)  # step 0 of the warm-up: lr 0
    with pytest.raises(ValueError, match=r"learning rate is 0.*initial_lr=0.0003.*scheduler="):
        TrainingRecipe(optimizer=optimizer).lr_points(model)
    # with the schedule handed over, trials follow it from its true peak
    recipe = TrainingRecipe(optimizer=optimizer, scheduler=_warmup, total_steps=500)
    assert recipe.lr_points(model)[0].lr == pytest.approx(3e-4)


def test_a_scheduler_that_fails_when_stepped_is_named_with_the_run_length() -> None:
    """Found by a hunt: torch's "Tried to step 101 times" (a OneCycleLR built for 100 steps, a
    run of 1000: micro-batches counted) and a timm-style step(epoch) escaped raw, naming
    neither the factory nor total_steps."""

    class EpochScheduler:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def step(self, epoch: int) -> None:
            del epoch

    model = _model()
    for factory, said in [
        (
            lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1e-3, total_steps=100),
            r"total_steps=1000 .*raised ValueError: Tried to step 101 times.*not micro-batches",
        ),
        (EpochScheduler, r"raised TypeError: .*step\(\) missing 1 required positional"),
    ]:
        recipe = TrainingRecipe(
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            scheduler=factory,
            total_steps=1000,
        )
        with pytest.raises(ValueError, match=said):
            recipe.lr_points(model)


def test_a_plateau_schedule_is_refused_with_what_to_do_instead() -> None:
    # its lrs follow the run's validation metric: stepping it blind used to raise
    # "ReduceLROnPlateau.step() missing 1 required positional argument: 'metrics'"
    model = _model()
    recipe = TrainingRecipe(
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=1e-6),
        total_steps=100,
    )
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.*cannot be read ahead.*min_lr 1e-06"):
        recipe.lr_points(model)


def test_a_schedule_that_never_moves_is_refused() -> None:
    model = _model()
    recipe = TrainingRecipe(
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0),
        total_steps=10,
    )
    with pytest.raises(ValueError, match="keeps the learning rate at 0 for all 10 steps"):
        recipe.lr_points(model)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheduler": _warmup}, "needs total_steps"),
        ({"total_steps": 0}, "total_steps must be a positive int"),
        ({"grad_accumulation_steps": 0}, "grad_accumulation_steps must be >= 1"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be positive"),
        # a bool passed as an int and a number, then failed in the first trial as autoprec's
        ({"grad_accumulation_steps": True}, "must be a whole number of micro-batches"),
        ({"clip_grad_norm": True}, "clip_grad_norm must be a number"),
        ({"loss_fn": lambda o, t: o, "train_step": lambda p, b: b}, "not both"),
        ({"optimizer": {"optimizer": None}}, "Lightning-style dict"),
        ({"scheduler": object()}, "factory optimizer -> LRScheduler"),
        ({"loss_fn": 42}, r"loss_fn must be a function loss_fn\(output, target\) -> loss, not int"),
        ({"train_step": "step"}, r"train_step must be a function .* not str"),
    ],
)
def test_bad_recipes(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        TrainingRecipe(**kwargs)


def test_summary_records_the_optimizer_and_compares_by_value() -> None:
    model = _model()
    factory = functools.partial(torch.optim.AdamW, lr=5e-5, weight_decay=0.0)
    summary = TrainingRecipe(
        optimizer=factory, scheduler=_cosine, total_steps=100, grad_accumulation_steps=4
    ).summary(model)
    assert summary.optimizer == "torch.optim.adamw:AdamW"
    assert summary.optimizer_groups[0]["lr"] == 5e-5
    assert summary.scheduler == "tests.test_recipe:_cosine"
    assert (summary.total_steps, summary.grad_accumulation_steps) == (100, 4)
    assert [p.role for p in summary.lr_points] == ["peak", "floor"]
    again = TrainingRecipe(
        optimizer=factory, scheduler=_cosine, total_steps=100, grad_accumulation_steps=4
    ).summary(model)
    assert again == summary
    other = TrainingRecipe(optimizer=factory, scheduler=_cosine, total_steps=100).summary(model)
    assert other != summary


def test_factory_returning_something_else_is_named() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"returned a dict \(Lightning's configure_optimizers"):
        TrainingRecipe(optimizer=lambda params: {"optimizer": None}).make_optimizer(model, model)
    with pytest.raises(TypeError, match=r"returned int, not a torch\.optim\.Optimizer"):
        TrainingRecipe(optimizer=lambda params: 3).make_optimizer(model, model)


def test_a_stepped_optimizers_state_starts_each_trial_as_a_copy() -> None:
    """A run's optimizer (a late checkpoint's) starts every trial with its own Adam moments;
    the trial's copy is the trial's alone, and reading the schedule or the summary copies no
    state (a 7B model's Adam state is 56 GB)."""
    import copy

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = copy.deepcopy(optimizer.state_dict()["state"])
    recipe = TrainingRecipe(optimizer=optimizer)
    trial_model = copy.deepcopy(model)
    trial = recipe.make_optimizer(model, trial_model, with_state=True)
    assert torch.equal(trial.state[trial_model[0].weight]["exp_avg"], saved[0]["exp_avg"])
    trial_model(torch.randn(4, 8)).square().mean().backward()
    trial.step()
    for index, state in optimizer.state_dict()["state"].items():  # the user's, untouched
        assert all(torch.equal(value, saved[index][key]) for key, value in state.items())
    assert not recipe.make_optimizer(model, copy.deepcopy(model)).state
    assert recipe.summary(model).optimizer_state_steps == 5
    assert TrainingRecipe(optimizer=_fresh(model)).summary(model).optimizer_state_steps is None


def _fresh(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_an_optimizer_a_scheduler_moved_is_named_when_no_scheduler_is_passed() -> None:
    # mid-warm-up at 1e-6 of a 1e-3 run, with no scheduler passed: every trial trained at 1e-6
    # without a word (only an lr of exactly 0 was named)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _warmup(optimizer)  # LambdaLR: step 0 of 100, lr 0 ...
    optimizer.param_groups[0]["lr"] = 1e-6  # ... or a step into it
    note = scheduled_lr_note(TrainingRecipe(optimizer=optimizer))
    assert note is not None and "current lr 1e-06" in note and "initial_lr 0.001" in note
    assert (
        scheduled_lr_note(TrainingRecipe(optimizer=torch.optim.AdamW(model.parameters()))) is None
    )
    scheduled = TrainingRecipe(optimizer=optimizer, scheduler=_cosine, total_steps=100)
    assert scheduled_lr_note(scheduled) is None


@pytest.mark.parametrize("built", ["on the user's optimizer", "beforehand"])
def test_a_scheduler_factory_that_steps_the_users_optimizer_is_refused(built: str) -> None:
    """Found by a hunt: ``lambda o: CosineAnnealingLR(opt, ...)`` (a one-letter typo) or
    ``lambda o: sched`` was accepted; reading the schedule stepped the user's own scheduler
    999 times (their optimizer ended at the schedule's last lr) and read the run as constant."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    if built == "beforehand":
        scheduler = _cosine(optimizer, 1000)
        factory = lambda _: scheduler  # noqa: E731
    else:
        factory = lambda _: _cosine(optimizer, 1000)  # noqa: E731
    before = [dict(group) for group in optimizer.param_groups]
    recipe = TrainingRecipe(optimizer=optimizer, scheduler=factory, total_steps=1000)
    with pytest.raises(ValueError, match="returned a scheduler of another optimizer"):
        recipe.lr_points(model)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(1e-3, rel=1e-6)
    assert set(optimizer.param_groups[0]) == set(before[0])  # no initial_lr left by a build
    stepped = TrainingRecipe(optimizer=optimizer, scheduler=_cosine, total_steps=1000)
    assert len(stepped.lr_points(model)) == 2  # the factory as meant: peak and floor


def test_a_scheduler_factory_on_an_optimizer_autoprec_does_not_hold_says_what_it_changed() -> None:
    """Found by a hunt: with ``optimizer=`` a factory, a scheduler factory closing over the
    user's own optimizer was refused, and that optimizer was left at the schedule's first lr
    (0.0, an ``initial_lr`` beside it) without a word: autoprec holds no copy to put back."""
    model = _model()
    users = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=lambda _: torch.optim.lr_scheduler.LambdaLR(users, lambda step: step / 100),
        total_steps=100,
    )
    with pytest.raises(
        ValueError, match=r"set the optimizer's lrs to the schedule's first \(\[0.0\]"
    ):
        recipe.lr_points(model)


def test_an_optimizer_factory_over_other_parameters_is_refused_as_the_users_slip() -> None:
    """Found by a hunt: ``optimizer=lambda p: opt`` (the user's own optimizer) was refused as
    "raised by autoprec's own code ... please report it"."""
    import autoprec

    model = _model()
    own = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(6)]
    with pytest.raises(ValueError, match="over other parameters than the ones it was handed"):
        autoprec.check(
            model, batches, loss_fn=nn.functional.mse_loss, optimizer=lambda _: own, steps=4
        )


def test_total_steps_true_is_refused_as_apply_refuses_it() -> None:
    """Found by a hunt: True is an int, and tune/check took it as 1 step."""
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="total_steps must be a positive int but got True"):
        TrainingRecipe(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            total_steps=True,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("factory", "moved", "expected"),
    [
        # a warm-up built before tune(): the optimizer sits at 1e-5, its run peaks at 1e-3
        (lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.01, 1.0, 100), 0, [(1e-3, 100)]),
        # a checkpoint halfway through a cosine: the run read from its start, not from 5e-4
        (
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 1000),
            500,
            [(1e-3, 0), (2.4471741852423e-05, 900)],
        ),
        (  # LambdaLR reads initial_lr itself: it was right before, and stays so
            lambda o: torch.optim.lr_scheduler.LambdaLR(
                o, lambda s: 0.5 * (1 + math.cos(math.pi * s / 1000))
            ),
            500,
            [(1e-3, 0), (2.4471741852423e-05, 900)],
        ),
    ],
)
def test_a_chainable_schedule_is_read_from_its_start_on_a_scheduled_optimizer(
    factory: object, moved: int, expected: list[tuple[float, int]]
) -> None:
    """Found by a hunt: a chainable scheduler (LinearLR, CosineAnnealingLR, ...) computes
    from the group's current lr, and the schedule was read from a clone of an optimizer a
    scheduler had already moved: a LinearLR warm-up built before tune() trained every step at
    1e-5 for a run that peaks at 1e-3."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    users = factory(optimizer)  # type: ignore[operator]
    for _ in range(moved):
        optimizer.step()
        users.step()
    current = optimizer.param_groups[0]["lr"]
    recipe = TrainingRecipe(optimizer=optimizer, scheduler=factory, total_steps=1000)  # type: ignore[arg-type]
    points = recipe.lr_points(model)
    assert [(p.lr, p.schedule_step) for p in points] == [
        (pytest.approx(lr, rel=1e-9), step) for lr, step in expected
    ]
    assert optimizer.param_groups[0]["lr"] == current  # the user's optimizer as it was


def test_a_leg_of_several_groups_is_described_by_every_groups_lr() -> None:
    """Found by a hunt: a leg was described by group 0's lr alone, and a head scheduled beside
    a constant backbone read the same lr at its peak and its floor, and for the proven and
    the applied schedules."""
    from autoprec.recipe import LrPoint

    point = LrPoint(
        role="floor", lrs=(1e-4, 3.45e-5), momenta=(0.9, 0.95), schedule_step=900, total_steps=1000
    )
    assert point.describe() == (
        "lrs 0.0001 / 3.45e-05 (momentum/β1 0.9 / 0.95), the schedule's floor at step 900 of 1000"
    )
    assert point.describe(1) == (
        "lr 3.45e-05 (momentum/β1 0.95), the schedule's floor at step 900 of 1000"
    )
    assert LrPoint(role="constant", lrs=(3e-4,)).describe() == "lr 0.0003"


def test_a_partial_scheduler_factory_missing_the_runs_length_is_told_how_it_is_handed() -> None:
    """Found by a hunt: ``partial(get_cosine_schedule_with_warmup, num_warmup_steps=100)``
    leaves the length keyword-only, never handed; the refusal read "called as
    scheduler(optimizer)" and said nothing of how autoprec hands the length."""

    def get_cosine_schedule_with_warmup(
        optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
    ) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    factory = functools.partial(get_cosine_schedule_with_warmup, num_warmup_steps=100)
    recipe = TrainingRecipe(
        optimizer=lambda params: torch.optim.AdamW(params), scheduler=factory, total_steps=100
    )
    with pytest.raises(ValueError) as raised:
        recipe.lr_points(nn.Linear(2, 2))
    said = str(raised.value)
    assert "called as get_cosine_schedule_with_warmup(optimizer), raised TypeError" in said
    assert "hands the run's length as total_steps= or as a required second positional" in said
