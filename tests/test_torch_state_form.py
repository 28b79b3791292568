"""Reading the optimizer state a mode's optimizer saved back into torch's layout."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import autoprec
from autoprec.errors import OptimizerRebuiltWarning
from autoprec.torch_state_form import state_writer, torch_optimizer_state
from tests.test_state_translation import _rebuild


def _fresh(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _stepped(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model (a weight of 8192 elements, quantised by bitsandbytes, and a bias of 128, kept
    in fp32) and its torch optimizer after 20 steps, with a scheduler's ``initial_lr``."""
    torch.manual_seed(0)
    model = nn.Linear(64, 128)
    optimizer = _fresh(kind, model)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    for step in range(20):
        inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        model(inputs).sin().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _prepare(
    spec: autoprec.ModeSpec, model: nn.Module, optimizer: torch.optim.Optimizer
) -> autoprec.PrecisionPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)  # no scheduler to rebind
        return autoprec.prepare(spec, model, optimizer)


def _written_by(target: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state as the ``target`` rebuild over fp32 weights saves it."""
    fresh = _fresh("sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw", model)
    rebuilt = _rebuild(fresh, model, target)
    rebuilt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return copy.deepcopy(rebuilt.state_dict())


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("target", ["optimi_kahan", "bnb_8bit"])
def test_a_rebuilds_saved_state_reads_back_into_torchs_layout(kind: str, target: str) -> None:
    """torch -> torch-optimi or bitsandbytes -> torch gives the torch state back: exact to fp32
    arithmetic through torch-optimi's bias-corrected moments and bitsandbytes' fp32 states,
    within 8-bit block-wise quantisation through its 8-bit ones; the step, the lr and a
    scheduler's initial_lr come back too."""
    pytest.importorskip("optimi" if target == "optimi_kahan" else "bitsandbytes")
    model, optimizer = _stepped(kind)
    saved = _written_by(target, model, optimizer)
    assert state_writer(saved) == ("optimi" if target == "optimi_kahan" else "bnb")
    reader = _fresh(kind, model)
    reader.load_state_dict(torch_optimizer_state(saved, reader))
    assert reader.param_groups[0]["initial_lr"] == optimizer.param_groups[0]["initial_lr"]
    for parameter in model.parameters():
        original, read = optimizer.state[parameter], reader.state[parameter]
        quantised = target == "bnb_8bit" and parameter.numel() >= 4096
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key not in original:
                continue
            error = float((read[key] - original[key]).abs().max() / original[key].abs().max())
            assert error < (0.02 if quantised else 1e-5), (key, error)
        if kind == "adamw":
            assert int(read["step"]) == 20


def test_plain_torch_resumes_a_kahan_plans_checkpoint() -> None:
    """Leaving autoprec: a bf16_kahan plan's saved optimizer state, read by
    ``autoprec.torch_optimizer_state``, resumes a plain torch AdamW, whose next step then
    follows the plan's; loaded as it is, torch failed at the step (KeyError: 'step')."""
    pytest.importorskip("optimi")
    model, optimizer = _stepped("adamw")
    plan = _prepare(autoprec.ModeSpec(mode="bf16_kahan"), model, optimizer)
    saved = copy.deepcopy(plan.optimizer.state_dict())
    weights = {k: v.float() for k, v in plan.model.state_dict().items()}
    inputs = torch.randn(8, 64)
    plan.step(plan.model(inputs.bfloat16()).float().sin().pow(2).mean())
    plain = nn.Linear(64, 128)
    plain.load_state_dict(weights)
    torch_adamw = torch.optim.AdamW(plain.parameters(), lr=5e-2)
    with pytest.raises(KeyError):  # what autoprec replaces
        bare = torch.optim.AdamW(copy.deepcopy(plain).parameters(), lr=1e-3)
        bare.load_state_dict(copy.deepcopy(saved))
        bare.step()
    torch_adamw.load_state_dict(torch_optimizer_state(saved, torch_adamw))
    assert torch_adamw.param_groups[0]["lr"] == 1e-3  # the saved lr wins
    plain(inputs).sin().pow(2).mean().backward()
    torch_adamw.step()
    planned = plan.model.weight.detach().float() - weights["weight"]
    stepped = plain.weight.detach() - weights["weight"]
    cosine = float(nn.functional.cosine_similarity(planned.flatten(), stepped.flatten(), dim=0))
    assert cosine > 0.9, cosine


def test_a_kahan_checkpoint_keeps_onecyclelrs_max_lr_for_the_resumed_schedule() -> None:
    """Found by a hunt: OneCycleLR's per-group ``max_lr`` was dropped as a torch-optimi key
    (torch-optimi reads its own only with decouple_lr): OneCycleLR(last_epoch=N) on the loaded
    optimizer failed with KeyError: 'max_lr', where fp32, 8-bit and bf16_sr states resume."""
    pytest.importorskip("optimi")
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=20)
    plan = autoprec.prepare(autoprec.ModeSpec(mode="bf16_kahan"), model, optimizer, schedule)
    for _ in range(3):
        plan.step(plan.model(torch.randn(4, 8).bfloat16()).float().pow(2).mean())
        schedule.step()
    saved = plan.optimizer.state_dict()
    plain = torch.optim.AdamW(nn.Linear(8, 4).parameters(), lr=1e-3)
    plain.load_state_dict(torch_optimizer_state(saved, plain))
    assert plain.param_groups[0]["max_lr"] == 0.01
    # found by a hunt: the torch form took the beta1 torch-optimi stepped with last, not the
    # one the schedule set for the next step (what plan.optimizer steps with)
    assert plain.param_groups[0]["betas"] == pytest.approx(plan.optimizer.param_groups[0]["betas"])
    assert plain.param_groups[0]["betas"][0] != pytest.approx(
        plan.optimizer.param_groups[0]["beta1"]
    )
    resumed = torch.optim.lr_scheduler.OneCycleLR(plain, 0.01, total_steps=20, last_epoch=2)
    assert resumed.get_last_lr() == pytest.approx(schedule.get_last_lr())


def test_a_state_of_another_family_or_optimizer_is_refused_with_the_reason() -> None:
    pytest.importorskip("optimi")
    model, sgd = _stepped("sgd")
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"written by torch-optimi \(bf16_kahan\) for another"):
        torch_optimizer_state(_written_by("optimi_kahan", model, sgd), adamw)
    with pytest.raises(ValueError, match=r"written by torch for another optimizer family"):
        torch_optimizer_state(sgd.state_dict(), adamw)
    rmsprop = torch.optim.RMSprop(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    rmsprop.step()
    with pytest.raises(ValueError, match=r"not one autoprec can read .*square_avg"):
        torch_optimizer_state(rmsprop.state_dict(), adamw)
    with pytest.raises(TypeError, match=r"supported: torch\.optim\.AdamW"):
        torch_optimizer_state(sgd.state_dict(), rmsprop)
    saved = _written_by("optimi_kahan", *_stepped("adamw"))
    saved["param_groups"][0]["decouple_lr"] = True
    with pytest.raises(ValueError, match="decouple_lr=True"):
        torch_optimizer_state(saved, adamw)


def test_a_state_without_per_parameter_entries_is_refused_by_its_groups() -> None:
    """Found by a hunt: SGD without momentum and an optimizer that never stepped save no
    per-parameter state, and torch_optimizer_state handed such an SGD state to an AdamW as it
    was (lr 0.1, SGD's keys in its groups; `autoprec check --optimizer-state` trained AdamW so),
    and an unstepped Adam state to an SGD (lr 1e-3)."""
    model, _ = _stepped("adamw")
    plain_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 64)).sum().backward()
    plain_sgd.step()
    assert plain_sgd.state_dict()["state"] == {}
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"another optimizer family \(its groups hold no betas"):
        torch_optimizer_state(plain_sgd.state_dict(), adamw)
    unstepped_adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(ValueError, match=r"its groups hold no momentum"):
        torch_optimizer_state(unstepped_adam.state_dict(), sgd)
    same = torch_optimizer_state(plain_sgd.state_dict(), sgd)  # the family's own: read
    assert same["param_groups"][0]["lr"] == 0.1


WRITERS_AND_READERS = [
    ("bf16_kahan", "amp_bf16"),
    ("bf16_kahan", "bf16_pure"),
    ("bf16_kahan", "fp32+8bit"),
    ("fp32+8bit", "bf16_kahan"),
    ("fp32+8bit", "fp32"),
    ("bf16_sr_kahan", "bf16_kahan"),
    ("bf16_kahan", "bf16_sr_kahan"),
]


def _spec(label: str) -> autoprec.ModeSpec:
    mode, _, bits = label.partition("+")
    return autoprec.ModeSpec(mode=mode, optimizer_bits=8 if bits else 32)


@pytest.mark.parametrize(
    ("writer", "reader"), WRITERS_AND_READERS, ids=[f"{w}->{r}" for w, r in WRITERS_AND_READERS]
)
def test_a_checkpoint_resumes_under_a_mode_with_another_optimizer(writer: str, reader: str) -> None:
    """A run's checkpoint (weights and plan.optimizer's state) saved under one mode resumes
    under a profile of another whose optimizer is another library's: plan.optimizer reads the
    state (into torch's layout, translated on where it is torch-optimi's or bitsandbytes'), so
    its next step follows the writer's own next step far closer than with fresh state. Each
    pair failed before: torch's or torch-optimi's first step raised KeyError, or the load was
    refused."""
    for label in (writer, reader):
        if "kahan" in label:
            pytest.importorskip("optimi")
        if "8bit" in label:
            pytest.importorskip("bitsandbytes")

    def plan_for(label: str) -> autoprec.PrecisionPlan:
        torch.manual_seed(0)
        model = nn.Linear(64, 128)
        return _prepare(_spec(label), model, _fresh("adamw", model))

    def next_step(plan: autoprec.PrecisionPlan) -> torch.Tensor:
        before = plan.model.weight.detach().float().clone()
        inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(99))
        dtype = plan.model.weight.dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bitsandbytes on CPU
            plan.step(plan.model(inputs.to(dtype)).float().sin().pow(2).mean())
        return (plan.model.weight.detach().float() - before).flatten()

    written = plan_for(writer)
    for step in range(30):
        inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loss = written.model(inputs.to(written.model.weight.dtype)).float().sin().pow(2).mean()
            written.step(loss)
    weights = copy.deepcopy(written.model.state_dict())
    saved = copy.deepcopy(written.optimizer.state_dict())
    truth = next_step(written)

    def agreement(load: bool) -> float:
        resumed = plan_for(reader)
        resumed.model.load_state_dict(weights)
        if load:
            resumed.optimizer.load_state_dict(copy.deepcopy(saved))
        return float(nn.functional.cosine_similarity(next_step(resumed), truth, dim=0))

    loaded, fresh = agreement(True), agreement(False)
    assert loaded > 0.8 and fresh < 0.5, (loaded, fresh)


@pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes on a CPU
def test_an_sgd8bit_state_reads_back_with_the_momentum_its_next_step_takes() -> None:
    """Found by a hunt: the torch form of an SGD8bit state took ``betas[0]``, the momentum of
    the step before the save; OneCycleLR had set the next one in ``momentum``, which autoprec's
    own resume takes. A plain torch SGD resumed from the torch form stepped with the old one."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        sgd, max_lr=0.1, total_steps=10, base_momentum=0.5, max_momentum=0.95
    )
    plan = autoprec.prepare(autoprec.ModeSpec(mode="fp32", optimizer_bits=8), model, sgd, schedule)
    for step in range(4):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        plan.step(plan.model(inputs).pow(2).mean())
        schedule.step()
    saved = copy.deepcopy(plan.optimizer.state_dict())
    next_momentum = saved["param_groups"][0]["momentum"]  # what the next SGD8bit step takes
    assert next_momentum != saved["param_groups"][0]["betas"][0]  # the step before the save's
    plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plain.load_state_dict(torch_optimizer_state(saved, plain))
    assert plain.param_groups[0]["momentum"] == next_momentum
