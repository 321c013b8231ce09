"""What a finished trial's records hold when its worker died or its task was broken, through the
real `sweeps run`: the whole curves after a kill between training and recording the result, and
the reason when the task's data is empty (not a trial that "completed" with val_acc 0.0)."""
from __future__ import annotations

import pytest

from core import checkpoint as ckpt
from tests.sweeps.study_helpers import cli_in_process, load_study, mlflow_runs, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_worker_killed_after_training_leaves_the_retry_with_every_curve(tmp_path):
    spec = write_spec(tmp_path, name="killed", budget={"n_trials": 1, "max_failures": 3})
    # The worker trains the trial to the end, saves the final checkpoint, then dies before
    # anything records the outcome (and before its buffered points reach MLflow).
    first = cli_in_process(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT="after_training")
    assert not [t for t in load_study(tmp_path, "killed").trials if t.state.name == "COMPLETE"], first.stdout
    for _ in range(3):  # whatever the orchestrator does with the dead worker's trial, run until done
        proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
        if any(t.state.name == "COMPLETE" for t in load_study(tmp_path, "killed").trials):
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [done] = [t for t in load_study(tmp_path, "killed").trials if t.state.name == "COMPLETE"]

    # The retry resumed from the final epoch's checkpoint (no epoch left to train) in a new run.
    state = ckpt.load_checkpoint(tmp_path / done.user_attrs["out_dir"] / ckpt.LAST)
    assert state["epoch"] == 2 and state["progress"] is None
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    run = client.get_run(done.user_attrs["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    val_acc = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_acc"))
    assert val_acc == [(h["epoch"], h["val_acc"]) for h in _history(state)] and len(val_acc) == 2
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "step/train_loss"))
    assert [s for s, _ in losses] == list(range(1, state["step"] + 1))  # one point per step, no gap, no repeat
    assert losses == list(zip(state["steps"]["step"].tolist(), state["steps"]["train_loss"].tolist(), strict=True))
    assert run.data.metrics["objective"] == max(v for _, v in val_acc)
    # One MLflow run per attempt (sweeps run replaces a dead worker, so one invocation may make several);
    # every killed attempt's run is closed FAILED, only the finished one is FINISHED.
    trial_runs = [r for r in mlflow_runs(tmp_path, "killed") if r.data.tags.get("sweeps.role") == "trial"]
    assert len(trial_runs) == len(load_study(tmp_path, "killed").trials)
    assert sorted(r.info.status for r in trial_runs) == ["FAILED"] * (len(trial_runs) - 1) + ["FINISHED"]


def test_a_worker_killed_before_the_study_names_its_run_has_the_run_closed(tmp_path):
    """A worker killed after making its trial's MLflow run, before the study recorded the run's id:
    the run is found by the trial number it is tagged with and closed FAILED with the reason when
    the trial is requeued, not left RUNNING. The next invocation (no fault) completes the trial."""
    spec = write_spec(tmp_path, name="unnamed", budget={"n_trials": 1, "max_failures": 1})
    cli_in_process(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT="trial_run_made")
    trials = load_study(tmp_path, "unnamed").trials
    assert trials and not [t for t in trials if t.state.name == "COMPLETE"]
    assert not [t for t in trials if "mlflow_run_id" in t.user_attrs]  # every attempt died before naming its run
    runs = [r for r in mlflow_runs(tmp_path, "unnamed") if r.data.tags.get("sweeps.role") == "trial"]
    assert runs and [r.info.status for r in runs] == ["FAILED"] * len(runs), [r.info.status for r in runs]
    assert all(r.data.tags["sweeps.state"] == "FAIL" and "killed by SIGKILL" in r.data.tags["sweeps.error"]
               for r in runs)
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [r for r in mlflow_runs(tmp_path, "unnamed") if r.data.tags.get("sweeps.role") == "trial"]
    assert sorted(r.info.status for r in runs) == ["FAILED"] * (len(runs) - 1) + ["FINISHED"]


def _history(state: dict) -> list[dict]:
    import json

    return json.loads(state["history_json"])


def test_a_user_task_with_empty_validation_data_fails_its_trial_with_the_reason(tmp_path):
    spec = write_spec(tmp_path, name="empty", budget={"n_trials": 1, "max_failures": 1},
                      task={"name": None, "target": "tests.sweeps.empty_task:make_empty_val_task", "model": "mlp",
                            "args": {}})
    cli_in_process(tmp_path, "run", str(spec), "--quiet")
    [trial] = load_study(tmp_path, "empty").trials
    assert trial.state.name == "FAIL"

    status = cli_in_process(tmp_path, "status", str(spec))
    assert status.returncode == 0, status.stdout + status.stderr
    line = next(s for s in status.stdout.splitlines() if s.startswith("trial 0 failed: "))
    assert "TaskError: task 'empty_val_digits'" in line and "returned an empty validation dataset" in line
    [run] = [r for r in mlflow_runs(tmp_path, "empty") if r.data.tags.get("sweeps.role") == "trial"]
    assert run.info.status == "FAILED" and "val_acc" not in run.data.metrics
