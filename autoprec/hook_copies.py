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
objects inside a list, tuple, set or dict (a dict keyed by the parameters), through a
module-level name, or through the attributes of an object outside the model it is a method
of, cannot be mapped: it is not carried, and the run's notes say so (:func:`unmapped_hooks`).
Not followed: a module-level helper the hook calls, which reads the model by its global name
(the copy's hook then reads the user's model); a closure cell the user's other code rebinds
(``nonlocal``), once the copy holds a new cell for it.
"""

from __future__ import annotations

import collections
import dis
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
    tuple, set or dict it holds (closure, defaults, a partial's arguments), none among the
    attributes of an object outside the model it is a method of (a pruner's ``self.target``
    built every trial's mask from the user's weights; a review), and none it reads as a
    module-level name, alone or in such a container (a module-level ``fisher`` buffer a hook
    accumulates into: a copy's hook wrote the user's; a review)?"""
    if isinstance(hook, functools.partial):
        held = [*hook.args, *hook.keywords.values()]
        return not any(_holds(value, own) for value in held) and mappable(hook.func, own)
    if inspect.ismethod(hook):
        owner = hook.__self__
        if id(owner) not in own:
            attributes = list((getattr(owner, "__dict__", None) or {}).values())
            if any(id(value) in own or _holds(value, own) for value in attributes):
                return False
        return mappable(hook.__func__, own)
    if not inspect.isfunction(hook):
        return True
    read = [hook.__globals__[name] for name in _globals_read(hook.__code__)
            if name in hook.__globals__]  # fmt: skip
    if any(id(value) in own for value in read):  # a module-level name is the user's alone
        return False
    return not any(_holds(value, own) for value in (*_held(hook), *read))


def _globals_read(code: Any) -> set[str]:
    """The names ``code`` (and the code nested in it) loads as globals: not attribute names,
    which ``co_names`` holds too (a hook's ``self.model`` matched a script's global ``model``
    and was left out; a review)."""
    names = {
        instruction.argval
        for instruction in dis.get_instructions(code)
        if instruction.opname == "LOAD_GLOBAL"
    }
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _globals_read(const)
    return names


def unmapped_hooks(model: nn.Module) -> list[str]:
    """The parameters whose gradient hooks cannot be carried onto a copy (:func:`mappable`)."""
    own = model_objects(model)
    return [
        name
        for name, hooks in gradient_hooks(model).items()
        if not all(mappable(hook, own) for hook in hooks)
    ]


class HookMapping:
    """Hooks for a copy of the model made with ``memo``: the model's own objects (``own``)
    a hook holds directly swapped for the copy's; anything else the user's, even where the
    copy's memo holds it (a warm-up object the model also keeps: a copy's factor of 0 scaled
    every gradient; a review). A closure cell holding the model's object is a new cell on the
    copy: a ``nonlocal`` rebinding by the user's other code no longer reaches the copy's hook."""

    def __init__(self, own: set[int], memo: dict[int, Any]) -> None:
        self.own, self.memo = own, memo

    def object(self, value: Any) -> Any:
        """The copy's ``value`` where it is the model's, else ``value``."""
        return self.memo.get(id(value), value) if id(value) in self.own else value

    def hook(self, hook: Any) -> Any:
        if isinstance(hook, functools.partial):
            args = [self.object(value) for value in hook.args]
            keywords = {key: self.object(value) for key, value in hook.keywords.items()}
            return functools.partial(self.hook(hook.func), *args, **keywords)
        if inspect.ismethod(hook):
            owner = self.object(hook.__self__)
            return hook if owner is hook.__self__ else types.MethodType(hook.__func__, owner)
        if not inspect.isfunction(hook):
            return self.object(hook)
        return self._function(hook)

    def _function(self, hook: Any) -> Any:
        cells = hook.__closure__ or ()
        closure = tuple(self._cell(cell) for cell in cells)
        defaults = hook.__defaults__
        if defaults is not None:
            defaults = tuple(self.object(value) for value in defaults)
        keywords = hook.__kwdefaults__
        if keywords is not None:  # keyword-only defaults too (a review: they acted on the user's)
            keywords = {key: self.object(value) for key, value in keywords.items()}
        unchanged = (
            all(new is old for new, old in zip(closure, cells, strict=True))
            and all(
                new is old for new, old in zip(defaults or (), hook.__defaults__ or (), strict=True)
            )
            and all(keywords[key] is value for key, value in (hook.__kwdefaults__ or {}).items())
        )
        if unchanged:
            return hook
        function = types.FunctionType(
            hook.__code__, hook.__globals__, hook.__name__, defaults, closure
        )
        function.__kwdefaults__ = keywords
        function.__dict__.update(hook.__dict__)
        return function

    def _cell(self, cell: Any) -> Any:
        """``cell``, or a new one holding the copy's object where it holds the model's (a
        counter beside it keeps its own cell: put back after every run like any closure's)."""
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            return cell
        twin = self.object(value)
        return cell if twin is value else types.CellType(twin)


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
