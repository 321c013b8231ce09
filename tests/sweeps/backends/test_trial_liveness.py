"""A trial is alive while its worker process holds it (Optuna's heartbeat, from a thread), from its
ask to its outcome, whatever the trial is doing: a set-up or an ONNX export longer than the grace
period, or a wait in a pack while another population trains, does not get a live trial failed as
stale (and its result dropped)."""
from __future__ import annotations

import time

import optuna
import pytest

from sweeps.backends import optuna_adapter, optuna_recovery, optuna_study
from sweeps.backends.trial_liveness import HeldTrials, progress_beat
from tests.sweeps.study_helpers import sqlite_rdb_spec


def _study(tmp_path, monkeypatch) -> optuna.Study:
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "1")
    monkeypatch.setenv("SWEEPS_GRACE_S", "2")
    spec = sqlite_rdb_spec(tmp_path, "alive")
    return optuna_study.open_study(spec)


def _wait_past_the_grace(study: optuna.Study) -> None:
    time.sleep(2 * optuna_adapter.heartbeat_grace_seconds(study) + 1)


@pytest.mark.slow  # waits out the grace period twice: about 10 s of real time
def test_a_held_trial_stays_alive_until_released_and_then_goes_stale(tmp_path, monkeypatch):
    study = _study(tmp_path, monkeypatch)
    held = HeldTrials(study)
    trial, waiting = held.ask("here"), held.ask("here")  # the second waits (in a pack, say)
    try:
        _wait_past_the_grace(study)  # neither trial beats itself (a long set-up, a long export, a wait)
        assert optuna_recovery.fail_stale_trials(study) == []
        assert [t.state.name for t in study.trials] == ["RUNNING", "RUNNING"]
        held.release(trial)  # its outcome is known: beaten no more
        _wait_past_the_grace(study)
        assert optuna_recovery.fail_stale_trials(study) == [trial.number]
        assert study.trials[waiting.number].state.name == "RUNNING"
    finally:
        held.stop()
    assert not held.thread.is_alive()
    _wait_past_the_grace(study)  # the worker is gone (no more beats): now it is stale
    assert optuna_recovery.fail_stale_trials(study) == [waiting.number]


def test_no_thread_where_the_storage_keeps_no_heartbeats(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/plain.db")
    held = HeldTrials(study)
    trial = held.ask("here")
    assert trial.user_attrs["worker"] == "here" and held.thread.ident is None
    held.release(trial)
    held.stop()


def test_the_progress_beat_touches_the_beat_file(tmp_path):
    beat_file = tmp_path / "w.beat"
    beat = progress_beat(beat_file)
    assert beat_file.exists()
    first = beat_file.stat().st_mtime_ns
    time.sleep(0.01)
    beat()
    assert beat_file.stat().st_mtime_ns > first
    progress_beat(None)()  # no file: nothing to mark, no error
