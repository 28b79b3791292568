"""How long `autoprec probe` takes, end to end, as a user runs it (new process each time).

Prints the median and worst wall time over several runs per example model, and the time the
probe itself reports (hardware, backends, model scan, verdicts; without interpreter start and
imports). Target: under 3 s end to end on a CPU-only machine.

    python -m benchmarks.probe_time [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).parents[1]
MODELS = [
    None,
    "examples.tiny_gpt:make_model",
    "examples.small_convnet:make_model",
    "examples.raw_param_mlp:make_model",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    print(f"{'model':40} {'median s':>9} {'max s':>7} {'probe() s':>10}")
    for model in MODELS:
        command = [sys.executable, "-m", "autoprec", "probe", "--json"]
        if model:
            command += ["--model", model]
        walls, inner = [], []
        for _ in range(runs):
            start = time.perf_counter()
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
            walls.append(time.perf_counter() - start)
            inner.append(json.loads(done.stdout)["seconds"])
        print(
            f"{model or '(no model)':40} {statistics.median(walls):9.2f} {max(walls):7.2f} "
            f"{statistics.median(inner):10.3f}"
        )


if __name__ == "__main__":
    main()
