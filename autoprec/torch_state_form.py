"""Read an optimizer state that a mode's optimizer saved back into torch's layout.

bf16_kahan trains with torch-optimi and 8-bit states with bitsandbytes; their checkpoints do not
load into torch's AdamW/Adam/SGD (the first step fails with ``KeyError: 'step'``). A run that
moves back to a mode that keeps the user's optimizer (a new profile, other hardware) or leaves
autoprec resumes from this torch form. The layouts (read in torch-optimi 0.3 and
bitsandbytes 0.50; torch's is described in ``state_translation``):

- torch-optimi: *bias-corrected* moments ``exp_avg``/``exp_avg_sq`` in the parameter's dtype
  (bf16_kahan's ``exp_avg_sq`` fp32: ``autoprec.kahan_adamw``), one ``step`` per group, a
  ``kahan_comp`` buffer; groups hold ``beta1``/``beta2`` and ``kahan_sum``.
  Its SGD keeps torch's undampened momentum as ``exp_avg``.
- bitsandbytes: raw moments as ``state1``/``state2`` (8-bit block-wise with ``qmap``/``absmax``, or
  fp32 below ``min_8bit_size``), saved inside ``__bnb_optimizer_quant_state__``, ``step`` per
  parameter; its SGD8bit keeps the momentum in ``betas[0]`` (autoprec's keeps the next step's in
  torch's ``momentum`` too).
- autoprec's stochastic-rounding optimizers write torch's layout plus ``compensation`` and
  ``rounding_rng``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from autoprec._imports import require
from autoprec.optim import SourceKind, source_kind

Writer = Literal["torch", "optimi", "bnb"]
"""Which library's layout a saved optimizer state is in."""

TORCH_STATE_KEYS: dict[SourceKind, set[str]] = {
    "adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "sgd": {"momentum_buffer"},
}
"""The per-parameter state keys torch's optimizers of each family save."""

HYPER_KEYS: dict[SourceKind, set[str]] = {
    "adamw": {"lr", "betas", "eps", "weight_decay"},
    "adam": {"lr", "betas", "eps", "weight_decay"},
    "sgd": {"lr", "momentum", "weight_decay"},
}
"""The group keys of each family's hyper-parameters, in torch's names."""

STOCHASTIC_EXTRA_KEYS = {
    "compensation", "rounding_rng",
    "exp_avg_absmax", "exp_avg_sq_absmax", "momentum_buffer_absmax",
}  # fmt: skip
"""What autoprec's stochastic-rounding optimizers save besides torch's keys (the Kahan
compensation, the rounding stream, 8-bit moments' block scales)."""

_BNB_WRAPPED = "__bnb_optimizer_quant_state__"
_BNB_BLOCKSIZE = 256
"""bitsandbytes' optimizers quantise their states in blocks of 256 elements."""

_WRITER_GROUP_KEYS: dict[Writer, set[str]] = {
    "optimi": {
        "lr", "beta1", "beta2", "betas", "eps", "weight_decay", "momentum", "dampening",
        "decouple_wd", "decouple_lr", "max_lr", "kahan_sum", "foreach", "triton",
        "gradient_release", "setup", "step", "torch_init",
    },
    "bnb": {"lr", "betas", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3"},
}  # fmt: skip
"""The group keys each library writes itself (torch-optimi 0.3.3, bitsandbytes 0.50.2); any
other key (a scheduler's ``initial_lr``, a group's ``name``) is carried into the torch form."""

_NAMES: dict[Writer, str] = {
    "torch": "torch",
    "optimi": "torch-optimi (bf16_kahan)",
    "bnb": "bitsandbytes (8-bit states)",
}


def state_writer(state_dict: dict[str, Any]) -> Writer | None:
    """The layout ``state_dict`` is in; None when no known one (another optimizer's state)."""
    entries = [entry for entry in state_dict.get("state", {}).values() if isinstance(entry, dict)]
    if any(_BNB_WRAPPED in entry or "state1" in entry for entry in entries):
        return "bnb"
    if any("kahan_sum" in group for group in state_dict.get("param_groups", [])):
        return "optimi"
    torch_keys = set().union(*TORCH_STATE_KEYS.values()) | STOCHASTIC_EXTRA_KEYS
    if all(set(entry) <= torch_keys for entry in entries):
        return "torch"
    return None


def torch_optimizer_state(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``state_dict`` (saved by any mode's optimizer) in the layout of ``optimizer``, a torch
    AdamW, Adam or SGD, ready for its ``load_state_dict``.

    Use it to resume a bf16_kahan or 8-bit-states run with plain torch, without autoprec::

        optimizer.load_state_dict(autoprec.torch_optimizer_state(saved, optimizer))

    (``plan.optimizer`` of a profile applied with autoprec loads such a state itself.) The
    saved hyper-parameters win, as in torch's own load; moments come back in fp32, and torch's
    load casts them to the parameters' dtype. A state already in torch's layout is returned
    as it was, without the stochastic-rounding optimizers' own buffers.

    Raises:
        TypeError: ``optimizer`` is not a torch AdamW, Adam or SGD.
        ValueError: the state is another optimizer's, or another family's (SGD's for Adam).
    """
    return in_layout_of(torch_form(state_dict, source_kind(optimizer)), optimizer)


def in_layout_of(form: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch form (``torch_form``) with each group completed by ``optimizer``'s own group
    keys (torch's ``amsgrad``, ``foreach``, ...; a stochastic-rounding optimizer's ``kahan``)
    under the saved hyper-parameters, so that torch's load, which replaces the groups, keeps
    them."""
    saved_groups = form["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The saved optimizer state has {len(saved_groups)} parameter group(s), the optimizer "
            f"loading it {len(optimizer.param_groups)}. Build the optimizer with the groups of "
            "the run that saved it."
        )
    groups = [
        {**{key: value for key, value in group.items() if key != "params"}, **saved}
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True)
    ]
    return {"state": form["state"], "param_groups": groups}


def torch_form(state_dict: dict[str, Any], kind: SourceKind) -> dict[str, Any]:
    """``state_dict`` in torch's layout for an optimizer of family ``kind``: each group holds
    its hyper-parameters in torch's names (``lr``, ``betas``/``momentum``, ``eps``,
    ``weight_decay``) and the keys no library wrote; each parameter, torch's state keys."""
    writer = state_writer(state_dict)
    if writer is None:
        keys = sorted({key for entry in state_dict.get("state", {}).values() for key in entry})
        raise ValueError(
            f"This optimizer state is not one autoprec can read (its per-parameter keys are "
            f"{keys[:6]}): it reads torch's AdamW/Adam/SGD, torch-optimi's and bitsandbytes' "
            "states. Load it into the optimizer that wrote it."
        )
    if writer == "torch":
        return _torch_family_form(state_dict, kind)
    groups = []
    state: dict[Any, dict[str, Any]] = {}
    for group in state_dict["param_groups"]:
        groups.append(_torch_group(group, writer, kind))
        for index in group["params"]:
            entry = state_dict["state"].get(index)
            if entry:
                read = _optimi_entry if writer == "optimi" else _bnb_entry
                state[index] = read(entry, group, kind)
    return {"state": state, "param_groups": groups}


def _family_error(kind: SourceKind, writer: Writer, found: str) -> ValueError:
    wanted = "SGD's momentum" if kind == "sgd" else "Adam's two moments"
    return ValueError(
        f"This optimizer state was written by {_NAMES[writer]} for another optimizer family "
        f"({found}); the optimizer loading it is {kind} and needs {wanted}. Load it into an "
        "optimizer of the family that wrote it."
    )


def check_torch_family(state_dict: dict[str, Any], kind: SourceKind) -> None:
    """Refuse a state in torch's layout that an optimizer of another family wrote: per-parameter
    keys not of ``kind`` (Adam's moments for an SGD), or groups without ``kind``'s
    hyper-parameters (an SGD's groups, which have no betas, for an AdamW)."""
    _torch_family_form(state_dict, kind)


def _torch_family_form(state_dict: dict[str, Any], kind: SourceKind) -> dict[str, Any]:
    """The torch form of a state in torch's layout, refused when another family wrote it. The
    groups are read too: an SGD without momentum, or an optimizer that has not stepped, saves
    no per-parameter state, and such a state loaded into another family trained at its lr
    (found by a hunt: an SGD state without momentum went into AdamW, lr 0.1, as given)."""
    form = _torch_written(state_dict, kind)
    for group in state_dict.get("param_groups", []):
        missing = HYPER_KEYS[kind] - set(group)
        if missing:
            raise _family_error(kind, "torch", f"its groups hold no {', '.join(sorted(missing))}")
    return form


def _torch_written(state_dict: dict[str, Any], kind: SourceKind) -> dict[str, Any]:
    state = {}
    for index, entry in state_dict.get("state", {}).items():
        kept = {key: value for key, value in entry.items() if key not in STOCHASTIC_EXTRA_KEYS}
        if not set(kept) <= TORCH_STATE_KEYS[kind]:
            raise _family_error(kind, "torch", f"keys {sorted(kept)}")
        state[index] = kept
    return {"state": state, "param_groups": [dict(g) for g in state_dict["param_groups"]]}


def _torch_group(group: dict[str, Any], writer: Writer, kind: SourceKind) -> dict[str, Any]:
    """A saved group's hyper-parameters in torch's names, with the keys no library wrote."""
    if writer == "optimi" and group.get("decouple_lr"):
        raise ValueError(
            "This torch-optimi state decays weights by weight_decay alone (decouple_lr=True); "
            "torch's optimizers scale it by lr and cannot resume it. Load it into torch-optimi."
        )
    if writer == "optimi" and ("beta1" in group) == (kind == "sgd"):
        raise _family_error(kind, writer, "Adam moments" if "beta1" in group else "SGD momentum")
    hyper: dict[str, Any] = {"lr": group["lr"], "weight_decay": group["weight_decay"]}
    if kind == "sgd":
        # autoprec's SGD8bit keeps torch's ``momentum`` beside ``betas``: a scheduler cycling it
        # (OneCycleLR) sets the next step's there, and ``betas[0]`` is the last step's
        # (``optim._momentum_into_betas``, which a resume follows; found by a hunt)
        hyper["momentum"] = group["momentum"] if "momentum" in group else group["betas"][0]
    else:
        # torch-optimi keeps the betas it stepped with last as beta1/beta2 and reads "betas",
        # which a momentum-cycling scheduler (OneCycleLR) sets, at its next step: "betas" is what
        # the next step uses (the last step's beta1 was taken; found by a hunt)
        betas = group.get("betas") or (group["beta1"], group["beta2"])
        hyper.update(betas=tuple(betas), eps=group["eps"])
        # the kind of decay the run had, which torch's Adam takes from a checkpoint: without
        # it an AdamW's bf16_kahan or 8-bit state resumed torch's Adam with L2 decay (found by
        # a hunt). torch-optimi records it; bitsandbytes' Adam decays decoupled always.
        hyper["decoupled_weight_decay"] = (
            bool(group.get("decouple_wd")) if writer == "optimi" else True
        )
    extras = {k: v for k, v in group.items() if k not in _WRITER_GROUP_KEYS[writer]}
    if writer == "optimi" and group.get("max_lr") is not None:
        # torch-optimi reads its own max_lr only with decouple_lr (refused above): a value
        # there is OneCycleLR's, which a resumed OneCycleLR(last_epoch=N) needs
        extras["max_lr"] = group["max_lr"]
    return {**extras, **hyper}


def _optimi_entry(entry: dict[str, Any], group: dict[str, Any], kind: SourceKind) -> dict[str, Any]:
    """torch's state from torch-optimi's: the moments' bias correction undone at the group's
    step (``m_torch = m_optimi * (1 - beta1**t)``), the Kahan buffer dropped."""
    if kind == "sgd":  # the family was checked on the group (``_torch_group``)
        momentum = entry.get("exp_avg")
        return {} if momentum is None else {"momentum_buffer": momentum.detach().float()}
    step = int(group["step"])
    beta1, beta2 = group["beta1"], group["beta2"]
    return {
        "step": torch.tensor(float(step)),
        "exp_avg": entry["exp_avg"].detach().float() * (1 - beta1**step),
        "exp_avg_sq": entry["exp_avg_sq"].detach().float() * (1 - beta2**step),
    }


def _bnb_entry(entry: dict[str, Any], group: dict[str, Any], kind: SourceKind) -> dict[str, Any]:
    """torch's state from bitsandbytes': ``state1``/``state2`` dequantised with their own
    ``qmap``/``absmax`` (fp32 ones taken as they are)."""
    flat = {**entry, **entry.get(_BNB_WRAPPED, {})}
    adam = "state2" in flat
    if adam != (kind != "sgd"):
        raise _family_error(kind, "bnb", "Adam moments" if adam else "a momentum buffer only")
    values = [_bnb_value(flat, number) for number in ((1, 2) if adam else (1,))]
    if not adam:
        return {"momentum_buffer": values[0]}
    step = torch.tensor(float(flat["step"]))
    return {"step": step, "exp_avg": values[0], "exp_avg_sq": values[1]}


def _bnb_value(flat: dict[str, Any], number: int) -> torch.Tensor:
    stored = flat[f"state{number}"]
    if stored.dtype != torch.uint8:
        return stored.detach().float().clone()
    functional = require("bitsandbytes").functional
    value = functional.dequantize_blockwise(
        stored,
        absmax=flat[f"absmax{number}"],
        code=flat[f"qmap{number}"],
        blocksize=_BNB_BLOCKSIZE,
    )
    return value.float().reshape(stored.shape)
