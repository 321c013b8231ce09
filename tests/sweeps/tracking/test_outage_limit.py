"""An MLflow store outage is bounded by ``SWEEPS_STORAGE_WAIT_S``: one line when it starts, one
when the store answers again; past the wait the owner's check raises ``TrackingUnavailable`` (the
process stops as on SIGTERM, exit 143) with the writes kept; at the end of a study the spool is
waited for up to the same limit, then the runs still kept are counted with the command that sends
them. Real stores: the session's sqlite store, an http URI where nothing listens, and the real
client made to fail as an unreachable server (503) while a test says so."""
from __future__ import annotations

import logging
import signal

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient

from sweeps.durations import ENV_STORAGE_WAIT
from sweeps.errors import StoreGone, TrackingError
from sweeps.stop_signals import STOP_SIGNALS
from sweeps.tracking import sync_spool
from sweeps.tracking.outage import TrackingUnavailable


class _Flaky:
    """The real client; while ``down``, or for the next ``failing`` calls, every call fails as a
    server that does not answer (HTTP 503)."""

    def __init__(self, client) -> None:
        self._client, self.down, self.failing = client, False, 0

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.down or self.failing > 0:
                self.failing -= 1
                raise MlflowException("503 Service Unavailable", error_code=TEMPORARILY_UNAVAILABLE)
            return attr(*args, **kwargs)

        return call


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sweeps.tracking.outage"]


def _steps(store, run) -> list[int]:
    return [m.step for m in store.client.get_metric_history(run.run_id, "val_acc")]


def test_past_the_wait_the_check_raises_store_gone_and_the_writes_stay_kept(
        make_tracker, store, free_port, fast_http_env, monkeypatch, caplog):
    run = make_tracker().start_run("trial-0", experiment=store.experiment_name())
    monkeypatch.setenv(ENV_STORAGE_WAIT, "3600")
    down = make_tracker(f"http://127.0.0.1:{free_port}", retry_interval_s=0)
    down.log_metrics(run, {"val_acc": 0.5}, 1)
    down.flush(run)  # kept: the outage starts
    down.check_outage()  # tried again, failed again: within the wait
    down.check_outage()
    monkeypatch.setenv(ENV_STORAGE_WAIT, "0")
    with pytest.raises(TrackingUnavailable) as gone:
        down.check_outage()
    assert isinstance(gone.value, StoreGone) and gone.value.exit_code == 143
    text = str(gone.value)
    assert len(text.splitlines()) == 1 and text.startswith(f"stopped: the MLflow tracking store {down.tracking_uri} "
                                                           "did not answer for"), text
    assert f"({ENV_STORAGE_WAIT}=0; last error:" in text and str(down.spool.directory) in text, text
    assert f"sweeps sync-tracking --uri {down.tracking_uri} --spool {down.spool.directory}" in text, text
    with pytest.raises(TrackingUnavailable):  # and so on while the store stays away
        down.check_outage()
    said = _said(caplog)
    assert len(said) == 1 and "is unreachable" in said[0] and f"for up to 3600 s ({ENV_STORAGE_WAIT})" in said[0], said

    assert _steps(store, run) == []
    sync_spool(store.uri, down.spool.directory)  # what `sweeps sync-tracking` does: nothing was lost
    assert _steps(store, run) == [1]


def test_the_store_answering_again_ends_the_outage_and_its_stop_in_one_line(make_tracker, store, monkeypatch, caplog):
    monkeypatch.setenv(ENV_STORAGE_WAIT, "0")
    flaky = _Flaky(MlflowClient(store.uri))
    tracker = make_tracker(client=flaky, retry_interval_s=0)
    run = tracker.start_run("trial-0", experiment=store.experiment_name())
    flaky.down = True
    tracker.log_metrics(run, {"val_acc": 0.25}, 1)
    tracker.flush(run)
    with pytest.raises(TrackingUnavailable):
        tracker.check_outage()
    flaky.down = False
    tracker.check_outage()  # tried: the store takes the kept writes, and nothing stops any more
    tracker.check_outage()
    assert _steps(store, run) == [1] and not tracker.spool.run_ids()
    said = _said(caplog)
    assert len(said) == 2 and "is unreachable" in said[0] and "answers again after" in said[1], said


def test_a_tracker_that_wrote_nothing_sees_the_outage_in_the_writes_its_workers_kept(
        make_tracker, store, free_port, fast_http_env, monkeypatch):
    """A driver between trials writes nothing of its own: the writes its workers keep for the same
    store (one spool folder per machine) are what it tries, so it stops as they would."""
    monkeypatch.setenv(ENV_STORAGE_WAIT, "0")
    run = make_tracker().start_run("trial-0", experiment=store.experiment_name())
    uri = f"http://127.0.0.1:{free_port}"
    worker, driver = make_tracker(uri, retry_interval_s=0), make_tracker(uri, retry_interval_s=0)
    driver.check_outage()  # nothing kept: nothing to try, no outage
    worker.log_metrics(run, {"val_acc": 0.5}, 1)
    worker.flush(run)
    with pytest.raises(TrackingUnavailable):
        driver.check_outage()


def test_the_end_of_a_study_past_the_wait_counts_the_runs_kept_and_names_the_command(
        make_tracker, store, free_port, fast_http_env, monkeypatch):
    monkeypatch.setenv(ENV_STORAGE_WAIT, "0")
    up = make_tracker()
    study = up.start_run("study", experiment=store.experiment_name())
    trial = up.start_run("trial-0", parent=study)
    down = make_tracker(f"http://127.0.0.1:{free_port}", retry_interval_s=0)
    down.log_metrics(trial, {"val_acc": 0.5}, 1)
    down.end_run(trial, "FINISHED")
    down.end_run(study, "FINISHED")
    with pytest.raises(TrackingError) as kept:
        down.send_spooled()
    assert kept.value.exit_code == 1 and not isinstance(kept.value, StoreGone)  # the study is done: no resume
    text = str(kept.value)
    assert len(text.splitlines()) == 1 and f"the writes of 2 runs are still kept in {down.spool.directory}" in text
    assert f"sweeps sync-tracking --uri {down.tracking_uri} --spool {down.spool.directory}" in text, text
    assert store.client.get_run(trial.run_id).info.status == "RUNNING"


def test_the_end_of_a_study_waits_for_a_store_that_answers_within_the_wait(make_tracker, store, monkeypatch, caplog):
    monkeypatch.setenv(ENV_STORAGE_WAIT, "3600")
    flaky = _Flaky(MlflowClient(store.uri))
    tracker = make_tracker(client=flaky, retry_interval_s=3600)
    run = tracker.start_run("trial-0", experiment=store.experiment_name())
    flaky.down = True
    tracker.log_metrics(run, {"val_acc": 0.5}, 1)
    tracker.end_run(run, "FINISHED")
    flaky.down, flaky.failing = False, 2  # two more tries fail, the third is taken
    with caplog.at_level(logging.WARNING):
        tracker.send_spooled()
    assert flaky.failing == 0 and not tracker.spool.run_ids()  # waited through both
    assert store.client.get_run(run.run_id).info.status == "FINISHED" and _steps(store, run) == [1]
    assert "answers again after" in _said(caplog)[-1]


def test_a_lone_workers_trial_beat_stops_its_trial_as_sigterm_does(make_tracker, store, free_port, fast_http_env,
                                                                  monkeypatch):
    """`sweeps worker` on its own has no supervisor: its trial's beat asks the tracker, and past the
    wait the worker's stop event is set as by SIGTERM (the trial checkpoints at its next step)."""
    from sweeps.backends.optuna_worker import _Signals, _watching_tracking

    monkeypatch.setenv(ENV_STORAGE_WAIT, "0")
    run = make_tracker().start_run("trial-0", experiment=store.experiment_name())
    tracker = make_tracker(f"http://127.0.0.1:{free_port}", retry_interval_s=0)
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        signals, beats = _Signals(), []
        beat = _watching_tracking(lambda: beats.append(1), tracker, signals)
        beat()  # nothing kept: the store is not in question
        assert not signals.event.is_set()
        tracker.log_metrics(run, {"val_acc": 0.5}, 1)
        tracker.flush(run)
        beat()
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert beats == [1, 1] and signals.event.is_set() and signals.exit_code() == 143
    assert isinstance(signals.storage_lost, TrackingUnavailable)


def test_the_ray_driver_ends_its_fit_as_on_sigterm_once_the_store_is_away_past_the_wait(
        make_tracker, store, free_port, fast_http_env, monkeypatch):
    """The Ray driver's callback, on a trial's result, checks the outage of the tracker whose spool
    its trials' writes wait in: past the wait it asks the fit to end as a SIGTERM would (Ray saves
    the experiment; the trials resume on the next run) and keeps the error the driver exits with."""
    from sweeps.backends.ray_cluster import Interrupts
    from sweeps.backends.ray_live import LIVE, DriverCallback

    run = make_tracker().start_run("trial-0", experiment=store.experiment_name())
    monkeypatch.setenv(ENV_STORAGE_WAIT, "0")
    down = make_tracker(f"http://127.0.0.1:{free_port}", retry_interval_s=0)
    down.log_metrics(run, {"val_acc": 0.5}, 1)
    down.flush(run)  # kept: the outage starts
    with Interrupts(None) as interrupts:
        LIVE.update(tracker=down, interrupts=interrupts, drawn=float("inf"))  # no live view to draw
        try:
            DriverCallback().on_trial_result(0, [], None, {})
        finally:
            LIVE.clear()
    assert isinstance(interrupts.lost, TrackingUnavailable) and interrupts.lost.exit_code == 143
    assert interrupts.stop_reason == "store gone" and interrupts.signum is None
