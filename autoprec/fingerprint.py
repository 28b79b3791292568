"""What a study's outcomes were measured under, so a resumed run never reuses them for another.

A study records a :class:`StudyFingerprint`: digests of the model (its parameters and buffers,
and its modules' ``repr``) and of the batches read, the recipe (and of what its loss and
``eval_fn`` compute with), objective, drift thresholds, candidate set, budget,
hardware, seed and autoprec version. A run whose fingerprint differs refuses, in one line naming
what differs. The fp32 reference and noise runs of a matching study are kept in a file next to
a file storage (SQLite, journal) and reused: :func:`save_references` / :func:`load_references`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from torch.utils._pytree import tree_flatten

from autoprec._files import write_atomically
from autoprec._models import FROZEN_RECORD
from autoprec.drift import Fp32Runs
from autoprec.errors import read_stored
from autoprec.model_copies import NUDGE
from autoprec.outside_state import code_names
from autoprec.search import SQLITE_PREFIX, STUDY_OF_ANOTHER_VERSION, sqlite_file, study_writer
from autoprec.trial_records import OutputSummary, StateDigest, TrialRecord, TrialResult
from autoprec.weight_dtypes import as_real

SAMPLED_ELEMENTS = 4096
"""Elements per tensor read into a digest (evenly strided): every tensor's name, shape and
dtype count in full, its values by this sample, so a digest of a large model stays cheap."""


def tensor_digest(tree: Any) -> str:
    """sha256 (16 hex digits) of every tensor in ``tree`` (or of a module's state dict and its
    non-persistent buffers: two models differing only in RoPE's ``inv_freq``, which is not
    saved, read the same and one resumed the other's study)."""
    if isinstance(tree, torch.nn.Module):
        tree = sorted(_module_tensors(tree).items())
    digest = hashlib.sha256()
    leaves, spec = tree_flatten(tree)
    digest.update(repr(spec).encode())
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):  # a batch's set of tags, an object of its own
            digest.update(_stable_repr(leaf).encode())  # (a plain repr held its address)
            continue
        digest.update(f"{tuple(leaf.shape)}{leaf.dtype}".encode())
        flat = as_real(leaf.detach()).reshape(-1)  # a complex tensor: both parts
        if flat.numel() and not leaf.is_meta:
            step = max(1, flat.numel() // SAMPLED_ELEMENTS)
            sample = flat[::step].float().cpu()
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def _module_tensors(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s state dict, with every buffer it does not save beside it."""
    tensors: dict[str, Any] = dict(module.state_dict(keep_vars=False))
    for name, buffer in module.named_buffers(remove_duplicate=False):
        tensors.setdefault(name, buffer.detach())
    return tensors


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


_DEFAULT_REPR = re.compile(r"^<[\w.]+ object>$")
"""``object.__repr__`` once the address is left out: nothing of the object's data in it."""
STATE_DEPTH = 3
"""How deep a default-``repr`` object's public attributes are followed (a DataLoader, its
sampler, their dataset): beyond it, its type alone."""


def _stable_repr(value: Any, depth: int = 0, seen: frozenset[int] = frozenset()) -> str:
    """``repr(value)`` the same in every process: tensors (and modules) by digest, memory
    addresses (``<object at 0x7f...>``) left out, sets sorted (the order of a set of strings
    follows the process's hash seed: the same run was refused as another one). An object whose
    ``repr`` says nothing of its data (a DataLoader, a Dataset: ``<... object at 0x...>``) by
    its public attributes, to ``STATE_DEPTH`` levels: two validation loaders over other data
    read the same and a resumed run reused the other's verdicts."""

    def inner(item: Any) -> str:
        return _stable_repr(item, depth + 1, seen | {id(value)})

    if isinstance(value, torch.Tensor | torch.nn.Module):
        shown = repr(value) if isinstance(value, torch.nn.Module) else type(value).__name__
        return f"{shown}:{tensor_digest(value)}"
    if isinstance(value, set | frozenset):
        return f"{type(value).__name__}({sorted(inner(v) for v in value)})"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__}[{', '.join(inner(v) for v in value)}]"
    if isinstance(value, dict):
        items = sorted(f"{inner(k)}: {inner(v)}" for k, v in value.items())
        return f"{{{', '.join(items)}}}"
    shown = _ADDRESS.sub("", repr(value))
    state = getattr(value, "__dict__", None)
    if _DEFAULT_REPR.match(shown) and isinstance(state, dict) and id(value) not in seen:
        if depth >= STATE_DEPTH:
            return shown
        return f"{shown[:-1]} {', '.join(f'{k}={inner(v)}' for k, v in _public(state))}>"
    return shown


def _code_repr(code: Any) -> str:
    """A code object by what it computes: its bytecode and constants, nested functions' code
    included, without its file, line numbers or address (moving a function in its file
    changes nothing)."""
    consts = [
        _code_repr(const) if hasattr(const, "co_code") else _stable_repr(const)
        for const in code.co_consts
    ]
    return f"{code.co_code.hex()}({', '.join(consts)}){code.co_names}"


def _empty_cell(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty closure cell raises
    except ValueError:
        return True
    return False


def callable_digest(function: Any) -> str | None:
    """sha256 (16 hex digits) of what a ``loss_fn`` / ``train_step`` / ``eval_fn`` computes
    with, beyond its name: a partial's arguments, a function's code, defaults and closure
    values, a callable object's (an ``nn.HuberLoss``'s) attributes and tensors. Two losses of
    one name but other settings (``HuberLoss(delta=1e-4)`` and ``(delta=100)``) differ."""
    if function is None:
        return None
    parts = [type(function).__qualname__]
    target = function
    if isinstance(function, functools.partial):
        parts += [_stable_repr(a) for a in function.args]
        parts += [f"{k}={_stable_repr(v)}" for k, v in sorted(function.keywords.items())]
        target = function.func
    if inspect.ismethod(target):  # a bound method computes with its object's attributes
        parts += _attributes(target.__self__)
        target = target.__func__
    code = getattr(target, "__code__", None)
    if code is not None:
        parts += [getattr(target, "__qualname__", ""), _code_repr(code)]
        parts += [_stable_repr(d) for d in getattr(target, "__defaults__", None) or ()]
        keyword_defaults = getattr(target, "__kwdefaults__", None) or {}
        parts += [f"{k}={_stable_repr(v)}" for k, v in sorted(keyword_defaults.items())]
        cells = getattr(target, "__closure__", None) or ()
        parts += [_stable_repr(c.cell_contents) for c in cells if not _empty_cell(c)]
        parts += _data_globals(code, getattr(target, "__globals__", {}))
    else:
        parts += _attributes(target)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _data_globals(code: Any, namespace: dict[str, Any]) -> list[str]:
    """The module-level data a function reads by name (a validation loader built at import,
    a table of weights): its code says only the name. Modules, classes, functions and other
    callables are left to their names, as their code is not followed."""
    names = code_names(code)
    return [
        f"{name}={_stable_repr(namespace[name])}"
        for name in sorted(names)
        if name in namespace
        and not inspect.ismodule(namespace[name])
        and not callable(namespace[name])  # classes and functions: their names suffice
    ]


def _attributes(target: Any) -> list[str]:
    """A callable object's (an ``nn.HuberLoss``'s) settings and tensors, as text."""
    parts = [_stable_repr(target)] if isinstance(target, torch.nn.Module) else []
    attributes = getattr(target, "__dict__", {})
    return parts + [f"{k}={_stable_repr(v)}" for k, v in _public(attributes) if k != "training"]


def _public(state: dict[str, Any]) -> list[tuple[str, Any]]:
    """An object's ``__dict__`` without its private names, sorted by name."""
    return sorted((k, v) for k, v in state.items() if not k.startswith("_"))


class StudyFingerprint(BaseModel):
    """Everything a study's outcomes depend on; two runs may share outcomes only when equal."""

    model_config = FROZEN_RECORD

    model: str
    architecture: str = ""
    """:func:`architecture_digest`: its modules and their settings (a GELU swapped for a
    ReLU, a Dropout added), other attributes and methods' code change no weight."""
    batches: str
    trainable: str = ""
    """Digest of which parameters train (``requires_grad``) and which optimizer group holds
    each: a frozen layer, or tensors moved between groups of equal settings, change neither
    the weights nor the recipe's group settings."""
    recipe: dict[str, Any]
    objective: str
    thresholds: dict[str, Any]
    candidates: tuple[str, ...]
    keep_fp32: tuple[str, ...] = ()
    """Your keep_fp32 patterns (candidates' labels do not show them)."""
    budget_minutes: float
    hardware: str
    seed: int
    eval_fn: str | None
    optimizer_state: str = ""
    """:func:`optimizer_state_digest` of the optimizer passed (a run checked from a
    checkpoint's state), "" without state."""
    functions: dict[str, str | None] = {}
    """:func:`callable_digest` of ``loss_fn``, ``train_step`` and ``eval_fn``: the recipe and
    ``eval_fn`` above name them only."""
    autoprec_version: str

    def differences(self, stored: StudyFingerprint) -> list[str]:
        """Field by field, what this run has that the stored study does not."""
        found = []
        for name in type(self).model_fields:
            ours, theirs = getattr(self, name), getattr(stored, name)
            if ours == theirs:
                continue
            if name in ("model", "batches"):
                found.append(f"{name} (other weights or data)")
            elif name == "architecture":
                found.append("architecture (other modules, module settings or code)")
            elif name == "optimizer_state":
                found.append("optimizer state (other moments or none)")
            elif name == "trainable":
                found.append("trainable parameters or their optimizer groups")
            elif name == "functions":
                keys = sorted(k for k in {*ours, *theirs} if ours.get(k) != theirs.get(k))
                found.append(f"what {', '.join(keys)} computes with")
            elif name in ("recipe", "thresholds"):
                keys = sorted(k for k in {*ours, *theirs} if ours.get(k) != theirs.get(k))
                found.append(f"{name} ({', '.join(keys)})")
            elif name == "candidates":
                added, dropped = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
                change = [f"+{c}" for c in added] + [f"-{c}" for c in dropped]
                found.append(f"candidates ({', '.join(change) or 'order'})")
            elif name == "keep_fp32":
                found.append(f"keep_fp32 ({list(theirs)} -> {list(ours)})")
            elif isinstance(ours, str | int | float) and len(str(ours)) < 40:
                found.append(f"{name} ({theirs} -> {ours})")
            else:
                found.append(name)
        return found

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


def architecture_digest(model: torch.nn.Module) -> str:
    """sha256 (16 hex digits) of what the model computes beyond its tensors: its ``repr``
    (modules and their settings), every module's other public attributes (a ``self.scale =
    50.0`` its forward multiplies by, which no repr shows) and the code of every method its
    classes define (a forward edited from GELU to ``sin``). Both had resumed another model's
    study (found by a hunt)."""
    parts = [repr(model)]
    classes: dict[type, None] = {}
    for name, module in model.named_modules():
        settings = [
            f"{key}={_stable_repr(value)}"
            for key, value in _public(module.__dict__)
            if key != "training" and not isinstance(value, torch.Tensor | torch.nn.Module)
        ]
        parts.append(f"{name}: {', '.join(settings)}")
        classes.setdefault(type(module), None)
    for cls in classes:
        for klass in cls.__mro__:
            if klass in (torch.nn.Module, object):
                break
            for key, value in sorted(vars(klass).items()):
                code = getattr(value, "__code__", None)
                if code is not None:
                    parts.append(f"{klass.__qualname__}.{key}: {_code_repr(code)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def optimizer_state_digest(optimizer: Any) -> str:
    """sha256 (16 hex digits) of an optimizer's state (its moments, not only its step count:
    two checkpoints of one step count resumed each other's study; found by a hunt), or ""
    without state."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.state:
        return ""
    return tensor_digest(optimizer.state_dict()["state"])


def trainable_digest(model: torch.nn.Module, groups: list[list[str]]) -> str:
    """sha256 (16 hex digits) of the names of ``model``'s trainable parameters and of the
    parameter names in each optimizer group."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return hashlib.sha256(json.dumps([trainable, groups]).encode()).hexdigest()[:16]


def storage_file(storage: str | None) -> Path | None:
    """The file behind a SQLite URL or a journal path; None for servers and in-memory."""
    if storage is None:
        return None
    if storage.startswith(SQLITE_PREFIX):
        file = sqlite_file(storage)
        # sqlite:///:memory: is no file (its references were written to ':memory:.*.pt')
        return None if file is None or str(file) in ("", ":memory:") else file
    if "://" not in storage:
        return Path(storage)
    return None


def references_path(storage: str | None, study_name: str | None) -> Path | None:
    """Where the fp32 reference runs of a study are kept: next to its storage file, the study
    name percent-quoted (a ``/`` in ``exp/1`` would name a folder; ``%`` is quoted too, so two
    names never share a file)."""
    from urllib.parse import quote

    file = storage_file(storage)
    if file is None:
        return None
    name = quote(study_name or "study", safe=" -_.,+=@()[]")
    cache = f"{file.name}.{name}.references.pt"
    if len(cache.encode()) > MAX_CACHE_NAME_BYTES:  # a long study name: its digest instead
        digest = hashlib.sha256(cache.encode()).hexdigest()[:16]
        cache = f"{file.name.encode()[:80].decode(errors='ignore')}.{digest}.references.pt"
    return file.with_name(cache)


ONE_FP32_ULP = 2.0**-23
"""The nudge of the paired run in caches written before they recorded one."""

MAX_CACHE_NAME_BYTES = 240
"""The longest name a references file takes whole: file systems take 255 bytes, and the
temporary it is written through adds a dot, 8 characters and its suffix. A 126-character study
name (the ``--out`` stem) made a 270-byte name, and the run failed after measuring its fp32
runs with "File name too long", then again at every resume (found by a hunt)."""


def _pack(result: TrialResult) -> dict[str, Any]:
    return {
        "record": result.record.model_dump_json(),
        "leg_weights": result.leg_weights,
        "sample_indices": result.sample_indices,
        "parameter_groups": result.parameter_groups,
        "outside_state": [
            {name: list(digest) for name, digest in digests.items()}
            for digests in result.outside_state
        ],
        "heldout_outputs": [
            None
            if output is None
            else {"shape": list(output.shape), "values": output.values, "top1": output.top1}
            for output in result.heldout_outputs
        ],
    }


def _unpack(data: dict[str, Any]) -> TrialResult:
    return TrialResult(
        record=TrialRecord.model_validate_json(data["record"]),
        leg_weights=list(data["leg_weights"]),
        sample_indices=dict(data["sample_indices"]),
        parameter_groups=dict(data.get("parameter_groups", {})),
        outside_state=[
            {name: StateDigest(*digest) for name, digest in digests.items()}
            for digests in data.get("outside_state", [])
        ],
        heldout_outputs=[
            None
            if output is None
            else OutputSummary(
                shape=tuple(output["shape"]), values=output["values"], top1=output["top1"]
            )
            for output in data["heldout_outputs"]
        ],
    )


def save_references(
    path: Path, fingerprint: StudyFingerprint, references: Fp32Runs, steps: int | None = None
) -> None:
    """Write the fp32 reference and noise runs of ``steps`` steps atomically (a temporary file,
    then a rename)."""
    runs = [references.reference, references.noise]
    runs += [run for run in (references.paired, references.nudged) if run is not None]
    data = {
        "fingerprint": fingerprint.digest(),
        "steps": steps,
        "nudge": NUDGE,
        "runs": [_pack(r) for r in runs],
    }
    # write_atomically removes its temporary on any error or Ctrl-C (one named by the pid
    # stayed behind, one more each interrupted run) and fsyncs before the rename
    write_atomically(path, lambda temporary: torch.save(data, temporary))


def load_references(
    path: Path | None, fingerprint: StudyFingerprint, steps: int | None = None
) -> Fp32Runs | None:
    """The stored fp32 reference and noise runs when they match ``fingerprint`` and ran
    ``steps`` steps, else None. The trial length is planned from timing, which no fingerprint
    holds: a cache left by a deleted study of the same run, measured at another length, was
    read by a new one stopped before it rewrote the cache (294-step trials judged against
    53-step references; found by a hunt)."""
    if path is None or not path.exists():
        return None
    try:
        data = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - an unreadable cache is re-measured, never trusted
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != fingerprint.digest():
        return None
    if data.get("steps") != steps or data.get("nudge", ONE_FP32_ULP) != NUDGE:
        return None  # a paired run nudged otherwise (one ulp before 2026-11-29) is measured again
    return Fp32Runs(*(_unpack(run) for run in data["runs"]))


def check_study(study: Any, fingerprint: StudyFingerprint, where: str) -> bool:
    """Record ``fingerprint`` in a study that holds no outcomes (a new one, or one left by a run
    that stopped before its first trial: a failed fp32 reference, Ctrl-C); refuse a study that
    holds another run's outcomes.

    Args:
        where: how to name the study in the message (its name and storage).

    Returns:
        True when the fingerprint was recorded now: what the study holds besides it (trial
        length, stored references) is not this run's.
    """
    raw = study.user_attrs.get("fingerprint")
    has_trials = bool(study.get_trials(deepcopy=False))
    if raw is None and has_trials:
        raise ValueError(
            f"The study {where} holds trials without a fingerprint (a study of your own, or "
            "one an older autoprec made): they cannot be shown to match this run. Use "
            "another study name (--study NAME / study_name=) or delete the storage."
        )
    differences = None if raw is None else fingerprint.differences(stored_fingerprint(raw, where))
    if differences and has_trials:
        raise ValueError(
            f"The study {where} holds outcomes of another run ({'; '.join(differences)} "
            "differ): they would be reused for this one. Use another study name "
            "(--study NAME / study_name=) to keep both in the same storage, or delete it."
        )
    if differences == []:
        return False  # the same run resumes
    study.set_user_attr("fingerprint", fingerprint.model_dump(mode="json"))
    return True


def stored_fingerprint(raw: Any, where: str) -> StudyFingerprint:
    """The fingerprint a study holds, read in one line's refusal when another autoprec wrote
    it with other fields."""
    return read_stored(
        StudyFingerprint,
        raw,
        f"The fingerprint of the study {where}",
        writer=study_writer(raw),
        advice=STUDY_OF_ANOTHER_VERSION,
    )


def confirm_study(study: Any, fingerprint: StudyFingerprint, where: str) -> None:
    """Refuse to go on when the study no longer records ``fingerprint``: another run took it
    over while this one measured its fp32 reference (a study without outcomes is taken over),
    and the outcomes it holds now would be adopted as this run's."""
    raw = study.user_attrs.get("fingerprint")
    stored = None if raw is None else stored_fingerprint(raw, where)
    if stored is None or stored == fingerprint:
        return
    differences = fingerprint.differences(stored)
    raise ValueError(
        f"Another run took over the study {where} while this one measured its fp32 reference "
        f"(its {'; '.join(differences) or 'fingerprint'} differ): the outcomes it holds are "
        "not this run's. Run again with another study name (--study NAME / study_name=)."
    )
