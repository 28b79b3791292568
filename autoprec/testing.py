"""The contract every precision mode keeps, as a pytest test case to subclass.

Modelled on ``optuna.testing``'s sampler test cases: a subclass sets ``spec`` and inherits every
test. Each test prepares a small model (two Linears with dimensions FP8 kernels take, a LayerNorm
between them; on the first CUDA GPU when there is one) with an AdamW of two parameter groups, and
checks what every mode promises: it runs or refuses with every reason (never another mode), keeps
the user's groups and hyper-parameters, trains, keeps ``keep_fp32`` modules in fp32, leaves the
global RNG alone, and resumes from a checkpoint exactly where it stopped. A mode that cannot run
on this machine is skipped with its own reasons, after checking that ``prepare`` refuses it
naming them::

    from autoprec.specs import ModeSpec
    from autoprec.testing import ModeContract

    class TestBf16Sr(ModeContract):
        spec = ModeSpec(mode="bf16_sr")

Needs pytest (a test dependency, not one of autoprec's).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from autoprec.errors import OptimizerRebuiltWarning, PrecisionSwitchWarning, UnsupportedModeError
from autoprec.plan import PrecisionPlan, prepare
from autoprec.specs import ModeSpec

KEPT_MODULE = "1"
"""The LayerNorm of :func:`contract_model`, the module the ``keep_fp32`` test keeps."""


def contract_device() -> torch.device:
    """Where the contract trains: the first CUDA GPU when there is one (so TF32 and FP8 run
    there for real), else the CPU."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def contract_model() -> nn.Sequential:
    """The same small model every time: Linear(32, 64), LayerNorm, GELU, Linear(64, 32)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32))
    return model.to(contract_device())


def contract_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """AdamW with nanoGPT's two groups: matrices decay, vectors do not (and learn faster)."""
    matrices = [p for p in model.parameters() if p.ndim > 1]
    vectors = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": 0.1},
            {"params": vectors, "weight_decay": 0.0, "lr": 2e-3},
        ],
        lr=1e-3,
        betas=(0.9, 0.98),
        eps=1e-7,
    )


def contract_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    device = contract_device()
    return [
        (
            torch.randn(16, 32, generator=generator).to(device),
            torch.randn(16, 32, generator=generator).to(device),
        )
        for _ in range(count)
    ]


def train(plan: PrecisionPlan, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """One optimizer step per batch (mean squared error); the losses."""
    losses = []
    for inputs, targets in batches:
        with plan.autocast():
            loss = nn.functional.mse_loss(plan.model(inputs).float(), targets)
        plan.step(loss)
        losses.append(float(loss.detach()))
    return losses


class ModeContract:
    """Subclass, set ``spec``; pytest collects the inherited ``test_*`` methods."""

    spec: ClassVar[ModeSpec]

    def make_plan(self, spec: ModeSpec | None = None) -> PrecisionPlan:
        """A fresh model and optimizer prepared for ``spec`` (default: the class's); skips
        the test, with the mode's own reasons, where it cannot run (after checking that the
        refusal names every reason)."""
        spec = spec or self.spec
        model = contract_model()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", OptimizerRebuiltWarning)  # no scheduler here
                return prepare(spec, model, contract_optimizer(model))
        except UnsupportedModeError as refusal:
            _expect(bool(refusal.reasons), f"{spec.label} refused without a reason")
            for reason in refusal.reasons:
                _expect(reason in str(refusal), f"the refusal does not name {reason!r}")
            pytest.skip(f"{spec.label} cannot run here: {'; '.join(refusal.reasons)}")

    def test_runs_as_asked_or_refuses_with_every_reason(self) -> None:
        plan = self.make_plan()  # a refusal is checked (and skipped) in make_plan
        substitute = f"asked for {self.spec.label}, got {plan.spec.label} ({type(plan.mode).name})"
        _expect(plan.spec == self.spec and type(plan.mode).name == self.spec.mode, substitute)
        _expect(isinstance(plan.optimizer, torch.optim.Optimizer), "no torch optimizer")

    def test_keeps_the_users_groups_and_hyperparameters(self) -> None:
        plan = self.make_plan()
        user = contract_optimizer(contract_model())
        ours, theirs = plan.optimizer.param_groups, user.param_groups
        _expect(len(ours) == len(theirs), "parameter groups merged or split")
        for group, expected in zip(ours, theirs, strict=True):
            sizes = [sum(p.numel() for p in g["params"]) for g in (group, expected)]
            _expect(sizes[0] == sizes[1], f"a group holds {sizes[0]} elements, not {sizes[1]}")
            ours_h, theirs_h = _hyperparameters(group), _hyperparameters(expected)
            _expect(
                ours_h == theirs_h, f"hyper-parameters {ours_h} where the user's are {theirs_h}"
            )

    def test_trains(self) -> None:
        plan = self.make_plan()
        before = {name: p.detach().float().clone() for name, p in plan.model.named_parameters()}
        losses = train(plan, contract_batches(12))
        _expect(bool(torch.isfinite(torch.tensor(losses)).all()), f"non-finite losses: {losses}")
        _expect(sum(losses[-3:]) < sum(losses[:3]), f"the loss did not fall: {losses}")
        moved = [
            name
            for name, p in plan.model.named_parameters()
            if not torch.equal(p.detach().float(), before[name])
        ]
        _expect(
            len(moved) == len(before), f"parameters that never moved: {set(before) - set(moved)}"
        )

    def test_keeps_keep_fp32_modules_in_fp32(self) -> None:
        spec = self.spec.model_copy(update={"keep_fp32": (KEPT_MODULE,)})
        plan = self.make_plan(spec)
        kept = plan.model.get_submodule(KEPT_MODULE)
        seen: list[torch.dtype] = []
        kept.register_forward_pre_hook(lambda _module, args: seen.append(args[0].dtype))
        train(plan, contract_batches(3))
        dtypes = {p.dtype for p in kept.parameters()}
        _expect(dtypes == {torch.float32}, f"the kept module's weights are {dtypes}")
        _expect(bool(seen) and set(seen) == {torch.float32}, f"the kept module computed in {seen}")

    def test_leaves_the_global_rng_alone(self) -> None:
        plan = self.make_plan()
        batches = contract_batches(4)
        states = _global_rng_states()
        train(plan, batches)  # the model draws nothing: neither may the mode
        for before, after in zip(states, _global_rng_states(), strict=True):
            _expect(torch.equal(before, after), "the mode drew from the global RNG")

    def test_resumes_from_a_checkpoint_exactly(self) -> None:
        batches = contract_batches(8)
        plan = self.make_plan()
        train(plan, batches[:4])
        checkpoint = copy.deepcopy(
            {
                "model": plan.model.state_dict(),
                "optimizer": plan.optimizer.state_dict(),
                "plan": plan.state_dict(),
            }
        )
        train(plan, batches[4:])
        resumed = self.make_plan()
        resumed.model.load_state_dict(checkpoint["model"])
        resumed.optimizer.load_state_dict(checkpoint["optimizer"])
        resumed.load_state_dict(checkpoint["plan"])
        train(resumed, batches[4:])
        for (name, value), other in zip(
            plan.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
        ):
            _expect(torch.equal(value, other), f"{name} differs after resuming")

    def test_another_modes_checkpoint_switches_with_a_warning(self) -> None:
        """A plan state another mode saved: the run switches precision here, with a warning;
        the saved mode's own state (a loss scale) is left behind, the step counter taken."""
        plan = self.make_plan()
        other = ModeSpec(mode="fp32" if self.spec.mode != "fp32" else "amp_bf16")
        own = plan.mode.state_dict()
        state = {**plan.state_dict(), "spec": other.model_dump(mode="json"), "micro_step": 7}
        state["mode"] = {"scaler": {"scale": 1.0}}
        with pytest.warns(PrecisionSwitchWarning, match=f"written by a plan for {other.label}"):
            plan.load_state_dict(state)
        _expect(plan.micro_step == 7, f"micro_step {plan.micro_step} after loading 7")
        _expect(plan.mode.state_dict() == own, "the other mode's state was taken")

    def test_a_deep_copy_of_the_model_trains(self) -> None:
        plan = self.make_plan()
        copied = copy.deepcopy(plan.model)  # trials and checkpoints deep-copy converted models
        inputs, targets = contract_batches(1)[0]
        with plan.autocast():
            loss = nn.functional.mse_loss(copied(inputs).float(), targets)
        loss.backward()
        _expect(bool(torch.isfinite(loss)), f"the copy's loss is {loss.item()}")
        _expect(any(p.grad is not None for p in copied.parameters()), "the copy got no gradient")


def _expect(condition: bool, message: str) -> None:
    """A contract check that holds under ``python -O`` too: pytest rewrites no assert in an
    installed module, and ``-O`` strips them, so every check passed there (found by a hunt)."""
    if not condition:
        raise AssertionError(message)


def _global_rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return states


def _hyperparameters(group: dict[str, Any]) -> dict[str, tuple[float, ...]]:
    """lr, betas, eps and weight_decay of an Adam group as floats, in torch's names (numbers,
    0-d tensors and tuples alike; torch-optimi names the betas ``beta1`` and ``beta2``)."""
    betas = group["betas"] if "betas" in group else (group["beta1"], group["beta2"])
    found = {"lr": group["lr"], "betas": betas, "eps": group["eps"]}
    found["weight_decay"] = group["weight_decay"]
    return {
        key: tuple(float(v) for v in (value if isinstance(value, tuple | list) else (value,)))
        for key, value in found.items()
    }
