"""The one place that knows autoprec's optional backends and the extras that install them.

Detection never imports a backend: ``find_spec`` on a top-level package and the installed
distribution's metadata are enough, so ``autoprec probe`` stays quick and quiet. Only
:func:`require` imports, and it turns any failure (a CUDA-less Transformer Engine raises
``RuntimeError`` or ``OSError`` on import, not ``ImportError``) into a
:class:`~autoprec.errors.MissingBackendError` that names the pip extra.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.errors import MissingBackendError

logger = logging.getLogger(__name__)

IMPORT_CHATTER: tuple[tuple[str, str], ...] = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    ("torchao", "Failed to load "),
    ("torchao.kernel.intmm", "Warning: Detected no triton"),
    ("torch.utils._pytree", "<enum "),
)
"""(logger, message start) of what the backends log when imported on a machine without their GPU
kernels (bitsandbytes' CPU gemm kernels, torchao's CUDA extensions, its triton check, torch's enum
deprecation): true, harmless where they are not used, and not autoprec's. :func:`require` turns
them into autoprec debug records."""


class _Demote(logging.Filter):
    """Drops one kind of chatter from its logger and re-logs it as an autoprec debug record."""

    def __init__(self, start: str, *, lasting: bool = False) -> None:
        super().__init__()
        self.start = start
        self.lasting = lasting

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.start):
            return True
        logger.debug("%s while importing: %s", record.name, message)
        return False


def demote_import_chatter(demote: bool = True) -> None:
    """Demote the backends' import chatter for the whole process (``demote=False``: leave it
    as the backends log it). The CLI's setting: demoted unless ``--debug``."""
    for name, start in IMPORT_CHATTER:
        chatter = logging.getLogger(name)
        for old in [f for f in chatter.filters if isinstance(f, _Demote) and f.lasting]:
            chatter.removeFilter(old)
        if demote:
            chatter.addFilter(_Demote(start, lasting=True))


@contextlib.contextmanager
def import_chatter_demoted() -> Iterator[None]:
    """Inside: the backends' known import chatter goes to autoprec's debug log, not stderr, and
    warnings about a backend's own source (an invalid escape sequence: SyntaxWarning from
    Python 3.12, DeprecationWarning before) are ignored, so that a run with warnings as errors
    can still import it (seen on the first GPU run: torchao 0.18's quant_api.py, compiled at
    import under pytest's -W error, failed to import)."""
    installed = [(logging.getLogger(name), _Demote(start)) for name, start in IMPORT_CHATTER]
    for chatter, demote in installed:
        chatter.addFilter(demote)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=SyntaxWarning)
            warnings.filterwarnings("ignore", message="invalid escape sequence")
            yield
    finally:
        for chatter, demote in installed:
            chatter.removeFilter(demote)


@dataclass(frozen=True)
class Backend:
    """An optional package autoprec can use."""

    name: str
    """Import name of the top-level package."""
    distributions: tuple[str, ...]
    """Distribution names that provide it, most common first (for the version)."""
    extra: str
    """The autoprec extra that installs it."""
    purpose: str


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend(
            "transformer_engine",
            ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
            "te",
            "FP8 training with Transformer Engine (fp8_te)",
        ),
        Backend("torchao", ("torchao",), "torchao", "FP8 training with torchao (fp8_torchao)"),
        Backend("bitsandbytes", ("bitsandbytes",), "bnb", "8-bit optimizer states"),
        Backend("torchastic", ("torchastic",), "lowbit", "stochastic rounding (bf16_sr)"),
        Backend("optimi", ("torch-optimi",), "lowbit", "Kahan summation (bf16_kahan)"),
    )
}


def _backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(f"Unknown backend {name!r}; known backends: {known}.") from None


def install_hint(name: str) -> str:
    """The pip command that installs backend ``name``."""
    return f"pip install 'autoprec[{_backend(name).extra}]'"


def is_installed(name: str) -> bool:
    """True when backend ``name`` is installed (without importing it)."""
    _backend(name)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def installed_version(name: str) -> str | None:
    """The installed version of backend ``name`` from package metadata, or None."""
    if not is_installed(name):
        return None
    for distribution in _backend(name).distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def require(name: str) -> ModuleType:
    """Import backend ``name`` or raise MissingBackendError naming the extra to install.

    Any exception during import counts as "not usable" (a broken CUDA build of a backend must
    become a reason, not a crash).
    """
    backend = _backend(name)
    if not is_installed(name):
        raise MissingBackendError(
            f"{backend.name} is not installed; it is needed for {backend.purpose}. "
            f"Install it with: {install_hint(name)}"
        )
    try:
        with import_chatter_demoted():
            return importlib.import_module(name)
    except Exception as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise MissingBackendError(
            f"{backend.name} is installed but failed to import "
            f"({type(error).__name__}: {first_line}); it is needed for {backend.purpose}. "
            f"Reinstall it with: {install_hint(name)}"
        ) from error


class BackendStatus(BaseModel):
    """Whether a backend is installed (and, when checked, importable)."""

    model_config = FROZEN_RECORD

    name: str
    installed: bool
    version: str | None
    extra: str
    purpose: str
    import_error: str | None = None
    """Set when an import was attempted and failed."""

    @property
    def usable(self) -> bool:
        return self.installed and self.import_error is None


def backend_status(name: str, *, try_import: bool = False) -> BackendStatus:
    """Status of backend ``name``; imports it only when ``try_import`` (slow: seconds)."""
    backend = _backend(name)
    installed = is_installed(name)
    import_error = None
    if installed and try_import:
        try:
            require(name)
        except MissingBackendError as error:
            import_error = str(error)
    return BackendStatus(
        name=name,
        installed=installed,
        version=installed_version(name),
        extra=backend.extra,
        purpose=backend.purpose,
        import_error=import_error,
    )
