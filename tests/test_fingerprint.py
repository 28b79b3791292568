"""Study fingerprints: digests, differences named, reference runs kept and reused safely."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch

from autoprec.drift import Fp32Runs
from autoprec.fingerprint import (
    StudyFingerprint,
    callable_digest,
    check_study,
    confirm_study,
    load_references,
    references_path,
    save_references,
    storage_file,
    tensor_digest,
    trainable_digest,
)
from autoprec.recipe import TrainingRecipe
from autoprec.specs import ModeSpec
from autoprec.trial import run_trial
from autoprec.trial_records import TrialResult
from examples import tasks


def _fingerprint(**changes: object) -> StudyFingerprint:
    values = {
        "model": "m",
        "batches": "b",
        "recipe": {"optimizer": "torch.optim.adamw:AdamW", "total_steps": None},
        "objective": "speed",
        "thresholds": {"max_loss_gap_units": 3.0},
        "candidates": ("fp32", "amp_bf16"),
        "budget_minutes": 1.0,
        "hardware": "cpu (Test CPU), torch 2.13.0",
        "seed": 0,
        "eval_fn": None,
        "autoprec_version": "0.1.0",
    }
    return StudyFingerprint(**{**values, **changes})  # type: ignore[arg-type]


def test_digest_follows_values_shapes_and_order() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(64, 64)
    b = torch.nn.Linear(64, 64)
    b.load_state_dict(a.state_dict())
    assert tensor_digest(a) == tensor_digest(b)
    with torch.no_grad():
        b.weight[0, 0] += 1.0  # the first element is always sampled
    assert tensor_digest(a) != tensor_digest(b)
    batches = [(torch.ones(2, 3), torch.zeros(2))]
    assert tensor_digest(batches) == tensor_digest([(torch.ones(2, 3), torch.zeros(2))])
    assert tensor_digest(batches) != tensor_digest([(torch.ones(3, 2), torch.zeros(2))])
    assert tensor_digest(batches * 2) != tensor_digest(batches)
    # a complex tensor: both parts count (``.float()`` warned and dropped the imaginary part)
    spectral = torch.complex(torch.ones(4), torch.zeros(4))
    assert tensor_digest([spectral]) != tensor_digest([spectral + 1j])


def test_a_buffer_the_model_does_not_save_counts_in_its_digest() -> None:
    # RoPE's ``inv_freq`` is registered with ``persistent=False``: two models with another
    # ``rope_theta`` had one digest and the second resumed the first one's study
    def rotary(theta: float) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        frequencies = 1.0 / theta ** (torch.arange(0, 8, 2).float() / 8)
        model.register_buffer("inv_freq", frequencies, persistent=False)
        return model

    assert tensor_digest(rotary(10000.0)) == tensor_digest(rotary(10000.0))
    assert tensor_digest(rotary(10000.0)) != tensor_digest(rotary(500000.0))


def test_differences_name_what_changed() -> None:
    stored = _fingerprint()
    assert _fingerprint().differences(stored) == []
    found = _fingerprint(
        objective="memory", model="other", recipe={"optimizer": "x", "total_steps": 5}
    ).differences(stored)
    assert found == [
        "model (other weights or data)",
        "recipe (optimizer, total_steps)",
        "objective (speed -> memory)",
    ]


def test_differences_name_the_thresholds_and_candidates_that_changed() -> None:
    """A resume refused for other thresholds or candidates says which (it said "thresholds")."""
    stored = _fingerprint()
    found = _fingerprint(
        thresholds={"max_loss_gap_units": 2.0, "max_rounded_beta2": 0.9995},
        candidates=("fp32", "bf16_sr"),
    ).differences(stored)
    assert found == [
        "thresholds (max_loss_gap_units, max_rounded_beta2)",
        "candidates (+bf16_sr, -amp_bf16)",
    ]


def test_check_study_records_then_refuses_another_run() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    assert check_study(study, _fingerprint(), "'s' in memory")
    assert study.user_attrs["fingerprint"]["objective"] == "speed"
    assert not check_study(study, _fingerprint(), "'s' in memory")  # the same run resumes
    # no outcome yet (its reference failed): another run takes the study over
    assert check_study(study, _fingerprint(budget_minutes=3.0), "'s' in memory")
    assert study.user_attrs["fingerprint"]["budget_minutes"] == 3.0
    study.tell(study.ask(), [1.0, 1.0])
    with pytest.raises(ValueError, match=r"budget_minutes \(3.0 -> 2.0\).*--study NAME"):
        check_study(study, _fingerprint(budget_minutes=2.0), "'s' in memory")


def test_a_study_with_trials_but_no_fingerprint_is_refused() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    trial = study.ask()
    study.tell(trial, [1.0, 1.0])
    with pytest.raises(ValueError, match="without a fingerprint"):
        check_study(study, _fingerprint(), "'old' in memory")


def _fp32_runs(seeds: tuple[int, ...]) -> tuple[TrialResult, ...]:
    task = tasks.regression()
    recipe = TrainingRecipe(optimizer=task.optimizer, loss_fn=task.mse)
    return tuple(
        run_trial(
            ModeSpec(mode="fp32"),
            task.model,
            task.batches,
            recipe=recipe,
            steps=4,
            heldout=task.heldout,
            seed=seed,
        )
        for seed in seeds
    )


def test_reference_runs_round_trip_only_under_their_fingerprint(tmp_path: Path) -> None:
    runs = _fp32_runs(seeds=(0, 1, 2))
    path = references_path(f"sqlite:///{tmp_path / 'x.db'}", "s")
    assert path == tmp_path / "x.db.s.references.pt"
    assert references_path("postgresql://host/db", "s") is None
    assert references_path(None, "s") is None
    save_references(path, _fingerprint(), Fp32Runs(*runs[:2]))  # no paired run
    loaded = load_references(path, _fingerprint())
    assert loaded is not None and loaded.paired is None and loaded.noise_runs == 1
    save_references(path, _fingerprint(), Fp32Runs(*runs))  # the paired run too
    loaded = load_references(path, _fingerprint())
    assert loaded is not None and loaded.noise_runs == 2
    for before, after in zip(runs, (loaded.reference, loaded.noise, loaded.paired), strict=True):
        assert after is not None
        assert after.record == before.record
        assert all(
            torch.equal(x[k], y[k])
            for x, y in zip(before.leg_weights, after.leg_weights, strict=True)
            for k in x
        )
        for x, y in zip(before.heldout_outputs, after.heldout_outputs, strict=True):
            assert x is not None and y is not None and x.shape == y.shape
            assert torch.equal(x.values, y.values) and x.top1 is not None
            assert y.top1 is not None and torch.equal(x.top1, y.top1)
    assert load_references(path, _fingerprint(seed=1)) is None
    # runs of another length (a deleted study's cache, its trials planned shorter) are not
    # this study's references, whatever the fingerprint
    save_references(path, _fingerprint(), Fp32Runs(*runs), steps=53)
    assert load_references(path, _fingerprint(), steps=53) is not None
    assert load_references(path, _fingerprint(), steps=294) is None
    # a cache written before the paired run's nudge was recorded (one fp32 ulp, 2026-11-29):
    # its paired run is measured again under today's nudge
    old = torch.load(path, weights_only=True)
    del old["nudge"]
    torch.save(old, path)
    assert load_references(path, _fingerprint(), steps=53) is None
    path.write_bytes(b"not a torch file")
    assert load_references(path, _fingerprint()) is None


def test_a_loss_of_one_name_with_other_settings_has_another_digest() -> None:
    import functools

    from autoprec.fingerprint import callable_digest

    def huber_of(delta: float):  # type: ignore[no-untyped-def]
        return lambda output, target: torch.nn.functional.huber_loss(output, target, delta=delta)

    assert callable_digest(torch.nn.HuberLoss(delta=1e-4)) != callable_digest(
        torch.nn.HuberLoss(delta=100)
    )
    huber = torch.nn.functional.huber_loss
    assert callable_digest(functools.partial(huber, delta=1.0)) != callable_digest(
        functools.partial(huber, delta=2.0)
    )
    assert callable_digest(huber_of(1.0)) != callable_digest(huber_of(2.0))
    # the same settings digest alike (no memory address, no object identity in it)
    assert callable_digest(huber_of(1.0)) == callable_digest(huber_of(1.0))
    assert callable_digest(torch.nn.HuberLoss(delta=1.0)) == callable_digest(
        torch.nn.HuberLoss(delta=1.0)
    )
    assert callable_digest(None) is None
    # a function moved within its file (another line, a nested lambda's too) computes the same
    source = (
        "def loss(o, t):\n    scale = lambda x: x * 2\n    return (scale(o) - t).pow(2).mean()\n"
    )
    moved = [{}, {}]
    exec(compile(source, "train.py", "exec"), moved[0])
    exec(compile("\n" * 30 + source, "train.py", "exec"), moved[1])
    assert callable_digest(moved[0]["loss"]) == callable_digest(moved[1]["loss"])


def test_a_study_refuses_a_resume_with_other_modules_or_another_loss_setting(
    tmp_path: Path,
) -> None:
    # a GELU swapped for a ReLU changes no weight, and HuberLoss(delta) only its attribute:
    # both resumed the study and reused the other run's figures
    import autoprec

    def model(activation: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), activation, torch.nn.Linear(16, 1))

    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
        for _ in range(12)
    ]
    storage = f"sqlite:///{tmp_path / 's.db'}"
    common = {"budget_minutes": 0.2, "modes": ["amp_bf16"], "storage": storage, "study_name": "s"}
    autoprec.tune(model(torch.nn.GELU()), batches, loss_fn=torch.nn.HuberLoss(delta=1.0), **common)
    with pytest.raises(
        ValueError, match=r"architecture \(other modules, module settings or code\)"
    ):
        autoprec.tune(
            model(torch.nn.ReLU()), batches, loss_fn=torch.nn.HuberLoss(delta=1.0), **common
        )
    with pytest.raises(ValueError, match=r"what loss_fn computes with"):
        autoprec.tune(
            model(torch.nn.GELU()), batches, loss_fn=torch.nn.HuberLoss(delta=100.0), **common
        )


def test_references_interrupted_while_written_leave_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a temporary named by the pid stayed behind, one more after each interrupted run
    run = _fp32_runs(seeds=(0,))[0]
    path = tmp_path / "x.db.s.references.pt"
    save = torch.save

    def interrupted(data: object, file: Path) -> None:
        save(data, file)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_references(path, _fingerprint(), Fp32Runs(run, run))
    assert list(tmp_path.iterdir()) == []


def _scaled(scale: float) -> object:
    def loss(output: torch.Tensor, target: torch.Tensor, *, weight: float = scale) -> object:
        return weight * (output - target).abs().mean()

    return loss


class _Weighted:
    def __init__(self, weight: float) -> None:
        self.weight = weight

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> object:
        return self.weight * (output - target).abs().mean()


def test_what_a_function_computes_with_includes_keyword_defaults_and_its_object() -> None:
    # a keyword-only default and a bound method's object were not read: a loss 100x larger
    # resumed a study, and reused its fp32 reference
    assert callable_digest(_scaled(1.0)) != callable_digest(_scaled(100.0))
    assert callable_digest(_Weighted(1.0).loss) != callable_digest(_Weighted(100.0).loss)
    assert callable_digest(_Weighted(1.0).loss) == callable_digest(_Weighted(1.0).loss)


def _printed_under_hash_seeds(script: str) -> set[str]:
    """What ``script`` prints in three processes of other hash seeds."""
    return {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2, 3)
    }


def test_a_set_in_a_closure_digests_the_same_in_every_process() -> None:
    # the order of a set of strings follows the hash seed: the same run was refused as another
    script = (
        "import functools\n"
        "from autoprec.fingerprint import callable_digest\n"
        "def loss(o, y, *, skip=frozenset()):\n    return o\n"
        "print(callable_digest(functools.partial(loss, skip={'pad', 'eos', 'bos', 'unk'})))\n"
    )
    assert len(_printed_under_hash_seeds(script)) == 1


def test_batches_holding_a_set_or_an_object_digest_the_same_in_every_process() -> None:
    """Found by a hunt: a batch's non-tensor leaves were digested by their plain repr (an
    object's address, a set's hash-seed order), so a resumed tune() was refused as another
    run ("batches (other weights or data) differ")."""
    script = (
        "import torch\n"
        "from autoprec.fingerprint import tensor_digest\n"
        "class Meta:\n    def __init__(self, i):\n        self.i = i\n"
        "batches = [(torch.ones(2, 2) * i, {'meta': Meta(i), 'tags': {'a', 'b', 'c', 'd'}})"
        " for i in range(3)]\n"
        "print(tensor_digest(batches))\n"
    )
    assert len(_printed_under_hash_seeds(script)) == 1


def test_an_eval_fn_over_a_loader_digests_the_loaders_data() -> None:
    """Found by a hunt: a DataLoader's repr holds no data (``<... object at 0x...>``, the
    address left out), so an eval_fn over a validation loader of other data digested the same
    and a resumed study reused verdicts scored on the other set. Across processes the digest
    of the same data is the same."""
    script = (
        "import sys, torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from autoprec.fingerprint import callable_digest\n"
        "data = torch.randn(16, 4, generator=torch.Generator().manual_seed(int(sys.argv[1])))\n"
        "loader = DataLoader(TensorDataset(data), batch_size=4)\n"
        "def eval_fn(model):\n    return sum(float(model(x).sum()) for (x,) in loader)\n"
        "print(callable_digest(eval_fn))\n"
    )

    def digest(seed: int) -> str:
        return subprocess.run(
            [sys.executable, "-c", script, str(seed)], capture_output=True, text=True, check=True
        ).stdout

    assert digest(0) == digest(0)
    assert digest(0) != digest(123)  # a module-level loader, as a CLI eval_fn's module builds
    from torch.utils.data import DataLoader, TensorDataset

    def closing_over(seed: int) -> object:
        data = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
        loader = DataLoader(TensorDataset(data), batch_size=4)

        def eval_fn(model: torch.nn.Module) -> float:
            return sum(float(model(x).sum()) for (x,) in loader)

        return eval_fn

    assert callable_digest(closing_over(0)) == callable_digest(closing_over(0))
    assert callable_digest(closing_over(0)) != callable_digest(closing_over(123))


def test_frozen_layers_and_group_membership_are_part_of_the_fingerprint() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    groups = [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    before = trainable_digest(model, groups)
    assert trainable_digest(model, [["0.weight", "1.weight"], ["0.bias", "1.bias"]]) != before
    model[0].requires_grad_(False)
    assert trainable_digest(model, groups) != before


def test_an_in_memory_sqlite_url_is_no_file() -> None:
    # its references were written to ':memory:.autoprec.references.pt' in the working folder
    assert storage_file("sqlite:///:memory:") is None
    assert references_path("sqlite:///:memory:", "s") is None


def test_a_study_another_run_took_over_during_the_reference_is_refused() -> None:
    # run A recorded its fingerprint and measured its fp32 reference; run B, started on the
    # empty study meanwhile, took it over and ran its trials; A then adopted B's outcomes
    study = optuna.create_study(directions=["maximize", "minimize"])
    ours = _fingerprint()
    assert check_study(study, ours, "s")
    confirm_study(study, ours, "s")  # still ours: goes on
    assert check_study(study, _fingerprint(seed=1), "s")  # B takes the empty study over
    with pytest.raises(ValueError, match=r"Another run took over the study s.*seed \(1 -> 0\)"):
        confirm_study(study, ours, "s")
    # tune() names the study with its storage's password hidden (it printed the raw URL here)
    from autoprec.tuning import study_place

    where = study_place(study, "postgresql://bob:s3cret@db.example/optuna")
    with pytest.raises(ValueError, match=r"postgresql://bob:\*\*\*@db\.example") as refused:
        confirm_study(study, ours, where)
    assert "s3cret" not in str(refused.value)


def test_a_study_written_by_another_autoprec_is_refused_in_one_line() -> None:
    """Records forbid unknown fields and the project adds fields: a study another version
    wrote failed with pydantic's multi-line "1 validation error for StudyFingerprint"."""
    from autoprec import __version__
    from autoprec.search import finished_outcomes

    study = optuna.create_study(directions=["maximize", "minimize"])
    newer = {**_fingerprint().model_dump(mode="json"), "autoprec_version": "9.0.0"}
    study.set_user_attr("fingerprint", {**newer, "compile_mode": "max-autotune"})
    trial = study.ask()
    trial.set_user_attr("outcome", '{"spec": {"mode": "fp32"}, "status": "accepted", "joules": 1}')
    study.tell(trial, [1.0, 1.0])
    for refused in (
        lambda: check_study(study, _fingerprint(), "'s' in memory"),
        lambda: confirm_study(study, _fingerprint(), "'s' in memory"),
        lambda: finished_outcomes(study),
    ):
        with pytest.raises(ValueError) as error:
            refused()
        said = str(error.value)
        assert f"written by autoprec 9.0.0, this is {__version__}" in said, said
        assert "Extra inputs are not permitted" in said and "\n" not in said
        assert "Use another study name (--study NAME / study_name=)" in said


def test_a_trials_file_of_another_autoprec_is_named_as_one(tmp_path: Path) -> None:
    """It was called "not a tune run's trials file" (it is one, of another version)."""
    import json

    from autoprec.report import outcomes_from_result

    trials = tmp_path / "p.trials.json"
    trials.write_text(json.dumps({"profile": {"autoprec_version": "9.0.0"}, "energy": 1}))
    with pytest.raises(ValueError, match=r"written by autoprec 9\.0\.0.*Draw it with the autoprec"):
        outcomes_from_result(trials)


class _Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.scale = scale  # a plain float, as nanoGPT keeps self.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)) * self.scale)


class _Sine(_Scaled):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sin(30 * self.fc1(x)) * self.scale)


def test_the_architecture_digest_reads_plain_attributes_and_code() -> None:
    """Found by a hunt: a model with ``self.scale = 50`` for 1, or a forward edited from GELU
    to sin, had the same weights and repr and resumed the other's study."""
    from autoprec.fingerprint import architecture_digest

    assert architecture_digest(_Scaled(1.0)) == architecture_digest(_Scaled(1.0))
    assert architecture_digest(_Scaled(50.0)) != architecture_digest(_Scaled(1.0))
    sine = _Sine(1.0)
    sine.__class__.__name__ = sine.__class__.__qualname__ = "_Scaled"  # the same repr
    assert repr(sine) == repr(_Scaled(1.0))
    assert architecture_digest(sine) != architecture_digest(_Scaled(1.0))


def test_the_optimizer_state_counts_in_the_fingerprint_not_only_its_steps() -> None:
    """Found by a hunt: two checkpoints of one step count (exp_avg 1e-6 and 10) resumed each
    other's study; only the step count was recorded."""
    from autoprec.fingerprint import optimizer_state_digest

    def stepped(moment: float) -> torch.optim.Optimizer:
        model = _Scaled(1.0)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        for state in optimizer.state.values():
            state["exp_avg"].fill_(moment)
        return optimizer

    assert optimizer_state_digest(torch.optim.AdamW(_Scaled(1.0).parameters())) == ""
    assert optimizer_state_digest(stepped(1e-6)) == optimizer_state_digest(stepped(1e-6))
    assert optimizer_state_digest(stepped(1e-6)) != optimizer_state_digest(stepped(10.0))
    ours = _fingerprint().model_copy(update={"optimizer_state": "a"})
    assert ours.differences(ours.model_copy(update={"optimizer_state": ""})) == [
        "optimizer state (other moments or none)"
    ]


def test_a_long_study_name_gets_a_references_file_the_file_system_takes(tmp_path: Path) -> None:
    """Found by a hunt: a 126-character ``--out`` stem named the study, and its references
    file (storage name + study name) passed 255 bytes: "File name too long" after the fp32
    runs were measured, and again at every resume."""
    stem = "sweep_" + "x" * 120
    storage = str(tmp_path / f"{stem}.study.db")
    paths = {references_path(storage, stem + suffix) for suffix in ("", "_b")}
    assert len(paths) == 2  # two long names, two files
    for path in paths:
        assert path is not None and len(path.name.encode()) <= 240
        assert path.name.startswith(f"{stem}.study.db"[:80]) and path.name.endswith(".pt")
        path.write_bytes(b"")  # the file system takes it
    short = references_path(storage[: -len(".study.db")][:20] + ".db", "s")
    assert short is not None and short.name.endswith(".db.s.references.pt")
