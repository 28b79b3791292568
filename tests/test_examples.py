"""The examples run as the README shows them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def test_train_with_profile_runs_and_learns() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.train_with_profile", "--steps", "12"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step")]
    first, last = float(lines[0].split()[-1]), float(lines[-1].split()[-1])
    assert last < first
    assert "PrecisionPlan(amp_bf16, optimizer=AdamW)" in done.stdout


def test_readme_training_snippet_runs(monkeypatch) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Load a profile into your training loop", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert repr(namespace["plan"]) == "PrecisionPlan(amp_bf16, optimizer=AdamW)"
