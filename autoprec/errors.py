"""The exceptions autoprec raises on purpose.

Bad arguments raise the built-in ``ValueError`` / ``TypeError``; refusals that belong to
autoprec's domain raise a subclass of :class:`AutoprecError`. Every message says what was
found and what to do about it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from autoprec._version import __version__


class AutoprecError(Exception):
    """Base class of every error autoprec raises on purpose."""


class MissingBackendError(AutoprecError):
    """An optional backend (torchao, bitsandbytes, ...) is absent or fails to import."""


class UnsupportedModeError(AutoprecError):
    """A precision mode cannot run here; the message lists every reason."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.reasons = reasons


class ModelLoadError(AutoprecError):
    """A ``module.path:attr`` model factory could not be imported, called or understood."""


class LossError(AutoprecError, ValueError):
    """No loss to train on: the model's output, ``loss_fn`` or ``train_step`` gave something
    that is not one number (a tensor of shape (8, 4), a tuple, an int)."""


class BatchError(AutoprecError, ValueError):
    """A batch autoprec cannot read (no tensor with a batch dimension in it)."""


class BudgetTooSmallError(AutoprecError, ValueError):
    """The time budget cannot hold the runs a tune needs. The message names the budget as
    ``tune()`` takes it; ``naming(flag)`` gives it under the CLI's flag."""

    def __init__(self, minutes: float, detail: str) -> None:
        self.minutes = minutes
        self.detail = detail
        super().__init__(f"budget_minutes={minutes} {detail}")

    def __reduce__(self) -> tuple[type, tuple[float, str]]:  # copy, pickle: both arguments
        return type(self), (self.minutes, self.detail)

    def naming(self, flag: str) -> str:
        return f"{flag} {self.minutes} {self.detail}"


class ProfileError(AutoprecError):
    """A profile file is unreadable, invalid, or from a newer schema version."""


class ExportError(AutoprecError):
    """A training framework cannot express a profile's mode or knobs exactly."""


class HardwareMismatchWarning(UserWarning):
    """A profile is loaded on hardware other than the one it was proven on."""


class UnprovenProfileWarning(UserWarning):
    """A profile that carries no evidence (not measured by ``autoprec tune``) is loaded."""


class OptimizerRebuiltWarning(UserWarning):
    """A mode rebuilt the optimizer and no LR scheduler was handed over to rebind."""


class ModelMismatchWarning(UserWarning):
    """A profile is applied to a model other than the one it was proven for."""


class OutsideOptimizerWarning(UserWarning):
    """Trainable weights plan.optimizer does not step: a pure-bf16 mode cast them and nothing
    of the mode rounds their updates, or amp_fp16 scales their gradients and nothing unscales
    them."""


class PrecisionSwitchWarning(UserWarning):
    """A plan resumes a checkpoint a plan of another mode wrote: the run switches precision."""


class RecipeMismatchWarning(UserWarning):
    """A profile is applied under another optimizer, hyper-parameters, accumulation or clipping
    than the recipe its evidence was measured under."""


def field_errors(error: ValidationError) -> str:
    """A pydantic validation error in one line: each field, what is wrong, what was given
    (the first three; the rest counted)."""
    parts = []
    for item in error.errors()[:3]:
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        got = f" (got {item['input']!r})" if item["type"] != "missing" else ""
        parts.append(f"{location}: {item['msg']}{got}")
    more = len(error.errors()) - 3
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


Record = TypeVar("Record", bound=BaseModel)


def read_stored(model: type[Record], raw: Any, what: str, *, writer: object, advice: str) -> Record:
    """``model`` read from ``raw`` (a dict, or JSON text) that autoprec stored earlier; when
    it does not fit this version's records, one line naming ``what`` it is, the autoprec that
    wrote it (``writer``) and what to do (``advice``), not pydantic's multi-line report (the
    project adds fields over time, and every record forbids unknown ones)."""
    try:
        if isinstance(raw, str | bytes):
            return model.model_validate_json(raw)
        return model.model_validate(raw)
    except ValidationError as error:
        wrote = (
            f"written by autoprec {writer}, this is {__version__}"
            if writer and writer != __version__
            else f"read by autoprec {__version__}"
        )
        raise ValueError(
            f"{what} does not fit this autoprec's records ({wrote}): {field_errors(error)}. "
            f"{advice}"
        ) from None


def check_flag(value: Any, name: str) -> None:
    """Refuse a flag that is not ``True`` or ``False``: ``strict="no"`` is truthy, and was
    taken as ``strict=True`` (found by a hunt)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r} ({type(value).__name__}).")
