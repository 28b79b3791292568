from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from autoprec.optim import named_groups, rebuild_optimizer, source_kind, translation_problem


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64))


def _groups_optimizer(model: nn.Module, cls: type = torch.optim.AdamW, **kwargs: object):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return cls(
        [
            {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": other, "weight_decay": 0.0, "lr": 1e-4},
        ],
        **kwargs,
    )


def test_named_groups() -> None:
    model = _model()
    optimizer = _groups_optimizer(model, lr=1e-3)
    groups = named_groups(optimizer, model)
    assert groups[0].names == ("0.weight", "2.weight")
    assert groups[1].names == ("0.bias", "1.weight", "1.bias", "2.bias")
    assert groups[1].options["lr"] == 1e-4 and groups[0].options["name"] == "decay"


def test_foreign_parameters_are_refused() -> None:
    model = _model()
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="group 0 holds 1 parameter"):
        named_groups(torch.optim.SGD([stranger], lr=0.1), model)


@pytest.mark.parametrize(
    ("target", "class_name"),
    [
        ("bnb_8bit", "AdamW8bit"),
        ("optimi_kahan", "AdamW"),
        ("stochastic", "StochasticAdamW"),
        ("same", "AdamW"),
    ],
)
def test_rebuild_keeps_groups_and_extras(target: str, class_name: str) -> None:
    model = _model()
    optimizer = _groups_optimizer(model, lr=1e-3, betas=(0.85, 0.9), eps=1e-7)
    rebuilt = rebuild_optimizer(optimizer, named_groups(optimizer, model), model, target)  # type: ignore[arg-type]
    assert type(rebuilt).__name__ == class_name
    assert [len(g["params"]) for g in rebuilt.param_groups] == [2, 4]
    first, second = rebuilt.param_groups
    assert first["name"] == "decay"  # a non-hyper-parameter extra is carried over
    assert (first["lr"], second["lr"]) == (1e-3, 1e-4)
    assert (first["weight_decay"], second["weight_decay"]) == (0.1, 0.0)
    betas = (first["beta1"], first["beta2"]) if target == "optimi_kahan" else first["betas"]
    assert betas == (0.85, 0.9) and first["eps"] == 1e-7


def test_adam_l2_decay_maps_to_coupled_decay() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)
    groups = named_groups(optimizer, model)
    kahan = rebuild_optimizer(optimizer, groups, model, "optimi_kahan")
    assert type(kahan).__name__ == "Adam" and kahan.param_groups[0]["decouple_wd"] is False
    sr = rebuild_optimizer(optimizer, groups, model, "stochastic")
    assert sr.param_groups[0]["decoupled_weight_decay"] is False
    with pytest.raises(ValueError, match="Adam8bit decays weights directly"):
        rebuild_optimizer(optimizer, groups, model, "bnb_8bit")


def test_adam_with_decoupled_flag_is_adamw() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), decoupled_weight_decay=True)
    assert source_kind(optimizer) == "adamw"


def test_sgd() -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    groups = named_groups(sgd, model)
    eight = rebuild_optimizer(sgd, groups, model, "bnb_8bit")
    assert type(eight).__name__ == "SGD8bit" and eight.param_groups[0]["momentum"] == 0.9
    kahan = rebuild_optimizer(sgd, groups, model, "optimi_kahan")
    assert kahan.param_groups[0]["torch_init"] is True  # torch's momentum initialisation
    stochastic = rebuild_optimizer(sgd, groups, model, "stochastic_kahan")
    assert type(stochastic).__name__ == "StochasticSGD"
    group = stochastic.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 1e-4)
    assert group["kahan"] is True and group["nesterov"] is False
    nesterov = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    rebuilt = rebuild_optimizer(nesterov, named_groups(nesterov, model), model, "stochastic")
    assert rebuilt.param_groups[0]["nesterov"] is True  # translates here, not to 8 bit
    with pytest.raises(ValueError, match="nesterov=True has no equivalent in bitsandbytes"):
        rebuild_optimizer(nesterov, named_groups(nesterov, model), model, "bnb_8bit")
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="SGD without momentum keeps no optimizer state"):
        rebuild_optimizer(plain, named_groups(plain, model), model, "bnb_8bit")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad=True has no equivalent"),
        (lambda p: torch.optim.AdamW(p, maximize=True), "maximize=True has no equivalent"),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
            "nesterov=True has no equivalent",
        ),
    ],
)
def test_untranslatable_options_are_refused(make, message: str) -> None:
    model = _model()
    optimizer = make(model.parameters())
    with pytest.raises(ValueError, match=message):
        rebuild_optimizer(optimizer, named_groups(optimizer, model), model, "bnb_8bit")


def test_unsupported_optimizer_class_names_the_supported_ones() -> None:
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters())
    with pytest.raises(
        TypeError,
        match=r"torch\.optim\.rmsprop\.RMSprop .*supported: "
        r"torch\.optim\.AdamW, torch\.optim\.Adam, torch\.optim\.SGD",
    ):
        rebuild_optimizer(optimizer, named_groups(optimizer, model), model, "optimi_kahan")
    # the same class works where no translation is needed
    same = rebuild_optimizer(optimizer, named_groups(optimizer, model), model, "same")
    assert type(same) is torch.optim.RMSprop


def test_stepped_optimizer_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already stepped"):
        rebuild_optimizer(optimizer, named_groups(optimizer, model), model, "bnb_8bit")


def test_parameters_found_by_name_after_a_swap() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    groups = named_groups(optimizer, model)
    replacement = nn.Linear(64, 128)
    model[0] = replacement  # a module swap creates new Parameter objects
    rebuilt = rebuild_optimizer(optimizer, groups, model, "same")
    assert rebuilt.param_groups[0]["params"][0] is replacement.weight
    assert rebuilt.param_groups[0]["lr"] == 5e-4


def test_translation_problem_is_the_error_a_rebuild_would_raise_without_building() -> None:
    parameters = list(_model().parameters())
    adamw = torch.optim.AdamW(parameters)
    assert translation_problem(adamw, "stochastic") is None
    assert translation_problem(adamw, "bnb_8bit") is None
    sgd = torch.optim.SGD(parameters, lr=0.1)
    assert translation_problem(sgd, "stochastic_kahan") is None
    assert "SGD without momentum keeps no optimizer state" in (
        translation_problem(sgd, "bnb_8bit") or ""
    )
    assert translation_problem(sgd, "optimi_kahan") is None
    rmsprop = torch.optim.RMSprop(parameters)
    assert "cannot translate torch.optim.rmsprop.RMSprop" in (
        translation_problem(rmsprop, "optimi_kahan") or ""
    )
    assert not adamw.state and not sgd.state


@pytest.mark.parametrize("target", ["optimi_kahan", "bnb_8bit"])
def test_the_backends_refused_for_complex_weights_still_mistrain_them(target: str) -> None:
    """Why bf16_kahan and 8-bit states are refused for complex weights (eligibility): their
    libraries move a complex weight's imaginary parts unlike torch's AdamW. When this fails, a
    library has learnt complex weights: lift the refusal."""
    pytest.importorskip("optimi" if target == "optimi_kahan" else "bitsandbytes")
    model = nn.Module()
    model.spectral = nn.Parameter(torch.randn(64, 80, dtype=torch.complex64))
    source = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    rebuilt = rebuild_optimizer(source, named_groups(source, model), model, target)
    reference = nn.Parameter(model.spectral.detach().clone())
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.0)
    start = reference.detach().clone()
    for step in range(3):
        grad = torch.randn(
            64, 80, dtype=torch.complex64, generator=torch.Generator().manual_seed(step)
        )
        model.spectral.grad, reference.grad = grad.clone(), grad.clone()
        with warnings.catch_warnings():  # bitsandbytes: "Casting complex values to real ..."
            warnings.simplefilter("ignore", UserWarning)
            rebuilt.step()
        torch_adamw.step()
    theirs = (model.spectral.detach() - start).imag.abs().mean()
    torch_moved = (reference.detach() - start).imag.abs().mean()
    assert not 0.5 < float(theirs / torch_moved) < 2.0, (float(theirs), float(torch_moved))


@pytest.mark.parametrize("target", ["optimi_kahan", "bnb_8bit"])
def test_another_optimizers_state_is_refused_at_load_and_its_own_loads(target: str) -> None:
    """A state neither plan.optimizer's own nor the user's optimizer's (here RMSprop's, for an
    AdamW rebuild): the first step failed with a bare KeyError ('kahan_sum', 'state1'). Now the
    load says what and why."""
    import copy

    pytest.importorskip("optimi" if target == "optimi_kahan" else "bitsandbytes")
    model = nn.Linear(64, 128)
    source = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    other_run = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    other_run.step()
    rebuilt = rebuild_optimizer(source, named_groups(source, model), model, target)
    with pytest.raises(ValueError, match=r"cannot load this optimizer state: another optimizer"):
        rebuilt.load_state_dict(other_run.state_dict())
    rebuilt.step()
    saved = copy.deepcopy(rebuilt.state_dict())
    if target == "optimi_kahan":
        twin = copy.deepcopy(rebuilt)  # the wrapped load binds to the copy
    else:  # a deep copy of a bitsandbytes optimizer cannot load (its own non_castable_tensor_keys)
        twin = rebuild_optimizer(source, named_groups(source, model), model, target)
    twin.load_state_dict(saved)
    for name in ("exp_avg", "state1"):
        if name in rebuilt.state[model.weight]:
            assert torch.equal(
                twin.state[twin.param_groups[0]["params"][0]][name],
                rebuilt.state[model.weight][name],
            )


def _torch_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    inputs = torch.randn(256, 64, generator=torch.Generator().manual_seed(99))
    targets = inputs[:, :1].sin()
    for step in steps:
        rows = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(step))
        dtype = next(model.parameters()).dtype
        loss = (model(inputs[rows].to(dtype)).float() - targets[rows]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _resumed_error(kind: str, target: str, width: int, dtype: torch.dtype, load: bool) -> float:
    """Relative distance, after 30 resumed steps, between an fp32 run continued with its own
    optimizer and the same run switched to ``target`` (its state loaded, or left fresh)."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 1))
    optimizer = _torch_optimizer(kind, model)
    _train(model, optimizer, range(100))
    saved = optimizer.state_dict()
    continued = copy.deepcopy(model)
    continued_optimizer = _torch_optimizer(kind, continued)
    continued_optimizer.load_state_dict(copy.deepcopy(saved))
    _train(continued, continued_optimizer, range(100, 130))
    switched = copy.deepcopy(model).to(dtype)
    fresh = _torch_optimizer(kind, switched)
    rebuilt = rebuild_optimizer(fresh, named_groups(fresh, switched), switched, target)
    if load:
        rebuilt.load_state_dict(copy.deepcopy(saved))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bitsandbytes on CPU
        _train(switched, rebuilt, range(100, 130))
    pairs = list(
        zip(switched.parameters(), continued.parameters(), model.parameters(), strict=True)
    )
    error = sum(float((a.detach().float() - b.detach()).norm() ** 2) for a, b, _ in pairs)
    moved = sum(float((b.detach() - c.detach()).norm() ** 2) for _, b, c in pairs)
    return (error / moved) ** 0.5


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("target", ["optimi_kahan", "bnb_8bit"])
def test_a_torch_optimizers_state_is_translated_into_the_rebuild(kind: str, target: str) -> None:
    """A run switched mid-way from fp32 to bf16_kahan or 8-bit states resumes with its Adam
    moments or SGD momentum: the load was refused before. Where the target keeps fp32 state
    (torch-optimi over fp32 weights; bitsandbytes below min_8bit_size) the resumed run is
    torch's to rounding; with bf16 weights or 8-bit states it is far closer to the run
    continued in fp32 than a restart with fresh state."""
    pytest.importorskip("optimi" if target == "optimi_kahan" else "bitsandbytes")
    exact = _resumed_error(kind, target, width=40, dtype=torch.float32, load=True)
    assert exact < 1e-5, exact
    low = torch.bfloat16 if target == "optimi_kahan" else torch.float32
    loaded = _resumed_error(kind, target, width=128, dtype=low, load=True)
    fresh = _resumed_error(kind, target, width=128, dtype=low, load=False)
    assert loaded < 0.4 * fresh, (loaded, fresh)


def test_a_translated_load_takes_the_saved_hyperparameters_and_fails_whole() -> None:
    """As torch's own load: the checkpoint's lr (and a scheduler's initial_lr) win. A state
    that does not fit (other parameter counts, an amsgrad run) is refused before anything of
    the optimizer changed."""
    pytest.importorskip("optimi")
    model = nn.Linear(64, 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 5e-4
    saved = optimizer.state_dict()
    bf16 = nn.Linear(64, 128).to(torch.bfloat16)
    fresh = torch.optim.AdamW(bf16.parameters(), lr=1e-3)
    rebuilt = rebuild_optimizer(fresh, named_groups(fresh, bf16), bf16, "optimi_kahan")
    rebuilt.load_state_dict(saved)
    group = rebuilt.param_groups[0]
    assert (group["lr"], group["initial_lr"], int(group["step"])) == (5e-4, 1e-3, 1)
    assert rebuilt.state[bf16.weight]["exp_avg"].dtype == torch.bfloat16

    pristine = rebuild_optimizer(fresh, named_groups(fresh, bf16), bf16, "optimi_kahan")
    before = {key: value for key, value in pristine.param_groups[0].items() if key != "params"}
    one_short = {**saved, "param_groups": [{**saved["param_groups"][0], "params": [0]}]}
    with pytest.raises(ValueError, match=r"groups hold \[1\] parameters, plan.optimizer's \[2\]"):
        pristine.load_state_dict(one_short)
    amsgrad = {**saved, "param_groups": [{**saved["param_groups"][0], "amsgrad": True}]}
    with pytest.raises(ValueError, match="amsgrad=True has no equivalent"):
        pristine.load_state_dict(amsgrad)
    after = {key: value for key, value in pristine.param_groups[0].items() if key != "params"}
    assert after == before and not pristine.state
