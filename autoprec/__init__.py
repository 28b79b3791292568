"""autoprec: pick the fastest training precision that does not hurt quality, and prove it.

Public API only. Optuna and rich are never imported here.
"""

from autoprec._version import __version__
from autoprec.errors import (
    AutoprecError,
    BatchError,
    BudgetTooSmallError,
    ExportError,
    HardwareMismatchWarning,
    LossError,
    MissingBackendError,
    ModelLoadError,
    ModelMismatchWarning,
    OptimizerRebuiltWarning,
    OutsideOptimizerWarning,
    PrecisionSwitchWarning,
    ProfileError,
    RecipeMismatchWarning,
    UnprovenProfileWarning,
    UnsupportedModeError,
)
from autoprec.plan import PrecisionPlan, prepare
from autoprec.probing import ModeVerdict, ProbeReport, probe
from autoprec.profile import Profile, load_profile, profile_for
from autoprec.screening import QualityReport, check
from autoprec.specs import ModeSpec
from autoprec.torch_state_form import torch_optimizer_state
from autoprec.tune_result import TuneResult
from autoprec.tuning import tune

__all__ = [
    "AutoprecError",
    "BatchError",
    "BudgetTooSmallError",
    "ExportError",
    "HardwareMismatchWarning",
    "LossError",
    "MissingBackendError",
    "ModeSpec",
    "ModeVerdict",
    "ModelLoadError",
    "ModelMismatchWarning",
    "OptimizerRebuiltWarning",
    "OutsideOptimizerWarning",
    "PrecisionPlan",
    "PrecisionSwitchWarning",
    "ProbeReport",
    "Profile",
    "ProfileError",
    "QualityReport",
    "RecipeMismatchWarning",
    "TuneResult",
    "UnprovenProfileWarning",
    "UnsupportedModeError",
    "__version__",
    "check",
    "load_profile",
    "prepare",
    "probe",
    "profile_for",
    "torch_optimizer_state",
    "tune",
]
