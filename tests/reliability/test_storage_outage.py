"""An outage of the Optuna storage (PostgreSQL stopped with ``-m immediate``, as a crash or a
failover cuts every connection, then started again) is waited out by ``sweeps run`` and a
``sweeps worker`` while their trials train; past ``SWEEPS_STORAGE_WAIT_S`` both stop as on SIGTERM
and the same command finishes the study; a permanent error (a user without rights) is one line.

Each test runs its own server (tests/reliability/own_postgres.py). The outage starts at a fixed
point: every trial is held at its start (``SWEEPS_HOLD_TRIAL``) until the test has seen them all
RUNNING in the study's storage and stopped the server; then the trials train into the outage.
"""
from __future__ import annotations

import subprocess
import time

import optuna
import pytest
from optuna.trial import TrialState

from tests.sweeps.backends.conftest import mlflow_client, study_runs
from tests.sweeps.study_helpers import cli_in_process, start_cli, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
OUTAGE_S = 12  # how long the server stays down (a restart under load); nothing is timed against it


def _spec(tmp_path, name, url, n_trials):
    return write_spec(tmp_path, name=name, storage=url, train={"epochs": 3, "batch_size": 64},
                      budget={"n_trials": n_trials, "max_failures": 2}, resources={"devices": "cpu", "workers": 1})


def _running(url: str, name: str) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except Exception:  # noqa: BLE001 - not created yet
        return 0
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def _hold_until_running(url: str, name: str, count: int, procs: list[subprocess.Popen]) -> None:
    """Wait for ``count`` trials RUNNING in the study (held at their start, they stay so)."""
    while _running(url, name) < count:
        for p in procs:
            assert p.poll() is None, p.stdout.read() if p.stdout else p.returncode
        time.sleep(0.5)


def _trials(url: str, name: str) -> list:
    return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)


def test_sweeps_run_and_a_worker_wait_out_a_postgresql_restart(tmp_path, own_postgres):
    spec = _spec(tmp_path, "outage", own_postgres.url, n_trials=3)
    gate = tmp_path / "go"
    env = {"SWEEPS_HOLD_TRIAL": str(gate)}
    driver = start_cli(tmp_path, "run", str(spec), "--quiet", **env)
    worker = start_cli(tmp_path, "worker", str(spec), "--wait", "300", **env)
    try:
        _hold_until_running(own_postgres.url, "outage", 2, [driver, worker])
        own_postgres.stop()
        gate.touch()  # both trials train on into the outage
        time.sleep(OUTAGE_S)
        own_postgres.start()
        out_driver, _ = driver.communicate(timeout=600)
        out_worker, _ = worker.communicate(timeout=600)
    finally:
        for p in (driver, worker):
            if p.poll() is None:
                p.kill()
    assert driver.returncode == 0, out_driver[-4000:]
    assert worker.returncode == 0, out_worker[-4000:]
    for out in (out_driver, out_worker):
        assert "StorageInternalError" not in out and "Traceback" not in out, out[-4000:]
    said = out_driver + out_worker
    assert "does not answer" in said and "waiting up to 300 s (SWEEPS_STORAGE_WAIT_S)" in said, said[-4000:]
    assert "answers again after" in said, said[-4000:]

    trials = _trials(own_postgres.url, "outage")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3, [(t.number, t.state) for t in trials]
    _, children = study_runs(tmp_path, "outage")
    assert sorted(int(c.data.tags["sweeps.trial_number"]) for c in children) == [0, 1, 2]  # each trial once
    assert {c.info.status for c in children} == {"FINISHED"}
    client = mlflow_client(tmp_path)
    for child in children:
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [1, 2, 3]


def test_past_the_wait_both_stop_as_on_sigterm_and_the_same_command_finishes(tmp_path, own_postgres):
    spec = _spec(tmp_path, "gone", own_postgres.url, n_trials=2)
    gate = tmp_path / "go"
    env = {"SWEEPS_HOLD_TRIAL": str(gate), "SWEEPS_STORAGE_WAIT_S": "3"}
    driver = start_cli(tmp_path, "run", str(spec), "--quiet", **env)
    worker = start_cli(tmp_path, "worker", str(spec), "--wait", "300", **env)
    try:
        _hold_until_running(own_postgres.url, "gone", 2, [driver, worker])
        own_postgres.stop()
        gate.touch()
        out_driver, _ = driver.communicate(timeout=600)  # both give up while the server is down
        out_worker, _ = worker.communicate(timeout=600)
    finally:
        for p in (driver, worker):
            if p.poll() is None:
                p.kill()
    own_postgres.start()
    for proc, out in ((driver, out_driver), (worker, out_worker)):
        assert proc.returncode == 143, out[-4000:]
        assert "did not answer for 3 s (SWEEPS_STORAGE_WAIT_S" in out, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
    parents, children = study_runs(tmp_path, "gone")
    assert [p.info.status for p in parents] == ["KILLED"]
    assert "RUNNING" not in {c.info.status for c in children}, [c.info.status for c in children]

    done = cli_in_process(tmp_path, "run", str(spec), "--quiet", SWEEPS_GRACE_S="20", SWEEPS_HEARTBEAT_S="2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finished = [t for t in _trials(own_postgres.url, "gone") if t.state == TrialState.COMPLETE]
    assert len(finished) == 2
    _, children = study_runs(tmp_path, "gone")
    assert len([c for c in children if c.info.status == "FINISHED"]) == 2
    assert "RUNNING" not in {c.info.status for c in children}


def test_a_permanent_storage_error_is_one_clear_line(tmp_path, own_postgres, monkeypatch, caplog):
    from sweeps.backends.optuna_study import open_study
    from sweeps.errors import BackendError
    from sweeps.spec.load import load_spec

    monkeypatch.chdir(tmp_path)
    open_study(load_spec(_spec(tmp_path, "denied", own_postgres.url, n_trials=1)))  # the tables, as their owner
    own_postgres.psql("CREATE ROLE limited LOGIN; GRANT ALL ON ALL TABLES IN SCHEMA public TO limited; "
                      "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO limited")
    study = open_study(load_spec(_spec(tmp_path, "denied", own_postgres.url.replace("postgres@", "limited@"), 1)))
    own_postgres.psql("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM limited")
    with pytest.raises(BackendError) as refused:
        study.ask()
    text = str(refused.value)
    assert len(text.splitlines()) == 1 and "permission denied" in text, text
    assert "grant that user the rights Optuna needs" in text, text
    assert "does not answer" not in caplog.text  # refused at once, not waited for as an outage
