"""What a ``train_step`` reaches outside the model it is handed, watched while it runs.

A ``train_step`` that updates a module or tensor it closes over (an EMA teacher or a BYOL target
network kept outside the model) changed the caller's object in every run ``tune()`` and
``check()`` made, and each run started from where the last one left it: amp_bf16's output
noise read 200x larger than with the teacher inside the model, and trials learned from a
teacher earlier runs had trained (found by a hunt). The calibration watches what the function
reaches (its closure, its bound object, a partial's arguments, the module-level names its code
reads, the same for the functions of yours it calls by name, two calls deep, and one level into
lists, tuples and dicts of those: the modules among them) and refuses a ``train_step`` that
changes one, putting it back first.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoprec.weight_dtypes import same_values


def code_names(code: Any) -> set[str]:
    """The names a function's code (and the code nested in it) reads by name: globals and
    attributes alike."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= code_names(const)
    return names


FOLLOWED_DEPTH = 2
"""How many calls deep the watch follows the plain functions a ``train_step`` calls by name: a
helper updating a module-level teacher (``ema_update(plan)``) escaped it (found by a review),
as did a callable object's ``__call__`` reading one; functions held in a list, tuple or dict
it reads are followed too. torch's and autoprec's own functions are not followed: they hold no
module of yours."""

_NOT_FOLLOWED = ("torch", "autoprec")


def _unwrapped(value: Any) -> Any:
    """``value`` without its ``functools.wraps`` layers; as it is where reading them fails (a
    config whose ``__getattr__`` raises KeyError, a builder whose ``__getattr__`` returns a new
    builder: a crash of check() before any run, found by a review)."""
    try:
        return inspect.unwrap(value)
    except Exception:  # noqa: BLE001 - any __getattr__ of the user's may raise anything
        return value


def _followed(value: Any) -> bool:
    """A function of yours the watch reads into (see ``FOLLOWED_DEPTH``)."""
    value = _unwrapped(value) if callable(value) else value
    if not inspect.isfunction(value):
        return False
    package = (getattr(value, "__module__", None) or "").partition(".")[0]
    return package not in _NOT_FOLLOWED


def _reached(
    function: Any, depth: int = 0, seen: dict[int, int] | None = None
) -> Iterator[tuple[str, Any]]:
    """(name, object) for what ``function`` computes with beyond its arguments, and what the
    functions of yours it calls by name do (``FOLLOWED_DEPTH``). ``seen``: the depth each
    function was read at, by its id (not its code's: two closures of one factory hold other
    modules; a function met deeper first is read again nearer, where its calls are followed:
    both found by a review)."""
    seen = {} if seen is None else seen
    if isinstance(function, functools.partial):
        yield from ((f"argument {index}", a) for index, a in enumerate(function.args))
        yield from function.keywords.items()
        function = function.func
    if inspect.ismethod(function):  # before unwrapping: a decorated method keeps its self
        owner = function.__self__
        yield "self", owner
        if not isinstance(owner, nn.Module) and hasattr(owner, "__dict__"):  # a plain trainer
            yield from ((f"self.{name}", value) for name, value in vars(owner).items())
        function = function.__func__
    function = _unwrapped(function)  # a functools.wraps decorator (a review)
    if not inspect.isfunction(function):  # a callable object: its attributes
        yield from vars(function).items() if hasattr(function, "__dict__") else ()
        call = inspect.getattr_static(type(function), "__call__", None)  # what its call reads
        function = _unwrapped(call)
        if not inspect.isfunction(function):
            return
    if seen.get(id(function), FOLLOWED_DEPTH + 1) <= depth:
        return
    seen[id(function)] = depth
    for name, value in _names_read(function, function.__code__):
        yield name, value
        if depth < FOLLOWED_DEPTH:  # and one level into lists and dicts (a lambda in a table)
            for _, item in _with_contents(name, value):
                if _followed(item):
                    yield from _reached(item, depth + 1, seen)


def _names_read(function: Any, code: Any) -> Iterator[tuple[str, Any]]:
    """(name, object) for ``function``'s closure cells and the module-level names it reads."""
    cells = getattr(function, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell
            continue
    namespace = getattr(function, "__globals__", {})
    yield from ((name, namespace[name]) for name in sorted(code_names(code)) if name in namespace)


def _with_contents(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    yield name, value
    if isinstance(value, list | tuple):
        yield from ((f"{name}[{index}]", item) for index, item in enumerate(value))
    elif isinstance(value, dict):
        yield from ((f"{name}[{key!r}]", item) for key, item in value.items())


def reachable_tensors(function: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and saved buffers of the modules ``function`` reaches outside ``model``,
    by name. Bare tensors are left alone: a step counter or a running total for a log changes
    nothing a run measures."""
    inside = {id(module) for module in model.modules()}
    inside |= {id(tensor) for tensor in model.state_dict(keep_vars=True).values()}
    found: dict[str, torch.Tensor] = {}
    watched: set[int] = set()  # tensors, each once, whatever names reach it
    for name, value in _reached(function):
        for shown, item in _with_contents(name, value):
            if id(item) in inside or not isinstance(item, nn.Module):
                continue
            for key, tensor in item.state_dict(keep_vars=True).items():
                if not _watchable(tensor) or id(tensor) in inside | watched:
                    continue
                watched.add(id(tensor))
                found[_unused(f"{shown}.{key}", found)] = tensor
    return found


def _unused(name: str, found: dict[str, torch.Tensor]) -> str:
    """``name``, or ``name (2)``, ... where another tensor holds it: helpers of one script
    naming their own modules ``teacher`` dropped the second (found by a review)."""
    count = 1
    unused = name
    while unused in found:
        count += 1
        unused = f"{name} ({count})"
    return unused


def _watchable(value: Any) -> bool:
    """A tensor a run could change and this watch could put back: not a quantized module's
    dtype or packed tuple (a review: a crash), not meta, not an inference tensor."""
    return isinstance(value, torch.Tensor) and not (value.is_meta or value.is_inference())


class OutsideStateWatch:
    """A host copy of what a ``train_step`` reaches outside the model, to tell whether a run
    changed it and to put it back."""

    def __init__(self, function: Any, model: nn.Module) -> None:
        self.tensors = reachable_tensors(function, model) if function is not None else {}
        self.saved = {
            name: tensor.detach().to("cpu", copy=True) for name, tensor in self.tensors.items()
        }

    def changed(self) -> list[str]:
        """The names whose values are not what they were."""
        return [
            name
            for name, tensor in self.tensors.items()
            if not same_values(self.saved[name], tensor.detach().cpu())  # NaN is no change
        ]

    def restore(self) -> list[str]:
        """Put back what changed (only that: a tensor nothing wrote stays untouched); returns
        the names put back."""
        changed = self.changed()
        with torch.no_grad():
            for name in changed:
                self.tensors[name].copy_(self.saved[name].to(self.tensors[name].device))
        return changed
