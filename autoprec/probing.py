"""ProbeReport: hardware + backends + model scan + a verdict for every mode, with reasons."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel
from torch import nn

from autoprec._imports import BACKENDS, BackendStatus, backend_status
from autoprec._models import FROZEN_RECORD
from autoprec._version import __version__
from autoprec.eligibility import (
    Eligibility,
    Situation,
    mode_eligibility,
    optimizer_8bit_eligibility,
)
from autoprec.errors import check_flag
from autoprec.exclusive import one_run_at_a_time
from autoprec.hardware import HardwareInfo, detect_hardware
from autoprec.layers import LayerMix, scan_model
from autoprec.model_copies import inside_compile_wrapper
from autoprec.specs import MODE_DESCRIPTIONS, MODE_NAMES, ModeName


class ModeVerdict(BaseModel):
    """Whether one mode (or knob) can run here, is worth a trial, and why."""

    model_config = FROZEN_RECORD

    name: str
    description: str
    eligible: bool
    worth_trying: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...]


class ProbeReport(BaseModel):
    """What ``autoprec probe`` found: the first stage of the pipeline."""

    model_config = FROZEN_RECORD

    autoprec_version: str
    created_at: datetime
    device: str
    """The device verdicts are for: ``cpu`` or ``cuda:N``."""
    hardware: HardwareInfo
    backends: tuple[BackendStatus, ...]
    layers: LayerMix | None
    modes: tuple[ModeVerdict, ...]
    optimizer_8bit: ModeVerdict
    """The ``optimizer_bits=8`` knob (bitsandbytes), which composes with any mode."""
    seconds: float
    """How long the probe took."""

    def verdict(self, mode: ModeName | str) -> ModeVerdict:
        """The verdict on ``mode`` (a canonical name, as ``eligible_modes`` gives them).

        Raises:
            ValueError: ``mode`` is not a canonical mode name.
        """
        for verdict in self.modes:
            if verdict.name == mode:
                return verdict
        raise ValueError(f"Unknown mode {mode!r}; modes: {', '.join(MODE_NAMES)}.")

    @property
    def eligible_modes(self) -> tuple[str, ...]:
        return tuple(verdict.name for verdict in self.modes if verdict.eligible)


def probe(
    model: nn.Module | None = None,
    example_input: Any = None,
    *,
    device: str | int | None = None,
    import_backends: bool = False,
    hardware: HardwareInfo | None = None,
    backends: tuple[BackendStatus, ...] | None = None,
) -> ProbeReport:
    """Inspect this machine (and a model) and say which precision modes are worth a trial.

    Args:
        model: optional model to scan (left unchanged: one training-mode forward without grads,
            eval mode when that fails).
        example_input: a tensor, tuple of positional args or dict of kwargs for that forward.
        device: ``"cpu"``, ``"cuda:N"`` or a GPU index the verdicts are for; default the
            first GPU torch can use, else the CPU.
        import_backends: also import each installed backend to check it works (seconds).
        hardware: facts to use instead of detecting them (tests, reports for another machine).
        backends: backend statuses to use instead of detecting them.

    Example::

        from examples.tiny_gpt import make_model
        report = autoprec.probe(*make_model())
        print(report.eligible_modes)
    """
    if model is not None and not isinstance(model, nn.Module):  # said in probe's own words
        raise TypeError(f"model must be a torch.nn.Module (or None), not {type(model).__name__}.")
    if hardware is not None and not isinstance(hardware, HardwareInfo):
        raise TypeError(
            f"hardware must be a HardwareInfo (autoprec.hardware.detect_hardware()) or None, "
            f"not {type(hardware).__name__}."
        )
    check_flag(import_backends, "import_backends")
    start = time.perf_counter()
    with one_run_at_a_time("probe()"):  # warning filters and random streams: process-wide
        hardware = hardware if hardware is not None else detect_hardware()
        chosen = hardware.resolve_device(device)
        if backends is None:
            backends = tuple(backend_status(name, try_import=import_backends) for name in BACKENDS)
        # inside torch.compile's wrapper: scanned by the names tune and keep_fp32 use
        inner = inside_compile_wrapper(model)
        model = model if inner is None else inner
        layers = scan_model(model, example_input) if model is not None else None
    situation = Situation(hardware=hardware, device=chosen, layers=layers, backends=backends)
    modes = tuple(
        _verdict(mode, MODE_DESCRIPTIONS[mode], mode_eligibility(mode, situation))
        for mode in MODE_NAMES
    )
    optimizer_8bit = _verdict(
        "optimizer_bits=8",
        "8-bit optimizer states (bitsandbytes), composes with any mode",
        optimizer_8bit_eligibility(situation),
    )
    return ProbeReport(
        autoprec_version=__version__,
        created_at=datetime.now(timezone.utc),
        device=chosen,
        hardware=hardware,
        backends=backends,
        layers=layers,
        modes=modes,
        optimizer_8bit=optimizer_8bit,
        seconds=round(time.perf_counter() - start, 3),
    )


def _verdict(name: str, description: str, eligibility: Eligibility) -> ModeVerdict:
    return ModeVerdict(
        name=name,
        description=description,
        eligible=eligibility.eligible,
        worth_trying=eligibility.worth_trying,
        reasons=eligibility.reasons,
        notes=eligibility.notes,
    )
