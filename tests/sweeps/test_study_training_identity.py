"""A study's trials were trained one way: a resume (or a joining worker) whose spec trains them
another way (epochs, the task, its model or data arguments, the optimizer, the LR range test) is
refused, naming what changed and ``--fresh``; operational settings (loader workers, device,
exports, checkpoints) may change. Without this, 8-epoch and 2-epoch trials would be compared by
the sampler and the best trial would be one the spec no longer trains."""
from __future__ import annotations

import sqlite3

import optuna
import pytest

from sweeps.backends import optuna_attrs, optuna_storage
from sweeps.errors import StudyStateError
from sweeps.spec.load import spec_from_dict
from sweeps.spec.objectives import judged_by
from tests.sweeps.study_helpers import cli_in_process, tiny_spec, write_spec


def _spec(tmp_path, **overrides):
    storage = {} if overrides.get("backend") == "ray" else {"storage": str(tmp_path / "trained.journal")}
    return spec_from_dict(tiny_spec("trained", tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"},
                                    **storage, **overrides))


@pytest.mark.parametrize("changed, named", [
    ({"train": {"epochs": 3}}, "train.epochs: 2 -> 3"),
    ({"train": {"optimizer": "adam"}}, "train.optimizer: '(default)' -> 'adam'"),
    ({"train": {"label_smoothing": 0.1}}, "train.label_smoothing: '(default)' -> 0.1"),
    ({"task": {"args": {"width": 64}}}, "task.args: {'width': 32} -> {'width': 64}"),
    ({"task": {"model": "cnn", "args": {}}}, "task.model: 'mlp' -> 'cnn'"),
    ({"lr_finder": {"enabled": True}}, "lr_finder: off -> on"),
])
def test_a_resume_that_trains_differently_is_refused_naming_the_change(tmp_path, changed, named):
    from sweeps.backends import optuna_study

    optuna_study.open_study(_spec(tmp_path))
    with pytest.raises(StudyStateError) as info:
        optuna_study.open_study(_spec(tmp_path, **changed))
    said = str(info.value)
    assert "study 'trained' changed since it started: training (" in said and named in said, said
    assert "--fresh" in said
    assert optuna_study.open_study(_spec(tmp_path, **changed), fresh=True).study_name == "trained-v2"
    assert optuna_study.open_study(_spec(tmp_path, **changed)).study_name == "trained-v2"  # resumes the newest
    with pytest.raises(StudyStateError, match="study 'trained-v2' changed since it started: training"):
        optuna_study.open_study(_spec(tmp_path))  # the newest version trains the changed way


def test_operational_settings_and_spelt_out_defaults_may_change_between_runs(tmp_path):
    from sweeps.backends import optuna_study

    optuna_study.open_study(_spec(tmp_path))
    same = _spec(tmp_path, train={"num_workers": 2, "export_onnx": True, "save_checkpoints": False,
                                  "device": "cpu", "pin_memory": False, "onnx_tolerance": 1e-3,
                                  "momentum": 0.9, "grad_accum_steps": 1, "epochs": 2.0,  # defaults, 2 as 2.0
                                  "distributed": {"nproc": 1}},  # a nested section at its default
                 lr_finder={"enabled": False, "rule": "steepest", "num_steps": 50},  # off: its settings unused
                 resources={"workers": 2}, budget={"n_trials": 9})
    assert optuna_study.open_study(same).study_name == "trained"


def test_a_study_that_stored_no_training_resumes_and_stores_it_from_then_on(tmp_path):
    from sweeps.backends import optuna_study

    study = optuna_study.open_study(_spec(tmp_path))
    older = {k: v for k, v in judged_by(_spec(tmp_path)).items() if k != "training"}
    study.set_user_attr(optuna_attrs.ATTR_JUDGED_BY, older)  # as a study started before this stored it
    assert optuna_study.open_study(_spec(tmp_path, train={"epochs": 5})).study_name == "trained"
    stored = optuna.load_study(study_name="trained", storage=optuna_storage.open_storage(_spec(tmp_path)))
    assert stored.user_attrs[optuna_attrs.ATTR_JUDGED_BY]["training"]["train"]["epochs"] == 5
    with pytest.raises(StudyStateError, match=r"train.epochs: 5 -> 2"):
        optuna_study.open_study(_spec(tmp_path))


def test_a_study_that_stored_its_defaults_spelt_out_resumes_with_the_same_spec(tmp_path):
    """A study whose stored train settings hold defaults (as the first version of this check
    stored them) is compared the same way: the unchanged spec resumes."""
    from sweeps.backends import optuna_study

    study = optuna_study.open_study(_spec(tmp_path))
    stored = study.user_attrs[optuna_attrs.ATTR_JUDGED_BY]
    raw = _spec(tmp_path).train  # optimizer sgd, scheduler constant, seed 0: defaults, kept raw
    study.set_user_attr(optuna_attrs.ATTR_JUDGED_BY, {**stored, "training": {**stored["training"], "train": raw}})
    assert optuna_study.open_study(_spec(tmp_path)).study_name == "trained"


def test_a_ray_study_resumed_with_other_training_is_refused(tmp_path, monkeypatch):
    from sweeps.backends import ray_records as rr
    from sweeps.backends.ray_backend import RayBackend

    monkeypatch.chdir(tmp_path)
    backend = RayBackend()
    meta = backend._checked_meta(_spec(tmp_path, backend="ray"), "trained")
    (rr.ray_root() / "trained").mkdir(parents=True)
    meta = {**meta, "joined": True}  # its driver joined Ray: trials ran
    rr.write_meta("trained", meta)
    assert backend._checked_meta(_spec(tmp_path, backend="ray", train={"num_workers": 3}), "trained") == meta
    with pytest.raises(StudyStateError, match=r"training \(train.epochs: 2 -> 4\)"):
        backend._checked_meta(_spec(tmp_path, backend="ray", train={"epochs": 4}), "trained")


@pytest.mark.slow
def test_sweeps_run_with_more_epochs_under_the_same_name_exits_2_and_writes_nothing(tmp_path):
    spec = write_spec(tmp_path, "trained", budget={"n_trials": 1})
    first = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert first.returncode == 0, first.stdout + first.stderr
    runs_before = _mlflow_runs(tmp_path)
    spec = write_spec(tmp_path, "trained", budget={"n_trials": 2}, train={"epochs": 3})
    again = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    said = " ".join(again.stderr.split())
    assert again.returncode == 2 and "Traceback" not in said, again.stderr
    assert "train.epochs: 2 -> 3" in said and f"sweeps run {spec} --fresh" in said, said
    assert _mlflow_runs(tmp_path) == runs_before  # no study run reopened, no trial run made
    study = optuna.load_study(study_name="trained", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "runs" / "trained.journal"))))
    assert [t.state.name for t in study.trials] == ["COMPLETE"]
    fresh = cli_in_process(tmp_path, "run", str(spec), "--quiet", "--fresh")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr


def _mlflow_runs(folder) -> list[tuple]:
    with sqlite3.connect(folder / "runs" / "mlflow.db") as db:
        return sorted(db.execute("SELECT run_uuid, status, end_time FROM runs").fetchall())
