"""Rebuild the user's optimizer for a mode: same parameter groups, same hyper-parameters.

A mode may need another optimizer implementation (bitsandbytes 8-bit states, torch-optimi's
Kahan summation, stochastic rounding) or new parameter objects (a module swap). Parameters are
found by name, so groups survive swaps, and every hyper-parameter is copied per group and
translated to the target's own names: torch-optimi, for one, reads ``beta1``/``beta2`` and
silently ignores a group's ``betas``; its defaults (betas (0.9, 0.99), eps 1e-6) differ from
torch's. An option the target cannot honour is an error, never dropped.
"""

from __future__ import annotations

import collections
import copy
import inspect
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from autoprec._imports import require
from autoprec._wording import first_names
from autoprec.stochastic_optim import StochasticAdamW, StochasticSGD

OptimizerTarget = Literal[
    "same", "bnb_8bit", "optimi_kahan", "stochastic", "stochastic_kahan", "stochastic_8bit"
]
"""What to rebuild into: the user's own class (new parameter objects only), bitsandbytes
8-bit states, torch-optimi with Kahan summation, stochastic rounding (with Kahan, or with 8-bit
moments)."""

STOCHASTIC_TARGETS: tuple[OptimizerTarget, ...] = (
    "stochastic", "stochastic_kahan", "stochastic_8bit"
)  # fmt: skip

SourceKind = Literal["adamw", "adam", "sgd"]

SUPPORTED_SOURCES = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"

TARGET_NAMES: dict[OptimizerTarget, str] = {
    "same": "the same optimizer class",
    "bnb_8bit": "bitsandbytes 8-bit states",
    "optimi_kahan": "torch-optimi with Kahan summation",
    "stochastic": "stochastic-rounding Adam/SGD",
    "stochastic_kahan": "stochastic-rounding Adam/SGD with Kahan summation",
    "stochastic_8bit": "stochastic-rounding Adam/SGD with 8-bit states",
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
            shapes = first_names([str(tuple(p.shape)) for p in missing])
            raise ValueError(
                f"Optimizer group {index} holds {len(missing)} parameter(s) that are not in the "
                f"model (shapes {shapes}); build the "
                "optimizer from model.parameters() (or named groups of them). A parameter "
                "trained beside the model (a loss's learnable temperature or task weights) must "
                "be part of it, so that every mode and every trial's copy has it: register it on "
                "the model, or pass one module holding both (nn.ModuleDict({'model': model, "
                "'loss': loss_module}))."
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


def rebuildable_kind(optimizer: torch.optim.Optimizer) -> SourceKind:
    """:func:`source_kind`, for an optimizer to rebuild in another implementation. A subclass
    of torch's AdamW, Adam or SGD that defines its own ``step`` (or its group update) does what
    no rebuild can carry (a layer it skips, an update it changes): refused, not rebuilt as the
    plain family. A subclass that only sets options or adds methods is that family."""
    kind = source_kind(optimizer)
    family = next(
        k
        for k in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
        if isinstance(optimizer, k)
    )
    own = next(
        (
            klass
            for klass in type(optimizer).__mro__[: type(optimizer).__mro__.index(family)]
            for name in ("step", "_init_group")
            if name in vars(klass)  # torch's step hook re-sets an inherited step: unwrapped
            and _unwrapped(vars(klass)[name]) is not _unwrapped(getattr(family, name))
        ),
        None,
    )
    if own is not None:
        raise TypeError(
            f"autoprec cannot translate {own.__module__}.{own.__qualname__} into another "
            f"implementation: it subclasses {family.__module__}.{family.__qualname__} with its "
            "own step(), which a rebuilt optimizer would drop. Modes that keep your optimizer "
            "class (fp32, tf32, amp_*, bf16_pure, fp8_* with optimizer_bits=32) run it as it is."
        )
    return kind


def _unwrapped(function: Any) -> Any:
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


def _refuse(options: dict[str, Any], target: OptimizerTarget, **forbidden: Any) -> None:
    for key, allowed in forbidden.items():
        value = options.get(key, allowed)
        if value != allowed:
            raise ValueError(
                f"Optimizer option {key}={value!r} has no equivalent in "
                f"{TARGET_NAMES[target]}; use {key}={allowed!r} or another mode."
            )


def refuse_untranslatable(
    kind: SourceKind, options: dict[str, Any], target: OptimizerTarget
) -> None:
    """A ValueError naming an option of a ``kind`` group that ``target`` cannot run (a
    group being rebuilt, or one a checkpoint brings in)."""
    if kind in ("adam", "adamw"):
        _refuse(options, target, amsgrad=False, maximize=False)
    elif target in STOCHASTIC_TARGETS:  # SGD's own options all translate
        _refuse(options, target, maximize=False)
    else:
        _refuse(options, target, nesterov=False, maximize=False, dampening=0)


def _adam_options(options: dict[str, Any]) -> dict[str, Any]:
    return {key: options[key] for key in ("lr", "betas", "eps", "weight_decay")}


def translate_group(
    kind: SourceKind, options: dict[str, Any], target: OptimizerTarget
) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    """(constructor, group options in the target's names) for one group. torch's Adam and
    AdamW read ``decoupled_weight_decay`` per group: a group that sets it is of that kind."""
    if kind != "sgd" and "decoupled_weight_decay" in options:
        kind = "adamw" if options["decoupled_weight_decay"] else "adam"
    refuse_untranslatable(kind, options, target)
    if target == "bnb_8bit":
        bnb = require("bitsandbytes")
        if kind == "sgd":
            if not options["momentum"]:
                raise ValueError(
                    "SGD without momentum keeps no optimizer state: 8-bit states have nothing to "
                    "save. Use optimizer_bits=32."
                )
            # SGD8bit reads a group's momentum from ``betas[0]`` (its constructor writes
            # ``betas=(momentum, dampening)``); ``momentum`` stays for the schedulers that cycle it
            translated = {key: options[key] for key in ("lr", "momentum", "weight_decay")}
            translated["betas"] = (options["momentum"], 0.0)
            return getattr(bnb.optim, BNB_8BIT[kind]), translated
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
        from autoprec.kahan_adamw import KahanAdam, KahanDecayAdamW  # torch-optimi is there

        if kind == "adam":  # both keep the second moment fp32 (see autoprec.kahan_adamw)
            translated["decouple_wd"] = False
            return KahanAdam, translated
        return KahanDecayAdamW, translated  # its decay through the compensation
    if target in STOCHASTIC_TARGETS:
        storage = {"kahan": target == "stochastic_kahan"}
        if target == "stochastic_8bit":
            require("bitsandbytes")  # its block-wise quantisation keeps the moments
            storage["state_bits"] = 8
        if kind == "sgd":
            if target == "stochastic_8bit" and not options["momentum"]:
                raise ValueError(
                    "SGD without momentum keeps no optimizer state: 8-bit states have nothing to "
                    "save. Use optimizer_bits=32."
                )
            keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
            translated = {key: options[key] for key in keys}
            return StochasticSGD, {**translated, **storage}
        translated = _adam_options(options)
        translated["decoupled_weight_decay"] = kind == "adamw"
        return StochasticAdamW, {**translated, **storage}
    raise ValueError(f"Unknown optimizer target {target!r}.")


def check_translation(optimizer: torch.optim.Optimizer, target: OptimizerTarget) -> None:
    """Raise what rebuilding ``optimizer`` for ``target`` would raise (``TypeError`` for its
    class, ``ValueError`` for an option without an equivalent or a value the target's own
    constructor refuses). Builds each translated group once, over a placeholder tensor:
    torch-optimi refuses SGD's ``momentum=1.0``, which torch takes, and that refusal came
    after the model was converted (found by a hunt)."""
    groups = [
        NamedGroup((), {k: v for k, v in group.items() if k != "params"})
        for group in optimizer.param_groups
    ]
    _, translations = _translations(optimizer, groups, target)
    placeholder = nn.Parameter(torch.zeros(1))
    for constructor, translated in translations:
        defaults = _accepted_by(constructor, translated)  # as the rebuild passes them
        if "beta1" in translated:  # torch-optimi: constructor betas, groups beta1/beta2
            defaults["betas"] = (translated["beta1"], translated["beta2"])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                constructor([{**translated, "params": [placeholder]}], **defaults)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{TARGET_NAMES[target]} refuses this optimizer's settings ({error}); use "
                "settings it takes, or another mode."
            ) from error


def translation_problem(optimizer: torch.optim.Optimizer, target: OptimizerTarget) -> str | None:
    """Why ``optimizer`` cannot be rebuilt for ``target`` (the error rebuilding would raise),
    or None when every group translates. Builds nothing."""
    try:
        check_translation(optimizer, target)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def _accepted_by(constructor: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``constructor`` takes as keywords (some defaults are internal; a
    group's options may name what only groups hold, as bitsandbytes SGD's ``betas``)."""
    accepted = inspect.signature(constructor).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return {k: v for k, v in options.items() if k != "params"}
    return {k: v for k, v in options.items() if k in accepted and k != "params"}


_MISSING = object()


def _constructor_extras(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Constructor keywords an optimizer keeps outside ``defaults``, read back from where it
    keeps them: an attribute of the same name (torchao's ``block_size``,
    ``bf16_stochastic_round``; bitsandbytes' ``is_paged``) or bitsandbytes' ``args``
    (``optim_bits``, ``min_8bit_size``). Rebuilt from ``defaults`` alone, a user's 8-bit
    bitsandbytes AdamW came back with 32-bit states, and torchao's stochastic rounding off."""
    parameters = inspect.signature(type(optimizer)).parameters
    extras: dict[str, Any] = {}
    for name, parameter in parameters.items():
        if name in ("params", "args") or name in optimizer.defaults:
            continue
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        for holder in (optimizer, getattr(optimizer, "args", None)):
            value = getattr(holder, name, _MISSING) if holder is not None else _MISSING
            if value is not _MISSING and not callable(value):
                extras[name] = copy.deepcopy(value)
                break
    return extras


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    groups: list[NamedGroup],
    model: nn.Module,
    target: OptimizerTarget,
    *,
    require_fresh: bool = True,
    share_hooks: bool = True,
) -> torch.optim.Optimizer:
    """A new optimizer over ``model``'s parameters (found by name) for ``target``.

    Group-level extras that are not hyper-parameters (``initial_lr`` set by LR schedulers, a
    group's ``name``) are carried over unchanged. The new optimizer starts without state;
    ``require_fresh`` refuses a source that has already stepped (its state would be lost).
    ``share_hooks``: the new optimizer runs ``optimizer``'s step hooks (``apply()``: the
    user's run goes on with it); a trial's clone runs none, so the user's EMA or logging hook
    is not fed trial weights and autoprec's own hooks stay off the user's optimizer.
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
        # copied: a tensor lr is written in place by schedulers (``fill_``), and one shared
        # with the user's optimizer left it at a trial schedule's floor
        new_groups = [
            {**copy.deepcopy(group.options), "params": [parameters[name] for name in group.names]}
            for group in groups
        ]
        same = _clone(optimizer, new_groups)
        _own_bnb_overrides(optimizer, same)
        return _with_step_hooks_of(optimizer, same) if share_hooks else same
    kind, translations = _translations(optimizer, groups, target)
    constructor, first = translations[0]
    # the constructor's defaults are the user's optimizer's, translated: what a group added
    # later (add_param_group, progressive unfreezing) takes; group 0's gave it group 0's lr
    # and weight_decay. A default that does not translate (a coupled decay bitsandbytes
    # refuses, which no group uses) is group 0's, and a group added later must set it.
    translated_defaults, untranslatable = _translated_defaults(kind, optimizer, groups, target)
    defaults = _accepted_by(constructor, translated_defaults)  # SGD8bit: no betas
    if "beta1" in translated_defaults:  # torch-optimi: constructor betas, groups beta1/beta2
        defaults["betas"] = (translated_defaults["beta1"], translated_defaults["beta2"])
    new_groups = [
        {
            **{k: v for k, v in group.options.items() if k not in optimizer.defaults},
            **translated,
            "params": [parameters[name] for name in group.names],
        }
        for group, (_, translated) in zip(groups, translations, strict=True)
    ]
    rebuilt = constructor(new_groups, **defaults)
    _own_bnb_overrides(optimizer, rebuilt)
    if share_hooks:
        rebuilt = _with_step_hooks_of(optimizer, rebuilt)
    if "beta1" in first:
        _expose_betas(rebuilt)
    if target == "bnb_8bit" and kind == "sgd":
        _momentum_into_betas(rebuilt)
    _translate_added_groups(rebuilt, kind, optimizer, target, untranslatable)
    return rebuilt


def _own_bnb_overrides(source: torch.optim.Optimizer, rebuilt: torch.optim.Optimizer) -> None:
    """Give a bitsandbytes optimizer a manager of its own: the overrides registered for
    ``source``'s parameters moved to ``rebuilt``'s (parameter by parameter, in group order),
    over the process-wide ones, read live (bitsandbytes' own example overrides a weight after
    building the optimizer), and an index of its own.

    bitsandbytes keeps per-parameter overrides (``optim_bits=32`` for an embedding, as the
    Hugging Face Trainer registers for every ``nn.Embedding``) in one process-wide manager, and
    every 8-bit optimizer that has stepped writes them there again keyed by (group index,
    parameter index): a later optimizer read them for whatever parameter sits at that index, so
    a run earlier in the process decided which of a trial's states stayed 32-bit. Overrides the
    user registered for their own parameters belong to their recipe, and apply to the copies a
    trial trains; nothing else does."""
    manager = getattr(rebuilt, "mng", None)
    if manager is None or not hasattr(manager, "index2config"):
        return  # not a bitsandbytes optimizer
    shared = type(manager).get_instance()
    triples = shared.module_weight_config_triple
    registered = {id(getattr(m, a, None)): config for m, a, config in triples}
    registered.update(shared.pid2config)
    moved: dict[int, dict[str, Any]] = {}
    for old_group, new_group in zip(source.param_groups, rebuilt.param_groups, strict=False):
        for old, new in zip(old_group["params"], new_group["params"], strict=False):
            if id(old) in registered and old is not new:
                moved[id(new)] = dict(registered[id(old)])
    own = object.__new__(type(manager))
    own.initialize()
    own.pid2config = collections.ChainMap(moved, shared.pid2config)  # writes go to ``moved``
    own.module_weight_config_triple = shared.module_weight_config_triple
    rebuilt.mng = own


def _clone(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``optimizer``'s class called again over ``groups`` with its defaults. A constructor that
    needs more (a model, SAM's base optimizer) raised torch's bare TypeError from inside
    autoprec, and one whose arguments are named otherwise gave the clone other defaults than
    the user's (found by a hunt): both are refused, asking for a factory."""
    name = type(optimizer).__name__
    factory = f"optimizer=lambda params: {name}(params, ...)"
    defaults = copy.deepcopy(_accepted_by(type(optimizer), optimizer.defaults))
    try:
        clone = type(optimizer)(groups, **defaults, **_constructor_extras(optimizer))
    except TypeError as error:
        raise TypeError(
            f"autoprec builds a copy of your optimizer for every run by calling {name}(groups, "
            f"**its defaults), which {name}'s constructor does not take ({error}). Pass a "
            f"factory instead: {factory}."
        ) from error
    differing = sorted(
        key
        for key, value in optimizer.defaults.items()
        if key in clone.defaults and not _same_setting(clone.defaults[key], value)
    )
    if differing:
        raise TypeError(
            f"A copy of your {name} built by calling {name}(groups, **its defaults) has other "
            f"defaults ({', '.join(differing)}): its constructor names its arguments otherwise. "
            f"Pass a factory instead: {factory}."
        )
    return clone


def _same_setting(first: Any, second: Any) -> bool:
    try:
        return bool(first == second)
    except Exception:  # noqa: BLE001 - a tensor lr: compared by value
        return isinstance(first, torch.Tensor) and torch.equal(first, second)


def _translations(
    optimizer: torch.optim.Optimizer, groups: list[NamedGroup], target: OptimizerTarget
) -> tuple[SourceKind, list[tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]]]:
    """(the family, each group's (constructor, options)) for ``target``, or what a rebuild
    raises: a class it cannot carry, an option without an equivalent, groups needing two
    classes."""
    kind, options = _decay_kind(rebuildable_kind(optimizer), groups)
    translations = [translate_group(kind, group_options, target) for group_options in options]
    _refuse_mixed_constructors(translations, target)
    return kind, translations


def _decay_kind(
    kind: SourceKind, groups: list[NamedGroup]
) -> tuple[SourceKind, list[dict[str, Any]]]:
    """(the family, each group's options) with coupled vs decoupled decay settled by the groups
    that decay: a group without weight decay decays neither way, so it follows them (its own
    ``decoupled_weight_decay`` dropped) instead of asking for another optimizer class."""
    options = [dict(group.options) for group in groups]
    decaying = {
        bool(o["decoupled_weight_decay"])
        for o in options
        if o.get("weight_decay") and "decoupled_weight_decay" in o
    }
    if kind == "sgd" or len(decaying) > 1:
        return kind, options
    for group_options in options:
        if not group_options.get("weight_decay"):
            group_options.pop("decoupled_weight_decay", None)
    if not decaying:  # no group decays: every group is the family's, one class
        return kind, options
    return ("adamw" if decaying.pop() else "adam"), options


def _refuse_mixed_constructors(
    translations: list[tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]],
    target: OptimizerTarget,
) -> None:
    """One rebuilt optimizer has one class: groups that need two (coupled L2 decay in one,
    decoupled in another, through ``decoupled_weight_decay`` per group) are refused."""
    names = sorted({constructor.__name__ for constructor, _ in translations})
    if len(names) > 1:
        raise ValueError(
            f"Your optimizer's groups mix coupled (L2) and decoupled weight decay "
            f"(decoupled_weight_decay differs between groups), which {TARGET_NAMES[target]} "
            f"builds as different classes ({', '.join(names)}) and one optimizer cannot hold. "
            "Use one kind of decay in every group (or weight_decay=0 where it differs), or a "
            "mode that keeps your optimizer."
        )


def _translated_defaults(
    kind: SourceKind,
    optimizer: torch.optim.Optimizer,
    groups: list[NamedGroup],
    target: OptimizerTarget,
) -> tuple[dict[str, Any], dict[str, str]]:
    """(the user's defaults translated for ``target``, {option: why} for those that do not
    translate and were replaced by group 0's value). Only the options that fail are replaced:
    a later group still takes the user's lr and the rest."""
    options = _default_options(optimizer)
    try:
        return translate_group(kind, options, target)[1], {}
    except (TypeError, ValueError) as error:
        reason = str(error)
    first = groups[0].options
    differing = [key for key in options if key in first and first[key] != options[key]]
    for keys in [[key] for key in differing] + [differing]:
        try:
            translated = translate_group(kind, {**options, **{k: first[k] for k in keys}}, target)
        except (TypeError, ValueError):
            continue
        return translated[1], {key: reason for key in keys}
    return translate_group(kind, dict(first), target)[1], {key: reason for key in options}


def _translate_added_groups(
    rebuilt: torch.optim.Optimizer,
    kind: SourceKind,
    source: torch.optim.Optimizer,
    target: OptimizerTarget,
    needed: dict[str, str],
) -> None:
    """Make ``rebuilt.add_param_group`` take a group as the user's optimizer would (its options
    in torch's names, the rest from the user's defaults) and translate it as the rebuild did
    the others, refusing what ``target`` cannot run. Before, an added group went in as given:
    ``maximize=True`` under the stochastic-rounding SGD stepped uphill, Adam's L2
    ``weight_decay`` became bitsandbytes' decoupled decay, torch-optimi's SGD read
    ``dampening=0.5`` as True and dropped ``nesterov``. A group that leaves an option in
    ``needed`` to the defaults is refused: the user's default has no equivalent here
    (``needed[option]`` says why)."""
    user_defaults = _default_options(source)

    def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        unset = sorted(key for key in needed if key not in param_group)
        if unset:
            raise ValueError(
                f"This group leaves {', '.join(unset)} to your optimizer's default, which "
                f"{type(self).__name__} cannot take ({needed[unset[0]]}). Set "
                f"{', '.join(unset)} in the group you add."
            )
        given = {key: value for key, value in param_group.items() if key != "params"}
        _, translated = translate_group(kind, {**user_defaults, **given}, target)
        extras = {key: value for key, value in given.items() if key not in user_defaults}
        type(self).add_param_group(self, {**extras, **translated, "params": param_group["params"]})

    # bound to the instance, as state_translation wraps load_state_dict: a deep copy binds it
    # to the copy
    rebuilt.add_param_group = types.MethodType(add_param_group, rebuilt)  # type: ignore[method-assign]


def _default_options(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The user's optimizer's defaults as group options (copied: a tensor lr is its own)."""
    return {key: copy.deepcopy(value) for key, value in optimizer.defaults.items()}


def _with_step_hooks_of(
    optimizer: torch.optim.Optimizer, rebuilt: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """``rebuilt`` running the step hooks registered on ``optimizer`` (an EMA update, logging):
    the same hook tables, so a handle the user holds still removes its hook. Before, a rebuilt
    optimizer ran none of them, without a word. The hooks autoprec adds to ``rebuilt`` land in
    the shared tables too; each leaves an optimizer alone that does not keep its keys."""
    rebuilt._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
    rebuilt._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
    return rebuilt


def _momentum_into_betas(optimizer: torch.optim.Optimizer) -> None:
    """bitsandbytes' SGD8bit steps with ``betas[0]`` as each group's momentum; schedulers that
    cycle SGD's momentum (OneCycleLR, CyclicLR) write ``momentum``. Copy it over before each
    step (before, every group stepped with the first group's momentum, and a cycled one never
    reached the optimizer). A scheduler built on the rebuilt optimizer sees ``betas`` in its
    defaults and cycles ``betas[0]`` instead: whichever of the two changed since the last step
    wins (before, the constant ``momentum`` overwrote the cycled ``betas[0]`` every step). A
    group not synced yet (one a checkpoint's load put in place) takes its ``momentum``: the
    checkpoint's ``betas[0]`` is the momentum of the step before the save, and a table kept by
    group index made the first resumed step take it over OneCycleLR's (found by a hunt: 0.5223
    for 0.5847)."""
    synced: dict[int, tuple[dict[str, Any], float]] = {}  # id(group) -> (group, momentum)

    def sync(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if "momentum" not in group or "betas" not in group:  # others sharing the hooks
                continue
            beta, entry = next(iter(group["betas"])), synced.get(id(group))
            last = entry[1] if entry is not None and entry[0] is group else None
            value = beta if last is not None and beta != last else group["momentum"]
            group["momentum"] = value
            group["betas"] = (value, *tuple(group["betas"])[1:])
            synced[id(group)] = (group, value)

    for group in optimizer.param_groups:  # as built: both hold the user's momentum
        if "momentum" in group:
            synced[id(group)] = (group, group["momentum"])
    optimizer.register_step_pre_hook(sync)


def _expose_betas(optimizer: torch.optim.Optimizer) -> None:
    """torch-optimi's Adam groups hold ``beta1``/``beta2``; LR schedulers that cycle the
    momentum (OneCycleLR, CyclicLR) write torch's ``betas`` (and raised KeyError without it).
    Give every group ``betas`` and copy it into ``beta1``/``beta2`` before each step.

    torch-optimi folds Adam's bias correction into a per-step beta, exact for a constant one;
    under a cycled beta1 it differs from torch's AdamW while the correction matters. Measured
    (OneCycleLR over an MLP, all layers fp32, distance from torch's weights in units of their
    movement): 10 steps 0.26, 100 steps 0.034, 1000 and 3000 steps 0.003 and 0.005, as with
    constant betas (0.003, 0.004)."""
    for group in optimizer.param_groups:
        group["betas"] = (group["beta1"], group["beta2"])
    if "beta1" in optimizer.defaults:  # a scheduler built later checks the defaults for betas
        optimizer.defaults["betas"] = (optimizer.defaults["beta1"], optimizer.defaults["beta2"])

    def sync(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if "beta1" not in group:  # another optimizer sharing the hooks
                continue
            if "betas" not in group:  # groups loaded from a checkpoint written without it
                group["betas"] = (group["beta1"], group["beta2"])
            group["beta1"], group["beta2"] = group["betas"]

    optimizer.register_step_pre_hook(sync)
