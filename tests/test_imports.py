from __future__ import annotations

import importlib.util
import types
import warnings
from pathlib import Path

import pytest

from autoprec import _imports
from autoprec._imports import BACKENDS, backend_status, install_hint, is_installed, require
from autoprec.errors import MissingBackendError


def test_every_backend_names_an_extra_declared_in_pyproject() -> None:
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    pyproject = tomllib.loads(Path(__file__).parents[1].joinpath("pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for backend in BACKENDS.values():
        assert backend.extra in extras, backend.name


def test_install_hint() -> None:
    assert install_hint("bitsandbytes") == "pip install 'autoprec[bnb]'"
    with pytest.raises(ValueError, match="Unknown backend 'apex'"):
        install_hint("apex")


def test_absent_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchastic" else real_find_spec(name, *a),
    )
    assert not is_installed("torchastic")
    status = backend_status("torchastic", try_import=True)
    assert not status.installed and status.version is None and not status.usable
    with pytest.raises(MissingBackendError, match=r"pip install 'autoprec\[lowbit\]'"):
        require("torchastic")


def test_backend_that_fails_to_import_becomes_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformer Engine without CUDA raises RuntimeError/OSError on import, not ImportError."""
    monkeypatch.setattr(_imports, "is_installed", lambda name: True)

    def failing_import(name: str) -> types.ModuleType:
        raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(_imports.importlib, "import_module", failing_import)
    with pytest.raises(MissingBackendError) as caught:
        require("transformer_engine")
    message = str(caught.value)
    assert "installed but failed to import (OSError: libcudnn.so.9" in message
    assert "pip install 'autoprec[te]'" in message
    status = backend_status("transformer_engine", try_import=True)
    assert status.installed and not status.usable and "OSError" in (status.import_error or "")


def test_installed_backends_report_a_version() -> None:
    installed = [name for name in BACKENDS if is_installed(name)]
    for name in installed:
        assert backend_status(name).version not in (None, "")


def test_backend_import_chatter_goes_to_autoprecs_debug_log() -> None:
    """torchao and bitsandbytes log "Failed to load ..." when imported without their GPU
    kernels; through require() that is an autoprec debug record, not a line on stderr."""
    import subprocess
    import sys

    from autoprec._imports import is_installed

    if not (is_installed("torchao") and is_installed("bitsandbytes")):
        pytest.skip("needs torchao and bitsandbytes")
    code = (
        "import logging, sys\n"
        "debug = sys.argv[1] == 'debug'\n"
        "if debug:\n"
        "    logging.basicConfig(level=logging.DEBUG, format='%(name)s: %(message)s')\n"
        "from autoprec._imports import require\n"
        "require('torchao').float8\n"
        "require('bitsandbytes')\n"
    )
    quiet = subprocess.run(
        [sys.executable, "-c", code, "quiet"], capture_output=True, text=True, timeout=120
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "Failed to load" not in quiet.stderr and "Detected no triton" not in quiet.stderr
    loud = subprocess.run(
        [sys.executable, "-c", code, "debug"], capture_output=True, text=True, timeout=120
    )
    raw = subprocess.run(
        [sys.executable, "-c", "import torchao, bitsandbytes"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "Failed to load" in raw.stderr:  # the chatter exists here (no CUDA kernels)
        assert "autoprec._imports: " in loud.stderr and "while importing: " in loud.stderr


def test_a_backends_source_warnings_do_not_fail_its_import_under_warnings_as_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Seen on the first GPU run: torchao's source holds an invalid escape sequence, compiled at
    import; under -W error that warning became a SyntaxError and FP8 was refused as "failed to
    import". A backend's own source warnings are ignored while autoprec imports it."""
    package = tmp_path / "escapey_backend"
    package.mkdir()
    (package / "__init__.py").write_text('PATTERN = "a\\.b"\n')  # an invalid escape sequence
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_imports, "is_installed", lambda name: True)
    monkeypatch.setattr(_imports, "_backend", lambda name: BACKENDS["torchao"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = require("escapey_backend")
    assert module.PATTERN == "a\\.b"
