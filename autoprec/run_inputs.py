"""What the user passed to tune() or check(), checked before anything is copied or trained:
the model, the device, the budget and objective, the compile choice; the loader read into a
list of batches; and the global RNG states, left as they were."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn
from torch.utils._pytree import tree_flatten

from autoprec._files import check_writable
from autoprec._wording import first_names
from autoprec.batching import (
    MAIN_INPUT_RANKS,
    as_plain,
    main_input,
    map_tensors,
    tensors_in,
)
from autoprec.collector import callers_objects_frozen
from autoprec.drift_thresholds import DriftThresholds
from autoprec.eligibility import model_device
from autoprec.errors import BatchError, BudgetTooSmallError, field_errors
from autoprec.exclusive import one_run_at_a_time
from autoprec.fingerprint import storage_file
from autoprec.interrupts import remembered_interrupts
from autoprec.layer_kinds import (
    refuse_lazy,
    refuse_torchscript,
    uncalled_kept_module,
    unknown_name_refusal,
)
from autoprec.model_copies import (
    compiled_in_place,
    inside_compile_wrapper,
    refuse_parallel_wrapper,
)
from autoprec.outcomes import OBJECTIVES
from autoprec.random_streams import kept_streams
from autoprec.specs import matches_keep_fp32
from autoprec.trial_measures import torch_settings_kept
from autoprec.weight_dtypes import fp32_fix, non_fp32_weights

MAX_BATCHES = 64
"""Batches read from the loader; trials cycle over them."""


def _loader_generators(loader: Any) -> list[torch.Generator]:
    """The torch generators a loader draws its order from: a DataLoader's ``generator``
    (its worker seeds, and its RandomSampler's shuffle) and its samplers' own."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (
        loader,
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    )
    found = [getattr(holder, "generator", None) for holder in holders if holder is not None]
    unique = {id(g): g for g in found if isinstance(g, torch.Generator)}
    return list(unique.values())


def collect_batches(
    loader: Iterable[Any], after_each: Callable[[int], None] | None = None
) -> list[Any]:
    """Up to ``MAX_BATCHES`` batches of ``loader``; ``after_each(count)`` is called after each
    (the budget's check: it raises). A seeded DataLoader's generator is put back as it was:
    reading it drew the user's first epoch's order (the global RNGs are kept by
    ``preserved_rng``)."""
    generators = _loader_generators(loader)
    states = [generator.get_state() for generator in generators]
    persistent = isinstance(loader, torch.utils.data.DataLoader) and loader.persistent_workers
    had_iterator = getattr(loader, "_iterator", None) is not None
    try:
        return _read_batches(loader, after_each)
    finally:
        if persistent and not had_iterator:
            _drop_persistent_iterator(loader)  # type: ignore[arg-type]
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)


def _drop_persistent_iterator(loader: torch.utils.data.DataLoader) -> None:
    """A DataLoader with ``persistent_workers`` keeps the iterator autoprec's read made, whose
    workers' base seed it drew from the generator: the user's first epoch then reused it and
    drew only the shuffle, one draw off (found by a hunt: another first batch). Shut down, the
    user's first ``iter()`` makes its own, from the restored generator."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None:
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    loader._iterator = None


def _refuse_dataset(loader: Any) -> None:
    """A map-style Dataset iterates its samples one by one: every run trained on single
    unbatched samples (targets of shape (1,)), and samples/s counted features."""
    dataset = torch.utils.data.Dataset
    if isinstance(loader, dataset) and not isinstance(loader, torch.utils.data.IterableDataset):
        raise TypeError(
            f"loader is a Dataset ({type(loader).__name__}), which yields single samples, not "
            "batches: pass torch.utils.data.DataLoader(dataset, batch_size=...) (on the "
            "command line, make --data return the DataLoader)."
        )


def _batches_nothing(loader: Any) -> bool:
    """A loader that hands its dataset's items as they come: an IterableDataset itself, or a
    DataLoader with ``batch_size=None``."""
    data = torch.utils.data
    if isinstance(loader, data.IterableDataset):
        return True
    return (
        isinstance(loader, data.DataLoader)
        and loader.batch_size is None
        and loader.batch_sampler is None
    )


def _refuse_single_sample(loader: Any, batch: Any) -> None:
    """An IterableDataset yielding single samples was taken for batches: every run trained on
    one sample a step, and samples/s counted its features (found by a hunt). An item from a
    loader that batches nothing is taken as a batch where it shows a batch dimension: a main
    input of a batch's rank (``input_ids`` of shape (B, T), with a count or ``cu_seqlens``
    beside it), a leading dimension two of its tensors share (a causal mask aside them), or
    one tensor with no label of no dimension beside it; else it is refused, naming a list of
    the batches as the way to hand an item that is a batch (a narrower rule let single
    samples through; found by reviews)."""
    if not _batches_nothing(loader):
        return
    plain = as_plain(batch)
    found = main_input(plain)
    leaves = tree_flatten(plain)[0]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    scalars = [
        leaf
        for leaf in leaves
        if (isinstance(leaf, torch.Tensor) and leaf.dim() == 0)
        or (isinstance(leaf, numbers.Number) and not isinstance(leaf, bool))
    ]
    leading = [tensor.shape[0] for tensor in tensors]
    if found is not None:
        key, main = found
        rank = MAIN_INPUT_RANKS[key]
        if main.dim() >= rank:
            return
        found = f"{key} of shape {tuple(main.shape)}, one sample's (a batch's has {rank} dims)"
    else:
        shared = len(set(leading)) < len(leading)  # two tensors share a leading dimension
        if not tensors or shared or (len(tensors) == 1 and not scalars):
            return  # (no tensor at all: the runs' count refuses it, naming its type)
        shapes = ", ".join(str(tuple(tensor.shape)) for tensor in tensors)
        found = (
            f"one tensor of shape {shapes} and a label of no dimension"
            if len(tensors) == 1
            else f"tensors of shapes {shapes}, no batch dimension shared"
        )
    raise BatchError(
        f"The loader ({type(loader).__name__}, which batches nothing) yielded an item holding "
        f"{found}: a single sample, not a batch. Wrap it in "
        "torch.utils.data.DataLoader(dataset, batch_size=...), or, if its items are batches, "
        "hand them as a list (list(loader))."
    )


def _pointers(batch: Any) -> set[int]:
    return {tensor.data_ptr() for tensor in tensors_in(batch) if tensor.numel()}


def _kept(batch: Any) -> Any:
    """A copy of a batch that no later batch can overwrite (a leaf that requires grad stays
    one: a physics-informed loss differentiates by its inputs)."""

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone().requires_grad_(tensor.requires_grad and tensor.is_leaf)

    return map_tensors(copy, batch)


def _read_batches(
    loader: Iterable[Any], after_each: Callable[[int], None] | None = None
) -> list[Any]:
    """Up to ``MAX_BATCHES`` batches. A loader that refills one buffer in place (a prefetcher)
    hands every batch in the same tensors: each stored batch then held the last one read, and
    every run trained and was judged on one batch. A batch whose every tensor is an earlier
    batch's is copied as it is read, and the earlier batch, overwritten, is dropped."""
    _refuse_dataset(loader)
    try:
        iterator = iter(loader)
    except TypeError:
        raise TypeError(
            f"loader must be an iterable of batches (a DataLoader, a list), not "
            f"{type(loader).__name__}."
        ) from None
    batches: list[Any] = []
    held: dict[int, set[int]] = {}  # stored batches not copied: their tensors' addresses
    overwritten: set[int] = set()
    try:
        for batch in iterator:
            _refuse_unreadable_tensors(batch, len(batches))
            if not batches:
                _refuse_single_sample(loader, batch)
            pointers = _pointers(batch)
            # every tensor in an earlier batch's: a buffer refilled (a constant tensor shared
            # by every batch, such as position ids, is not)
            shared = {index for index, theirs in held.items() if pointers and pointers <= theirs}
            if shared:
                overwritten |= shared
                batch = _kept(batch)
            else:
                held[len(batches)] = pointers
                if any(tensor.requires_grad for tensor in tensors_in(batch)):
                    batch = _kept(batch)  # the runs' backward filled the user's own .grad
            batches.append(batch)
            if after_each is not None:
                after_each(len(batches))
            if len(batches) - len(overwritten) >= MAX_BATCHES:
                break
    except (BatchError, BudgetTooSmallError):  # ours, not the loader's
        raise
    except Exception as error:  # the user's loader: named, with its cause
        raise ValueError(
            f"Reading batch {len(batches)} from the loader raised {type(error).__name__}: "
            f"{error}. autoprec reads up to {MAX_BATCHES} batches before training; fix the "
            "loader (its traceback follows this error; the CLI shows it with --debug)."
        ) from error
    batches = [batch for index, batch in enumerate(batches) if index not in overwritten]
    if not batches:
        raise ValueError(
            "The loader yielded no batches: every run trains on them, so at least one is "
            f"needed ({_why_empty(loader)})."
        )
    return batches


def _refuse_unreadable_tensors(batch: Any, index: int) -> None:
    """Tensors autoprec cannot copy, compare or count a batch by: meta (a bare
    NotImplementedError at the first copy), sparse and nested ones (blamed on the loader, or
    a bare torch error in the batch comparison; found by hunts)."""
    for tensor in tensors_in(batch):
        if tensor.is_meta:
            raise BatchError(
                f"Batch {index} of the loader holds meta tensors (shapes without data): "
                "training cannot read them. Give the loader's batches real data."
            )
        if tensor.is_nested or tensor.layout != torch.strided:
            kind = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
            raise BatchError(
                f"Batch {index} of the loader holds a {kind} tensor: autoprec copies, compares "
                "and counts batches as dense tensors. Give dense batches (x.to_dense(), or "
                "padded sequences with a mask)."
            )


def _why_empty(loader: Iterable[Any]) -> str:
    """Why a loader yielded nothing, for the refusal (an empty DataLoader was told to pass a
    DataLoader)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return (
            "a generator or iterator that was already consumed yields none; pass a list or a "
            "DataLoader"
        )
    try:
        size = f"{len(loader.dataset)} samples"  # type: ignore[arg-type]
    except TypeError:
        size = "no length"
    dropped = "; drop_last drops a last batch under batch_size" if loader.drop_last else ""
    return f"this DataLoader's dataset has {size}{dropped}"


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Leave the global RNGs (torch CPU and CUDA, Python's random, NumPy's) as they were."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with kept_streams(cuda):
        yield


@contextlib.contextmanager
def callers_process_kept(what: str) -> Iterator[None]:
    """What ``tune()`` and ``check()`` (``what``) keep of the caller's process around their
    run: one run at a time, the global random streams, torch's settings and the caller's
    objects as they were, the caller's autocast / no_grad block lifted inside, and a Ctrl-C
    remembered (the garbage collector swallowed one, and the run went on to its end: a
    hunt)."""
    with (
        remembered_interrupts(terminate=False),
        one_run_at_a_time(what),
        preserved_rng(),
        torch_settings_kept(),
        callers_objects_frozen(),
        callers_blocks_lifted(),
    ):
        yield


@contextlib.contextmanager
def callers_blocks_lifted() -> Iterator[None]:
    """Run tune/check as at the top level of a script, whatever block the caller is in: autocast
    off and gradients on inside (restored after). Called inside ``torch.autocast`` the fp32
    reference ran bf16 forwards and every mode was compared with bf16; under
    ``torch.no_grad()`` the loss had no gradient (and amp_fp16 was called unsupported here).
    ``torch.inference_mode()`` cannot be lifted (its tensors never take gradients): refused."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "autoprec trains the model, and it was called inside torch.inference_mode(), whose "
            "tensors can never take gradients. Call tune()/check() outside that block."
        )
    blocked = [kind for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
    cache = torch.is_autocast_cache_enabled()
    with contextlib.ExitStack() as stack:
        for device_type in blocked:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        if blocked:
            # autocast clears its cache of weight casts only when the outermost block ends: under
            # the caller's, an amp trial's forwards reused the weights' first casts every step
            # (forward cost 4.1% where the same check at the top level reads 0.008%)
            torch.set_autocast_cache_enabled(False)
            stack.callback(torch.set_autocast_cache_enabled, cache)
        stack.enter_context(torch.enable_grad())
        yield


def device_name(device: str | torch.device | None) -> str | None:
    """``device=`` as the name the run passes on: a ``torch.device`` as its string."""
    return str(device) if isinstance(device, torch.device) else device


def checked_model(model: Any, device: str | None, compile: bool | str) -> tuple[nn.Module, bool]:
    """(the module to run, whether every run trains compiled): the user's model unwrapped from
    ``torch.compile`` and checked, the device checked, ``compile`` resolved against it."""
    model, compiled = uncompiled_model(model)
    check_model(model)
    check_device(device)
    if device is None:
        model_device(model)  # trials run where the model is: one device, not a device_map
    return model, resolve_compile(compile, compiled)


def resolve_thresholds(thresholds: Any) -> DriftThresholds | None:
    """``thresholds`` as :class:`DriftThresholds`: one already, or a dict of its fields."""
    if thresholds is None or isinstance(thresholds, DriftThresholds):
        return thresholds
    if not isinstance(thresholds, Mapping):
        raise TypeError(
            f"thresholds must be a DriftThresholds or a dict of its fields, not "
            f"{type(thresholds).__name__}."
        )
    fields = ", ".join(DriftThresholds.model_fields)
    keys = [key for key in thresholds if not isinstance(key, str)]
    flags = [key for key, value in thresholds.items() if isinstance(value, bool)]
    if keys or flags:
        found = (
            f"keys that are not field names: {keys!r}"
            if keys
            else f"True/False for {', '.join(map(str, flags))}, which take numbers"
        )
        raise ValueError(f"thresholds: {found}. Fields: {fields}.")
    try:
        return DriftThresholds(**thresholds)
    except ValidationError as error:
        raise ValueError(f"thresholds: {field_errors(error)}. Fields: {fields}.") from None


def checked_keep_fp32(model: nn.Module, keep_fp32: Any) -> tuple[str, ...]:
    """Your ``keep_fp32`` patterns, each checked to name at least one module of ``model`` (the
    exact name, a parent's, or an ``fnmatch`` pattern such as ``blocks.*.ln_*``)."""
    if keep_fp32 is None:
        return ()
    if isinstance(keep_fp32, str) or not isinstance(keep_fp32, Iterable):
        raise TypeError(
            f"keep_fp32 must be a list of module-name patterns (e.g. ['teacher', "
            f"'blocks.*.ln_1']), not {keep_fp32!r}."
        )
    patterns = tuple(keep_fp32)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"keep_fp32 holds {pattern!r}: each entry must be a module name or pattern; "
                "the whole model cannot be kept (that is fp32, the reference)."
            )
        unknown = unknown_name_refusal(model, pattern)
        if unknown:
            raise ValueError(unknown)
    _refuse_keeping_everything(model, patterns)
    uncalled = uncalled_kept_module(model, lambda fqn: matches_keep_fp32(fqn, patterns))
    if uncalled:
        raise ValueError(uncalled)
    return tuple(sorted(dict.fromkeys(patterns)))  # in any order: the same study (a hunt)


def _refuse_meta(model: nn.Module) -> None:
    """Parameters on the meta device (shapes without values) cannot train. Where only some are
    (a ``torch.func`` ensemble's template registered as a submodule beside the stacked real
    weights), the message names them, and ``to_empty()``, which would overwrite the real
    weights with uninitialised memory, is not the advice (found by a hunt)."""
    parameters = dict(model.named_parameters())
    meta = [name for name, p in parameters.items() if p.is_meta]
    if not meta:
        return
    if len(meta) == len(parameters):
        raise ValueError(
            "The model's parameters are on the meta device (shapes without values): nothing "
            "can train. Materialize it first, e.g. model.to_empty(device='cpu') and then "
            "initialize it or load a checkpoint."
        )
    raise ValueError(
        f"{len(meta)} of the model's {len(parameters)} parameters are on the meta device "
        f"(shapes without values): {first_names(meta)}. A meta template for torch.func "
        "(functional_call over stacked weights) registered as a submodule is one: keep it out "
        "of the model's submodules (e.g. in a plain list or a non-Module attribute), or "
        "materialize those parameters; the others hold values and are left as they are."
    )


def keeps_every_trainable(
    model: nn.Module, patterns: Sequence[str], frozen_too: bool = False
) -> bool:
    """Whether keep_fp32 ``patterns`` keep every trainable parameter of ``model`` (with
    ``frozen_too``, every floating-point one) in fp32 (a parameter is kept when a module that
    owns it is; the root's own are never kept)."""
    trainable = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad or (frozen_too and p.is_floating_point())
    ]

    def kept(name: str) -> bool:
        parts = name.split(".")[:-1]
        owners = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
        return any(matches_keep_fp32(owner, tuple(patterns)) for owner in owners)

    return bool(trainable) and all(kept(name) for name in trainable)


def _refuse_keeping_everything(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """Patterns that keep every trainable parameter in fp32 (``*``) leave nothing in lower
    precision: every mode would be the fp32 reference under another name, called safe."""
    if keeps_every_trainable(model, patterns):
        raise ValueError(
            f"keep_fp32 {list(patterns)} keeps every trainable parameter of "
            f"{type(model).__name__} in fp32: no mode would lower the precision of anything, "
            "and each would be judged as the fp32 reference under its name. Keep the modules "
            "that need fp32 only."
        )


SEED_RANGE = (-(2**63), 2**64 - 2)
"""The seeds torch's generators take (a signed or unsigned 64-bit integer), less one at the top:
the noise runs seed with ``seed + 1``."""


def check_seed(seed: Any) -> None:
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ValueError(
            f"seed must be an integer from {low} to {high} (torch's 64-bit generator seeds; the "
            f"noise runs use seed + 1), not {seed!r}."
        )


MAX_BUDGET_MINUTES = 1e7
"""About 19 years: a larger budget overflowed the step planning (``budget_minutes=1e307``
raised OverflowError; found by a hunt)."""


def check_budget(budget_minutes: Any, objective: Any) -> None:
    if (
        isinstance(budget_minutes, bool)
        or not isinstance(budget_minutes, numbers.Real)  # NumPy's numbers too (a hunt)
        or not budget_minutes > 0
        or not math.isfinite(budget_minutes)
        or budget_minutes > MAX_BUDGET_MINUTES
    ):
        raise ValueError(
            f"budget_minutes must be a positive, finite number of minutes up to "
            f"{MAX_BUDGET_MINUTES:g} but got {budget_minutes!r} (autoprec.check screens every "
            "mode without a budget)."
        )
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)} but got {objective!r}.")


def checked_storage(storage: Any) -> str | None:
    """``storage`` as a string: a ``pathlib.Path`` is a journal or SQLite file path (it
    failed after calibration with a bare TypeError; found by a hunt)."""
    if isinstance(storage, os.PathLike):
        storage = os.fspath(storage)
    if storage is not None and not isinstance(storage, str):
        raise TypeError(
            f"storage must be an Optuna storage URL or a file path, not {type(storage).__name__}."
        )
    _check_storage_writable(storage)
    return storage


def _check_storage_writable(storage: str | None) -> None:
    """A local study file (SQLite, a journal) a run could not write is refused before the run:
    it failed after calibration, and a read-only study file in a writable folder was blamed on
    the folder ("check ... that its folder exists and is writable"; found by a hunt)."""
    file = storage_file(storage)
    if file is None:
        return
    if file.is_file() and not os.access(file, os.W_OK):
        raise ValueError(
            f"The study storage {str(file)!r} is read-only: a tune writes its trials there. "
            "Make it writable, or give another storage."
        )
    check_writable(file)  # its folder (SQLite writes a journal beside it)


def uncompiled_model(model: Any) -> tuple[Any, bool]:
    """(the module to tune, whether the user compiled it): ``torch.compile(model)`` returns a
    wrapper whose ``_orig_mod`` is the model; ``model.compile()`` and a compiled ``forward``
    mark the model itself (trials drop that from their copies)."""
    original = inside_compile_wrapper(model)
    if original is not None:
        return original, True
    if not isinstance(model, nn.Module):
        return model, False
    return model, compiled_in_place(model)


def resolve_compile(compile: bool | str, user_compiled: bool) -> bool:
    """``compile=True`` / ``False`` as given; ``"auto"``: train compiled exactly when the user's
    model is (measure the run the user makes)."""
    if compile == "auto":
        return user_compiled
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True, False or 'auto' but got {compile!r}.")
    return compile


def check_model(model: Any) -> None:
    """A model that can train here: a Module with trainable parameters that hold values."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module but got {type(model).__name__}.")
    refuse_parallel_wrapper(model)
    refuse_torchscript(model)
    if next(model.parameters(), None) is None:
        raise ValueError("The model has no parameters: there is nothing to tune.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "The model has no trainable parameters (requires_grad=False everywhere): the fp32 "
            "reference would never move. Unfreeze the parameters your run trains."
        )
    refuse_lazy(model)
    _refuse_meta(model)
    found = non_fp32_weights(model)
    if found is not None:
        raise ValueError(
            f"The model's weights are not fp32 ({found}). Every mode is judged against an fp32 "
            "reference trained from these weights, and they would train as they are under "
            "every mode's name: a bf16 model's 'fp32' reference and AMP modes would be pure "
            f"bf16 with nearest rounding. {fp32_fix(model)}"
        )


def check_device(device: str | None) -> None:
    """A ``device=`` that this torch cannot use fails here, before anything is copied."""
    if device is None:
        return
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        target = None
    if target is not None and target.type == "cpu":
        return
    if target is None or target.type != "cuda":
        raise ValueError(f"autoprec tunes on 'cpu' or 'cuda:N', not {device!r}.")
    if torch.version.cuda is None and torch.version.hip is None:  # ROCm builds say "cuda" too
        raise ValueError(
            f"device={device!r}, but this torch ({torch.__version__}) is a CPU build without "
            "CUDA or ROCm. Tune on 'cpu', or install a CUDA (or ROCm) build of torch on a "
            "machine with a GPU."
        )
    count = torch.cuda.device_count()
    if (target.index or 0) >= count:
        found = f"{count} CUDA device(s)" if count else "no CUDA device"
        raise ValueError(
            f"device={device!r}, but torch sees {found} here (CUDA_VISIBLE_DEVICES, driver). "
            "Pick an existing device or 'cpu'."
        )
