"""What a ``train_step`` reaches outside the model it is handed, watched while it runs.

A ``train_step`` that updates a module or tensor it closes over (an EMA teacher or a BYOL target
network kept outside the model) changed the caller's object in every run ``tune()`` and
``check()`` made, and each run started from where the last one left it: amp_bf16's output
noise read 200x larger than with the teacher inside the model, and trials learned from a
teacher earlier runs had trained (found by a hunt). The calibration watches what the function
reaches (its closure, its bound object, a partial's arguments, the module-level names its code
reads, the same for the functions of yours it calls by name and the methods it calls on objects
it reaches, two calls deep, the attributes of those objects, and one level into lists, tuples
and dicts of those: the modules among them, and the bare tensors of a group that mirrors the
model's parameters, an EMA's shadows) and refuses a ``train_step`` that changes one, putting
it back first.
"""

from __future__ import annotations

import collections
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from autoprec.hook_copies import gradient_hooks
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
it reads are followed too, and the methods its code names on an object it reaches
(``ema.update(plan.model)``, diffusers' ``ema_model.step(...)``). torch's and autoprec's own
functions are not followed: they hold no module of yours."""

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
    function: Any,
    depth: int = 0,
    seen: dict[tuple[int, int], int] | None = None,
    owner_name: str = "self",
) -> Iterator[tuple[str, Any]]:
    """(name, object) for what ``function`` computes with beyond its arguments, and what the
    functions of yours it calls by name and the methods it calls on what it reaches do
    (``FOLLOWED_DEPTH``). ``seen``: the depth each function was read at, by its id (not its
    code's: two closures of one factory hold other modules; a function met deeper first is
    read again nearer, where its calls are followed: both found by a review), with its object's
    for a method. ``owner_name``: what a method's object is called where it was reached."""
    seen = {} if seen is None else seen
    if isinstance(function, functools.partial):
        yield from ((f"argument {index}", a) for index, a in enumerate(function.args))
        yield from function.keywords.items()
        function = function.func
    owner: Any = None
    if inspect.ismethod(function):  # before unwrapping: a decorated method keeps its self
        owner = function.__self__
        yield owner_name, owner
        yield from _attributes(owner_name, owner)  # a plain trainer's, an EMA object's
        function = function.__func__
    function = _unwrapped(function)  # a functools.wraps decorator (a review)
    if not inspect.isfunction(function):  # a callable object: its attributes
        owner = function
        yield from vars(function).items() if hasattr(function, "__dict__") else ()
        call = inspect.getattr_static(type(function), "__call__", None)  # what its call reads
        function = _unwrapped(call)
        if not inspect.isfunction(function):
            return
    key = (id(function), id(owner))  # one method on two EMA objects reaches both
    if seen.get(key, FOLLOWED_DEPTH + 1) <= depth:
        return
    seen[key] = depth
    code = function.__code__
    for name, value in _names_read(function, code):
        yield name, value
        yield from _attributes(name, value)  # ``ema.shadow[key].lerp_(...)`` in its code
        if depth < FOLLOWED_DEPTH:  # and one level into lists and dicts (a lambda in a table)
            for _, item in _with_contents(name, value):
                if _followed(item):
                    yield from _reached(item, depth + 1, seen)
    if depth < FOLLOWED_DEPTH:  # ``ema.update(plan.model)``, a method's ``self.helper()``
        reached = [
            *_names_read(function, code),
            *([(owner_name, owner)] if owner is not None else []),
        ]
        for name, value in reached:  # and one attribute or item deeper: ``self.ema.step()``
            for shown, item in [*_with_contents(name, value), *_attributes(name, value)]:
                for method in _methods_named(item, code):
                    yield from _reached(method, depth + 1, seen, owner_name=shown)


def _plain_object(value: Any) -> bool:
    """An object of yours (or of a library not torch's or autoprec's) whose attributes and
    methods the watch reads: not a module, class, function or Python module."""
    excluded = (nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType)
    if isinstance(value, excluded) or _own_attributes(value) is None:
        return False
    package = (getattr(type(value), "__module__", None) or "").partition(".")[0]
    return package not in _NOT_FOLLOWED


def _own_attributes(value: Any) -> dict[str, Any] | None:
    """``value``'s instance ``__dict__``, read without running its ``__getattr__`` (one with
    ``__slots__`` whose ``__getattr__`` raises KeyError crashed ``hasattr``: a review)."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 - __slots__, or a descriptor of the user's that raises
        return None
    return attributes if type(attributes) is dict else None


def _attributes(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(``name.attribute``, value) for a plain object's attributes: an EMA object's dict or
    list of shadow tensors (diffusers' ``EMAModel.shadow_params``) or its module."""
    if _plain_object(value):
        attributes = _own_attributes(value) or {}
        yield from ((f"{name}.{key}", item) for key, item in list(attributes.items()))


def _methods_named(value: Any, code: Any) -> Iterator[Any]:
    """``value``'s methods of yours whose names ``code`` reads, bound to it (read without
    running the user's ``__getattr__``; a module's too: its methods may reach other objects)."""
    if isinstance(value, torch.Tensor) or not (
        _plain_object(value) or isinstance(value, nn.Module)
    ):
        return
    for attribute in sorted(code_names(code)):
        method = inspect.getattr_static(type(value), attribute, None)
        if inspect.isfunction(method) and _followed(method):
            yield types.MethodType(method, value)


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


_LOOKED_INTO = (list, tuple, dict, collections.OrderedDict, collections.defaultdict)
"""The containers the watch looks into, by exact type: a dict subclass's ``items()`` may run
anything (transformers' lazy auto-mapping, reached through a Trainer's ``compute_loss``,
imported 569 model modules: 2.3 s and 41 MB, found by a review)."""


def _with_contents(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    yield from _contents(name, value, include_self=True)


def _contents(name: str, value: Any, include_self: bool = False) -> Iterator[tuple[str, Any]]:
    if include_self:
        yield name, value
    if type(value) not in _LOOKED_INTO and not isinstance(value, tuple):  # namedtuples too
        return
    if isinstance(value, dict):
        yield from ((f"{name}[{key!r}]", item) for key, item in list(value.items()))
    else:
        yield from ((f"{name}[{index}]", item) for index, item in enumerate(value))


def reachable_tensors(function: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and saved buffers of the modules ``function`` reaches outside ``model``,
    and the bare tensors of a group that mirrors ``model``'s parameters (``_mirrored``: an
    EMA's shadow weights, diffusers' ``EMAModel.shadow_params``: missed before, found by a
    hunt), by name. Other bare tensors are left alone: a step counter, a loss log or a running
    total changes nothing a run measures."""
    return _tensors_of(list(_reached(function)), model)


def _tensors_of(reached: list[tuple[str, Any]], model: nn.Module) -> dict[str, torch.Tensor]:
    """:func:`reachable_tensors` of the (name, object) pairs ``_reached`` gave."""
    inside = {id(module) for module in model.modules()}
    inside |= {id(tensor) for tensor in model.state_dict(keep_vars=True).values()}
    shapes = collections.Counter(tuple(p.shape) for p in model.parameters())
    found: dict[str, torch.Tensor] = {}
    watched: set[int] = set()  # tensors, each once, whatever names reach it
    for name, value in reached:
        tensors = list(_mirrored(name, value, shapes))
        for shown, item in _with_contents(name, value):
            if isinstance(item, nn.Module) and id(item) not in inside:
                state = item.state_dict(keep_vars=True).items()
                tensors += [(f"{shown}.{key}", tensor) for key, tensor in state]
        for key, tensor in tensors:
            if not _watchable(tensor) or id(tensor) in inside or id(tensor) in watched:
                continue
            watched.add(id(tensor))
            found[_unused(key, found)] = tensor
    return found


def _mirrored(
    name: str, value: Any, shapes: collections.Counter[tuple[int, ...]]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a list, tuple, dict or plain object's attributes that mirror the model:
    two or more, each shaped like a parameter, no shape more often than among the parameters
    (an EMA's shadows, of all parameters or some). A lone tensor shaped like a parameter (a
    per-class loss log shaped like a bias) or a list of per-sample tensors is no mirror: both
    were refused by a first version (a review)."""
    items = _contents(name, value) if not _plain_object(value) else _attributes(name, value)
    tensors = [(shown, item) for shown, item in items if isinstance(item, torch.Tensor)]
    if len(tensors) < 2:
        return []
    counted = collections.Counter(tuple(tensor.shape) for _, tensor in tensors)
    return tensors if all(count <= shapes[shape] for shape, count in counted.items()) else []


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
    changed it and to put it back; with the numbers of the objects holding those tensors (an
    EMA object's step count, which sets its decay: a change of them alone is no refusal)."""

    def __init__(self, function: Any, model: nn.Module) -> None:
        # the gradient hooks trial copies carry (model_copies.gradient_hooks) reach out too: a
        # warm-up hook's step counter in its closure ran on from run to run (a review)
        hooks = [hook for hooks in gradient_hooks(model).values() for hook in hooks]
        reached = list(_reached(function)) if function is not None else []  # one traversal
        reached += [item for hook in hooks for item in _reached(hook)]
        self.tensors = _tensors_of(reached, model)
        self.saved = {
            name: tensor.detach().to("cpu", copy=True) for name, tensor in self.tensors.items()
        }
        self.numbers = _numbers_beside(reached, self.tensors) if self.tensors else []
        self.carried = CarriedState(function, reached, also=hooks)

    def digest(self) -> torch.Tensor:
        """Per tensor, its sum and its sum of |values| in float64, on the host (one read):
        what a run compares before and after itself, without a second host copy of the state
        (a frozen 101M-parameter teacher copied per run took 0.45 s and 384 MiB each; a
        review). NaN reads as NaN; :func:`same_digest` takes it as equal."""
        if not self.tensors:
            return torch.zeros(0, 2, dtype=torch.float64)
        rows = []
        for tensor in self.tensors.values():
            values = tensor.detach()
            if not values.is_floating_point():
                values = values.double()
            total = values.sum(dtype=torch.float64)
            rows.append(
                torch.stack((total, torch.linalg.vector_norm(values, 1, dtype=torch.float64)))
            )
        if len({row.device for row in rows}) == 1:
            return torch.stack(rows).cpu()
        return torch.stack([row.cpu() for row in rows])

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
        self.restore_numbers()
        return changed

    def restore_numbers(self) -> None:
        """Put back the numbers beside the tensors (an EMA's step count) and the carried state
        (:class:`CarriedState`)."""
        _rebind(self.numbers)
        self.carried.restore()


class CarriedState:
    """The counters and carried state a ``train_step`` keeps outside the model
    (:func:`_counters`) and in small plain dicts (:func:`_tables`), as they stood: the objects
    themselves, no copies, put back by rebinding them."""

    def __init__(
        self,
        function: Any,
        reached: list[tuple[str, Any]] | None = None,
        also: list[Any] | None = None,
    ) -> None:
        """``also``: more functions whose globals and closures count (gradient hooks)."""
        if reached is None:
            reached = list(_reached(function)) if function is not None else []
        self.counters = _counters(function, reached, also or [])
        self.tables = [(table, _carried_items(table)) for table in _tables(reached)]

    def now(self) -> CarriedState:
        """The same bindings as they stand now (no traversal of the ``train_step`` again: a
        second one per trial took 6 s where it reached a 2M-entry vocabulary; a review)."""
        current = object.__new__(CarriedState)
        current.counters = [
            (owner, key, value)
            for owner, key, _ in self.counters
            if (value := _bound(owner, key, _UNBOUND)) is not _UNBOUND
        ]
        current.tables = [(table, _carried_items(table)) for table, _ in self.tables]
        return current

    def restore(self, widened_to: torch.dtype | None = None) -> None:
        """Put back what a run rebound, key by key in the tables (a run's log beside a hidden
        state stays; a key holding carried state the run added goes); ``widened_to``: floating
        tensors narrower than it as copies in it (for a plain fp32 read of a mode's trained
        weights, which started from the state the mode's own held-out pass started from: a
        bf16 hidden state raised there)."""
        for table, saved in self.tables:
            for key in [key for key, value in table.items() if key not in saved]:
                if _carried(table[key]):
                    del table[key]
            for key, value in saved.items():
                wanted = _widened(value, widened_to)
                if table.get(key, _UNBOUND) is not wanted:
                    table[key] = wanted
        _rebind([(owner, key, _widened(value, widened_to)) for owner, key, value in self.counters])


_UNBOUND = object()


def _bound(owner: Any, key: str, default: Any) -> Any:
    """What (owner, key) binds now (see :func:`_rebind`), ``default`` if nothing."""
    if isinstance(owner, dict):
        return owner.get(key, default)
    if isinstance(owner, types.CellType):
        try:
            return owner.cell_contents
        except ValueError:  # emptied
            return default
    return getattr(owner, key, default)


def _carried_items(table: dict[Any, Any]) -> dict[Any, Any]:
    return {key: value for key, value in table.items() if _carried(value)}


def _widened(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` (:func:`_carried`) with its floating tensors narrower than ``dtype`` copied
    in it; as it is without one."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        narrower = value.is_floating_point() and value.dtype.itemsize < dtype.itemsize
        return value.to(dtype) if narrower else value
    if type(value) in (tuple, list):
        return type(value)(_widened(item, dtype) for item in value)
    return value


def _rebind(bindings: list[tuple[Any, str, Any]]) -> None:
    """Bind each (owner, name, value) where another object stands: a module's globals (a
    dict), a closure's cell, or an object's attribute."""
    for owner, key, value in bindings:
        if isinstance(owner, dict):  # a module's globals
            if owner.get(key, value) is not value:
                owner[key] = value
        elif isinstance(owner, types.CellType):  # a closure's variable
            if owner.cell_contents is not value:
                owner.cell_contents = value
        elif getattr(owner, key, value) is not value:
            setattr(owner, key, value)


def same_digest(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Two :meth:`OutsideStateWatch.digest` readings alike, NaN equal to NaN."""
    return bool(torch.allclose(first, second, rtol=0, atol=0, equal_nan=True))


def _number(value: Any) -> bool:
    """An int or float, numpy's too (``np.linspace(...)[0]``, ``tau * np.exp(-r)``, an
    ``np.int64`` step: such a temperature ran on from run to run and came back at its floor;
    a hunt); not a bool."""
    return type(value) in (int, float) or isinstance(value, np.integer | np.floating)


def _carried(value: Any) -> bool:
    """A value a ``train_step`` rebinds from step to step: an int or float (a step counter),
    None, a tensor, or a tuple or list of tensors (a recurrent state carried between batches,
    None before the first)."""
    if value is None or _number(value) or isinstance(value, torch.Tensor):
        return True
    return type(value) in (tuple, list) and all(isinstance(item, torch.Tensor) for item in value)


def _counters(
    function: Any, reached: list[tuple[str, Any]], also: list[Any]
) -> list[tuple[Any, str, Any]]:
    """(owner, name, value) for the counters and carried state (:func:`_carried`) a
    ``train_step`` keeps outside the model: the module-level names its code reads (owner: the
    module's globals), its closure's variables (owner: the cell), and the attributes of the
    plain objects it reaches (a ``Schedule()`` with a ``step``). A step counter there (a Gumbel
    temperature's, a KL warm-up's) ran on from run to run: the reference trained at steps
    6-206, the noise run at 210-414, each trial further along its schedule, and every mode was
    rejected (or every gap blinded) by the schedule's offset, not by its precision; the user's
    counter came back thousands of steps on (found by a hunt). A truncated-BPTT hidden state
    in a closure (``nonlocal h``) the same: no run but the first started from the user's None,
    bf16_sr's bf16 state failed the next trial at step 0, and the user's own loop after
    ``check()`` (a hunt). Put back after every run (the objects themselves, rebound: no copy),
    each run starts where the user's stood."""
    found: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    base = function.func if isinstance(function, functools.partial) else function
    helpers = [value for _, value in reached if _followed(value)]  # its helpers too
    functions = [*([base] if function is not None else []), *map(_unpartial, also), *helpers]
    for each in functions:
        _function_counters(_unwrapped(each.__func__ if inspect.ismethod(each) else each), found)
    for _, value in reached:
        if _plain_object(value):
            for key, number in (_own_attributes(value) or {}).items():
                if _carried(number):
                    found.setdefault((id(value), key), (value, key, number))
    return list(found.values())


MAX_TABLE_KEYS = 64
"""The most keys a dict a ``train_step`` reaches may hold to count as a table of its state: a
state table holds a few (``STATE["h"]``); a vocabulary or a cache of thousands is no state a
run carries, and copying one of 2M entries after every run cost 2 s (a review)."""


def _tables(reached: list[tuple[str, Any]]) -> list[dict[Any, Any]]:
    """The small plain dicts a ``train_step`` reaches (``MAX_TABLE_KEYS``), whose carried state
    (:func:`_carried`) is put back key by key: ``STATE["h"] = h`` carried a bf16 hidden state
    from run to run and into the user's loop like a closure's (a hunt); other values in them
    (a log of the runs) are left as the runs leave them."""
    found: dict[int, dict[Any, Any]] = {}
    for _, value in reached:
        if type(value) in (dict, collections.OrderedDict) and len(value) <= MAX_TABLE_KEYS:
            found.setdefault(id(value), value)
    return list(found.values())


def _unpartial(function: Any) -> Any:
    """``function`` without its ``functools.partial`` layers (a hook written as
    ``partial(warm_up, over=100)``: its counter ran on; a review)."""
    while isinstance(function, functools.partial):
        function = function.func
    return function


def _function_counters(base: Any, found: dict[tuple[int, str], tuple[Any, str, Any]]) -> None:
    """The carried globals ``base``'s code reads and its closure's, into ``found``."""
    if inspect.isfunction(base):
        names = code_names(base.__code__)
        for name in names & set(base.__globals__):
            value = base.__globals__[name]
            if _carried(value):
                found[(id(base.__globals__), name)] = (base.__globals__, name, value)
        for name, cell in zip(base.__code__.co_freevars, base.__closure__ or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _carried(value):
                found[(id(cell), name)] = (cell, name, value)


def _numbers_beside(
    reached: list[tuple[str, Any]], tensors: dict[str, torch.Tensor]
) -> list[tuple[Any, str, int | float | None]]:
    """(object, attribute, value) for the int, float, bool and None attributes of the plain
    objects whose attributes hold one of ``tensors`` (diffusers' ``EMAModel.optimization_step``;
    its ``cur_decay_value``, None until a step: a review)."""
    ids = {id(tensor) for tensor in tensors.values()}
    numbers: dict[tuple[int, str], tuple[Any, str, int | float | None]] = {}
    for _, value in reached:
        if not _plain_object(value):
            continue
        attributes = _own_attributes(value) or {}
        held = (item for key in attributes for _, item in _with_contents(key, attributes[key]))
        if any(id(item) in ids for item in held):
            for key, number in attributes.items():
                if number is None or type(number) is bool or _number(number):
                    numbers[(id(value), key)] = (value, key, number)
    return list(numbers.values())
