"""Loading a torch optimizer's state into the optimizer a mode rebuilt it into."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from autoprec.optim import named_groups, rebuild_optimizer
from autoprec.state_translation import accept_source_state


def _rebuild(source: torch.optim.Optimizer, model: nn.Module, target: str) -> torch.optim.Optimizer:
    """``source`` rebuilt for ``target`` as a mode rebuilds it (``convert_optimizer``)."""
    rebuilt = rebuild_optimizer(source, named_groups(source, model), model, target)
    accept_source_state(rebuilt, source, target)
    return rebuilt


@pytest.mark.parametrize("target", ["optimi_kahan", "bnb_8bit"])
def test_another_optimizers_state_is_refused_at_load_and_its_own_loads(target: str) -> None:
    """A state neither plan.optimizer's own nor the user's optimizer's (here RMSprop's, for an
    AdamW rebuild): the first step failed with a bare KeyError ('kahan_sum', 'state1'). Now the
    load says what and why."""
    pytest.importorskip("optimi" if target == "optimi_kahan" else "bitsandbytes")
    model = nn.Linear(64, 128)
    source = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    other_run = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    other_run.step()
    rebuilt = _rebuild(source, model, target)
    with pytest.raises(ValueError, match=r"cannot load this optimizer state: another optimizer"):
        rebuilt.load_state_dict(other_run.state_dict())
    unstepped = torch.optim.RMSprop(model.parameters()).state_dict()  # groups alone tell
    with pytest.raises(ValueError, match=r"cannot load this optimizer state: another optimizer"):
        rebuilt.load_state_dict(unstepped)
    rebuilt.step()
    saved = copy.deepcopy(rebuilt.state_dict())
    # the wrapped load binds to a deep copy; a deep copy of a bitsandbytes optimizer cannot load
    # (its own non_castable_tensor_keys), so that one is rebuilt
    copied = target == "optimi_kahan"
    twin = copy.deepcopy(rebuilt) if copied else _rebuild(source, model, target)
    twin.load_state_dict(saved)
    for name in ("exp_avg", "state1"):
        if name in rebuilt.state[model.weight]:
            assert torch.equal(
                twin.state[twin.param_groups[0]["params"][0]][name],
                rebuilt.state[model.weight][name],
            )


@pytest.mark.parametrize(
    ("mode", "writer"),
    [
        (m, w)
        for m in ("amp_bf16", "bf16_sr", "bf16_sr_kahan")
        for w in ("sgd", "rmsprop", "fresh sgd")
    ],
)
def test_plans_keeping_torchs_layout_refuse_another_familys_state(mode: str, writer: str) -> None:
    """An AdamW plan whose optimizer saves torch's layout (the user's own AdamW under AMP, the
    stochastic-rounding rebuilds) loaded an SGD checkpoint silently: under bf16_sr it then
    trained at SGD's lr 0.1 and weight decay 0 (the user's: 1e-3 and 0.01); an RMSprop state
    failed at the first step with a bare KeyError. Both are refused at load, with the reason,
    and nothing is loaded."""
    from autoprec.plan import prepare
    from autoprec.specs import ModeSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    if writer == "rmsprop":
        other = torch.optim.RMSprop(model.parameters(), lr=0.1)
    else:
        other = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if writer != "fresh sgd":  # a fresh one has no per-parameter state: its groups tell
        model(torch.randn(4, 64)).pow(2).mean().backward()
        other.step()
    with warnings.catch_warnings():  # rebuilt, and no scheduler to rebind: said elsewhere
        warnings.simplefilter("ignore")
        plan = prepare(ModeSpec(mode=mode), model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    before = copy.deepcopy(plan.optimizer.state_dict())
    found = r"another optimizer family|another optimizer wrote it"
    with pytest.raises(ValueError, match=found):
        plan.optimizer.load_state_dict(other.state_dict())
    after = plan.optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"] == before["state"]
    assert plan.optimizer.param_groups[0]["lr"] == 1e-3


class _AdamWithGradEma(torch.optim.AdamW):
    """AdamW that also keeps an EMA of each gradient, as a per-parameter state entry."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        grads = {
            p: p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None
        }
        loss = super().step(closure)
        for parameter, grad in grads.items():
            ema = self.state[parameter].setdefault("grad_ema", torch.zeros_like(parameter))
            ema.mul_(0.9).add_(grad, alpha=0.1)
        return loss


@pytest.mark.parametrize("mode", ["fp32", "amp_bf16", "bf16_pure"])
def test_the_users_optimizer_subclass_reloads_its_own_extra_state(mode: str) -> None:
    """Found by a hunt: under the modes that keep the user's optimizer, an AdamW subclass
    keeping one more state entry could not load its own checkpoint ("another optimizer wrote
    it"), which it does without autoprec."""
    from autoprec.plan import prepare
    from autoprec.specs import ModeSpec

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    plan = prepare(ModeSpec(mode=mode), model, _AdamWithGradEma(model.parameters(), lr=1e-3))
    with plan.autocast():
        loss = plan.model(torch.randn(2, 8).to(next(plan.model.parameters()).dtype)).float().sum()
    plan.step(loss)
    saved = copy.deepcopy(plan.optimizer.state_dict())
    plan.optimizer.load_state_dict(saved)
    entry = plan.optimizer.state[next(plan.model.parameters())]
    assert torch.equal(entry["grad_ema"], saved["state"][0]["grad_ema"])


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
    rebuilt = _rebuild(fresh, switched, target)
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
@pytest.mark.parametrize("target", ["optimi_kahan", "bnb_8bit", "stochastic_8bit"])
def test_a_torch_optimizers_state_is_translated_into_the_rebuild(kind: str, target: str) -> None:
    """A run switched mid-way from fp32 to bf16_kahan or 8-bit states resumes with its Adam
    moments or SGD momentum: the load was refused before. Where the target keeps fp32 state
    (torch-optimi over fp32 weights; bitsandbytes and bf16_sr's 8-bit moments below
    min_8bit_size) the resumed run is torch's to rounding; with bf16 weights or 8-bit states
    it is far closer to the run continued in fp32 than a restart with fresh state."""
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
    rebuilt = _rebuild(fresh, bf16, "optimi_kahan")
    rebuilt.load_state_dict(saved)
    group = rebuilt.param_groups[0]
    assert (group["lr"], group["initial_lr"], int(group["step"])) == (5e-4, 1e-3, 1)
    assert rebuilt.state[bf16.weight]["exp_avg"].dtype == torch.bfloat16

    pristine = _rebuild(fresh, bf16, "optimi_kahan")
    before = {key: value for key, value in pristine.param_groups[0].items() if key != "params"}
    one_short = {**saved, "param_groups": [{**saved["param_groups"][0], "params": [0]}]}
    with pytest.raises(ValueError, match=r"groups hold \[1\] parameters, plan.optimizer's \[2\]"):
        pristine.load_state_dict(one_short)
    amsgrad = {**saved, "param_groups": [{**saved["param_groups"][0], "amsgrad": True}]}
    with pytest.raises(ValueError, match="amsgrad=True has no equivalent"):
        pristine.load_state_dict(amsgrad)
    after = {key: value for key, value in pristine.param_groups[0].items() if key != "params"}
    assert after == before and not pristine.state


@pytest.mark.filterwarnings("ignore::autoprec.errors.OptimizerRebuiltWarning")
@pytest.mark.parametrize("mode", ["bf16_sr", "bf16_sr_kahan"])
def test_a_checkpoint_option_the_rebuilt_optimizer_ignores_is_refused(mode: str) -> None:
    """A torch SGD checkpoint with maximize=True loaded into StochasticSGD: the group said
    maximize and the step went downhill. Refused now, before anything loads, as the rebuild
    refuses it."""
    import autoprec
    from autoprec.specs import ModeSpec

    saved = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1, maximize=True).state_dict()
    model = nn.Linear(2, 1)
    plan = autoprec.prepare(ModeSpec(mode=mode), model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = copy.deepcopy(plan.optimizer.state_dict())
    with pytest.raises(ValueError, match="maximize=True has no equivalent"):
        plan.optimizer.load_state_dict(saved)
    assert plan.optimizer.state_dict()["param_groups"] == before["param_groups"]


def _adam_checkpoint(family: type[torch.optim.Optimizer]) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(64, 128)
    optimizer = family(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return copy.deepcopy(optimizer.state_dict())


@pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes on a CPU; no scheduler
@pytest.mark.parametrize("target", ["stochastic", "stochastic_8bit", "optimi_kahan", "bnb_8bit"])
@pytest.mark.parametrize("user", [torch.optim.AdamW, torch.optim.Adam])
def test_a_checkpoint_of_the_other_adam_decays_as_torchs_load_would(
    target: str, user: type[torch.optim.Optimizer]
) -> None:
    """Found by a hunt: an Adam checkpoint loaded into the rebuild of the user's AdamW resumed
    it with L2 decay (torch's AdamW decays decoupled whatever it loads), and an AdamW one into
    the torch-optimi rebuild of an Adam with L2 decay (torch's Adam takes the checkpoint's
    decoupled decay). The rebuild now decays as torch's load leaves the user's optimizer, or,
    when its class cannot (torch-optimi's KahanAdam is L2 only), refuses."""
    pytest.importorskip("bitsandbytes" if "8bit" in target else "optimi")
    if user is torch.optim.Adam and target == "bnb_8bit":
        pytest.skip("Adam with weight decay is refused at the rebuild (bitsandbytes: decoupled)")
    other = torch.optim.Adam if user is torch.optim.AdamW else torch.optim.AdamW
    saved = _adam_checkpoint(other)
    model = nn.Linear(64, 128)
    plain = user(model.parameters(), lr=1e-3, weight_decay=0.1)
    plain.load_state_dict(copy.deepcopy(saved))
    decoupled = plain.param_groups[0]["decoupled_weight_decay"]  # True both ways in torch 2.13
    rebuilt = _rebuild(user(model.parameters(), lr=1e-3, weight_decay=0.1), model, target)
    if target == "optimi_kahan" and user is torch.optim.Adam:
        with pytest.raises(ValueError, match=r"resumes your optimizer with decoupled weight"):
            rebuilt.load_state_dict(saved)
        return
    rebuilt.load_state_dict(saved)
    group = rebuilt.param_groups[0]
    if target.startswith("stochastic"):
        assert group["decoupled_weight_decay"] == decoupled
    elif target == "optimi_kahan":
        assert group["decouple_wd"] == decoupled
    assert group["weight_decay"] == 0.1


@pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes on a CPU; no scheduler
@pytest.mark.parametrize("mode", ["bf16_kahan", "amp_bf16+8bit"])
def test_an_adam_whose_decaying_groups_decouple_resumes_its_own_state(mode: str) -> None:
    """Found by a hunt: an Adam whose decaying group sets ``decoupled_weight_decay=True`` is
    rebuilt decoupled (KahanDecayAdamW, AdamW8bit), but its own fp32 checkpoint was refused
    as "decays L2" (the check read the optimizer's defaults), and switching the stepped run
    to the mode failed after the model was cast."""
    import autoprec

    pytest.importorskip("bitsandbytes" if "8bit" in mode else "optimi")
    spec = autoprec.ModeSpec(mode=mode.split("+")[0], optimizer_bits=8 if "8bit" in mode else 32)

    def model_and_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        decay, no_decay = [model[0].weight, model[2].weight], [model[0].bias, model[2].bias]
        groups = [
            {"params": decay, "weight_decay": 0.1, "decoupled_weight_decay": True},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return model, torch.optim.Adam(groups, lr=1e-2)

    def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model(torch.randn(32, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = model_and_adam()
    one_step(model, optimizer)
    checkpoint = copy.deepcopy(optimizer.state_dict())
    fresh_model, fresh = model_and_adam()
    autoprec.prepare(spec, fresh_model, fresh).optimizer.load_state_dict(checkpoint)
    plan = autoprec.prepare(spec, model, optimizer)  # the stepped run, switched
    one_step(plan.model, plan.optimizer)


@pytest.mark.parametrize(
    ("spec", "hurt", "said"),
    [
        (("bf16_sr", 32), "extra", r"plan.optimizer \(stochastic-rounding Adam/SGD\) cannot load"),
        (("bf16_kahan", 32), "extra", "torch-optimi with Kahan summation"),
        (("bf16_pure", 8), "shape", r"'exp_avg' does not fit its parameter .*found shape \(3,\)"),
        (("bf16_kahan", 32), "missing", "'exp_avg_sq' does not fit its parameter .*found nothing"),
    ],
)
def test_a_stepped_state_that_cannot_load_is_refused_before_the_model_converts(
    spec: tuple[str, int], hurt: str, said: str
) -> None:
    """Found by a hunt: prepare() on a stepped optimizer whose state its rebuild refused (a
    key of its own beside Adam's, a moment of another shape) raised at the load, after the
    model had been converted: its weights bf16 and its hooks on."""
    from autoprec.plan import prepare
    from autoprec.specs import ModeSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    state = optimizer.state[model[0].weight]
    if hurt == "extra":
        state["grad_ema"] = torch.zeros(3)
    elif hurt == "shape":
        state["exp_avg"] = torch.zeros(3)
    else:
        del state["exp_avg_sq"]
    before = [parameter.detach().clone() for parameter in model.parameters()]
    mode, bits = spec
    with pytest.raises(ValueError, match=said):
        prepare(ModeSpec(mode=mode, optimizer_bits=bits), model, optimizer)  # type: ignore[arg-type]
    for parameter, was in zip(model.parameters(), before, strict=True):
        assert parameter.dtype == torch.float32 and torch.equal(parameter, was)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_an_adamw_checkpoint_in_optimi_or_bnb_layout_resumes_torchs_adam_decoupled() -> None:
    """Found by a hunt: torch's Adam takes a checkpoint's decoupled_weight_decay, and an
    AdamW's checkpoint saved under bf16_kahan (torch-optimi's layout) or 8-bit states
    (bitsandbytes') resumed Adam with L2 decay (mean weight 0.254 where torch's own rule
    gives 0.904 after 1000 zero-gradient steps); loaded natively into bf16_kahan's KahanAdam
    it never decayed. Resumed torch's way now, or refused where the rebuild cannot."""
    import autoprec
    from autoprec.profile import profile_for
    from autoprec.specs import ModeSpec

    def plan_for(spec: ModeSpec, optimizer_class: type) -> autoprec.PrecisionPlan:
        model = nn.Linear(64, 64, bias=False)
        nn.init.ones_(model.weight)
        optimizer = optimizer_class(model.parameters(), lr=1e-3, weight_decay=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return profile_for(spec).apply(model, optimizer, clip_grad_norm=None)

    def run(plan: autoprec.PrecisionPlan, steps: int) -> None:
        for _ in range(steps):
            plan.backward((plan.model.weight.float() * 0).sum())
            plan.step()

    fp32 = ModeSpec(mode="fp32")
    for saved_under in (ModeSpec(mode="bf16_kahan"), ModeSpec(mode="fp32", optimizer_bits=8)):
        saved = plan_for(saved_under, torch.optim.AdamW)
        run(saved, 5)
        state = copy.deepcopy(saved.optimizer.state_dict())
        resumed = plan_for(fp32, torch.optim.Adam)
        resumed.optimizer.load_state_dict(state)
        assert resumed.optimizer.param_groups[0]["decoupled_weight_decay"] is True
        run(resumed, 1000)
        assert float(resumed.model.weight.detach().mean()) == pytest.approx(0.904, abs=2e-3)
    kahan = plan_for(ModeSpec(mode="bf16_kahan"), torch.optim.AdamW)
    run(kahan, 5)
    with pytest.raises(ValueError, match="resumes your optimizer with decoupled weight decay"):
        plan_for(ModeSpec(mode="bf16_kahan"), torch.optim.Adam).optimizer.load_state_dict(
            copy.deepcopy(kahan.optimizer.state_dict())
        )
