"""Load user objects named on the command line: ``module.path:attr`` or ``file.py:attr``.

Every failure becomes a one-line :class:`~autoprec.errors.ModelLoadError` naming what was
wrong, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autoprec.errors import ModelLoadError
from autoprec.model_copies import inside_compile_wrapper
from autoprec.optim import source_kind
from autoprec.recipe import USER_MODULE_PREFIX
from autoprec.torch_state_form import state_writer, torch_optimizer_state

_FORM = "'module.path:factory' or 'path/to/file.py:factory'"

_LOADED_VERSIONS: dict[str, tuple[int, int]] = {}
"""(mtime in ns, size) of each ``file.py`` module as it was run: an edited file runs again."""


def _split(reference: str, option: str) -> tuple[str, str]:
    module_part, colon, attribute = reference.rpartition(":")
    if not colon or not module_part or not attribute or not attribute.isidentifier():
        raise ModelLoadError(f"{option} must look like {_FORM}, but got {reference!r}.")
    return module_part, attribute


def user_code_failed(option: str, doing: str, error: BaseException) -> ModelLoadError:
    """One line for what the user's code raised while autoprec ran it. ``sys.exit()`` (a
    script's argparse at import) is named as such: it escaped every handler, and argparse's
    usage line read as autoprec's own refusal of its arguments."""
    if isinstance(error, SystemExit) and doing.startswith("importing"):
        return ModelLoadError(
            f"{option}: {doing} called sys.exit({error.code!r}) (a script parsing its command "
            "line at import?). Put the script's own command-line handling under "
            '`if __name__ == "__main__":` so that importing it only defines things.'
        )
    if isinstance(error, SystemExit):
        return ModelLoadError(
            f"{option}: {doing} called sys.exit({error.code!r}); return the object instead."
        )
    return ModelLoadError(f"{option}: {doing} raised {type(error).__name__}: {error}")


def _import_file(path_text: str, option: str) -> ModuleType:
    path = Path(path_text)
    if path.is_dir():  # "does not exist" of a folder that does misled (found by a hunt)
        raise ModelLoadError(
            f"{option}: {path_text!r} is a folder, not a Python file; name the file "
            f"(e.g. {str(path / 'train.py')!r}:model) or a module (package.module:model)."
        )
    if not path.is_file():
        raise ModelLoadError(f"{option}: file {path_text!r} does not exist.")
    resolved = path.resolve()
    stat = resolved.stat()  # the file as it is now: an edited file is run again
    version = (stat.st_mtime_ns, stat.st_size)
    # the module's name follows the file, not its version: it goes into the study's fingerprint
    # (``qualified_name``), where a touched or re-commented file broke every resume
    path_digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    name = f"{USER_MODULE_PREFIX}{path.stem}_{path_digest}"
    loaded = sys.modules.get(name)
    if loaded is not None and _LOADED_VERSIONS.get(name) == version:
        return loaded  # --model, --data, --loss from one file: one module, run once
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{option}: cannot load {path_text!r} as a Python module.")
    module = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as `python file.py` does: modules next to the file
    sys.modules[name] = module
    _LOADED_VERSIONS[name] = version
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        sys.modules.pop(name, None)
        _LOADED_VERSIONS.pop(name, None)
        raise user_code_failed(option, f"importing {path_text!r}", error) from error
    return module


def _import_module(module_name: str, option: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the user
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and not (module_name + ".").startswith(missing + "."):
            raise ModelLoadError(  # the module is there; something it imports is not
                f"{option}: importing {module_name!r} failed: it imports {missing!r}, which is "
                f"not installed here ({error})."
            ) from error
        raise ModelLoadError(
            f"{option}: cannot import module {module_name!r} ({error}); run from the folder "
            "that contains it, or install it."
        ) from error
    except (Exception, SystemExit) as error:
        raise user_code_failed(option, f"importing {module_name!r}", error) from error


def load_object(reference: str, *, option: str = "--model") -> Any:
    """Import ``module.path:attr`` (or ``file.py:attr``) and return the attribute."""
    module_part, attribute = _split(reference, option)
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        module = _import_file(module_part, option)
    else:
        module = _import_module(module_part, option)
    try:
        return getattr(module, attribute)
    except AttributeError:
        public = sorted(
            name
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        )
        hint = f"; it defines: {', '.join(public)}" if public else ""
        raise ModelLoadError(
            f"{option}: module {module_part!r} has no attribute {attribute!r}{hint}."
        ) from None


def load_model(reference: str, *, option: str = "--model") -> tuple[nn.Module, Any]:
    """Load ``(model, example_input)`` from a factory reference.

    The attribute may be an ``nn.Module`` or a callable taking no arguments that returns an
    ``nn.Module`` or a ``(model, example_input)`` pair.
    """
    target = load_object(reference, option=option)
    if isinstance(target, nn.Module):
        return target, None
    if not callable(target):
        raise ModelLoadError(
            f"{option}: {reference!r} is a {type(target).__name__}, not a model or a factory "
            "function."
        )
    try:
        made = target()
    except (Exception, SystemExit) as error:
        raise user_code_failed(option, f"calling {reference!r}()", error) from error
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple | list) and len(made) == 2 and isinstance(made[0], nn.Module):
        return made[0], made[1]
    raise ModelLoadError(
        f"{option}: {reference!r}() returned {type(made).__name__}; expected an nn.Module or a "
        "(model, example_input) pair."
    )


CHECKPOINT_KEYS = ("model", "state_dict", "model_state_dict")
"""Where common training scripts put the weights inside a checkpoint dict (nanoGPT: "model")."""
COMPILED_PREFIX = "_orig_mod."
"""What a state dict saved from ``torch.compile(model)`` puts before every key."""


def _state_dict_in(loaded: Any, path: Path, option: str) -> dict[str, torch.Tensor]:
    """The weights in a loaded file: a state dict, or one under a common checkpoint key."""

    def weights(value: Any) -> bool:
        return (
            isinstance(value, dict)
            and bool(value)
            and all(isinstance(tensor, torch.Tensor) for tensor in value.values())
        )

    if weights(loaded):
        return loaded
    if isinstance(loaded, dict):
        for key in CHECKPOINT_KEYS:
            if weights(loaded.get(key)):
                return loaded[key]
        found = ", ".join(repr(key) for key in list(loaded)[:8]) or "none"
        raise ModelLoadError(
            f"{option}: {path} holds a dict without a state dict (keys: {found}); expected "
            f"torch.save(model.state_dict()) or a checkpoint with the weights under one of "
            f"{', '.join(repr(key) for key in CHECKPOINT_KEYS)}."
        )
    raise ModelLoadError(
        f"{option}: {path} holds a {type(loaded).__name__}, not a state dict; save the weights "
        "with torch.save(model.state_dict(), path)."
    )


def read_checkpoint(path_text: str, option: str, what: str) -> tuple[Path, Any]:
    """The file at ``path_text`` read with ``weights_only=True`` (no code runs)."""
    path = Path(path_text)
    if path.is_dir():
        raise ModelLoadError(f"{option}: {path_text!r} is a folder; give the checkpoint file.")
    if not path.is_file():
        raise ModelLoadError(f"{option}: no file {path_text!r}.")
    try:
        return path, torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same user error
        unsafe = _UNSAFE_GLOBAL.search(str(error))
        if unsafe is not None:
            raise ModelLoadError(
                f"{option}: {path} holds a Python object beyond tensors and plain containers "
                f"({unsafe.group(1)}); autoprec reads checkpoints with weights_only=True, so "
                f"that no code in them runs. Save the {what} alone (torch.save("
                f"{_SAVE_CALL.get(what, 'the state')}, path)){_OR_LOAD_IT.get(what, '')}."
            ) from None
        cause = _torch_load_cause(error) or "the file ends early"
        raise ModelLoadError(
            f"{option}: {path} is not a torch.save file of {what} "
            f"({type(error).__name__}: {cause})."
        ) from None


_UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
"""What torch's weights-only unpickler names when a file holds an object it will not build."""
_SAVE_CALL = {"weights": "model.state_dict()", "optimizer state": "optimizer.state_dict()"}
_OR_LOAD_IT = {"weights": ", or load the file in your model factory yourself if you trust it"}
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _torch_load_cause(error: BaseException) -> str:
    """The line of a ``torch.load`` error that says what is wrong with the file: after
    "WeightsUnpickler error:" when there is one (its first line is advice to load unsafely),
    else the first line; without terminal colour codes, which torch's messages carry."""
    lines = [line.strip() for line in _ANSI_ESCAPE.sub("", str(error)).splitlines()]
    lines = [line for line in lines if line]
    for index, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            rest = line.split("WeightsUnpickler error:", 1)[1].strip()
            following = lines[index + 1] if index + 1 < len(lines) else ""
            return rest or following
    return lines[0] if lines else ""


OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_states")
"""Where training scripts put the optimizer's state inside a checkpoint dict (nanoGPT:
"optimizer"; Lightning: "optimizer_states", a list with one per optimizer). A Hugging Face
Trainer's ``optimizer.pt`` is the optimizer's state dict itself."""


def _optimizer_state_in(loaded: Any, path: Path, option: str) -> dict[str, Any]:
    """The optimizer state dict in a loaded file: the file itself or one under a common key."""

    def state_dict(value: Any) -> bool:
        return isinstance(value, dict) and "state" in value and "param_groups" in value

    if state_dict(loaded):
        return loaded
    if isinstance(loaded, dict):
        for key in OPTIMIZER_KEYS:
            value = loaded.get(key)
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if state_dict(value):
                return value
    found = ", ".join(repr(key) for key in list(loaded)[:8]) if isinstance(loaded, dict) else ""
    raise ModelLoadError(
        f"{option}: {path} holds no optimizer state (keys: {found or 'none'}); expected "
        "optimizer.state_dict() saved alone or under one of "
        f"{', '.join(repr(key) for key in OPTIMIZER_KEYS)}."
    )


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    path_text: str,
    *,
    option: str = "--optimizer-state",
    read: tuple[Path, Any] | None = None,
) -> None:
    """Load the optimizer state saved at ``path_text`` into ``optimizer`` (built over the model
    the weights were loaded into): trials then start from a copy of it, as the run continues.
    A state a bf16_kahan (torch-optimi) or 8-bit-states (bitsandbytes) run saved is read into
    torch's layout first.
    The file is read with ``weights_only=True`` (or ``read``: the file already read, a
    checkpoint holding weights and optimizer is read once) and never written."""
    path, loaded = read or read_checkpoint(path_text, option, "optimizer state")
    state = _optimizer_state_in(loaded, path, option)
    try:
        if _translatable(optimizer) or state_writer(state) in ("optimi", "bnb"):
            # checks the family's keys (torch's own load does not), reads bf16_kahan/8-bit saves
            state = torch_optimizer_state(state, optimizer)
        _check_state_shapes(state, optimizer)
        optimizer.load_state_dict(state)
    except (TypeError, ValueError, KeyError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise ModelLoadError(
            f"{option}: {path}'s optimizer state does not fit {type(optimizer).__name__} over "
            f"this model ({type(error).__name__}: {first}); pass the --optimizer the run "
            "trained with, and the state saved with these --weights."
        ) from None


def _translatable(optimizer: torch.optim.Optimizer) -> bool:
    try:
        source_kind(optimizer)
    except TypeError:
        return False
    return True


def _check_state_shapes(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Each saved tensor state has its parameter's shape (torch's load checks only counts:
    another model's state with as many parameters loaded and failed at the first step)."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [index for group in state.get("param_groups", []) for index in group["params"]]
    for number, (index, parameter) in enumerate(zip(indices, parameters, strict=False)):
        for key, value in state.get("state", {}).get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != parameter.shape:
                raise ValueError(
                    f"its {key!r} for parameter {number} has shape {tuple(value.shape)}, the "
                    f"parameter {tuple(parameter.shape)}: it was saved for another model"
                )


def load_weights(
    model: nn.Module,
    path_text: str,
    *,
    option: str = "--weights",
    read: tuple[Path, Any] | None = None,
) -> None:
    """Load the state dict saved at ``path_text`` into ``model`` (a model the factory just
    made), every key matched: a late checkpoint of your run to start trials from. The file is
    read with ``weights_only=True`` (no code runs; or ``read``, the file already read) and
    never written."""
    # a factory returning torch.compile(model): its keys carry "_orig_mod.", which the
    # checkpoint's lose below; the model inside takes them (found by a hunt)
    model = inside_compile_wrapper(model) or model
    path, loaded = read or read_checkpoint(path_text, option, "weights")
    state = _state_dict_in(loaded, path, option)
    if all(key.startswith(COMPILED_PREFIX) for key in state):
        state = {key[len(COMPILED_PREFIX) :]: value for key, value in state.items()}
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{option}: {path} does not fit the model: missing {missing[:4] or 'none'}, "
            f"unexpected {unexpected[:4] or 'none'} ({len(missing)} and {len(unexpected)} keys)."
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as error:  # shapes
        first = (str(error).strip().splitlines() or [""])[-1].strip()
        raise ModelLoadError(f"{option}: {path} does not fit the model: {first}") from None
