"""A trial is alive while its worker process holds it (Optuna's heartbeat, from a thread), from its
ask to its outcome, whatever the trial is doing: a set-up or an ONNX export longer than the grace
period, or a wait in a pack while another population trains, does not get a live trial failed as
stale (and its result dropped)."""
from __future__ import annotations

import threading
import time
from collections import Counter

import optuna
import pytest

from sweeps.backends import optuna_adapter, optuna_recovery, optuna_study
from sweeps.backends.trial_liveness import HeldTrials, progress_beat
from tests.sweeps.study_helpers import silence_heartbeat, sqlite_rdb_spec


def _study(tmp_path, monkeypatch) -> optuna.Study:
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "1")
    monkeypatch.setenv("SWEEPS_GRACE_S", "30")  # never waited for: heartbeats are moved 60 s back
    spec = sqlite_rdb_spec(tmp_path, "alive")
    return optuna_study.open_study(spec)


class _Beats:
    """The beats recorded per trial id, counted as they are recorded."""

    def __init__(self, monkeypatch) -> None:
        self.count: Counter[int] = Counter()
        self._changed = threading.Condition()
        record = optuna_adapter.record_heartbeat

        def counted(study: optuna.Study, trial_id: int) -> None:
            record(study, trial_id)
            with self._changed:
                self.count[trial_id] += 1
                self._changed.notify_all()

        monkeypatch.setattr(optuna_adapter, "record_heartbeat", counted)

    def two_more(self, trial_id: int) -> None:
        """Until two more beats of the trial are recorded: the second began after this call."""
        with self._changed:
            target = self.count[trial_id] + 2
            assert self._changed.wait_for(lambda: self.count[trial_id] >= target, timeout=300)


@pytest.mark.slow  # waits for six beats of the thread, half a second apart
def test_a_held_trial_stays_alive_until_released_and_then_goes_stale(tmp_path, monkeypatch):
    study = _study(tmp_path, monkeypatch)
    beats = _Beats(monkeypatch)
    held = HeldTrials(study)
    trial, waiting = held.ask("here"), held.ask("here")  # the second waits (in a pack, say)
    ids = [optuna_adapter.trial_id_of(t) for t in (trial, waiting)]
    try:
        # Neither trial beats itself (a long set-up, a long export, a wait): silent past the
        # grace period, the thread's next beats keep both alive.
        for trial_id in ids:
            silence_heartbeat(study, trial_id)
        for trial_id in ids:
            beats.two_more(trial_id)
        assert optuna_recovery.fail_stale_trials(study) == []
        assert [t.state.name for t in study.trials] == ["RUNNING", "RUNNING"]
        held.release(trial)  # its outcome is known: beaten no more
        beats.two_more(ids[1])  # a whole round of the thread after the release
        for trial_id in ids:
            silence_heartbeat(study, trial_id)
        beats.two_more(ids[1])
        assert optuna_recovery.fail_stale_trials(study) == [trial.number]
        assert study.trials[waiting.number].state.name == "RUNNING"
    finally:
        held.stop()
    assert not held.thread.is_alive()
    silence_heartbeat(study, ids[1])  # the worker is gone (no more beats): now it is stale
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
