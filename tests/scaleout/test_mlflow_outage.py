"""A real ``mlflow server`` killed in the middle of a two-worker study on PostgreSQL and started
again a little later: the study reaches its budget with no restart by hand, and every run, curve
and artifact ends up on the server, nested under the study's run, nothing twice.

The test acts at known points (tests/scaleout/outage_tasks.py): it kills the server while the first
two trials are held after their first epoch, so they train on and end during the outage; the next
two trials start during the outage (their runs can only be made locally) and are held after their
first epoch while the server comes back."""
from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.scaleout.scaleout_helpers import Output, rest, start_mlflow_server, stop_group, wait_for
from tests.sweeps.study_helpers import ROOT, sweeps_env, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(1200)]

HERE = Path(__file__).resolve().parent
EPOCHS, BATCH, N_TRIALS = 3, 64, 6


def _steps_per_epoch() -> int:
    from core.tasks.digits import DigitsTask

    train, _ = DigitsTask("mlp").datasets()
    return math.ceil(len(train) / BATCH)


def _search(base: str, experiment_id: str) -> list[dict]:
    runs = rest(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id], "max_results": 1000})
    return runs.get("runs", [])


def _tags(run: dict) -> dict:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def _history(base: str, run_id: str, key: str) -> list[int]:
    got = rest(base, f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={key}&max_results=25000")
    return sorted(int(m["step"]) for m in got.get("metrics", []))


def test_a_study_runs_through_an_mlflow_server_outage(tmp_path, fresh_db, free_port):
    server_store, storage, barriers = fresh_db(), fresh_db(), tmp_path / "barriers"
    barriers.mkdir()
    proc, base, _, _ = start_mlflow_server(tmp_path, server_store, free_port)
    spec = write_spec(tmp_path, name="outage", storage=storage, tracking={"uri": base},
                      task={"name": None, "target": "outage_tasks:make_held_task", "model": "mlp", "args": {}},
                      train={"epochs": EPOCHS, "batch_size": BATCH}, budget={"n_trials": N_TRIALS},
                      resources={"devices": "cpu", "workers": 2})
    env = sweeps_env(PYTHONPATH=f"{HERE}:{ROOT}", OMP_NUM_THREADS="1", SWEEPS_TRACKING_RETRY_S="1",
                     OUTAGE_DIR=str(barriers), OUTAGE_EPOCH_STEPS=str(_steps_per_epoch()),
                     OUTAGE_HOLD_down="0,1", OUTAGE_HOLD_up="2,3")
    study = subprocess.Popen([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--quiet"], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Output(study)
    try:
        def held(*tickets: int):
            def check():
                assert study.poll() is None, f"sweeps run exited with {study.returncode}:\n{out.text()}"
                return all((barriers / f"at-{t}").exists() for t in tickets)
            return check

        # Trials 0 and 1 have one epoch in the store; the server dies under them.
        wait_for(held(0, 1), timeout=600, what=out.text)
        stop_group(proc)
        (barriers / "go-down").touch()
        # The next two trials start while nothing listens: their runs exist only on this machine.
        wait_for(held(2, 3), timeout=600, what=out.text)
        proc, _, _, _ = start_mlflow_server(tmp_path, server_store, free_port)
        (barriers / "go-up").touch()
        code, text = out.finish(timeout=900)
    finally:
        if study.poll() is None:
            study.kill()
        stop_group(proc)
        proc, _, _, _ = start_mlflow_server(tmp_path, server_store, free_port)  # to read it back
    try:
        assert code == 0, text
        assert "unreachable" in text  # the outage was real, and said so
        experiment = rest(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=outage")["experiment"]
        runs = _search(base, experiment["experiment_id"])
        parents = [r for r in runs if _tags(r).get("sweeps.role") == "study"]
        trials = [r for r in runs if _tags(r).get("sweeps.role") == "trial"]
        assert len(parents) == 1 and len(runs) == 1 + N_TRIALS, [(r["info"]["run_name"], _tags(r)) for r in runs]
        parent_id = parents[0]["info"]["run_id"]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(base)
        numbers = Counter(int(_tags(r)["sweeps.trial_number"]) for r in trials)
        assert numbers == Counter(range(N_TRIALS))  # each trial once: no run made twice
        steps = _steps_per_epoch() * EPOCHS
        for run in trials:
            run_id, tags = run["info"]["run_id"], _tags(run)
            assert tags["mlflow.parentRunId"] == parent_id and tags["sweeps.client_run_id"].startswith("local-")
            assert run["info"]["status"] == "FINISHED" and tags["sweeps.state"] == "COMPLETE", tags
            assert _history(base, run_id, "val_acc") == list(range(1, EPOCHS + 1))  # every epoch, once
            assert _history(base, run_id, "step/train_loss") == list(range(1, steps + 1))
            listed = rest(base, f"/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=checkpoints")
            assert "checkpoints/best.pt" in [f["path"] for f in listed.get("files", [])]
            # Trials that ended during the outage too: their logged model and dataset inputs.
            assert tags.get("sweeps.model_id") and "sweeps.model_error" not in tags, tags
            assert str(client.get_logged_model(tags["sweeps.model_id"]).status).endswith("READY")
            assert len(client.get_run(run_id).inputs.dataset_inputs) == 2
        assert parents[0]["info"]["status"] == "FINISHED"
        assert not list((tmp_path / "runs" / ".mlflow_spool").glob("*.jsonl"))  # nothing left to sync by hand
        # The study names each trial's run by the store's id, or (a trial that ended during the
        # outage) by the id it was made under, which tags exactly one run.
        import optuna

        by_client = {_tags(r)["sweeps.client_run_id"]: r["info"]["run_id"] for r in trials}
        study_trials = optuna.load_study(study_name="outage", storage=storage).trials
        recorded = [t.user_attrs["mlflow_run_id"] for t in study_trials]
        assert sorted(by_client.get(r, r) for r in recorded) == sorted(by_client.values())
        assert any(r in by_client.values() for r in recorded)  # trials that ended with the store up: its id
        status = subprocess.run([sys.executable, "-m", "sweeps.cli", "status", str(spec), "--format", "json"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count('"COMPLETE"') >= N_TRIALS
    finally:
        stop_group(proc)
