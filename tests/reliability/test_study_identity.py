"""A new trial never trains on another study's checkpoint (trust issue, defect 1): a study's
identity (a UUID) is in the study, its MLflow run and every trial folder it claims."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import cli_in_process, load_study, mlflow_runs, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(folder: Path, spec: Path, *args: str) -> None:
    proc = cli_in_process(folder, "run", str(spec), "--quiet", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _trial_runs(folder: Path, experiment: str, uid: str) -> dict[int, object]:
    return {int(r.data.tags["sweeps.trial_number"]): r for r in mlflow_runs(folder, experiment)
            if r.data.tags.get("sweeps.role") == "trial" and r.data.tags.get("sweeps.study_uid") == uid}


def _reference_values(tmp_path: Path, **overrides) -> list[float]:
    """The trial values of the same spec run in a folder of its own: what an honest run reports."""
    ref = tmp_path / "reference"
    _run(ref, write_spec(ref, **overrides))
    return [t.value for t in load_study(ref, "tiny").trials]


def test_a_study_recreated_after_its_journal_was_deleted_does_not_resume_the_old_checkpoints(tmp_path):
    work = tmp_path / "work"
    _run(work, write_spec(work, budget={"n_trials": 2}))
    old_uid = load_study(work, "tiny").user_attrs["study_uid"]
    (work / "runs" / "tiny.journal").unlink()
    new_spec = write_spec(work, budget={"n_trials": 2}, sampler={"name": "random", "seed": 7})
    _run(work, new_spec)
    study = load_study(work, "tiny")
    uid = study.user_attrs["study_uid"]
    assert uid != old_uid
    # Each new trial trained its own point from scratch: the values of an untouched run.
    assert [t.value for t in study.trials] == _reference_values(
        tmp_path, budget={"n_trials": 2}, sampler={"name": "random", "seed": 7})
    runs = _trial_runs(work, "tiny", uid)
    for t in study.trials:
        folder = work / "runs" / "tiny" / f"trial-{t.number:04d}"
        owner = json.loads((folder / "owner.json").read_text())
        assert owner == {"owner": f"{uid}:trial-{t.number:04d}", "params": t.params}
        assert json.loads((folder / "config.json").read_text())["train"]["lr"] == t.params["lr"]
        moved = Path(runs[t.number].data.tags["sweeps.moved_aside"])
        assert moved.parent == work / "runs" / "tiny" / "moved-aside"
        assert json.loads((moved / "owner.json").read_text())["owner"] == f"{old_uid}:trial-{t.number:04d}"
        assert (moved / "last.pt").exists()  # kept, never trained on
    # A new study, a new MLflow parent run: the old one keeps the old trials.
    parents = [r for r in mlflow_runs(work, "tiny") if r.data.tags.get("sweeps.role") == "study"]
    assert sorted(r.data.tags["sweeps.study_uid"] for r in parents) == sorted([old_uid, uid])


def test_two_specs_of_one_name_with_their_own_storage_do_not_share_checkpoints(tmp_path):
    work = tmp_path / "work"
    a = write_spec(work / "a", budget={"n_trials": 1}, storage=str(work / "runs" / "a.journal"))
    b = write_spec(work / "b", budget={"n_trials": 1}, storage=str(work / "runs" / "b.journal"),
                   train={"epochs": 3}, sampler={"name": "random", "seed": 3})
    _run(work, a)
    _run(work, b)  # same name, same runs/tiny folder, another study: another epochs count too
    values = [t.value for t in load_study_at(work / "runs" / "b.journal").trials]
    assert values == _reference_values(tmp_path, budget={"n_trials": 1}, train={"epochs": 3},
                                       sampler={"name": "random", "seed": 3})


def test_fresh_version_whose_folder_exists_does_not_resume_it(tmp_path):
    work = tmp_path / "work"
    spec = write_spec(work, budget={"n_trials": 1})
    _run(work, spec)
    squatter = work / "runs" / "tiny-v2" / "trial-0000"  # left by an earlier, deleted tiny-v2
    squatter.parent.parent.joinpath("tiny").rename(squatter.parent)
    _run(work, spec, "--fresh")
    (trial,) = load_study_at(work / "runs" / "tiny.journal", "tiny-v2").trials
    assert trial.state.name == "COMPLETE"
    assert (squatter.parent / "moved-aside").is_dir()
    assert json.loads((squatter / "owner.json").read_text())["owner"].endswith(":trial-0000")


def load_study_at(journal: Path, name: str = "tiny"):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(journal))))
