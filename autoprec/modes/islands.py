"""Modules that run in another precision than the model around them: ``keep_fp32`` modules in
fp32 (autocast off, low-precision inputs cast up), and modules tied to a kept one under
autocast.

The hooks are objects, not closures: ``torch.save(plan.model)`` pickles them, and
``copy.deepcopy(plan.model)`` gives every copy hooks of its own. They run eagerly under
``torch.compile`` (:class:`EagerHook`): dynamo cannot trace an autocast entered in one hook and
left in another (the exit found no saved state), nor ``set_autocast_enabled``; the module's
graph is compiled under the state the hooks set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

LOW_DTYPES = (torch.bfloat16, torch.float16)

_inside = threading.local()
"""``.fp32``: how many kept modules' fp32 islands the current thread's forward is inside."""


def _fp32_depth() -> int:
    return getattr(_inside, "fp32", 0)


def cast_floats(tree: Any, source: tuple[torch.dtype, ...], target: torch.dtype) -> Any:
    """Every tensor of a ``source`` dtype in ``tree`` cast to ``target``. A flat tuple or dict
    with nothing to cast comes back as it is, without torch's pytree walk: the hooks on every
    layer of a pure-bf16 model (and on every kept module) call it each forward, and the walk
    cost some 15 us a module (a 2000-layer forward 2.6x hand-written bf16's; found by a hunt)."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in source:
            return value.to(target)
        return value

    if _nothing_to_cast(tree, source):
        return tree
    return tree_map(cast, tree)


_LEAVES = (type(None), bool, int, float, str)
"""Values the pytree walk never opens. Anything else may be a registered node (a deque, a
``__slots__`` class or dataclass registered with torch's pytree): the walk decides (a review
found those left uncast when the shortcut judged by ``__dict__``)."""


def _nothing_to_cast(tree: Any, source: tuple[torch.dtype, ...]) -> bool:
    """Whether a flat tuple or dict holds only tensors not of a ``source`` dtype and plain
    leaves: then the walk would change nothing."""
    if type(tree) is tuple:
        values: Any = tree
    elif type(tree) is dict:
        values = tree.values()
    else:
        return False
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype in source:
                return False
        elif type(value) not in _LEAVES:
            return False
    return True


class EagerHook:
    """A module hook that runs eagerly under ``torch.compile``, picklable and deep-copyable
    (rebuilt from the function it wraps, so a copy's hook calls the copy's island)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        if EagerHook.__call__ is EagerHook._call:  # the first hook: see _call
            EagerHook.__call__ = torch.compiler.disable(EagerHook._call)  # type: ignore[method-assign]

    def _call(self, *args: Any) -> Any:
        """The hook's call, made ``__call__`` through ``torch.compiler.disable`` when the first
        hook is built: disabled on the frame dynamo meets, not on the function it calls (with
        only the inner call disabled, torch 2.11 compiled this frame for each island and
        autocast/grad state and hit dynamo's recompile limit in every pure-bf16 compiled trial,
        first H200 run); not at import, which would import dynamo with autoprec (1.1 s -> 1.9 s)."""
        return self.function(*args)

    __call__ = _call

    def __reduce__(self) -> tuple[Any, ...]:
        return (EagerHook, (self.function,))


class Fp32Island:
    """One kept module's hooks: autocast off and low-precision inputs cast to fp32 on the way
    in; on the way out autocast as it was and, with ``output_dtype``, fp32 outputs cast to it
    (pure bf16 hands bf16 on) while ``narrow()`` says the model around is still narrow (a copy
    made fp32 again keeps its fp32 outputs). ``original`` maps an input to the wider tensor it
    was cast from, where known (pure bf16: the model's own fp32 inputs)."""

    def __init__(
        self,
        device_type: str,
        output_dtype: torch.dtype | None = None,
        original: Callable[[Any], Any] | None = None,
        narrow: Callable[[], bool] | None = None,
    ) -> None:
        self.device_type = device_type
        self.output_dtype = output_dtype
        self.original = original
        self.narrow = narrow
        self.saved: list[bool] = []

    def enter(self, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.saved.append(torch.is_autocast_enabled(self.device_type))
        torch.set_autocast_enabled(self.device_type, False)
        _inside.fp32 = _fp32_depth() + 1
        if self.original is not None:
            args, kwargs = tree_map(self.original, args), tree_map(self.original, kwargs)
        return cast_floats(args, LOW_DTYPES, torch.float32), cast_floats(
            kwargs, LOW_DTYPES, torch.float32
        )

    def leave(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        torch.set_autocast_enabled(self.device_type, self.saved.pop() if self.saved else False)
        _inside.fp32 = max(0, _fp32_depth() - 1)
        if self.output_dtype is None or (self.narrow is not None and not self.narrow()):
            return output
        return cast_floats(output, (torch.float32,), self.output_dtype)


class AutocastIsland:
    """One module's hooks running it under autocast to ``dtype`` whatever surrounds it, while
    ``active()`` says so (pure bf16: while the model is still bf16), except inside a kept
    module's fp32 island: a module registered twice, once inside a kept container, computed
    in bf16 there too (found by a hunt: ``enc.0`` and ``dec.1`` one module, ``dec`` kept)."""

    def __init__(
        self, device_type: str, dtype: torch.dtype, active: Callable[[], bool] | None = None
    ) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.active = active
        self.contexts: list[torch.autocast | None] = []

    def enter(self, _module: nn.Module, _args: Any) -> None:
        if (self.active is not None and not self.active()) or _fp32_depth():
            self.contexts.append(None)
            return
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self.contexts.append(context)

    def leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        context = self.contexts.pop() if self.contexts else None
        if context is not None:
            context.__exit__(None, None, None)


def hooked_module(model: nn.Module, fqn: str) -> nn.Module:
    """The module whose hooks make ``fqn`` an island: a ``torch.compile`` wrapper's
    ``_orig_mod`` (compiling the whole model, dynamo inlines the wrapper and never runs its
    hooks: a kept ``head = torch.compile(head)`` computed in bf16 under AMP, unsaid, and failed
    under pure bf16; found by a hunt), else the module itself."""
    module = model.get_submodule(fqn)
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def install_fp32_islands(
    model: nn.Module,
    fqns: list[str],
    device_type: str,
    output_dtype: torch.dtype | None = None,
    original: Callable[[Any], Any] | None = None,
    narrow: Callable[[], bool] | None = None,
) -> None:
    """Run the named modules in fp32 (:class:`Fp32Island`)."""
    for fqn in fqns:
        island = Fp32Island(device_type, output_dtype, original, narrow)
        module = hooked_module(model, fqn)
        module.register_forward_pre_hook(EagerHook(island.enter), with_kwargs=True)
        module.register_forward_hook(EagerHook(island.leave), always_call=True)


def install_autocast_islands(
    model: nn.Module,
    fqns: list[str],
    device_type: str,
    dtype: torch.dtype,
    active: Callable[[], bool] | None = None,
) -> None:
    """Run the named modules under autocast to ``dtype``, whatever surrounds them: a module
    of a pure-bf16 model whose weight stays fp32 because it is tied to a kept module computes
    in bf16 from it (autocast casts the weight per call; its gradient arrives in fp32)."""
    for fqn in fqns:
        island = AutocastIsland(device_type, dtype, active)
        module = hooked_module(model, fqn)
        module.register_forward_pre_hook(EagerHook(island.enter))
        module.register_forward_hook(EagerHook(island.leave), always_call=True)
