"""The ground truth's long runs, committed: a fresh clone re-scores the gate in minutes.

``benchmarks.ground_truth`` caches every long run under ``--cache`` (one small JSON file a run:
its final test metric, last training loss, seconds, failure). Rebuilding that cache takes hours
(about 2.6 on our 2-core CPU), so each session that lost it could only re-score the tasks it had
time to train again. ``ground_truth_runs.json`` beside this module holds the runs as measured,
with the machine each was measured on; ``restore`` writes them into the cache (never over a run
already there), after which every benchmark that reads the cache (``ground_truth``,
``threshold_sweep``, ``late_checkpoint``, ...) trains only what is missing. ``export`` adds the
cache's runs of ``--steps`` (the truth's length, default 2000) to the archive.

    python -m benchmarks.ground_truth_archive restore [--cache runs/ground_truth]
    python -m benchmarks.ground_truth_archive export  [--cache runs/ground_truth] [--steps 2000]

The runs are what the benchmark measured, not figures typed in: their keys are the cache's own
(task and revision, mode label and knob digest, seed, steps, ``TRUTH_VERSION``), so a changed
task, mode or loop reads none of them and trains again. Pass ``--cache`` to a benchmark without
restoring to rebuild the truth on your machine instead.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch

from autoprec._files import write_text_atomically
from autoprec.cpu_info import read_cpu
from benchmarks.ground_truth import TRUTH_VERSION

ARCHIVE = Path(__file__).with_name("ground_truth_runs.json")


def this_machine() -> str:
    """The machine a run measured here is recorded as: CPU (or GPU), cores, torch."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        cpu = read_cpu(check_autocast=False)
        bf16 = {True: "bf16 instructions", False: "no bf16 instructions", None: "bf16 unknown"}
        device = f"{cpu.model_name}, {cpu.usable_cores} cores, {bf16[cpu.native_bf16]}"
    return f"{device}; {platform.machine()}; torch {torch.__version__}"


def read_archive(archive: Path) -> dict[str, Any]:
    """The archive's content: ``machines`` (id -> description) and ``runs`` (cache path ->
    the run and the id of its machine); empty where there is no archive yet."""
    if not archive.exists():
        return {"machines": {}, "runs": {}}
    content = json.loads(archive.read_text())
    if set(content) != {"machines", "runs"}:
        raise ValueError(
            f"{archive} is not a ground-truth archive (keys {sorted(content)}, expected "
            "machines and runs): restore it from git or export again."
        )
    return content


def export(cache: Path, archive: Path, steps: int) -> int:
    """Add the cache's runs of ``steps`` steps (of this ``TRUTH_VERSION``) to the archive,
    recorded as measured on this machine; runs it holds already keep their record. Returns the
    number added."""
    content = read_archive(archive)
    machines: dict[str, str] = content["machines"]
    here = this_machine()
    machine = next((key for key, value in machines.items() if value == here), None)
    if machine is None:
        machine = f"m{len(machines)}"
    added = 0
    for path in sorted((cache / f"v{TRUTH_VERSION}").glob(f"*/*.steps{steps}.json")):
        key = path.relative_to(cache).as_posix()
        if key not in content["runs"]:
            content["runs"][key] = {"machine": machine, **json.loads(path.read_text())}
            added += 1
    if added:
        machines[machine] = here
        write_text_atomically(archive, _archive_text(machines, content["runs"]))
    return added


def _archive_text(machines: dict[str, str], runs: dict[str, Any]) -> str:
    """JSON with one run a line, sorted: a re-export's diff shows the runs it added."""
    lines = [f"{json.dumps(key)}: {json.dumps(runs[key], sort_keys=True)}" for key in sorted(runs)]
    return (
        f'{{"machines": {json.dumps(machines, sort_keys=True)},\n"runs": {{\n'
        + ",\n".join(lines)
        + "\n}}\n"
    )


def restore(cache: Path, archive: Path) -> tuple[int, int]:
    """Write the archive's runs into the cache, never over a run the cache holds. Returns
    (written, already there)."""
    written = present = 0
    for key, record in read_archive(archive)["runs"].items():
        path = cache / key
        if path.exists():
            present += 1
            continue
        run = {name: value for name, value in record.items() if name != "machine"}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(run))
        written += 1
    return written, present


def main(argv: list[str] | None = None) -> tuple[int, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("restore", "export"))
    parser.add_argument("--cache", type=Path, default=Path("runs/ground_truth"))
    parser.add_argument("--archive", type=Path, default=ARCHIVE)
    parser.add_argument("--steps", type=int, default=2000, help="export: the runs' length")
    args = parser.parse_args(argv)
    if args.action == "export":
        added = export(args.cache, args.archive, args.steps)
        total = len(read_archive(args.archive)["runs"])
        print(f"{added} runs added to {args.archive} ({total} in all)")
        return added, total
    written, present = restore(args.cache, args.archive)
    machines = read_archive(args.archive)["machines"]
    print(
        f"{written} archived long runs written to {args.cache} ({present} there already); "
        f"measured on: {'; '.join(f'{key}: {value}' for key, value in machines.items()) or '-'}"
    )
    return written, present


if __name__ == "__main__":
    main()
