"""A trial is alive while its worker process is (Optuna's heartbeat, from a thread), whatever
the trial is doing between its steps: a set-up or an ONNX export longer than the grace period
no longer gets a live trial failed as stale (and its result dropped)."""
from __future__ import annotations

import time

import optuna
import pytest

from sweeps.backends import optuna_adapter, optuna_recovery, optuna_study
from sweeps.backends.trial_liveness import TrialAlive, progress_beat
from tests.sweeps.study_helpers import sqlite_rdb_spec


def _study(tmp_path, monkeypatch) -> optuna.Study:
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "1")
    monkeypatch.setenv("SWEEPS_GRACE_S", "2")
    spec = sqlite_rdb_spec(tmp_path, "alive")
    return optuna_study.open_study(spec)


def _wait_past_the_grace(study: optuna.Study) -> None:
    time.sleep(2 * optuna_adapter.heartbeat_grace_seconds(study) + 1)


@pytest.mark.slow  # waits out the grace period twice: about 10 s of real time
def test_a_trial_silent_in_its_own_code_stays_alive_while_its_worker_is(tmp_path, monkeypatch):
    study = _study(tmp_path, monkeypatch)
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 0.1)})
    alive = TrialAlive.start(study, optuna_adapter.trial_id_of(trial))
    assert alive is not None
    try:
        _wait_past_the_grace(study)  # the trial itself beats no more (a long set-up, a long export)
        assert optuna_recovery.fail_stale_trials(study) == []
        assert study.trials[trial.number].state.name == "RUNNING"
    finally:
        alive.stop()
    assert not alive.thread.is_alive()
    _wait_past_the_grace(study)  # the worker is gone (no more beats): now it is stale
    assert optuna_recovery.fail_stale_trials(study) == [trial.number]


def test_no_thread_where_the_storage_keeps_no_heartbeats(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/plain.db")
    trial = study.ask()
    assert TrialAlive.start(study, optuna_adapter.trial_id_of(trial)) is None


def test_the_progress_beat_touches_the_beat_file(tmp_path):
    beat_file = tmp_path / "w.beat"
    beat = progress_beat(beat_file)
    assert beat_file.exists()
    first = beat_file.stat().st_mtime_ns
    time.sleep(0.01)
    beat()
    assert beat_file.stat().st_mtime_ns > first
    progress_beat(None)()  # no file: nothing to mark, no error
