"""A Ray driver killed while a trial that Ray has not yet written to its experiment snapshot
runs: the restored experiment draws that trial again under a new Ray trial id and the same
number. The new trial continues the lost trial's MLflow run (no second run of that name, none
left RUNNING); a lost run that no trial takes up is closed with the reason."""
from __future__ import annotations

import signal

import pytest

from sweeps.tracking import layout
from tests.sweeps.backends.conftest import mlflow_client, run_cli, study_runs, write_spec
from tests.sweeps.study_helpers import save_spec, tiny_spec

pytestmark = pytest.mark.ray


def _seed_drawing(*epochs: int) -> int:
    """A TPE seed whose trials draw ``epochs`` in that order (what make_search's sampler draws)."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = {"epochs": CategoricalDistribution((1, 2))}
    for seed in range(100):
        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True))
        drawn = []
        for _ in epochs:
            trial = study.ask(space)
            drawn.append(trial.params["epochs"])
            study.tell(trial, 0.5)
        if tuple(drawn) == epochs:
            return seed
    raise AssertionError(f"no seed below 100 draws {epochs}")


@pytest.mark.slow
def test_a_trial_ray_forgot_when_its_driver_was_killed_continues_its_run(tmp_path, ray_tmp):
    """TPE over epochs (1, 2), one trial at a time, with a seed that draws 1 then 2: trial 0
    finishes with no epoch reported mid-trial; trial 1, suggested only once trial 0 ended,
    reports epoch 1 and the driver SIGKILLs itself there (``driver_kill_mid_trial``). Ray
    snapshots its experiment at most every hour here (``TUNE_GLOBAL_CHECKPOINT_S``), so trial 1
    is not in the snapshot the next run restores: Ray draws it again under a new trial id."""
    from core.faults import Fault

    study = tiny_spec("forgot", backend="ray", search={"epochs": {"type": "categorical", "choices": [1, 2]}},
                      sampler={"name": "tpe", "seed": _seed_drawing(1, 2)}, budget={"n_trials": 2, "max_failures": 1},
                      resources={"devices": "cpu", "workers": 1})
    del study["train"]["epochs"]  # searched
    spec = save_spec(tmp_path, study)
    rarely = {"TUNE_GLOBAL_CHECKPOINT_S": "3600"}
    killed = run_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT=Fault.DRIVER_KILL_MID_TRIAL.value, **rarely)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    _, before = study_runs(tmp_path, "forgot")
    lost = [r for r in before if r.info.run_name == "trial-1"]
    assert [r.info.status for r in lost] == ["RUNNING"]

    done = run_cli(tmp_path, "run", str(spec), "--quiet", **rarely)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, after = study_runs(tmp_path, "forgot")
    assert sorted(r.info.run_name for r in after) == ["trial-0", "trial-1"]  # no second run of a name
    assert all(r.info.status == "FINISHED" and r.data.tags[layout.TAG_STATE] == "COMPLETE" for r in after)
    continued = next(r for r in after if r.info.run_name == "trial-1")
    assert continued.info.run_id == lost[0].info.run_id
    assert continued.data.tags["sweeps.ray_trial_id"] != lost[0].data.tags["sweeps.ray_trial_id"]
    steps = [m.step for m in mlflow_client(tmp_path).get_metric_history(continued.info.run_id, "val_acc")]
    assert sorted(steps) == [1, 2]  # the epoch trained again is not logged twice


def test_a_lost_run_is_continued_by_its_trial_closed_for_another_and_never_left_running(tmp_path, monkeypatch):
    """In-process, on the study's real MLflow store: the lookup the trainable makes when no run
    carries its Ray trial id, and what the driver does at its end with lost runs no trial took."""
    from sweeps.backends.base import StudyResult, TrialRecord
    from sweeps.backends.ray_backend import settle_runs
    from sweeps.backends.ray_continuing_run import TAG_RAY_TRIAL_ID, adopt_lost_run
    from sweeps.parent_run import find_or_create_parent, reader_for, tracker_for
    from sweeps.spec.load import load_spec

    monkeypatch.chdir(tmp_path)
    spec = load_spec(write_spec(tmp_path, name="lost", backend="ray"))
    tracker, reader = tracker_for(spec), reader_for(spec)
    parent = find_or_create_parent(tracker, spec, spec.name, "ray")

    def lost(number: int, lr: float):
        run = tracker.start_run(f"trial-{number}", parent=parent, tags={
            layout.TAG_TRIAL_NUMBER: number, TAG_RAY_TRIAL_ID: f"old{number}", layout.TAG_STATE: "RUNNING"})
        tracker.log(run, params={"lr": lr})
        return run

    same, other, untaken = lost(1, 0.1), lost(2, 0.1), lost(3, 0.1)
    client = mlflow_client(tmp_path)

    got = adopt_lost_run(reader, tracker, parent, 1, "new1", {"lr": 0.1})
    assert got is not None and got.run_id == same.run_id
    assert client.get_run(same.run_id).data.tags[TAG_RAY_TRIAL_ID] == "new1"
    assert adopt_lost_run(reader, tracker, parent, 1, "new1", {"lr": 0.1}) is None  # found by its id from now on

    assert adopt_lost_run(reader, tracker, parent, 2, "new2", {"lr": 0.2}) is None  # another trial
    closed = client.get_run(other.run_id)
    assert closed.info.status == "FAILED" and closed.data.tags[layout.TAG_ERROR].startswith("lost:")
    assert adopt_lost_run(reader, tracker, parent, 4, "new4", {"lr": 0.1}) is None  # nothing lost

    tracker.end_run(same, "FINISHED")
    done = TrialRecord(number=1, state="COMPLETE", params={"lr": 0.1}, value=0.5, duration_s=1.0, run_id=same.run_id)
    done.ray_trial_id = "new1"  # type: ignore[attr-defined]  # as ray_records.load_result sets it
    settle_runs(tracker, reader, StudyResult(name="lost", backend="ray", direction="maximize", metric="val_acc",
                                             trials=[done], parent_run_id=parent.run_id))
    assert client.get_run(same.run_id).info.status == "FINISHED"
    left = client.get_run(untaken.run_id)
    assert left.info.status == "FAILED" and left.data.tags[layout.TAG_ERROR].startswith("lost:")
