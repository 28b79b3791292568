from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from autoprec.cli import main
from autoprec.factories import load_object

REPO = Path(__file__).parents[1]
MODES = {"fp32", "amp_bf16", "bf16_kahan"}


def test_probe_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--model", "examples.tiny_gpt:make_model"]) == 0
    out = capsys.readouterr().out
    assert "Precision modes" in out
    assert "TinyGPT" in out
    assert "amp_bf16" in out and "fp8_te" in out
    assert "pip install 'autoprec[te]'" in out or "transformer_engine" in out
    assert "Worth a trial here:" in out


def test_probe_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--model", "examples.raw_param_mlp:make_model"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"]["raw_param_matmuls"] == ["w1", "w2"]
    assert [mode["name"] for mode in report["modes"]][:2] == ["fp32", "tf32"]
    assert report["device"] in ("cpu", "cuda:0")


def test_probe_file_path_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--model", "examples/small_convnet.py:make_model"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"]["model_class"] == "SmallConvNet"


def test_factory_returning_a_bare_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = tmp_path / "bare.py"
    factory.write_text("import torch\nmodel = torch.nn.Linear(32, 32)\n")
    assert main(["probe", "--json", "--model", f"{factory}:model"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert layers["parameters"] == 32 * 32 + 32 and layers["forward_flops"] is None


def test_a_file_is_run_once_for_every_option_and_imports_its_neighbours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each option ran the file again as a new module (a dataclass batch failed isinstance:
    # "expected Batch, got _autoprec_user_dc.Batch"), and `from helper import net` failed
    (tmp_path / "helper_for_autoprec.py").write_text("import torch\nnet = torch.nn.Linear(4, 4)\n")
    script = tmp_path / "train_for_autoprec.py"
    script.write_text(
        "import dataclasses\nfrom helper_for_autoprec import net\nRUNS = []\nRUNS.append(1)\n"
        "@dataclasses.dataclass\nclass Batch:\n    x: object\n"
        "def build():\n    return net\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    build = load_object(f"{script}:build")
    batch = load_object(f"{script}:Batch", option="--data")
    assert isinstance(build(), torch.nn.Linear) and load_object(f"{script}:RUNS") == [1]
    assert batch is load_object(f"{script}:Batch", option="--train-step")


def test_a_touched_file_keeps_its_functions_names_and_an_edited_one_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name of a ``file.py`` module went into the study's fingerprint, and it was made from
    the file's mtime and size: touching the file, or adding a comment, refused every resume
    ("recipe (loss_fn) differ"). The name follows the file now, shown as its path."""
    import os

    from autoprec.recipe import qualified_name

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    script = tmp_path / "train_touched.py"
    script.write_text("RUNS = [1]\ndef loss(out, batch):\n    return out.sum()\n")
    first = load_object(f"{script}:loss", option="--loss")
    assert qualified_name(first) == f"{script.resolve()}:loss"
    stat = script.stat()
    os.utime(script, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = load_object(f"{script}:loss", option="--loss")
    assert touched is not first  # run again: the file may have changed
    assert qualified_name(touched) == qualified_name(first)
    script.write_text(script.read_text().replace("[1]", "[2]") + "# a comment\n")
    assert load_object(f"{script}:RUNS") == [2]
    assert qualified_name(load_object(f"{script}:loss")) == qualified_name(first)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("examples.tiny_gpt", "--model must look like 'module.path:factory'"),
        ("examples.tiny_gpt:", "--model must look like"),
        ("no_such_module:make", "cannot import module 'no_such_module'"),
        (
            "examples.tiny_gpt:nope",
            "has no attribute 'nope'; it defines: Block, CausalSelfAttention",
        ),
        ("examples.tiny_gpt:math", "is a module, not a model or a factory function"),
        ("examples/missing.py:make", "file 'examples/missing.py' does not exist"),
        ("examples/:make", "'examples/' is a folder, not a Python file; name the file"),
        ("examples.tiny_gpt:TinyGPT.forward", "--model must look like"),
    ],
)
def test_bad_model_is_one_line_exit_2(
    model: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autoprec: error: ")
    assert message in err


def test_factory_that_raises_or_returns_junk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = tmp_path / "factories.py"
    factory.write_text("def boom():\n    raise KeyError('weights')\n\ndef junk():\n    return 42\n")
    assert main(["probe", "--model", f"{factory}:boom"]) == 2
    assert "raised KeyError: 'weights'" in capsys.readouterr().err
    assert main(["probe", "--model", f"{factory}:junk"]) == 2
    assert "returned int; expected an nn.Module or a (model, example_input) pair" in (
        capsys.readouterr().err
    )


def test_user_code_that_exits_or_lacks_a_dependency_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script parsing its command line at import, or a factory raising SystemExit, escaped
    every handler (argparse's usage line read as autoprec refusing its own arguments; exit 3
    said nothing); a module whose dependency is missing was told to run from its folder."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    script = tmp_path / "parses_at_import.py"
    script.write_text(
        "import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n"
        "def build():\n    return None\n"
    )
    assert main(["probe", "--model", f"{script}:build"]) == 2
    said = capsys.readouterr().err
    assert f"--model: importing '{script}' called sys.exit(2)" in said
    assert 'if __name__ == "__main__":' in said
    exits = tmp_path / "exits_for_autoprec.py"
    exits.write_text("def batches():\n    raise SystemExit(3)\n")
    argv = ["tune", "examples.tiny_gpt:make_small_model", "--budget", "1"]
    assert main([*argv, "--data", f"{exits}:batches", "--out", str(tmp_path / "p.json")]) == 2
    assert f"--data: calling '{exits}:batches'() called sys.exit(3)" in capsys.readouterr().err
    (tmp_path / "needs_a_package.py").write_text("import no_such_package_xyz\n")
    monkeypatch.chdir(tmp_path)
    assert main(["probe", "--model", "needs_a_package:build"]) == 2
    assert (
        "importing 'needs_a_package' failed: it imports 'no_such_package_xyz', which is not "
        "installed here"
    ) in capsys.readouterr().err


def test_optimizer_and_scheduler_factories_that_fail_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a --scheduler or --optimizer factory raised ended in a traceback (exit 1), and a
    scheduler factory returning no scheduler in "'int' object has no attribute 'step'"."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    factories = tmp_path / "recipe_parts.py"
    factories.write_text(
        "def raises(optimizer, total_steps):\n    raise RuntimeError('bad schedule')\n"
        "def not_a_scheduler(optimizer, total_steps):\n    return 5\n"
        "def optimizer(params):\n    raise RuntimeError('bad optimizer')\n"
    )
    small = ["examples.tiny_gpt:make_small_model", "--data", "examples.tiny_gpt:make_small_batches"]
    check = ["check", *small, "--steps", "8", "--modes", "amp_bf16"]
    schedule = ["--total-steps", "100", "--scheduler"]
    for extra, said in [
        ([*schedule, f"{factories}:raises"], "called as raises(optimizer, total_steps=100), "
         "raised RuntimeError: bad schedule"),
        ([*schedule, f"{factories}:not_a_scheduler"], "returned int, not an lr scheduler"),
        (["--optimizer", f"{factories}:optimizer"], "called as optimizer(model.parameters()), "
         "raised RuntimeError: bad optimizer"),
    ]:  # fmt: skip
        assert main([*check, *extra]) == 2
        assert said in capsys.readouterr().err


def test_bad_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cuda:7"]) == 2
    assert "Device 'cuda:7' is not available" in capsys.readouterr().err


def test_debug_shows_the_traceback() -> None:
    with pytest.raises(Exception, match="cannot import module"):
        main(["probe", "--debug", "--model", "no_such_module:make"])


def test_console_script_end_to_end() -> None:
    """The installed `autoprec` entry point, as a user runs it: no traceback, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "autoprec", "probe", "--model", "nowhere:make"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("autoprec: error: --model: cannot import module 'nowhere'")
    ok = subprocess.run(
        [sys.executable, "-m", "autoprec", "probe", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["layers"] is None


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            ["--modes", "fp8_te"],
            "autoprec: error: Requested mode(s) cannot run on this model here: fp8_te",
        ),
        (["--device", "tpu:0"], "autoprec: error: autoprec tunes on 'cpu' or 'cuda:N'"),
    ],
)
def test_tune_errors_exit_2_through_the_console_script(
    arguments: list[str], expected: str, tmp_path: Path
) -> None:
    out = tmp_path / "new" / "p.json"
    done = subprocess.run(
        [sys.executable, "-m", "autoprec", *_tune_command(out, *arguments)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(expected) and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "new").exists()


def test_a_bad_model_factory_is_named_as_tune_and_check_call_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found by a hunt: tune's and check's positional MODEL_FACTORY was named "--model", an
    option only probe has."""
    for command in ("tune", "check"):
        arguments = [command, "nowhere:make", "--data", "examples.tiny_gpt:make_small_batches"]
        assert (
            main([*arguments, *(["--out", "x.json", "--budget", "1"] if command == "tune" else [])])
            == 2
        )
        assert "autoprec: error: MODEL_FACTORY: cannot import module 'nowhere'" in (
            capsys.readouterr().err
        )


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tune-everything"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tune-everything' (choose from 'probe'" in capsys.readouterr().err


def test_usage_error_is_one_line_naming_help(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a hunt: ``--budget abc`` printed tune's whole usage (12 lines) above the one
    that said what was wrong."""
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "examples.tiny_gpt:make_model", "--data", "x:y", "--budget", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "autoprec tune: error: argument --budget: invalid float value: 'abc' "
        "(see `autoprec tune --help`).\n"
    )
    assert main([]) == 2  # bare `autoprec`: the commands, as --help lists them
    assert "COMMAND" in capsys.readouterr().err


def test_show_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(REPO / "profiles/example-l4-fp8_te.json")]) == 0
    out = capsys.readouterr().out
    assert "fp8_te+delayed_hybrid" in out
    assert "amax history 1024, max, margin 0" in out
    assert "NVIDIA L4" in out
    assert "carries no evidence" in " ".join(out.split())  # the table wraps it


def test_show_json_and_strict(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REPO / "profiles/example-h100-fp8_torchao.json")
    assert main(["show", "--json", path]) == 0
    shown = capsys.readouterr()
    assert json.loads(shown.out)["spec"]["mode"] == "fp8_torchao"
    assert "proven on other hardware" in shown.err  # the table shows it; --json dropped it
    assert "carries no evidence (its note: 'Hand-written example" in shown.err
    assert main(["show", "--strict", path]) == 2
    assert "proven on other hardware" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the help says both refusals (a hunt: it named hardware)
        main(["show", "--help"])
    assert "or the profile carries no evidence" in " ".join(capsys.readouterr().out.split())


def test_show_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec: error: Profile") and "not valid JSON" in err


def test_schema_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == json.loads((REPO / "profiles/profile.schema.json").read_text())


def test_tune_end_to_end_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs" / "new" / "tiny.json"  # folders that do not exist yet
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoprec",
            "tune",
            "examples.tiny_gpt:make_small_model",
            "--data",
            "examples.tiny_gpt:make_small_batches",
            "--budget",
            "0.25",
            "--modes",
            "amp_bf16,bf16_kahan",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Trials (objective: speed)" in done.stdout and f"wrote {out}" in done.stdout
    # not a terminal: plain progress lines on stderr, from the first fp32 steps on
    progress = done.stderr.splitlines()
    assert progress[0].startswith("calibration (fp32) · 5 steps · ")
    assert any(line.startswith("trial 1/2 amp_bf16 · ") for line in progress)
    assert not any("WARNING" in line for line in progress), done.stderr  # no import chatter
    # the compact table fits 80 columns with full labels, one row per trial
    table = done.stdout.split("Profile:")[0].splitlines()
    assert max(len(line) for line in table) <= 80
    rows = [line for line in table if line.lstrip("★ ").split(" ")[0] in MODES]
    assert [row.lstrip("★ ").split()[0] for row in rows] == ["fp32", "amp_bf16", "bf16_kahan"]
    profile = json.loads(out.read_text())
    assert profile["evidence"]["trial_steps"] >= 20
    assert out.with_suffix(".study.db").exists() and out.with_suffix(".trials.json").exists()
    from rich.console import Console

    from autoprec.display import tune_table
    from autoprec.report import outcomes_from_result, outcomes_from_study
    from autoprec.tune_result import TuneResult

    result = TuneResult.model_validate_json(out.with_suffix(".trials.json").read_text())
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(tune_table(result, wide=True))
    wide = " ".join(console.export_text().replace("│", " ").split())
    for outcome in (*result.trials, *result.skipped):
        for reason in outcome.reasons:  # --wide: every reason in full, wrapped not cut
            assert " ".join(reason.split()) in wide, reason
    compact = Console(width=80, record=True, file=io.StringIO())
    compact.print(tune_table(result))  # a reason cut short says where to read it whole
    hinted = "(--wide shows every reason)" in compact.export_text()
    assert hinted == any(outcome.reasons for outcome in (*result.trials, *result.skipped))

    from_file = outcomes_from_result(out.with_suffix(".trials.json"))
    from_study = outcomes_from_study(f"sqlite:///{out.with_suffix('.study.db')}", None)
    no_windows = [o.model_copy(update={"windows": ()}) for o in from_file[0]]
    assert any(o.windows for o in from_file[0])  # the study's result leaves them out (MySQL)
    assert sorted(from_study[0], key=lambda o: o.label) == sorted(no_windows, key=lambda o: o.label)
    assert from_study[1:] == from_file[1:]  # the choice and the number of noise runs
    for source in (out.with_suffix(".trials.json"), out.with_suffix(".study.db")):
        png = tmp_path / f"{source.suffix}.png"
        assert main(["report", str(source), "--out", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = capsys.readouterr().out
    count = profile["evidence"]["trial_count"]
    assert written.count(f"({count} trials: ") == 2  # the profile's count, from both sources
    _a_full_disk_at_the_profile_keeps_the_study_and_says_so(out, capsys)


def _a_full_disk_at_the_profile_keeps_the_study_and_says_so(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command again (it resumes the study) with the disk full when the profile is
    written: a traceback and exit 1 before, and the profile was written before the trials
    file, so a failed second write left a new profile beside the last run's trials (a
    hunt). Now the trials file is written first and the error is one line."""
    import errno

    from autoprec.profile import Profile

    before = out.read_bytes()
    trials = out.with_suffix(".trials.json")
    os.utime(trials, (0, 0))  # the last run's

    def full(self: Profile, path: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    argv = ["tune", "examples.tiny_gpt:make_small_model", "--data",
            "examples.tiny_gpt:make_small_batches", "--budget", "0.25", "--modes",
            "amp_bf16,bf16_kahan", "--out", str(out)]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Profile, "save", full)
        assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("autoprec: error: [Errno 28] No space left on device")
    assert err.endswith("free space and run the same command again to resume")
    assert out.read_bytes() == before and trials.stat().st_mtime > 0  # trials written first


def test_tune_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "p.json")
    assert (
        main(
            [
                "tune",
                "examples.tiny_gpt:make_small_model",
                "--data",
                "nowhere:batches",
                "--budget",
                "1",
                "--out",
                out,
            ]
        )
        == 2
    )
    assert "--data: cannot import module 'nowhere'" in capsys.readouterr().err
    assert (
        main(
            [
                "tune",
                "examples.tiny_gpt:make_small_model",
                "--data",
                "examples.tiny_gpt:make_small_batches",
                "--budget",
                "0",
                "--out",
                out,
            ]
        )
        == 2
    )
    assert "--budget must be a positive, finite number of minutes" in capsys.readouterr().err
    assert (
        main(
            [
                "tune",
                "examples.tiny_gpt:make_small_model",
                "--data",
                "examples.tiny_gpt:make_small_batches",
                "--eval",
                "examples.tiny_gpt:nope",
                "--budget",
                "1",
                "--out",
                out,
            ]
        )
        == 2
    )
    assert "--eval: module 'examples.tiny_gpt' has no attribute 'nope'" in (capsys.readouterr().err)
    tiny = ["tune", "examples.tiny_gpt:make_small_model", "--data"]
    # a learning rate that is not a positive, finite number is named by its flag (--lr inf
    # printed two pydantic validation errors for LrPoint)
    for lr in ("inf", "nan", "-1"):
        argv = [*tiny, "examples.tiny_gpt:make_small_batches", "--lr", lr, "--budget", "1"]
        assert main([*argv, "--out", out]) == 2
        assert f"--lr must be a positive, finite learning rate, not {float(lr):g}" in (
            capsys.readouterr().err
        )
    # --modes naming no mode is refused in the CLI's terms (it said "pass None")
    for empty in ("", ","):
        assert main([*tiny, "examples.tiny_gpt:make_small_batches", "--modes", empty,
                     "--budget", "1", "--out", out]) == 2  # fmt: skip
        assert "names no mode: give them comma-separated" in capsys.readouterr().err
    # a storage URL's password is never printed (found by a hunt: the refusal showed it)
    server = "postgresql://user:s3cret@localhost:1/db"
    assert main([*tiny[:2], "--data", "examples.tiny_gpt:make_small_batches", "--storage",
                 server, "--budget", "0.5", "--out", out]) == 2  # fmt: skip
    said = capsys.readouterr().err
    assert "s3cret" not in said and "postgresql://user:***@localhost:1/db" in said
    assert "check the URL, its driver and that the database answers" in said
    # a budget too small for the runs is named by its flag (it said budget_minutes=0.002)
    assert (
        main([*tiny, "examples.tiny_gpt:make_small_batches", "--budget", "0.002", "--out", out])
        == 2
    )
    assert "autoprec: error: --budget 0.002 is too small" in capsys.readouterr().err


def _interruptible() -> None:
    """In the child before exec: SIGINT back to its default, so Python installs its handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_cli_tune_resumes_from_its_sqlite_file(tmp_path: Path) -> None:
    import signal

    import optuna

    out = tmp_path / "resume.json"
    command = [
        sys.executable,
        "-m",
        "autoprec",
        "tune",
        "examples.tiny_gpt:make_small_model",
        "--data",
        "examples.tiny_gpt:make_small_batches",
        "--budget",
        "2",
        "--modes",
        "amp_bf16,bf16_kahan,bf16_sr",
        "--objective",
        "memory",
        "--out",
        str(out),
    ]
    storage = f"sqlite:///{out.with_suffix('.study.db')}"
    # Ctrl-C must reach it as KeyboardInterrupt even when this suite runs as a background job
    # of a shell without job control, which starts it with SIGINT ignored (Python then keeps
    # it ignored, and the run finished with 0: a suite started with `(make test &)`)
    first = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
    )
    # Ctrl-C once the second candidate starts: fp32 and the first candidate are in the study.
    # Driven by the progress lines, not by polling the study, so a fast run cannot finish first.
    shown: list[str] = []
    assert first.stderr is not None
    for line in first.stderr:
        shown.append(line)
        if line.startswith("trial 2/"):
            break
    first.send_signal(signal.SIGINT)
    _, rest = first.communicate(timeout=60)
    err = "".join(shown) + rest
    study = optuna.load_study(study_name="resume", storage=storage)
    finished = [
        t.params["candidate"]
        for t in study.get_trials(deepcopy=False)
        if t.state.name in ("COMPLETE", "PRUNED")
    ]
    assert len(finished) >= 2, err  # the reference and the first candidate
    assert first.returncode == 130, err
    assert "interrupted; run the same command again to resume" in err and not out.exists()
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=200)
    assert second.returncode == 0, second.stderr
    reused = [line.split()[0] for line in second.stderr.splitlines() if "(from the study)" in line]
    assert set(finished) - {"fp32"} <= set(reused) and reused
    assert json.loads(out.read_text())["spec"]["mode"] in {
        "fp32",
        "amp_bf16",
        "bf16_kahan",
        "bf16_sr",
    }


def test_tune_runs_the_recipe_given_on_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "recipe.json"
    code = main(
        [
            "tune",
            "examples.tiny_gpt:make_small_model",
            "--data",
            "examples.tiny_gpt:make_small_batches",
            "--budget",
            "1",  # 0.5 refused now and then on a loaded 2-core machine (a slow fp32 step)
            "--modes",
            "fp32+8bit-optim",  # fast on any CPU: amp_bf16 ran 14x fp32 on one without bf16
            "--objective",
            "memory",
            "--optimizer",
            "examples.tiny_gpt:make_optimizer",
            "--lr",
            "5e-5",
            "--scheduler",
            "examples.tiny_gpt:cosine_schedule",
            "--total-steps",
            "5000",
            "--grad-accum",
            "2",
            "--clip",
            "1.0",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    recipe = json.loads(out.read_text())["recipe"]
    assert recipe["optimizer"] == "torch.optim.adamw:AdamW"
    assert recipe["optimizer_groups"][0]["lr"] == 5e-5
    assert recipe["optimizer_groups"][0]["betas"] == [0.9, 0.95]
    assert recipe["scheduler"] == "examples.tiny_gpt:cosine_schedule"
    assert (recipe["total_steps"], recipe["grad_accumulation_steps"]) == (5000, 2)
    assert recipe["clip_grad_norm"] == 1.0
    peak, floor = recipe["lr_points"]
    assert peak["lrs"] == [pytest.approx(5e-5)] and floor["lrs"][0] < 1e-5


def test_recipe_flag_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    common = [
        "tune",
        "examples.tiny_gpt:make_small_model",
        "--data",
        "examples.tiny_gpt:make_small_batches",
        "--budget",
        "0.3",
        "--out",
        str(tmp_path / "p.json"),
    ]
    assert main([*common, "--scheduler", "examples.tiny_gpt:cosine_schedule"]) == 2
    assert "needs --total-steps" in capsys.readouterr().err
    assert main([*common, "--optimizer", "examples.tiny_gpt:make_batches", "--lr", "1e-3"]) == 2
    assert "factory 'examples.tiny_gpt:make_batches' takes no lr argument" in (
        capsys.readouterr().err
    )
    help_text = subprocess.run(
        [sys.executable, "-m", "autoprec", "tune", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    for flag in ("--optimizer", "--lr", "--scheduler", "--total-steps", "--grad-accum", "--clip"):
        assert flag in help_text


def test_the_recipe_line_names_what_sets_each_optimizers_momentum() -> None:
    """SGD's momentum (and nesterov when on), torch-optimi's beta1/beta2, torch's betas."""
    from autoprec.display import describe_recipe
    from autoprec.recipe import TrainingRecipe

    model = torch.nn.Linear(4, 2)

    def line(optimizer: Callable[..., torch.optim.Optimizer]) -> str:
        return describe_recipe(TrainingRecipe(optimizer=optimizer).summary(model))

    sgd = line(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    assert sgd.startswith("SGD(lr 0.1, momentum 0.9, nesterov True, weight_decay 0")
    plain = line(lambda params: torch.optim.SGD(params, lr=0.1))
    assert "momentum 0," in plain and "nesterov" not in plain
    adam = line(lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.99)))
    assert adam.startswith("AdamW(lr 0.001, betas [0.8, 0.99], weight_decay 0.01)")
    # trials from the user's optimizer state say so (found by a hunt: only --json did)
    summary = TrainingRecipe(optimizer=torch.optim.AdamW).summary(model)
    resumed = describe_recipe(summary.model_copy(update={"optimizer_state_steps": 10}))
    assert "; from your optimizer state (10 steps);" in resumed
    assert "optimizer state" not in describe_recipe(summary)


def test_show_prints_the_recipe_a_profile_was_tuned_under(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autoprec.profile import profile_for
    from autoprec.recipe import TrainingRecipe
    from autoprec.specs import ModeSpec
    from examples import tiny_gpt

    model, _ = tiny_gpt.make_small_model()
    recipe = TrainingRecipe(
        optimizer=tiny_gpt.make_optimizer,
        scheduler=tiny_gpt.cosine_schedule,
        total_steps=5000,
        clip_grad_norm=1.0,
    ).summary(model)
    path = profile_for(ModeSpec(mode="amp_bf16"), recipe=recipe).save(tmp_path / "p.json")
    assert main(["show", str(path)]) == 0
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "tuned under" in shown and "AdamW(lr 0.0006, betas [0.9, 0.95]" in shown
    assert "schedule cosine_schedule over 5000 steps" in shown and "clip 1" in shown


def test_an_out_path_naming_a_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out new/` wrote the profile as a file named `new`."""
    command = _tune_command(tmp_path / "new")
    command[-1] += "/"
    assert main(command) == 2
    assert "names a folder; give the profile's file name" in _one_line_error(capsys)
    assert not (tmp_path / "new").exists()


def test_an_out_path_holding_another_file_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a hunt: `--out train.py` replaced the model's own script with a profile."""
    script = tmp_path / "train.py"
    script.write_text("print('my training script')\n")
    assert main(_tune_command(script)) == 2
    assert "exists and is not an autoprec profile: it would be replaced" in _one_line_error(capsys)
    assert script.read_text() == "print('my training script')\n"
    assert not (tmp_path / "train.study.db").exists()


def test_a_trials_path_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # only the profile's path was checked up front: the whole budget ran, the profile was
    # written, and then p.trials.json (a folder) was refused
    (tmp_path / "p.trials.json").mkdir()
    assert main(_tune_command(tmp_path / "p.json")) == 2
    assert "p.trials.json' is a folder, not a file" in _one_line_error(capsys)
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "p.study.db").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget", "0"], "--budget must be a positive, finite number of minutes up to 1e+07"),
        (["--budget", "inf"], "finite number of minutes up to 1e+07, not inf (`autoprec check`"),
        (["--budget", "1e306"], "up to 1e+07, not 1e+306"),  # a traceback (OverflowError)
        (["--budget", "1", "--grad-accum", "0"], "--grad-accum must be >= 1, not 0"),
        (["--budget", "1", "--total-steps", "0"], "--total-steps must be >= 1, not 0"),
        (["--budget", "1", "--clip", "-1"], "--clip must be a positive norm, not -1"),
        # accepted and ignored: the recipe recorded total_steps 100 with no scheduler
        (["--budget", "1", "--total-steps", "100"], "--total-steps is read only with --scheduler"),
        (  # the Python API's words: "A scheduler needs total_steps"
            ["--budget", "1", "--scheduler", "examples.tiny_gpt:cosine_schedule"],
            "--scheduler needs --total-steps",
        ),
        (  # "Pass loss_fn or train_step, not both"
            ["--budget", "1", "--loss", "a:b", "--train-step", "a:c"],
            "Pass --loss or --train-step, not both",
        ),
        (  # torch's bare "Overflow when unpacking long long" after the probe
            ["--budget", "1", "--seed", str(2**64)],
            "seed must be an integer from -9223372036854775808 to 18446744073709551614",
        ),
    ],
)
def test_bad_numbers_are_refused_before_anything_is_created(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "p.json"
    command = ["tune", "examples.tiny_gpt:make_small_model", "--data"]
    command += ["examples.tiny_gpt:make_small_batches", *flags, "--out", str(out)]
    assert main(command) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def _tune_command(out: Path, *flags: str) -> list[str]:
    return [
        "tune",
        "examples.tiny_gpt:make_small_model",
        "--data",
        "examples.tiny_gpt:make_small_batches",
        "--budget",
        "0.2",
        *flags,
        "--out",
        str(out),
    ]


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_a_data_factory_that_raises_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.py"
    data.write_text("def batches():\n    raise OSError('dataset shard 3 is missing')\n")
    out = tmp_path / "new" / "p.json"
    command = _tune_command(out)
    command[3] = f"{data}:batches"
    assert main(command) == 2
    line = _one_line_error(capsys)
    assert "--data: calling" in line and "OSError: dataset shard 3 is missing" in line
    assert not (tmp_path / "new").exists()
    # a generator factory raises only when read: that was a traceback and exit 1
    data.write_text(
        "import torch\n"
        "def batches():\n"
        "    yield torch.zeros(2, 4), torch.zeros(2, 4)\n"
        "    raise RuntimeError('shard 2 is corrupt')\n"
    )
    assert main(command) == 2
    line = _one_line_error(capsys)
    assert "Reading batch 1 from the loader raised RuntimeError: shard 2 is corrupt" in line
    assert not (tmp_path / "new").exists()


def _meta_factory(folder: Path) -> str:
    factory = folder / "meta_model.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    with torch.device('meta'):\n"
        "        return torch.nn.Linear(4, 4)\n"
    )
    return f"{factory}:make"


@pytest.mark.parametrize(
    ("case", "expected"),
    [("cuda_on_cpu_build", "device='cuda:0', but this torch"), ("meta_model", "meta device")],
)
def test_unusable_device_or_model_is_one_line(
    case: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    out = tmp_path / "new" / "p.json"
    if case == "cuda_on_cpu_build":
        if torch.version.cuda is not None:
            pytest.skip("needs a CPU build of torch")
        command = _tune_command(out, "--device", "cuda:0")
    else:
        command = _tune_command(out, "--device", "cpu")
        command[1] = _meta_factory(tmp_path)
    assert main(command) == 2
    assert expected in _one_line_error(capsys)
    assert not (tmp_path / "new").exists()


def test_a_mode_that_cannot_run_here_is_an_error_not_an_fp32_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "p.json"
    assert main(_tune_command(out, "--modes", "fp8_te")) == 2
    line = _one_line_error(capsys)
    assert (
        "Requested mode(s) cannot run on this model here: fp8_te: fp8_te needs a CUDA GPU" in line
    )
    assert not (tmp_path / "new").exists()
    assert main(_tune_command(out, "--modes", "bf16")) == 2
    assert "Unknown mode(s) ['bf16']" in _one_line_error(capsys)


def test_report_and_show_on_the_wrong_file_say_which_file_to_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = REPO / "profiles" / "example-cpu-amp_bf16.json"
    assert main(["report", str(profile), "--out", str(tmp_path / "r.png")]) == 2
    assert "is a profile, not a tune run's trials" in _one_line_error(capsys)
    junk = tmp_path / "junk.json"
    junk.write_text('{"x": 1}')
    assert main(["report", str(junk), "--out", str(tmp_path / "r.png")]) == 2
    line = _one_line_error(capsys)
    assert "is not a tune run's trials file" in line and "pydantic" not in line
    trials = tmp_path / "p.trials.json"
    trials.write_text(json.dumps({"profile": {}, "trials": [], "reference": {}}))
    assert main(["show", str(trials)]) == 2
    assert "is a tune run's trials file (*.trials.json), not a profile" in _one_line_error(capsys)
    assert main(["report", str(tmp_path / "nothing.db"), "--out", str(tmp_path / "r.png")]) == 2
    assert "does not exist" in _one_line_error(capsys)
    assert not (tmp_path / "r.png").exists()
    # a folder was opened as an Optuna journal: a traceback and exit code 1
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 2
    assert "is a folder; give a tune run's *.trials.json" in _one_line_error(capsys)
    # a trials file renamed is read as one (it was read as a journal: "Expecting property
    # name enclosed in double quotes")
    renamed = tmp_path / "copy.txt"
    renamed.write_text(json.dumps({"profile": {}, "trials": [], "reference": {}}, indent=2))
    assert main(["report", str(renamed), "--out", str(tmp_path / "r.png")]) == 2
    assert "is not a tune run's trials file" in _one_line_error(capsys)


def test_report_names_a_missing_study_an_unknown_format_and_an_empty_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import optuna

    from autoprec.outcomes import TrialOutcome
    from autoprec.report import plot_outcomes
    from autoprec.specs import ModeSpec

    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.storages.RDBStorage(url)  # an empty storage
    assert main(["report", url, "--out", str(tmp_path / "r.png")]) == 2
    assert "holds no study: nothing was tuned with it" in _one_line_error(capsys)
    optuna.create_study(study_name="mine", storage=url)
    capsys.readouterr()  # Optuna's own log line
    assert main(["report", url, "--study", "other", "--out", str(tmp_path / "r.png")]) == 2
    assert "holds no study 'other'; it holds ['mine']" in _one_line_error(capsys)  # KeyError
    assert main(["report", url, "--out", str(tmp_path / "r.png")]) == 2  # no trial ended yet
    assert "nothing to draw" in _one_line_error(capsys)
    assert not (tmp_path / "r.png").exists()
    measured = [
        TrialOutcome(spec=ModeSpec(mode="fp32"), status="accepted", samples_per_second=10.0,
                     memory_bytes=2**20)
    ]  # fmt: skip
    # no suffix: ".png" added and named (matplotlib added it unseen, "wrote r" was untrue)
    assert plot_outcomes(measured, "fp32", tmp_path / "r") == tmp_path / "r.png"
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match=r"matplotlib writes no \.txt files.*\.svg"):
        plot_outcomes(measured, "fp32", tmp_path / "r.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.png", "s.db"]  # no temporary left
    junk = tmp_path / "s.json"
    junk.write_bytes((tmp_path / "s.db").read_bytes())
    assert main(["show", str(junk)]) == 2
    assert "is not JSON: the file is an SQLite database" in _one_line_error(capsys)


def test_only_autoprecs_records_are_formatted_as_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import logging

    from autoprec.cli import _configure_logging

    try:
        _configure_logging(debug=False)
        logging.getLogger("autoprec.tuning").warning("own words")
        logging.getLogger("somelib").warning("their words")
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no such file")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: No module"
        )
        err = capsys.readouterr().err
        assert "autoprec: WARNING: own words" in err
        assert "somelib: WARNING: their words" in err and "autoprec: WARNING: their" not in err
        assert "Failed to load" not in err  # import chatter: only with --debug
        _configure_logging(debug=True)
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no such file")
        assert "torchao: WARNING: Failed to load /x/_C_mxfp8.so" in capsys.readouterr().err
    finally:
        _configure_logging(debug=False)


def test_log_records_go_to_stderr_as_it_is_when_they_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The live display redirects stderr to print above its status line; a handler holding
    the stderr of its creation glued warnings onto that line (found by a hunt)."""
    import io
    import logging

    from autoprec.cli import _configure_logging

    try:
        _configure_logging(debug=False)
        redirected = io.StringIO()
        monkeypatch.setattr(sys, "stderr", redirected)  # what rich's Live does
        logging.getLogger("autoprec.tuning").warning("while live")
        assert "autoprec: WARNING: while live" in redirected.getvalue()
    finally:
        monkeypatch.undo()
        _configure_logging(debug=False)


@pytest.mark.parametrize("command", ["tune", "check"])
def test_compile_is_a_training_flag_of_tune_and_check(command: str) -> None:
    from autoprec.cli_parser import build_parser

    base = [command, "m.py:model", "--data", "m.py:data"]
    if command == "tune":
        base += ["--budget", "1", "--out", "p.json"]
    parser = build_parser()
    assert parser.parse_args(base).compile is None  # "auto": follow the model factory
    assert parser.parse_args([*base, "--compile"]).compile is True
    assert parser.parse_args([*base, "--no-compile"]).compile is False


def test_tune_refuses_an_out_that_is_not_a_file_before_any_trial(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--out /dev/null` (as root) replaced the device with a profile after the whole run."""
    import os

    pipe = tmp_path / "p.json"
    os.mkfifo(pipe)
    data = "examples.tiny_gpt:make_small_batches"
    argv = ["tune", "examples.tiny_gpt:make_small_model", "--data", data, "--budget", "1",
            "--out", str(pipe)]  # fmt: skip
    assert main(argv) == 2
    assert "is a pipe, not a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no study was started
    # where no file can be made: refused before calibration, not after the run
    (tmp_path / "notes.txt").write_text("mine")
    for out, said in [
        ("/proc/p.json", "making a file in '/proc' fails"),
        (str(tmp_path / "notes.txt" / "sub" / "p.json"), "notes.txt' is a file, not a folder"),
    ]:
        assert main([*argv[:-1], out]) == 2
        err = capsys.readouterr().err
        assert "cannot be written" in err and said in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "p.json"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_report_refuses_bad_storage_urls_and_outputs_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # bad URLs gave tracebacks (exit 1), a mistyped SQLite path created a database, and
    # --out naming a folder or /dev/null wrote `folder.png` / `/dev/null.png` beside it
    out = str(tmp_path / "r.png")
    assert main(["report", "bogus://x", "--out", out]) == 2
    assert "Cannot read the study storage 'bogus://x'" in _one_line_error(capsys)
    typo = tmp_path / "typo.db"
    assert main(["report", f"sqlite:///{typo}", "--out", out]) == 2
    assert "no such SQLite file" in _one_line_error(capsys)
    assert not typo.exists()
    cache = tmp_path / "s.db.s.references.pt"  # a binary file beside a study: named as such
    cache.write_bytes(b"\xf8\x02junk\n")
    assert main(["report", str(cache), "--out", out]) == 2
    assert "s.references.pt' is not a study: neither" in _one_line_error(capsys)
    trials = tmp_path / "p.trials.json"
    trials.write_text(json.dumps({"profile": {}, "trials": [], "reference": {}}))
    folder = tmp_path / "plots"
    folder.mkdir()
    for target in (str(folder) + "/", "/dev/null"):
        assert main(["report", str(trials), "--out", target]) == 2
        assert "not a file" in _one_line_error(capsys)
    assert not (tmp_path / "plots.png").exists()


def test_report_of_an_interrupted_compiled_study_finds_its_reference(tmp_path: Path) -> None:
    # the reference was looked up by the label "fp32": a compiled study's is "fp32+compiled",
    # so an interrupted compiled run reported "chosen: none"; and a resumed study's earlier
    # result (cleared now when a run resumes) is not read when it is None
    import optuna

    from autoprec.outcomes import TrialOutcome
    from autoprec.report import outcomes_from_study
    from autoprec.specs import ModeSpec

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=url, directions=["maximize", "minimize"])
    study.set_user_attr("result", None)
    for spec, speed in ((ModeSpec(mode="fp32", compile=True), 10.0),
                        (ModeSpec(mode="amp_bf16", compile=True), 30.0)):  # fmt: skip
        trial = study.ask()
        outcome = TrialOutcome(
            spec=spec, status="accepted", samples_per_second=speed, memory_bytes=2**20
        )
        trial.set_user_attr("outcome", outcome.model_dump_json())
        study.tell(trial, [speed, 2**20])
    outcomes, chosen, _ = outcomes_from_study(url, "s")
    assert len(outcomes) == 2 and chosen == "amp_bf16+compiled"


def test_report_of_an_interrupted_study_chooses_with_tunes_margin(tmp_path: Path) -> None:
    """Found by a hunt: `autoprec report` chose among an interrupted study's one-trial speeds
    without the margin tune() gives them (``UNRETIMED_SPEED_MARGIN``): bf16_sr at 108 was
    marked where tune() keeps fp32 at 100."""
    import optuna

    from autoprec.outcomes import TrialOutcome
    from autoprec.report import outcomes_from_study
    from autoprec.specs import ModeSpec

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=url, directions=["maximize", "minimize"])
    study.set_user_attr("result", None)
    for mode, speed in (("fp32", 100.0), ("amp_bf16", 105.0), ("bf16_sr", 108.0)):
        trial = study.ask()
        outcome = TrialOutcome(
            spec=ModeSpec(mode=mode), status="accepted", samples_per_second=speed,  # type: ignore[arg-type]
            memory_bytes=2**20,
        )  # fmt: skip
        trial.set_user_attr("outcome", outcome.model_dump_json())
        study.tell(trial, [speed, 2**20])
    _, chosen, _ = outcomes_from_study(url, "s")
    assert chosen == "fp32"


def test_report_reads_a_journal_storage_named_like_a_trials_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tune --storage study.json` writes an Optuna journal; `report study.json` read it as a
    trials file by its suffix and failed ("Extra data" on its second line)."""
    import optuna

    from autoprec.outcomes import TrialOutcome
    from autoprec.search import optuna_storage
    from autoprec.specs import ModeSpec

    journal = tmp_path / "study.json"
    study = optuna.create_study(
        study_name="s", storage=optuna_storage(str(journal)), directions=["maximize", "minimize"]
    )
    for spec, speed in ((ModeSpec(mode="fp32"), 10.0), (ModeSpec(mode="amp_bf16"), 30.0)):
        trial = study.ask()
        outcome = TrialOutcome(
            spec=spec, status="accepted", samples_per_second=speed, memory_bytes=2**20
        )
        trial.set_user_attr("outcome", outcome.model_dump_json())
        study.tell(trial, [speed, 2**20])
    assert main(["report", str(journal), "--out", str(tmp_path / "r.png")]) == 0
    assert "chosen: amp_bf16" in capsys.readouterr().out


def test_report_names_a_study_that_is_not_autoprecs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "a run interrupted before its first trial ended has none"."""
    import optuna

    from autoprec.search import optuna_quiet

    url = f"sqlite:///{tmp_path / 'mine.db'}"
    with optuna_quiet():
        mine = optuna.create_study(study_name="mine", storage=url, direction="minimize")
        mine.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    capsys.readouterr()
    assert main(["report", url, "--study", "mine", "--out", str(tmp_path / "r.png")]) == 2
    assert "'mine' in " in (said := _one_line_error(capsys)) and "is not an autoprec study" in said


def test_report_refuses_a_study_name_for_a_trials_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --study was ignored for a *.trials.json: "wrote ..." with rc 0 whatever it named
    trials = tmp_path / "p.trials.json"
    trials.write_text("{}")
    command = ["report", str(trials), "--study", "nope", "--out", str(tmp_path / "r.png")]
    assert main(command) == 2
    assert "--study names a study in a storage" in _one_line_error(capsys)


def test_report_names_the_trials_it_does_not_draw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt: a study whose candidates failed drew fp32 alone and said "3 modes
    measured", nothing of the two failed trials."""
    from autoprec import report
    from autoprec.outcomes import TrialOutcome
    from autoprec.specs import ModeSpec

    outcomes = [
        TrialOutcome(spec=ModeSpec(mode="fp32"), status="accepted", samples_per_second=10.0,
                     memory_bytes=1000),
        TrialOutcome(spec=ModeSpec(mode="amp_bf16"), status="failed", reasons=("boom",)),
        TrialOutcome(spec=ModeSpec(mode="bf16_sr"), status="failed", reasons=("boom",)),
    ]  # fmt: skip
    monkeypatch.setattr(report, "outcomes_from_result", lambda source: (outcomes, "fp32", 2))
    monkeypatch.setattr(report, "plot_outcomes", lambda *args, **kwargs: tmp_path / "f.png")
    monkeypatch.setattr(report, "trials_run", lambda found, noise: len(found) + noise)
    trials = tmp_path / "f.trials.json"
    trials.write_text("{}")
    assert main(["report", str(trials), "--out", str(tmp_path / "f.png")]) == 0
    said = capsys.readouterr().out
    assert "3 modes run and 2 fp32 noise runs" in said
    assert said.rstrip().endswith("not drawn, without figures: amp_bf16, bf16_sr)")


def test_a_terminated_run_says_so_and_exits_143(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM is raised as ``Terminated`` (found by a hunt: it ended the process silently,
    a trial left RUNNING): the CLI says so, with the resume advice, and exits 128 + 15."""
    import autoprec.cli as cli
    from autoprec.interrupts import Terminated

    def terminated(args: object) -> int:
        raise Terminated

    monkeypatch.setitem(cli._COMMANDS, "tune", terminated)
    code = main(["tune", "m:f", "--data", "m:d", "--budget", "1", "--out", "x.json"])
    assert code == 143
    assert capsys.readouterr().err == (
        "autoprec: terminated; run the same command again to resume: finished trials are kept "
        "in the study\n"
    )


def test_a_failing_study_storage_or_write_is_one_line_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """optuna's storage error (SQLite's "database or disk is full") printed a traceback, and
    every OSError was told to free space (found by a review)."""
    import errno

    import optuna

    import autoprec.cli as cli

    argv = ["tune", "m:f", "--data", "m:d", "--budget", "1", "--out", "x.json"]
    # as optuna 5 raises it: its own fixed words, SQLite's cause beneath (a review)
    storage = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
    storage.__cause__ = RuntimeError("(sqlite3.OperationalError) database or disk is full")
    raised: list[Exception] = [
        storage,
        PermissionError(errno.EACCES, "Permission denied", "/data/full_runs/x.json"),
    ]

    def failing(args: object) -> int:
        raise raised.pop(0)

    monkeypatch.setitem(cli._COMMANDS, "tune", failing)
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "autoprec: error: the study's storage failed ((sqlite3.OperationalError) database or "
        "disk is full); the study keeps every finished trial: free space and run the same "
        "command again to resume\n"
    )
    assert main(argv) == 1
    assert capsys.readouterr().err.endswith(
        "Permission denied: '/data/full_runs/x.json'; the study keeps every finished trial: "
        "fix that and run "
        "the same command again to resume\n"
    )


def test_main_in_a_process_of_your_own_leaves_its_path_and_loggers() -> None:
    """Found by a hunt: main() called in a notebook or a test left the working folder on
    sys.path, the root and autoprec loggers at WARNING with the CLI's handlers, and a filter
    on torchao's logger."""
    import logging

    names = ("", "autoprec", "torchao")
    before = [(list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names]
    filters, path = list(logging.getLogger("torchao").filters), list(sys.path)
    assert main(["show", str(REPO / "profiles/example-l4-fp8_te.json")]) == 0
    assert main(["probe", "--model", "examples.raw_param_mlp:make_model"]) == 0
    assert [(list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names] == (
        before
    )
    assert logging.getLogger("torchao").filters == filters and sys.path == path


def test_a_divergence_refusal_names_the_cli_flags() -> None:
    """A review: the CLI's refusal of a diverging fp32 run named scheduler= and
    clip_grad_norm=, the Python arguments, not --scheduler and --clip."""
    from autoprec.cli import in_cli_words

    said = in_cli_words(
        "lower the lr, add warm-up (scheduler=) or clip gradients (clip_grad_norm=)"
    )
    assert said == "lower the lr, add warm-up (--scheduler) or clip gradients (--clip)"
