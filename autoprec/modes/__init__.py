"""Precision modes: one small class per mode; the base class is fp32 training."""

from __future__ import annotations

from autoprec.modes.amp import AmpBf16Mode, AmpFp16Mode
from autoprec.modes.base import PrecisionMode
from autoprec.modes.fp8_te import Fp8TeMode
from autoprec.modes.fp8_torchao import Fp8TorchaoMode
from autoprec.modes.pure_bf16 import Bf16KahanMode, Bf16PureMode, Bf16SrKahanMode, Bf16SrMode
from autoprec.modes.tf32 import Tf32Mode
from autoprec.specs import ModeName, ModeSpec

MODE_CLASSES: dict[ModeName, type[PrecisionMode]] = {
    cls.name: cls
    for cls in (
        PrecisionMode,
        Tf32Mode,
        AmpFp16Mode,
        AmpBf16Mode,
        Bf16PureMode,
        Bf16SrMode,
        Bf16KahanMode,
        Bf16SrKahanMode,
        Fp8TeMode,
        Fp8TorchaoMode,
    )
}


def mode_for(spec: ModeSpec) -> PrecisionMode:
    """The mode object that runs ``spec``."""
    return MODE_CLASSES[spec.mode](spec)


__all__ = ["MODE_CLASSES", "PrecisionMode", "mode_for"]
