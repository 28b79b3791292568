"""Deep copies of the user's model for trials: in-place compilation dropped, and an error that
names the attribute when copying fails; and the compiled forward a plan sets, which copies
itself for the copy."""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch
from torch import nn

from autoprec._wording import first_names
from autoprec.hook_copies import HookMapping, gradient_hooks, mappable, model_objects
from autoprec.weight_dtypes import same_values


class CompileSetupError(RuntimeError):
    """``torch.compile`` itself raised, before tracing anything: under ``python -W error`` its
    import of a module using ``torch.jit.script_method`` raises torch's DeprecationWarning, and
    a run then failed with "check that the loader's batches fit the model" (found by a hunt)."""


class CompiledForward:
    """``torch.compile`` of a model's forward, set as the model's ``forward`` attribute (the
    same object, the same state_dict keys). A deep copy of the model gets a forward compiled
    afresh for the copy: a copied ``torch.compile`` wrapper still calls the original model's
    forward, so ``AveragedModel(plan.model)`` (an EMA, a deep copy) would have evaluated the
    live weights and updated the live buffers, silently. A pickled model (``torch.save``) is
    compiled afresh when loaded; a ``torch.compile`` wrapper could not be pickled."""

    def __init__(self, model: nn.Module, forward: Any = None) -> None:
        self.model = model
        self.forward = forward
        """A forward set on the instance before (compiled instead of the class's), or None."""
        try:
            self.compiled = torch.compile(forward or type(model).forward.__get__(model))
        except Exception as error:  # before dynamo runs: its own errors come at the first call
            raise CompileSetupError(
                f"torch.compile(model) raised {type(error).__name__}: {error}"
            ) from error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what it compiles (``torch.save(plan.model)``): loading compiles afresh."""
        return (CompiledForward, (self.model, self.forward))

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledForward:
        model = memo.get(id(self.model))  # the copy being made, when the model is copied
        if model is None:
            model = copy.deepcopy(self.model, memo)
        return CompiledForward(model, copy.deepcopy(self.forward, memo))


def _uncopyable_attribute(model: nn.Module) -> str | None:
    """``module.attribute (type)`` of the first attribute that copy.deepcopy refuses."""
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute in ("_parameters", "_buffers", "_modules"):
                continue
            try:
                copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - looking for the one that fails
                where = f"{name}.{attribute}" if name else attribute
                return f"{where} ({type(value).__name__})"
    return None


def _compiled_forward(module: nn.Module) -> bool:
    """A compiled ``forward`` set on the instance (what ``plan.compile_model`` does)."""
    forward = vars(module).get("forward")
    return isinstance(forward, CompiledForward) or hasattr(forward, "_torchdynamo_orig_callable")


def inside_compile_wrapper(model: Any) -> nn.Module | None:
    """The model inside ``torch.compile(model)``'s wrapper (its ``_orig_mod``); None when
    ``model`` is no such wrapper."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(model, nn.Module) and isinstance(original, nn.Module) else None


def compiled_in_place(model: nn.Module) -> bool:
    """Is any module compiled in place (``nn.Module.compile()`` or a compiled ``forward``)?"""
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or _compiled_forward(module)
        for module in model.modules()
    )


def _uncompiled(model: nn.Module) -> nn.Module:
    """Drop in-place compilation from a copy (a copied ``torch.compile`` callable would still
    run the original); a forward the instance had before a plan compiled it stays."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        if _compiled_forward(module):
            compiled = vars(module)["forward"]
            before = compiled.forward if isinstance(compiled, CompiledForward) else None
            del module.forward
            if before is not None:
                module.forward = before
            inner = inside_compile_wrapper(module)
            if inner is not None:
                # a submodule the user wrapped (model.encoder = torch.compile(model.encoder)):
                # the wrapper's class has no forward of its own; it calls what it wraps, and
                # keeps its place, so parameter names stay the user's
                module.forward = inner.__call__
    return model


def deep_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` without in-place compilation, with its parameters' gradient
    hooks (:func:`_with_parameter_hooks`), or a TypeError naming the attribute that cannot be
    copied."""
    try:
        memo: dict[int, Any] = {}
        copied = _uncompiled(copy.deepcopy(model, memo))
        return _with_parameter_hooks(model, copied, memo)
    except Exception as error:
        culprit = _uncopyable_attribute(model)
        found = f"; the attribute {culprit} cannot be copied" if culprit else ""
        raise TypeError(
            f"autoprec trains copies of your model (copy.deepcopy), and copying "
            f"{type(model).__name__} failed ({type(error).__name__}: {error}){found}. "
            f"{_copy_advice(model)}"
        ) from error


def _with_parameter_hooks(source: nn.Module, copied: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copied`` with the gradient hooks of ``source``'s trainable parameters that can be
    carried (``autoprec.hook_copies``), mapped through the deep copy's ``memo``."""
    own = model_objects(source)
    mapping = HookMapping(own, memo)
    copies = dict(copied.named_parameters())
    for name, hooks in gradient_hooks(source).items():
        twin = copies.get(name)
        if twin is None or not twin.requires_grad:
            continue
        for hook in hooks:
            if mappable(hook, own):
                twin.register_hook(mapping.hook(hook))
    return copied


def _copy_advice(model: nn.Module) -> str:
    """What makes a model copyable: torch's old ``nn.utils.weight_norm`` hook leaves a computed
    weight no deep copy takes (the advice about locks and loggers misled there; found by a
    hunt); its parametrization form copies."""
    from torch.nn.utils.weight_norm import WeightNorm

    hooked = [
        fqn or type(model).__name__
        for fqn, module in model.named_modules()
        if any(isinstance(hook, WeightNorm) for hook in module._forward_pre_hooks.values())
    ]
    if hooked:
        return (
            f"{first_names(hooked)} use torch.nn.utils.weight_norm, whose hook form cannot be "
            "copied: use torch.nn.utils.parametrizations.weight_norm (the same "
            "reparametrization, which torch recommends and which copies)."
        )
    with_history = _holding_history(model)  # a MoE's aux_loss kept from an earlier forward
    if with_history:
        holds = "holds" if len(with_history) == 1 else "hold"
        return (
            f"{first_names(with_history)} {holds} a tensor with autograd history from an "
            "earlier forward (a mixture-of-experts' aux_loss): no deep copy takes one. Set it to "
            "None before tuning, or store it detached where it is only read for logging; each "
            "forward sets it again."
        )
    return (
        "Keep locks, files, open connections and loggers out of the model's attributes "
        "(create them outside it, or define __deepcopy__)."
    )


def _holding_history(model: nn.Module) -> list[str]:
    """The attributes and buffers of ``model``'s modules that hold a tensor with autograd
    history, directly or in a list, tuple or dict (found by a hunt; buffers and lists by a
    review)."""
    found = []
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        for name, value in vars(module).items():
            if name == "_buffers":
                found += [prefix + key for key, buffer in value.items() if _has_history(buffer)]
            elif name not in ("_parameters", "_modules") and _has_history(value):
                found.append(prefix + name)
    return found


def _has_history(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    if isinstance(value, list | tuple):
        return any(_has_history(item) for item in value)
    if isinstance(value, dict):
        return any(_has_history(item) for item in value.values())
    return False


def _is_fsdp1(model: nn.Module) -> bool:
    if not torch.distributed.is_available():  # (builds without torch.distributed)
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def refuse_parallel_wrapper(model: nn.Module) -> None:
    """nn.DataParallel and DistributedDataParallel wrap the model a profile was proven on: a
    wrapped model read as another model (its keep_fp32 patterns matched nothing, and a kept
    LayerNorm trained in bf16), and DDP's gradient buckets are built for the fp32 parameters a
    mode then casts. Refused, naming the order that works."""
    if _is_fsdp1(model):  # (its flat parameters, its dtypes)
        raise TypeError(
            "The model is wrapped in FullyShardedDataParallel (FSDP1), which autoprec does not "
            "run under: the wrapper renames every module (_fsdp_wrapped_module.), so the "
            "profile's keep_fp32 names and fingerprint no longer match, and a mode that casts "
            "the weights failed at the first forward with a dtype error (found by a review). "
            "Use FSDP2 (fully_shard, then apply an fp32 or AMP profile), or DDP around "
            "plan.model."
        )
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    if isinstance(model, wrappers):
        name = type(model).__name__
        raise TypeError(
            f"The model is wrapped in {name}: autoprec converts, tunes and checks the model "
            f"itself. Pass model.module, and wrap what apply() returns: {name}(plan.model, "
            "...) (DDP's gradient buckets are built for the parameters' dtypes, which a mode "
            "changes)."
        )


class UserModelWatch:
    """The user's model (and optimizer) as they were before a run that trains a copy, to tell
    afterwards whether the run trained the original instead (a ``train_step`` or ``loss_fn``
    calling the model it closes over, not ``plan.model``) and to put everything back: each
    ``.grad`` as it was, and a host copy of the weights, buffers and optimizer state (a
    closure that also steps its own optimizer changed them, and only the gradients came back).
    Kept for the calibration run only."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, copy_weights: bool
    ) -> None:
        """``copy_weights``: keep the host copy of the weights and the optimizer's state (a
        ``train_step``, which can step an optimizer of its own); a ``loss_fn`` only computes a
        loss: its gradients and buffers (its forwards move BatchNorm's statistics) are kept."""
        self.model = model
        self.optimizer = optimizer if copy_weights else None
        self.grads = {
            name: (p.grad, None if p.grad is None else p.grad.detach().clone())
            for name, p in model.named_parameters()
        }
        weights = _weights_and_buffers(model) if copy_weights else list(model.named_buffers())
        self.tensors = {name: _host_copy(t) for name, t in weights}
        kept = self.optimizer
        self.optimizer_state = None if kept is None else copy.deepcopy(kept.state_dict())

    def changed(self) -> list[str]:
        """Names of the parameters whose gradient is not what it was."""
        names = []
        for name, p in self.model.named_parameters():
            grad, values = self.grads.get(name, (None, None))
            if p.grad is not grad or (values is not None and not same_values(p.grad, values)):
                names.append(name)
        return names

    def changed_values(self) -> list[str]:
        """Names of the copied weights and buffers whose values are not what they were, and
        ``"optimizer state"`` when the watched optimizer's state changed: a ``train_step``
        that steps the user's model and optimizer and zeroes their gradients (to None) left
        no gradient behind, and the user's model came back trained (found by a hunt)."""
        names = [
            name
            for name, tensor in _weights_and_buffers(self.model)
            if (saved := self.tensors.get(name)) is not None
            and not same_values(tensor.detach().cpu(), saved)  # a NaN fill value stays put
        ]
        if self.optimizer is not None and self.optimizer_state is not None:
            now = self.optimizer.state_dict()["state"]
            before = self.optimizer_state["state"]
            if now.keys() != before.keys() or any(
                not _same_state(now[key], before[key]) for key in now
            ):
                names.append("optimizer state")
        return names

    def restore(self) -> list[str]:
        """Put gradients, weights, buffers and the optimizer's state back; returns the names of
        the weights and buffers that had changed."""
        for name, p in self.model.named_parameters():
            grad, values = self.grads.get(name, (None, None))
            if values is not None:
                assert grad is not None
                with torch.no_grad():
                    grad.copy_(values)
            p.grad = grad
        changed = []
        with torch.no_grad():
            for name, tensor in _weights_and_buffers(self.model):
                saved = self.tensors.get(name)
                if saved is not None and not same_values(tensor.detach().cpu(), saved):
                    tensor.copy_(saved)
                    changed.append(name)
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(self.optimizer_state)
        return changed


def _same_state(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """One parameter's optimizer state, the same keys and values (tensors by value)."""
    if first.keys() != second.keys():
        return False
    for key, value in first.items():
        other = second[key]
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
            if not same_values(value.cpu(), other.cpu()):
                return False
        elif value != other:
            return False
    return True


def _weights_and_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _plain(value: Any) -> bool:
    """Tensors, numbers, strings and None, alone or in lists, tuples and dicts of them."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return True
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(_plain(key) and _plain(item) for key, item in value.items())
    return False


def _carried_attribute(value: Any, current: Any, floating: torch.dtype) -> Any:
    """``value`` (a trained module's plain attribute or buffer) for the fp32 reader: tensors in
    the dtype of the reader's own tensor in the same place (``current``), floating tensors with
    none there (None before the first batch, a new key) no narrower than ``floating``, the
    reader's; tuples, lists and dicts item by item; other values copied. A truncated-BPTT
    LSTM's ``(h, c)`` carried in bf16 into the fp32 reader failed every bf16 mode at its last
    step (found by a hunt)."""
    if isinstance(value, torch.Tensor):
        dtype = current.dtype if isinstance(current, torch.Tensor) else value.dtype
        if not isinstance(current, torch.Tensor) and value.is_floating_point():
            dtype = max(value.dtype, floating, key=lambda each: torch.finfo(each).bits)
        return value.detach().to(dtype=dtype, copy=True)
    if type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        alike = type(current) is type(value) and len(current) == len(value)
        items = [
            _carried_attribute(item, current[index] if alike else None, floating)
            for index, item in enumerate(value)
        ]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if type(value) in (dict, collections.OrderedDict):  # a defaultdict is copied (a review)
        mine = current if isinstance(current, dict) else {}
        return type(value)(
            (key, _carried_attribute(item, mine.get(key), floating)) for key, item in value.items()
        )
    return copy.deepcopy(value)


def floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating parameter (torch's default without one)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()


def carry_unsaved_state(trained: nn.Module, reader: nn.Module) -> None:
    """Give ``reader`` (a fresh copy of the user's model holding ``trained``'s
    ``state_dict()``) what a state dict leaves out but a forward may read: non-persistent
    buffers, buffers registered as None that training set (a memory, a running statistic set
    at the first batch), and the plain attributes training changed (a step counter an
    annealed temperature follows, a recurrent state carried from batch to batch), module by
    module where names and classes match. Modules a mode swapped (FP8 Linears) and attributes
    a mode added are left alone, and so is anything but plain data (:func:`_plain`): an
    instance ``forward`` (a ``torch.compile`` wrapper's, or one bound on the instance)
    deep-copied the trained module it is bound to, so the "fp32" reader ran the trained mode's
    copy (bf16_sr failed on a regionally compiled model, and the forward-cost check read 0;
    found by a hunt)."""
    sources = dict(trained.named_modules())
    floating = floating_dtype(reader)
    for name, module in reader.named_modules():
        source = sources.get(name)
        if source is None or type(source) is not type(module):
            continue
        for buffer, value in source._buffers.items():
            if value is None or buffer not in module._buffers:
                continue
            mine = module._buffers[buffer]
            if mine is None or mine.shape != value.shape:  # a buffer None until training set it
                module._buffers[buffer] = _carried_attribute(value, mine, floating)
            elif buffer in module._non_persistent_buffers_set:
                with torch.no_grad():
                    mine.copy_(value)
        own = vars(module)
        for key, value in vars(source).items():
            if key.startswith("_") or key == "training" or key not in own:
                continue
            if value is own[key] or not _plain(value):
                continue
            own[key] = _carried_attribute(value, own[key], floating)


NUDGE = 2.0**-12
"""The paired run's nudge of the initial weights, relative: a quarter of an fp16 and tf32 ulp
(2^-10 at 1.0), below the finest rounding any mode applies, and applied once where a mode rounds
at every step. It was one fp32 ulp (2^-23) until 2026-11-29: on a mixture-of-experts MLP (top-1
routing, 200 steps) that flipped 0.4% of the routes and left the outputs 1.7% apart, where every
bf16 and fp16 mode, like fp32 nudged by 2^-12, flipped about 20% and ended 60% apart, so
amp_bf16, amp_fp16, bf16_sr and bf16_kahan were rejected for their outputs alone, though
1000-step runs (4 seeds) found them fine; a VQ-VAE's codebook lookup the same (found by a hunt).
On the 14 ground-truth tasks (172 pairs) no verdict moved; the conv nets' paired output
difference rose from 0.0% to 3.6-4.0%, the others' stayed under 0.3%."""


def nudge_weights(model: nn.Module, seed: int) -> None:
    """Multiply every element of ``model``'s floating parameters by 1 +- NUDGE (signs from a
    generator of its own, the global RNG untouched), in place, on a copy. Two fp32 runs that
    differ by this much stay together when training is not chaotic, and drift apart as far as
    chaos takes them when it is (benchmarks/chaos_floor.py)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point() and not parameter.is_meta:
                signs = torch.randint(0, 2, parameter.shape, generator=generator) * 2 - 1
                parameter.mul_(1 + NUDGE * signs.to(parameter.device, parameter.dtype))
