"""Let plan.optimizer load the optimizer state any mode saved, whichever optimizer wrote it.

A run switched between modes resumes with its Adam moments or SGD momentum, not with fresh
state: from fp32 (or AMP) to bf16_kahan (torch-optimi with Kahan summation) or 8-bit states
(bitsandbytes), back, or between the two. A state in another library's layout is read into
torch's (``torch_state_form``) and, for a torch-optimi or bitsandbytes rebuild, translated on
from there. What each library keeps (read in their sources, torch-optimi 0.3, bitsandbytes 0.50):

- torch: ``exp_avg`` m, ``exp_avg_sq`` v (raw; the update divides by ``1 - beta ** step``),
  ``step`` per parameter; SGD ``momentum_buffer``.
- torch-optimi: the *bias-corrected* moments ``m / (1 - beta1 ** t)`` and ``v / (1 - beta2 ** t)``
  (its betas are debiased step by step, ``optimi.utils.debias_beta``), in the parameter's dtype
  (bf16_kahan's second moment in fp32: ``autoprec.kahan_adamw``),
  one ``step`` per group, and a ``kahan_comp`` buffer (zeros: the weights' rounding to bf16 on
  load is what any switch to bf16 weights costs); SGD keeps the momentum as ``exp_avg``, torch's
  undampened buffer.
- bitsandbytes: raw m and v as ``state1``/``state2``, block-wise quantised to 8 bits (blocks of
  256, its own ``qmap1``/``qmap2``) for tensors of ``min_8bit_size`` elements or more, fp32 below;
  ``step`` per parameter. Its SGD overwrites the momentum with the gradient at step 1, so a loaded
  buffer is given step 1.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from autoprec._imports import require
from autoprec.optim import (
    SUPPORTED_SOURCES,
    TARGET_NAMES,
    OptimizerTarget,
    SourceKind,
    refuse_untranslatable,
    source_kind,
    translate_group,
)
from autoprec.torch_state_form import (
    HYPER_KEYS,
    TORCH_STATE_KEYS,
    Writer,
    check_torch_family,
    in_layout_of,
    state_writer,
    torch_form,
)

_OWN_LAYOUT: dict[OptimizerTarget | None, Writer] = {"bnb_8bit": "bnb", "optimi_kahan": "optimi"}
"""The layout each rebuild saves in; every other plan optimizer saves torch's."""


def accept_source_state(
    optimizer: torch.optim.Optimizer,
    source: torch.optim.Optimizer,
    target: OptimizerTarget | None,
) -> None:
    """Let ``optimizer`` (plan.optimizer: ``source`` itself, ``target`` None, or ``source``
    rebuilt for ``target``) load the state any mode's optimizer saved: its own natively, the
    others translated (a run switched between modes, either way, resumes with its moments). A
    no-op when ``source`` is no torch AdamW, Adam or SGD: its own state loads as torch loads it."""
    try:
        kind = source_kind(source)
    except TypeError:
        return
    own = _OWN_LAYOUT.get(target, "torch")
    source_keys = set(source.defaults)  # not ``source``: the closure would keep it alive
    forces_decoupled = isinstance(source, torch.optim.AdamW)

    def load_state_dict(
        self: torch.optim.Optimizer, state_dict: dict[str, Any], *args: Any, **kwargs: Any
    ) -> None:
        writer = state_writer(state_dict)
        groups = state_dict.get("param_groups", [])
        if writer is None and target in (None, "same") and _family_plus_extras(state_dict, kind):
            # the user's own optimizer class (or a copy of it) keeping state torch's do not (a
            # subclass's gradient EMA): it loads its own state as it would without autoprec,
            # which refused it as "another optimizer wrote it" (found by a hunt)
            type(self).load_state_dict(self, state_dict, *args, **kwargs)
            return
        if writer == "torch" and target not in (None, "same"):
            # before anything loads: a torch checkpoint's groups replace the rebuilt ones, and
            # an option the rebuilt optimizer ignores (SGD's maximize under stochastic
            # rounding stepped downhill where the checkpoint's run stepped uphill) is refused
            # as the rebuild refuses it
            for group in groups:
                refuse_untranslatable(kind, group, target)
            if kind != "sgd":
                state_dict = _decay_as_torch_loads(state_dict, forces_decoupled)
                _refuse_other_decay(state_dict["param_groups"], self.param_groups, target)
        if writer == "torch" and own != "torch":  # to translate: the family's hyper-parameters
            writer = writer if all(HYPER_KEYS[kind] <= set(group) for group in groups) else None
        if writer == own:
            if own == "torch":  # torch would load another family's groups and fail (or not) later
                check_torch_family(state_dict, kind)
            elif own == "optimi" and kind != "sgd":  # its own groups: the decay kind they hold
                groups = _optimi_decay(state_dict["param_groups"], forces_decoupled)
                _refuse_other_decay(groups, self.param_groups, target)
            type(self).load_state_dict(self, state_dict, *args, **kwargs)
        elif writer is None:
            raise _foreign_state(f"{type(self).__module__.split('.')[0]}'s {type(self).__name__}")
        elif own == "torch":
            form = in_layout_of(torch_form(state_dict, kind), self)
            type(self).load_state_dict(self, form, *args, **kwargs)

        else:
            form = torch_form(state_dict, kind)
            _translate_source_state(self, form, kind, target, source_keys)  # type: ignore[arg-type]

    # bitsandbytes overrides load_state_dict and runs no load hooks, so the instance's method
    # is wrapped (a bound method: a deep copy binds to the copy)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]


def _foreign_state(name: str) -> ValueError:
    return ValueError(
        f"plan.optimizer ({name}) cannot load this optimizer state: another optimizer wrote "
        f"it. It loads the states of torch ({SUPPORTED_SOURCES}), torch-optimi and "
        "bitsandbytes, as autoprec's modes save them; load one of those, or keep the optimizer "
        "fresh and load the model's weights only."
    )


def refuse_unloadable_state(source: torch.optim.Optimizer, target: OptimizerTarget) -> None:
    """Raise what loading a stepped ``source``'s state into its rebuild for ``target`` raises,
    checked on ``source``'s own parameters (the rebuild's have their shapes) before anything is
    converted: refused at the load, a state had left the user's model converted, its weights
    bf16 and its hooks on (found by a hunt: a state with a key of its own beside Adam's)."""
    if not source.state:
        return
    try:
        kind = source_kind(source)
    except TypeError:
        return
    state_dict = source.state_dict()
    own, writer = _OWN_LAYOUT.get(target, "torch"), state_writer(state_dict)
    saved_groups = state_dict["param_groups"]
    if writer == "torch" and own != "torch":
        writer = writer if all(HYPER_KEYS[kind] <= set(g) for g in saved_groups) else None
    if writer is None:
        raise _foreign_state(TARGET_NAMES[target])
    if writer == "torch" and own == "torch":
        check_torch_family(state_dict, kind)
    elif writer == "torch":  # translated by optimi_state or bnb_state: as they check it
        for group, saved_group in zip(source.param_groups, saved_groups, strict=True):
            for parameter, index in zip(group["params"], saved_group["params"], strict=True):
                saved = state_dict["state"].get(index)
                if saved:
                    _check_translatable(saved, parameter, kind, own)


def _check_translatable(
    saved: dict[str, Any], parameter: torch.Tensor, kind: SourceKind, own: Writer
) -> None:
    """What ``optimi_state`` / ``bnb_state`` refuse in one parameter's saved torch state."""
    if kind == "sgd":
        if own == "bnb" or saved.get("momentum_buffer") is not None:  # optimi: may be none
            _moment(saved, "momentum_buffer", parameter)
        return
    _moment(saved, "exp_avg", parameter)
    _moment(saved, "exp_avg_sq", parameter)
    if own == "optimi" and saved_step(saved) < 1:
        raise ValueError(f"The saved Adam state has step {saved_step(saved)}; expected at least 1.")


def _decay_as_torch_loads(state_dict: dict[str, Any], forces_decoupled: bool) -> dict[str, Any]:
    """An Adam-family torch checkpoint's groups with the weight decay torch's own load leaves:
    AdamW decays decoupled whatever the checkpoint says (its ``__setstate__``), Adam takes the
    checkpoint's ``decoupled_weight_decay``. A rebuild took the checkpoint's always: an Adam
    checkpoint resumed the user's AdamW with L2 decay under bf16_sr (found by a hunt)."""
    groups = [
        {
            **group,
            "decoupled_weight_decay": forces_decoupled
            or bool(group.get("decoupled_weight_decay", False)),
        }
        for group in state_dict["param_groups"]
    ]
    return {**state_dict, "param_groups": groups}


def _optimi_decay(groups: list[dict[str, Any]], forces_decoupled: bool) -> list[dict[str, Any]]:
    """A torch-optimi checkpoint's groups' weight decay as torch's own load would leave it
    (``_decay_as_torch_loads``): its ``decouple_wd`` loaded natively into a KahanAdam had
    decayed by torch-optimi's own multiply, which rounds away on bf16 weights (found by a
    hunt: an AdamW's checkpoint resumed with Adam under bf16_kahan never decayed)."""
    return [
        {
            "weight_decay": group["weight_decay"],
            "decoupled_weight_decay": forces_decoupled or bool(group.get("decouple_wd")),
        }
        for group in groups
    ]


def _refuse_other_decay(
    groups: list[dict[str, Any]], rebuilt_groups: list[dict[str, Any]], target: OptimizerTarget
) -> None:
    """torch-optimi's and bitsandbytes' rebuilds are one class for one kind of weight decay
    (``KahanAdam``: L2, ``KahanDecayAdamW`` and bitsandbytes': decoupled): a checkpoint that
    resumes the user's optimizer with the other kind (torch's Adam loading an AdamW checkpoint
    decays decoupled from then on) cannot resume there. The stochastic-rounding optimizers
    read it per group. The rebuild's own groups say which kind it has (an Adam whose decaying
    groups set ``decoupled_weight_decay=True`` is rebuilt decoupled; found by a hunt)."""
    if target not in _OWN_LAYOUT or len(groups) != len(rebuilt_groups):  # (the load says so)
        return
    for group, rebuilt_group in zip(groups, rebuilt_groups, strict=True):
        decoupled = target == "bnb_8bit" or bool(rebuilt_group.get("decouple_wd"))
        if group["weight_decay"] and group["decoupled_weight_decay"] != decoupled:
            loaded = "decoupled" if group["decoupled_weight_decay"] else "L2"
            rebuilt = "decoupled" if decoupled else "L2"
            raise ValueError(
                f"This optimizer state resumes your optimizer with {loaded} weight decay (torch's "
                f"Adam takes the checkpoint's decoupled_weight_decay), where plan.optimizer "
                f"(rebuilt for {target}) decays {rebuilt}. Build your optimizer as the run that "
                f"saved it did (AdamW for decoupled decay, Adam for L2), then load it."
            )


def _family_plus_extras(state_dict: dict[str, Any], kind: SourceKind) -> bool:
    """Does ``state_dict`` hold ``kind``'s state and more: every group its hyper-parameters,
    every per-parameter entry its moments, with keys of its own beside them (an AdamW subclass
    keeping a gradient EMA)? Another family's (RMSprop's ``square_avg``) does not."""
    entries = [entry for entry in state_dict.get("state", {}).values() if isinstance(entry, dict)]
    groups = state_dict.get("param_groups", [])
    return (
        bool(entries)
        and all(HYPER_KEYS[kind] <= set(group) for group in groups)
        # torch's keys of the family, AMSGrad's optional one aside
        and all(TORCH_STATE_KEYS[kind] - {"max_exp_avg_sq"} <= set(entry) for entry in entries)
    )


def _translate_source_state(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    kind: SourceKind,
    target: OptimizerTarget,
    source_keys: set[str],
) -> None:
    """Load a torch optimizer's state (``kind``) into its rebuild for ``target``: each saved
    group's hyper-parameters translated as at rebuild (the saved values win, as in torch's own
    load), each parameter's state by ``optimi_state`` or ``bnb_state``. Everything is
    translated before anything is written, so a failure leaves the optimizer as it was."""
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
        _, translated = translate_group(kind, saved_options, target)
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
            steps[group_index] = max(steps[group_index], saved_step(saved))
            if target == "bnb_8bit":
                states[parameter] = bnb_state(
                    optimizer, saved, (group_index, position), adam=kind != "sgd"
                )
            else:
                betas = None if kind == "sgd" else tuple(group["betas"])
                states[parameter] = optimi_state(saved, parameter, betas)
    for group, translated, step in zip(optimizer.param_groups, options, steps, strict=True):
        group.update(translated)
        if target == "optimi_kahan":
            adam = "beta1" in translated
            if adam:
                group["betas"] = (translated["beta1"], translated["beta2"])
            optimi_group_resumed(group, step if adam else None)
    optimizer.state.clear()
    optimizer.state.update(states)


def saved_step(saved: dict[str, Any]) -> int:
    """The saved parameter's step count (0 when it holds none)."""
    step = saved.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def _moment(saved: dict[str, Any], key: str, parameter: torch.Tensor) -> torch.Tensor:
    value = saved.get(key)
    if not isinstance(value, torch.Tensor) or value.shape != parameter.shape:
        found = "nothing" if value is None else f"shape {tuple(getattr(value, 'shape', ()))}"
        raise ValueError(
            f"The saved optimizer state's {key!r} does not fit its parameter (shape "
            f"{tuple(parameter.shape)}; found {found}): the checkpoint was written for another "
            "model. Load the optimizer state saved with this model's weights."
        )
    return value.detach().to(device=parameter.device, dtype=torch.float32, copy=True)


def optimi_state(
    saved: dict[str, Any], parameter: torch.Tensor, betas: tuple[float, float] | None
) -> dict[str, Any]:
    """torch-optimi's state for ``parameter`` from torch's (``betas`` None: SGD)."""
    compensation = (
        torch.zeros_like(parameter) if parameter.dtype in (torch.float16, torch.bfloat16) else None
    )
    if betas is None:
        buffer = saved.get("momentum_buffer")
        exp_avg = None if buffer is None else _moment(saved, "momentum_buffer", parameter)
        return {
            "exp_avg": None if exp_avg is None else exp_avg.to(parameter.dtype),
            "kahan_comp": compensation,
        }
    step = saved_step(saved)
    if step < 1:
        raise ValueError(f"The saved Adam state has step {step}; expected at least 1.")
    beta1, beta2 = betas
    exp_avg = _moment(saved, "exp_avg", parameter) / (1 - beta1**step)
    exp_avg_sq = _moment(saved, "exp_avg_sq", parameter) / (1 - beta2**step)
    return {
        "exp_avg": exp_avg.to(parameter.dtype),
        "exp_avg_sq": exp_avg_sq,  # fp32 whatever the weight (autoprec.kahan_adamw)
        "kahan_comp": compensation,
    }


def bnb_state(
    optimizer: torch.optim.Optimizer,
    saved: dict[str, Any],
    indices: tuple[int, int],
    adam: bool,
) -> dict[str, Any]:
    """bitsandbytes' state for the parameter at ``indices`` (group, position) from torch's,
    built by the optimizer's own ``init_state`` (8-bit or fp32 by its ``min_8bit_size``) and
    filled with bitsandbytes' block-wise quantisation."""
    functional = require("bitsandbytes").functional

    group_index, position = indices
    group = optimizer.param_groups[group_index]
    parameter = group["params"][position]
    keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
    values = [_moment(saved, key, parameter) for key in keys]
    live = optimizer.state.pop(parameter, None)
    try:
        optimizer.init_state(group, parameter, group_index, position)  # type: ignore[attr-defined]
        state = optimizer.state.pop(parameter)
    finally:
        if live is not None:
            optimizer.state[parameter] = live
    for number, value in enumerate(values, start=1):
        target = state[f"state{number}"]
        if target.dtype == torch.uint8:
            quantised, quant_state = functional.quantize_blockwise(
                value.contiguous(), code=state[f"qmap{number}"], blocksize=256
            )
            target.copy_(quantised.view_as(target))
            state[f"absmax{number}"].copy_(quant_state.absmax)
        else:
            target.copy_(value)
    state["step"] = saved_step(saved) if adam else 1
    return state


def optimi_group_resumed(group: dict[str, Any], step: int | None) -> None:
    """Set a torch-optimi group up as its first step would, at ``step`` (None: SGD, which counts
    none): its first step otherwise resets the group's step to 0, and Adam's bias correction
    would start again over moments that are already corrected."""
    default_to_triton = require("optimi").utils._default_to_triton

    if step is not None:
        group["step"] = torch.tensor(step, dtype=torch.int32)
    if not group["setup"]:
        group["setup"] = True
        if group["triton"] is None and group["foreach"] is None:
            group["triton"] = default_to_triton(group["params"])
