"""autoprec: pick the fastest training precision that does not hurt quality, and prove it.

Public API only. Optuna and rich are never imported here.
"""

from autoprec._version import __version__
from autoprec.errors import (
    AutoprecError,
    MissingBackendError,
    ModelLoadError,
    ProfileError,
    UnsupportedModeError,
)
from autoprec.probing import ModeVerdict, ProbeReport, probe

__all__ = [
    "AutoprecError",
    "MissingBackendError",
    "ModeVerdict",
    "ModelLoadError",
    "ProbeReport",
    "ProfileError",
    "UnsupportedModeError",
    "__version__",
    "probe",
]
