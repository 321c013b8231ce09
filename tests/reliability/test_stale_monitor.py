"""Dead workers' trials are failed on a timer (issue 26): a worker killed mid-trial has its trial
failed and requeued while every live worker is still busy in its own trial, not only when one of
them finishes a trial and asks for the next."""
from __future__ import annotations

import os
import shutil
import signal
import time

import optuna
import pytest

from sweeps.backends import optuna_adapter, optuna_attrs, optuna_study
from sweeps.backends.trial_liveness import StaleTrialMonitor, check_interval_seconds
from sweeps.spec.load import spec_from_dict
from sweeps.worker_identity import worker_identity
from tests.scaleout import conftest as scaleout_fixtures
from tests.scaleout.scaleout_helpers import Output, kill_all, pg_study, running_trials, wait_for
from tests.sweeps.study_helpers import (
    empty_mlflow_db,
    silence_heartbeat,
    silence_worker,
    sqlite_rdb_spec,
    start_cli,
    write_spec,
)

ENV = {"OMP_NUM_THREADS": "1"}
# A trial's worker beats twice a second from a thread (sweeps/backends/trial_liveness.py); the
# check runs every second.
BEAT = {"SWEEPS_HEARTBEAT_S": "1", "SWEEPS_GRACE_S": "20"}

fresh_db, pg_admin = scaleout_fixtures.fresh_db, scaleout_fixtures.pg_admin  # PostgreSQL fixtures, used by name


def test_the_check_interval_follows_the_heartbeat_settings():
    assert check_interval_seconds(10, 40) == 10  # the defaults: every heartbeat interval
    assert check_interval_seconds(10, 8) == 2  # a short grace: four looks per grace period
    assert check_interval_seconds(1, 1) == 0.5  # never faster than MIN_INTERVAL_S


def test_no_monitor_on_a_journal_file(tmp_path):
    spec = spec_from_dict({"name": "journal", "task": {"name": "digits", "model": "mlp"},
                           "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
                           "tracking": {"uri": "sqlite:///unused.db"}, "storage": str(tmp_path / "s.journal")})
    assert StaleTrialMonitor.start_for(spec, optuna_study.open_study(spec)) is None


def test_the_monitor_fails_and_requeues_a_silent_trial_without_anyone_asking(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "1")
    monkeypatch.setenv("SWEEPS_GRACE_S", "1")
    spec = sqlite_rdb_spec(tmp_path, "mon")
    study = optuna_study.open_study(spec)
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 0.1)})
    trial.set_user_attr(optuna_attrs.ATTR_WORKER, "gone:00000000:1")
    optuna_adapter.storage_of(study).record_heartbeat(optuna_adapter.trial_id_of(trial))
    silence_heartbeat(study, optuna_adapter.trial_id_of(trial))  # then silence
    monitor = StaleTrialMonitor.start_for(spec, study)
    assert monitor is not None
    try:
        deadline = time.monotonic() + 300  # a bound for a broken monitor, not a speed assumption
        while study.trials[trial.number].state.name == "RUNNING":
            assert time.monotonic() < deadline, "the monitor never failed the silent trial"
            time.sleep(0.2)
    finally:
        monitor.stop()
    dead = study.trials[trial.number]
    assert dead.state.name == "FAIL" and "heartbeat lost: worker gone:00000000:1" in dead.user_attrs["fail_reason"]
    [retry] = [t for t in study.trials if t.state.name == "WAITING"]
    assert retry.system_attrs["failed_trial"] == trial.number and retry.params == dead.params
    assert not monitor.thread.is_alive()


def _study_spec(tmp_path, url: str, n_trials: int):
    shutil.copyfile(empty_mlflow_db(), tmp_path / "mlflow.db")
    search = {"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}}  # every trial completes
    return write_spec(tmp_path, name="stale", storage=url, tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"},
                      search=search, budget={"n_trials": n_trials, "max_failures": 3})


def _held(tmp_path, *args: str, gate, **env) -> Output:
    """A `sweeps` process whose first trial waits at its start (RUNNING, beating) until ``gate`` exists."""
    return Output(start_cli(tmp_path, *args, SWEEPS_HOLD_TRIAL=str(gate), **ENV, **BEAT, **env))


def _kill_victim_and_wait_for_the_requeue(url: str, victim: Output, gate, others: list[Output]):
    """Open the victim's gate: it trains, then SIGKILLs itself at the end of training. Returns
    the study's trials once the trial it died in is failed and its retry is WAITING."""
    victim_id = worker_identity(victim.proc.pid)
    gate.touch()
    code, out = victim.finish(timeout=400)
    assert code == -9, out
    # Its trial's heartbeats ended with it: moved back past the grace period, the trial is failed
    # at a timer's next look, not 20 s on (a grace that long keeps the live, held trials from going
    # stale on a slow machine).
    silence_worker(pg_study(url, "stale"), victim_id)

    def requeued():
        trials = pg_study(url, "stale").trials
        # (A retry inherits its failed attempt's user attributes, the worker's name among them.)
        victims = [t for t in trials if t.user_attrs.get("worker") == victim_id and t.state.name != "WAITING"]
        if any(t.state.name == "RUNNING" for t in victims):
            return None
        retries = {t.system_attrs.get("failed_trial") for t in trials if t.state.name == "WAITING"}
        return trials if victims[-1].number in retries else None

    trials = wait_for(requeued, timeout=300, every=0.2,
                      what=lambda: f"the dead trial failed and requeued: {[o.text() for o in others]}")
    # The trial it died in.
    dead = [t for t in trials if t.user_attrs.get("worker") == victim_id and t.state.name == "FAIL"][-1]
    assert f"heartbeat lost: worker {victim_id}" in dead.user_attrs["fail_reason"], dead.user_attrs
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.state.name == "WAITING" and retry.params == dead.params
    return trials, dead


def _check_the_end(tmp_path, url: str, dead, survivors: set[str], n_trials: int) -> None:
    trials = pg_study(url, "stale").trials
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") == n_trials and set(states) == {"COMPLETE", "FAIL"}, states
    retry = next(t for t in trials if t.system_attrs.get("failed_trial") == dead.number)
    assert retry.state.name == "COMPLETE" and retry.user_attrs["worker"] in survivors  # a survivor took it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("stale").experiment_id])
    dead_run = next(r for r in runs if r.info.run_id == trials[dead.number].user_attrs["mlflow_run_id"])
    assert dead_run.info.status == "FAILED" and "heartbeat" in dead_run.data.tags["sweeps.error"]
    assert not [r for r in runs if r.info.status == "RUNNING"]


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_sweeps_run_requeues_a_killed_workers_trial_while_its_own_worker_is_still_in_its_trial(tmp_path, fresh_db):
    url = fresh_db()
    spec = _study_spec(tmp_path, url, n_trials=2)
    victim_gate, survivor_gate = tmp_path / "victim.go", tmp_path / "survivor.go"
    victim = _held(tmp_path, "worker", str(spec), "--wait", "300", gate=victim_gate, SWEEPS_FAULT="after_training")
    run = _held(tmp_path, "run", str(spec), "--quiet", gate=survivor_gate)
    try:
        both = wait_for(lambda: len(running_trials(url)) == 2 and running_trials(url), timeout=400,
                        what=lambda: f"both processes holding a trial: {victim.text()} {run.text()}")
        [held] = [t for t in both if t["worker"] != worker_identity(victim.proc.pid)]
        trials, dead = _kill_victim_and_wait_for_the_requeue(url, victim, victim_gate, [run])
        # The survivor is still held in its trial: only `sweeps run`'s timer can have failed the dead one.
        assert trials[held["number"]].state.name == "RUNNING" and not survivor_gate.exists()
        survivor_gate.touch()
        code, out = run.finish(timeout=400)
        assert code == 0, out
    finally:
        kill_all([victim, run])
    _check_the_end(tmp_path, url, dead, {held["worker"]}, n_trials=2)


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_a_lone_sweeps_worker_requeues_a_killed_workers_trial_while_it_is_still_in_its_trial(tmp_path, fresh_db):
    url = fresh_db()
    spec = _study_spec(tmp_path, url, n_trials=3)
    victim_gate, survivor_gate, run_gate = tmp_path / "victim.go", tmp_path / "survivor.go", tmp_path / "run.go"
    victim = _held(tmp_path, "worker", str(spec), "--wait", "300", gate=victim_gate, SWEEPS_FAULT="after_training")
    survivor = _held(tmp_path, "worker", str(spec), "--wait", "300", gate=survivor_gate)
    run = _held(tmp_path, "run", str(spec), "--quiet", gate=run_gate)
    try:
        wait_for(lambda: len(running_trials(url)) == 3, timeout=400,
                 what=lambda: f"three processes holding a trial: {victim.text()} {survivor.text()} {run.text()}")
        # `sweeps run` is frozen (its worker, a child, still holds its trial and beats): only the lone
        # `sweeps worker`'s own timer can fail the dead trial now.
        os.kill(run.proc.pid, signal.SIGSTOP)
        held = {t["worker"]: t for t in running_trials(url)}
        survivor_id = worker_identity(survivor.proc.pid)
        trials, dead = _kill_victim_and_wait_for_the_requeue(url, victim, victim_gate, [survivor, run])
        assert trials[held[survivor_id]["number"]].state.name == "RUNNING" and not survivor_gate.exists()
        os.kill(run.proc.pid, signal.SIGCONT)
        survivor_gate.touch()
        run_gate.touch()
        code, out = run.finish(timeout=400)
        assert code == 0, out
        code, out = survivor.finish(timeout=120)
        assert code == 0, out
    finally:
        kill_all([victim, survivor, run])
    _check_the_end(tmp_path, url, dead, set(held) - {worker_identity(victim.proc.pid)}, n_trials=3)
