"""Rebuild the user's optimizer for a mode: same parameter groups, same hyper-parameters.

A mode may need another optimizer implementation (bitsandbytes 8-bit states, torch-optimi's
Kahan summation, stochastic rounding) or new parameter objects (a module swap). Parameters are
found by name, so groups survive swaps, and every hyper-parameter is copied per group and
translated to the target's own names: torch-optimi, for one, reads ``beta1``/``beta2`` and
silently ignores a group's ``betas``; its defaults (betas (0.9, 0.99), eps 1e-6) differ from
torch's. An option the target cannot honour is an error, never dropped.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from autoprec import state_translation
from autoprec._imports import require
from autoprec.stochastic_optim import StochasticAdamW, StochasticSGD

OptimizerTarget = Literal["same", "bnb_8bit", "optimi_kahan", "stochastic", "stochastic_kahan"]
"""What to rebuild into: the user's own class (new parameter objects only), bitsandbytes
8-bit states, torch-optimi with Kahan summation, stochastic rounding (with Kahan)."""

SourceKind = Literal["adamw", "adam", "sgd"]

SUPPORTED_SOURCES = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"

_TARGET_NAMES: dict[OptimizerTarget, str] = {
    "same": "the same optimizer class",
    "bnb_8bit": "bitsandbytes 8-bit states",
    "optimi_kahan": "torch-optimi with Kahan summation",
    "stochastic": "stochastic-rounding Adam/SGD",
    "stochastic_kahan": "stochastic-rounding Adam/SGD with Kahan summation",
}


@dataclass(frozen=True)
class NamedGroup:
    """One parameter group, its parameters named by their fqn in the model."""

    names: tuple[str, ...]
    options: dict[str, Any]


def named_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[NamedGroup]:
    """The optimizer's groups with parameters named after the model's (before any swap)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"Optimizer group {index} holds {len(missing)} parameter(s) that are not in the "
                "model; build the optimizer from model.parameters() (or named groups of them)."
            )
        options = {key: value for key, value in group.items() if key != "params"}
        groups.append(NamedGroup(tuple(names[id(p)] for p in group["params"]), options))
    return groups


BNB_8BIT: dict[SourceKind, str] = {"adamw": "AdamW8bit", "adam": "Adam8bit", "sgd": "SGD8bit"}
"""The bitsandbytes class (in ``bitsandbytes.optim``) each optimizer family's 8-bit states
are rebuilt into."""


def source_kind(optimizer: torch.optim.Optimizer) -> SourceKind:
    """Which supported family the user's optimizer belongs to, or a clear error."""
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        decoupled = optimizer.defaults.get("decoupled_weight_decay", False)
        return "adamw" if decoupled else "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    raise TypeError(
        f"autoprec cannot translate {type(optimizer).__module__}.{type(optimizer).__name__} into "
        f"another implementation; supported: {SUPPORTED_SOURCES}. Modes that keep your "
        "optimizer class (fp32, tf32, amp_*, bf16_pure, fp8_* with optimizer_bits=32) work with "
        "any optimizer."
    )


def _refuse(options: dict[str, Any], target: OptimizerTarget, **forbidden: Any) -> None:
    for key, allowed in forbidden.items():
        value = options.get(key, allowed)
        if value != allowed:
            raise ValueError(
                f"Optimizer option {key}={value!r} has no equivalent in "
                f"{_TARGET_NAMES[target]}; use {key}={allowed!r} or another mode."
            )


def _adam_options(options: dict[str, Any]) -> dict[str, Any]:
    return {key: options[key] for key in ("lr", "betas", "eps", "weight_decay")}


def _translate(
    kind: SourceKind, options: dict[str, Any], target: OptimizerTarget
) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    """(constructor, group options in the target's names) for one group."""
    if kind in ("adam", "adamw"):
        _refuse(options, target, amsgrad=False, maximize=False)
    else:
        if target in ("stochastic", "stochastic_kahan"):  # SGD's own options all translate
            _refuse(options, target, maximize=False)
        else:
            _refuse(options, target, nesterov=False, maximize=False, dampening=0)
    if target == "bnb_8bit":
        bnb = require("bitsandbytes")
        if kind == "sgd":
            if not options["momentum"]:
                raise ValueError(
                    "SGD without momentum keeps no optimizer state: 8-bit states have nothing to "
                    "save. Use optimizer_bits=32."
                )
            keys = ("lr", "momentum", "weight_decay")
            return getattr(bnb.optim, BNB_8BIT[kind]), {key: options[key] for key in keys}
        if kind == "adam" and options["weight_decay"]:
            raise ValueError(
                "torch.optim.Adam applies weight_decay as an L2 gradient term, but bitsandbytes' "
                "Adam8bit decays weights directly (as AdamW does); use AdamW, or weight_decay=0."
            )
        return getattr(bnb.optim, BNB_8BIT[kind]), _adam_options(options)
    if target == "optimi_kahan":
        optimi = require("optimi")
        if kind == "sgd":
            translated = {
                "lr": options["lr"],
                "momentum": options["momentum"],
                "weight_decay": options["weight_decay"],
                "dampening": False,
                "torch_init": True,
                "kahan_sum": True,
            }
            return optimi.SGD, translated
        beta1, beta2 = options["betas"]
        translated = {
            "lr": options["lr"],
            "beta1": beta1,
            "beta2": beta2,
            "eps": options["eps"],
            "weight_decay": options["weight_decay"],
            "kahan_sum": True,
        }
        if kind == "adam":
            translated["decouple_wd"] = False
        return (optimi.AdamW if kind == "adamw" else optimi.Adam), translated
    if target in ("stochastic", "stochastic_kahan"):
        if kind == "sgd":
            keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
            translated = {key: options[key] for key in keys}
            translated["kahan"] = target == "stochastic_kahan"
            return StochasticSGD, translated
        translated = _adam_options(options)
        translated["decoupled_weight_decay"] = kind == "adamw"
        translated["kahan"] = target == "stochastic_kahan"
        return StochasticAdamW, translated
    raise ValueError(f"Unknown optimizer target {target!r}.")


def translation_problem(optimizer: torch.optim.Optimizer, target: OptimizerTarget) -> str | None:
    """Why ``optimizer`` cannot be rebuilt for ``target`` (the error rebuilding would raise),
    or None when every group translates. Builds nothing."""
    try:
        kind = source_kind(optimizer)
        for group in optimizer.param_groups:
            _translate(kind, {k: v for k, v in group.items() if k != "params"}, target)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (some defaults are internal)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    groups: list[NamedGroup],
    model: nn.Module,
    target: OptimizerTarget,
    *,
    require_fresh: bool = True,
) -> torch.optim.Optimizer:
    """A new optimizer over ``model``'s parameters (found by name) for ``target``.

    Group-level extras that are not hyper-parameters (``initial_lr`` set by LR schedulers, a
    group's ``name``) are carried over unchanged. The new optimizer starts without state;
    ``require_fresh`` refuses a source that has already stepped (its state would be lost).
    """
    if require_fresh and optimizer.state:
        raise ValueError(
            "The optimizer has already stepped (it holds state). Apply the precision profile "
            "to an optimizer built fresh over the model, then load your optimizer's "
            "state_dict() (or checkpoint) into plan.optimizer: a torch AdamW/Adam/SGD state is "
            "translated into the optimizer the mode trains with."
        )
    parameters = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted({name for group in groups for name in group.names} - set(parameters))
    if missing:
        raise RuntimeError(f"After conversion the model lacks parameters {missing[:5]}.")
    if target == "same":
        new_groups = [
            {**group.options, "params": [parameters[name] for name in group.names]}
            for group in groups
        ]
        return type(optimizer)(new_groups, **_constructor_defaults(optimizer))
    kind = source_kind(optimizer)
    translations = [_translate(kind, group.options, target) for group in groups]
    constructor, first = translations[0]
    defaults = {k: v for k, v in first.items() if k not in ("beta1", "beta2")}
    if "beta1" in first:  # torch-optimi: constructor takes betas, groups hold beta1/beta2
        defaults["betas"] = (first["beta1"], first["beta2"])
    new_groups = [
        {
            **{k: v for k, v in group.options.items() if k not in optimizer.defaults},
            **translated,
            "params": [parameters[name] for name in group.names],
        }
        for group, (_, translated) in zip(groups, translations, strict=True)
    ]
    rebuilt = constructor(new_groups, **defaults)
    if "beta1" in first:
        _expose_betas(rebuilt)
    if target in ("bnb_8bit", "optimi_kahan"):
        _load_source_state(rebuilt, kind, target, set(optimizer.defaults))
    return rebuilt


_TORCH_STATE_KEYS: dict[SourceKind, set[str]] = {
    "adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "sgd": {"momentum_buffer"},
}
"""The per-parameter state keys torch's optimizers of each family save."""


def _load_source_state(
    optimizer: torch.optim.Optimizer,
    kind: SourceKind,
    target: OptimizerTarget,
    source_keys: set[str],
) -> None:
    """Let ``optimizer`` (a bitsandbytes or torch-optimi rebuild) load, besides its own state,
    the state of the torch optimizer it was rebuilt from (``kind``, whose groups hold
    ``source_keys``): the user's fp32 AdamW checkpoint, resumed under the profile, is translated
    (``_translate_source_state``). Any other optimizer's state is refused: torch's own
    ``load_state_dict`` takes the saved groups as they are, and the first step then failed with
    a bare ``KeyError`` (``'state1'`` in bitsandbytes, ``'kahan_sum'`` in torch-optimi).
    bitsandbytes overrides ``load_state_dict`` and runs no load hooks, so the instance's method
    is wrapped (a bound method: a deep copy binds to the copy)."""

    def load_state_dict(
        self: torch.optim.Optimizer, state_dict: dict[str, Any], *args: Any, **kwargs: Any
    ) -> None:
        groups = state_dict.get("param_groups", [])
        saved_keys = {key for entry in state_dict.get("state", {}).values() for key in entry}
        torch_written = saved_keys <= _TORCH_STATE_KEYS[kind]
        if groups and torch_written and all(source_keys <= set(group) for group in groups):
            _translate_source_state(self, state_dict, kind, target, source_keys)
            return
        expected = set(self.param_groups[0]) - {"params", "betas", "initial_lr"}
        for group in groups:
            missing = sorted(expected - set(group))
            if missing:
                name = f"{type(self).__module__.split('.')[0]}'s {type(self).__name__}"
                raise ValueError(
                    f"plan.optimizer ({name}) cannot load this optimizer state: another "
                    f"optimizer wrote it (its parameter groups lack {missing[:4]}). It loads "
                    "its own state and that of the torch optimizer passed to apply() "
                    f"({SUPPORTED_SOURCES}); load one of those, or keep the optimizer fresh "
                    "and load the model's weights only."
                )
        type(self).load_state_dict(self, state_dict, *args, **kwargs)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]


def _translate_source_state(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    kind: SourceKind,
    target: OptimizerTarget,
    source_keys: set[str],
) -> None:
    """Load a torch optimizer's state (``kind``) into its rebuild for ``target``: each saved
    group's hyper-parameters translated as at rebuild (the saved values win, as in torch's own
    load), each parameter's state by ``state_translation``. Everything is translated before
    anything is written, so a failure leaves the optimizer as it was."""
    saved_groups = state_dict["param_groups"]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if [len(group["params"]) for group in saved_groups] != sizes:
        raise ValueError(
            "The saved optimizer state does not fit plan.optimizer: its parameter groups hold "
            f"{[len(group['params']) for group in saved_groups]} parameters, plan.optimizer's "
            f"{sizes}. Save and load the state of the optimizer built over this model."
        )
    options = []
    for group in saved_groups:
        saved_options = {key: value for key, value in group.items() if key != "params"}
        _, translated = _translate(kind, saved_options, target)
        extras = {k: v for k, v in saved_options.items() if k not in source_keys}
        options.append({**extras, **translated})
    states: dict[torch.Tensor, dict[str, Any]] = {}
    steps = [0] * len(saved_groups)
    for group_index, group in enumerate(saved_groups):
        for position, saved_index in enumerate(group["params"]):
            saved = state_dict["state"].get(saved_index)
            if not saved:
                continue
            parameter = optimizer.param_groups[group_index]["params"][position]
            steps[group_index] = max(steps[group_index], state_translation.saved_step(saved))
            if target == "bnb_8bit":
                states[parameter] = state_translation.bnb_state(
                    optimizer, saved, (group_index, position), adam=kind != "sgd"
                )
            else:
                betas = None if kind == "sgd" else tuple(group["betas"])
                states[parameter] = state_translation.optimi_state(saved, parameter, betas)
    for group, translated, step in zip(optimizer.param_groups, options, steps, strict=True):
        group.update(translated)
        if target == "optimi_kahan":
            adam = "beta1" in translated
            if adam:
                group["betas"] = (translated["beta1"], translated["beta2"])
            state_translation.optimi_group_resumed(group, step if adam else None)
    optimizer.state.clear()
    optimizer.state.update(states)


def _expose_betas(optimizer: torch.optim.Optimizer) -> None:
    """torch-optimi's Adam groups hold ``beta1``/``beta2``; LR schedulers that cycle the
    momentum (OneCycleLR, CyclicLR) write torch's ``betas`` (and raised KeyError without it).
    Give every group ``betas`` and copy it into ``beta1``/``beta2`` before each step."""
    for group in optimizer.param_groups:
        group["betas"] = (group["beta1"], group["beta2"])

    def sync(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if "betas" not in group:  # groups loaded from a checkpoint written without it
                group["betas"] = (group["beta1"], group["beta2"])
            group["beta1"], group["beta2"] = group["betas"]

    optimizer.register_step_pre_hook(sync)
