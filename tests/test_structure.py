"""Keep the shape honest: the public API and the one-way import layers of DESIGN.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import autoprec

PACKAGE = Path(autoprec.__file__).parent

# The one-way flow, in order. A module may import only modules listed before it.
# Layers: base | facts | runtime (apply path) | pipeline | artifact | drivers.
# fmt: off
ORDER = [
    "_version", "_models", "_files", "_wording", "_warnings", "errors", "_imports",  # base
    "random_streams", "collector", "interrupts", "exclusive",
    "specs",
    "cpu_info", "hardware", "layer_kinds", "buffer_slots", "own_autocast", "layer_flops",  # facts
    "weight_dtypes", "running_state",
    "layer_mix", "layer_keep", "layer_findings", "layers",
    "eligibility",
    "flat_chunks",  # runtime
    "eight_bit_states", "stochastic_optim", "kahan_foreach", "kahan_adamw", "optim",
    "torch_state_form",
    "state_translation",
    "modes", "hook_copies", "model_copies", "outside_state", "plan", "testing",
    "probing", "candidates", "batching", "recipe", "recipe_match",  # pipeline
    "trial_records", "trial_failures", "trial_measures", "trial_loop", "trial", "drift_thresholds",
    "drift_movement", "drift_outside_state", "drift_state_rule", "drift_fp16", "drift",
    "drift_blind_spots",
    "outcomes", "search_events", "search", "retiming", "choice", "fingerprint",
    "integrations", "profile",                                       # artifact
    "factories", "progress", "run_inputs", "run_setup", "tune_result", "tuning", "screening",
    "trainers",
    "report", "display", "display_probe", "cli_parser", "cli",
]  # drivers
# fmt: on
EXEMPT = {"__init__", "__main__"}
TRAINER_DRIVERS = {"integrations/hf.py", "integrations/lightning_trainer.py"}
"""Modules of the integrations package that drive tune() inside a trainer: a driver layer
("trainers"), not the exports the rest of the package holds."""


def _unit(path: Path) -> str:
    """The ORDER entry a file belongs to: its module, or its top-level subpackage."""
    relative = path.relative_to(PACKAGE)
    if relative.as_posix() in TRAINER_DRIVERS:
        return "trainers"
    return relative.parts[0].removesuffix(".py")


def _imported_units(path: Path) -> set[str]:
    units: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import inside a subpackage: same unit
                continue
            module = node.module or ""
            names = (
                [module]
                if module != "autoprec"
                else [f"autoprec.{alias.name}" for alias in node.names]
            )
        for name in names:
            parts = name.split(".")
            if parts[0] == "autoprec" and len(parts) > 1:
                units.add(parts[1])
    return units


def test_public_api_is_complete_sorted_and_public() -> None:
    exported = autoprec.__all__
    assert exported == sorted(exported)
    assert len(set(exported)) == len(exported)
    assert all(not name.startswith("_") or name == "__version__" for name in exported)
    public = {
        name
        for name, value in vars(autoprec).items()
        if not name.startswith("_") and not isinstance(value, type(autoprec))
    }
    assert public == set(exported) - {"__version__"}
    for name in exported:
        assert hasattr(autoprec, name)


def test_every_module_has_a_place_in_the_flow() -> None:
    units = {_unit(path) for path in PACKAGE.rglob("*.py")} - EXEMPT
    assert units <= set(ORDER), f"place these in ORDER: {sorted(units - set(ORDER))}"


def test_no_module_imports_a_later_stage() -> None:
    violations = []
    for path in PACKAGE.rglob("*.py"):
        unit = _unit(path)
        if unit in EXEMPT:
            continue
        for imported in _imported_units(path):
            if imported in EXEMPT or imported == unit:
                continue
            if ORDER.index(imported) > ORDER.index(unit):
                violations.append(f"{path.relative_to(PACKAGE)} imports autoprec.{imported}")
    assert not violations, violations


def test_layer_check_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from autoprec.cli import main\n    from autoprec import tuning\n")
    assert _imported_units(bad) == {"cli", "tuning"}


def test_library_never_prints() -> None:
    for path in PACKAGE.rglob("*.py"):
        if _unit(path) in {"cli", "display"}:
            continue
        tree = ast.parse(path.read_text())
        calls = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
        ]
        assert not calls, f"{path.name} prints; log instead"


def test_the_public_functions_type_hints_resolve() -> None:
    """``typing.get_type_hints`` raised NameError on tune_trainer, tune_module and the HF
    apply_profile (their return types imported only under TYPE_CHECKING), for tools that read
    hints at run time (pydantic, typer, IDE stubs)."""
    import importlib
    import typing

    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    modules = [autoprec] + [
        importlib.import_module(f"autoprec.integrations.{name}")
        for name in ("hf", "hf_trainer", "lightning", "lightning_trainer", "accelerate", "fsdp2")
    ]
    for module in modules:
        for name in getattr(module, "__all__", None) or dir(module):
            value = getattr(module, name)
            if name.startswith("_") or not callable(value) or isinstance(value, type(autoprec)):
                continue
            if getattr(value, "__module__", "").startswith("autoprec"):
                typing.get_type_hints(value)  # raises on a name it cannot resolve
