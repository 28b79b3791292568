"""Gradient hooks on a model's parameters, carried onto the copies autoprec trains.

``p.register_hook(fn)`` lives on the parameter tensor, and a deep copy of a parameter drops it:
no trial ran a pruning mask's ``g * mask`` or a per-element clamp, the gate called amp_fp16 safe
where the user's loop clamped its loss-scaled gradients and stalled at its starting loss, and
bf16_sr safe where ``apply()`` then failed on the mask's fp32 gradient (found by a hunt).

A hook is carried onto a copy with the model's own objects it holds directly (a closure's
``self`` or mask buffer, a default ``p=p``, a partial's argument, the model a method is bound
to) mapped to the copy's, through the deep copy's memo; every other object it holds is the
user's, shared as the user's own loop shares it (a warm-up object the ``train_step`` drives: a
deep copy of it left every run's gradients scaled by 0; a review). A hook holding the model's
objects inside a list, tuple or dict, or reading them through a module-level one (torch's
optimizer-in-backward dict keyed by the parameters), cannot be mapped: it is not carried, and
the run's notes say so (:func:`unmapped_hooks`).
"""

from __future__ import annotations

import collections
import functools
import inspect
import types
from typing import Any

from torch import nn

_CONTAINERS = (list, tuple, set, frozenset, dict, collections.OrderedDict, collections.defaultdict)


def gradient_hooks(model: nn.Module) -> dict[str, list[Any]]:
    """The hooks registered on ``model``'s trainable parameters (``p.register_hook``), by
    parameter name. Hooks run after accumulation (``register_post_accumulate_grad_hook``: an
    optimizer step fused into backward, a log) are not among them: a trial steps its own
    optimizer."""
    return {
        name: list(parameter._backward_hooks.values())
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and parameter._backward_hooks
    }


def model_objects(model: nn.Module) -> set[int]:
    """The ids of ``model``'s modules, parameters and buffers."""
    return {id(item) for item in (*model.modules(), *model.parameters(), *model.buffers())}


def mappable(hook: Any, own: set[int]) -> bool:
    """Can ``hook`` be carried onto a copy: no object of the model's (``own``) inside a list,
    tuple, set or dict it holds (closure, defaults, a partial's arguments), and none it reads
    by name from its module, alone or in such a container (a module-level ``fisher`` buffer a
    hook accumulates into: a copy's hook wrote the user's; a review)?"""
    if isinstance(hook, functools.partial):
        held = [*hook.args, *hook.keywords.values()]
        return not any(_holds(value, own) for value in held) and mappable(hook.func, own)
    if inspect.ismethod(hook):
        return mappable(hook.__func__, own)
    if not inspect.isfunction(hook):
        return True
    names = set(hook.__code__.co_names)
    read = [value for name, value in hook.__globals__.items() if name in names]
    if any(id(value) in own for value in read):  # a module-level name is the user's alone
        return False
    return not any(_holds(value, own) for value in (*_held(hook), *read))


def unmapped_hooks(model: nn.Module) -> list[str]:
    """The parameters whose gradient hooks cannot be carried onto a copy (:func:`mappable`)."""
    own = model_objects(model)
    return [
        name
        for name, hooks in gradient_hooks(model).items()
        if not all(mappable(hook, own) for hook in hooks)
    ]


def mapped(hook: Any, memo: dict[int, Any]) -> Any:
    """``hook`` for a copy of the model made with ``memo``: the model's objects it holds
    directly swapped for the copy's, anything else left the user's."""
    if isinstance(hook, functools.partial):
        args = [memo.get(id(value), value) for value in hook.args]
        keywords = {key: memo.get(id(value), value) for key, value in hook.keywords.items()}
        return functools.partial(mapped(hook.func, memo), *args, **keywords)
    if inspect.ismethod(hook):
        owner = memo.get(id(hook.__self__))
        return hook if owner is None else types.MethodType(hook.__func__, owner)
    if not inspect.isfunction(hook):
        return memo.get(id(hook), hook)
    cells = hook.__closure__ or ()
    closure = tuple(_mapped_cell(cell, memo) for cell in cells)
    defaults = hook.__defaults__
    if defaults is not None:
        defaults = tuple(memo.get(id(value), value) for value in defaults)
    same_defaults = all(
        new is old for new, old in zip(defaults or (), hook.__defaults__ or (), strict=True)
    )
    if same_defaults and all(new is old for new, old in zip(closure, cells, strict=True)):
        return hook
    function = types.FunctionType(hook.__code__, hook.__globals__, hook.__name__, defaults, closure)
    function.__kwdefaults__ = hook.__kwdefaults__
    function.__dict__.update(hook.__dict__)
    return function


def _mapped_cell(cell: Any, memo: dict[int, Any]) -> Any:
    """``cell``, or a new one holding the copy's object where it holds the model's (a counter
    beside it keeps its own cell: put back after every run like any closure's)."""
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return cell
    twin = memo.get(id(value))
    return cell if twin is None else types.CellType(twin)


def _held(function: Any) -> list[Any]:
    """What a plain function holds: its closure's values and its defaults."""
    held = []
    for cell in function.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return [*held, *(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]


def _holds(value: Any, own: set[int]) -> bool:
    """Is ``value`` a container holding one of ``own`` (keys too)?"""
    if type(value) not in _CONTAINERS:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
    return any(id(item) in own for item in items)
