"""The spool: writes the store cannot take are kept on disk and sent later, in order,
exactly once. Real stores throughout: a sqlite store, an http URI where nothing listens,
and a real ``mlflow server`` that goes away and comes back."""
from __future__ import annotations

import json
import logging
import time

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

from sweeps.errors import TrackingError
from sweeps.tracking import layout, sync_spool
from sweeps.tracking.send import MAX_BATCH_BYTES, _plan, drain
from sweeps.tracking.spool import Spool
from sweeps.tracking.store_errors import is_transient

from .conftest import FAST_HTTP_ENV, CountingClient, pick_free_port

KEYS = ("step/train_loss", "step/lr", "step/grad_norm")


def _points(tracker, run, steps):
    for step in steps:
        tracker.log_metrics(run, {k: step * (i + 1) * 0.5 for i, k in enumerate(KEYS)}, step=step)


def _assert_exactly(client, run_id, steps):
    for i, key in enumerate(KEYS):
        hist = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in hist) == list(steps), key  # none missing, none twice
        assert all(m.value == m.step * (i + 1) * 0.5 for m in hist)


# -- the file format --------------------------------------------------------------------
def test_append_read_commit_finish(tmp_path):
    spool = Spool(tmp_path / "spool")
    assert spool.run_ids() == [] and not spool.has_pending("r1")
    spool.append("r1", [["m", "a", 1.0, 10, 1], ["p", "lr", "0.1"]])
    spool.append("r1", [["end", "FINISHED", 11]])
    spool.append("r2", [["t", "x", "y"]])
    assert spool.run_ids() == ["r1", "r2"]
    with spool.locked():
        entries, end = spool.read_pending("r1")
        assert [r for _, r in entries] == [["m", "a", 1.0, 10, 1], ["p", "lr", "0.1"], ["end", "FINISHED", 11]]
        spool.commit("r1", entries[1][0])  # the first two reached the store
        assert [r for _, r in spool.read_pending("r1")[0]] == [["end", "FINISHED", 11]]
        assert not spool.finish_if_drained("r1")
        spool.commit("r1", end)
        assert spool.finish_if_drained("r1")
    assert not spool.has_pending("r1") and spool.run_ids() == ["r2"]
    assert not (spool.directory / "r1.offset").exists()


def test_a_torn_line_from_a_crash_is_skipped_not_merged(tmp_path, caplog):
    spool = Spool(tmp_path)
    spool.append("r", [["m", "a", 1.0, 10, 1]])
    with open(spool.path("r"), "ab") as fh:
        fh.write(b'["m","a",2.0,1')  # the process died mid-append
    spool.append("r", [["m", "a", 3.0, 12, 3]])
    with spool.locked():
        entries, end = spool.read_pending("r")
    assert [r[2] for _, r in entries] == [1.0, 3.0]
    assert end == spool.path("r").stat().st_size
    assert "torn" in caplog.text


def test_spool_refuses_unsafe_run_ids(tmp_path):
    from sweeps.errors import UnsafeNameError

    with pytest.raises(UnsafeNameError):
        Spool(tmp_path).append("../x", [["t", "a", "b"]])


def test_batches_respect_mlflow_limits():
    metrics = [["m", "k", 1.0, 1, s] for s in range(2500)]
    assert [(o.start, o.end) for o in _plan(metrics)] == [(0, 1000), (1000, 2000), (2000, 2500)]
    params = [["p", f"p{i}", "v"] for i in range(250)]
    assert [o.end - o.start for o in _plan(params)] == [100, 100, 50]
    # A repeated tag key starts a new batch, so the later value is applied last.
    tags = [["t", "state", "RUNNING"], ["t", "best", "1"], ["t", "state", "COMPLETE"]]
    assert [(o.start, o.end) for o in _plan(tags)] == [(0, 2), (2, 3)]
    # Artifacts and statuses are calls of their own, in their place in the order.
    mixed = [["m", "k", 1.0, 1, 1], ["a", "/f", None, False], ["m", "k", 2.0, 2, 2], ["end", "FINISHED", 3]]
    assert [o.kind for o in _plan(mixed)] == ["batch", "a", "batch", "end"]
    # Big values: the request stays under MLflow's 1 MB limit.
    big = [["t", f"t{i}", "x" * 8000] for i in range(100)]
    ops = _plan(big)
    assert len(ops) == 2 and all((o.end - o.start) * 8000 < MAX_BATCH_BYTES for o in ops)


def test_transient_or_not():
    assert is_transient(MlflowException("down", error_code=TEMPORARILY_UNAVAILABLE))
    assert is_transient(MlflowException("API request failed with exception ..."))  # 500
    assert is_transient(ConnectionRefusedError())
    assert not is_transient(MlflowException.invalid_parameter_value("bad"))
    assert not is_transient(ValueError("bug"))


# -- an unreachable store, then sync_spool -----------------------------------------------
def test_unreachable_store_spools_and_sync_sends_exactly_once(make_tracker, store, fast_http_env, caplog,
                                                              monkeypatch):
    from .test_mlflow_tracker import _count_connection_attempts

    real = make_tracker()
    run = real.start_run("trial-0", experiment=store.experiment_name())  # created while the store was up
    real.log(run, tags={"sweeps.reason": "paused"})
    real.end_run(run, "KILLED")

    dead_uri = f"http://127.0.0.1:{pick_free_port()}"
    # retry_interval_s: after a failure the store is left alone this long (long enough for any machine).
    down = make_tracker(dead_uri, flush_every_points=1000, flush_every_s=1e9, retry_interval_s=3600)
    attempts = _count_connection_attempts(monkeypatch)
    down.start_run(run, tags={"sweeps.reason": None})  # continued (a Ray trial): RUNNING, stale tag removed
    _points(down, run, range(1, 1501))  # 4,500 points: several flushes are due, none raise
    down.log(run, params={"lr": 0.1}, tags={layout.TAG_STATE: "PRUNED", "never_set": None})
    down.log_artifact(run, {"seed": 1}, layout.ART_CONFIG)
    with caplog.at_level(logging.WARNING):
        down.end_run(run, "KILLED")  # does not raise into training
    # Fast failures, not minutes of HTTP retries: the store is tried twice in all (the first flush,
    # then end_run's last chance), whatever the number of flushes and calls in between, each try with
    # at most one retry (MLFLOW_HTTP_REQUEST_MAX_RETRIES=1), and every attempt with a timeout.
    assert 2 <= len(attempts) <= 2 * (1 + int(FAST_HTTP_ENV["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])), attempts
    assert all(isinstance(t, (int, float)) for t in attempts), attempts

    lines = down.spool.path(run.run_id).read_text().splitlines()
    kinds = [json.loads(line)[0] for line in lines]
    assert kinds[:2] == ["open", "dt"] and kinds.count("m") == 4500 and kinds[-1] == "end"  # the status too
    command = f"sweeps sync-tracking --uri {dead_uri} --spool {down.spool.directory}"
    assert command in caplog.text and str(down.spool.path(run.run_id)) in caplog.text
    assert store.client.get_run(run.run_id).data.tags["sweeps.reason"] == "paused"

    with pytest.raises(TrackingError, match="cannot reach"):
        sync_spool(dead_uri, down.spool.directory)  # still down: clear error, spool intact
    assert down.spool.has_pending(run.run_id)

    counting = CountingClient(store.client)
    result = sync_spool(store.uri, down.spool.directory, client=counting)
    assert result["totals"] == {"metrics": 4500, "params": 1, "tags": 3, "artifacts": 1, "inputs": 0, "models": 0,
                                "statuses": 2}
    assert result["runs"][run.run_id]["drained"] and not result["refused"] and not result["failed"]
    assert counting.metrics_accepted == 4500  # each point sent once
    got = store.client.get_run(run.run_id)
    assert got.info.status == "KILLED" and got.data.params == {"lr": "0.1"}
    assert got.data.tags[layout.TAG_STATE] == "PRUNED" and "sweeps.reason" not in got.data.tags
    assert [a.path for a in store.client.list_artifacts(run.run_id, "config")] == [layout.ART_CONFIG]
    _assert_exactly(store.client, run.run_id, range(1, 1501))
    assert not down.spool.has_pending(run.run_id) and not list(down.spool.directory.glob("*.files"))

    again = sync_spool(store.uri, down.spool.directory, client=counting)
    assert again["totals"]["metrics"] == 0 and counting.metrics_accepted == 4500


class FlakyClient(CountingClient):
    """The real client; log_batch call number ``fail_on`` fails as the network would,
    either before the store got it or after (the answer lost on the way back)."""

    def __init__(self, client, fail_on: int, after_store: bool) -> None:
        super().__init__(client)
        self.fail_on, self.after_store, self.n = fail_on, after_store, 0

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name != "log_batch":
            return attr

        def flaky(*args, **kwargs):
            self.n += 1
            if self.n == self.fail_on and not self.after_store:
                raise MlflowException("connection reset", error_code=TEMPORARILY_UNAVAILABLE)
            out = attr(*args, **kwargs)
            if self.n == self.fail_on:
                raise MlflowException("read timed out", error_code=TEMPORARILY_UNAVAILABLE)
            return out

        return flaky


@pytest.mark.parametrize("after_store", [False, True])
def test_a_sync_cut_short_resumes_where_it_stopped(make_tracker, store, tmp_path, after_store):
    real = make_tracker()
    run = real.start_run("trial-0", experiment=store.experiment_name())
    spool = Spool(tmp_path / "cut")
    ts = int(time.time() * 1000)
    spool.append(run.run_id, [["m", k, s * (i + 1) * 0.5, ts + s, s]
                              for s in range(1, 1001) for i, k in enumerate(KEYS)])

    flaky = FlakyClient(store.client, fail_on=2, after_store=after_store)
    with pytest.raises(MlflowException):
        drain(spool, flaky, run.run_id)
    with spool.locked():
        left = len(spool.read_pending(run.run_id)[0])
    assert left == 2000  # batch 1 committed; batch 2 (maybe stored, unacknowledged) kept

    result = sync_spool(store.uri, spool.directory)
    assert result["totals"]["metrics"] == 2000
    # When the store had batch 2 already, resending it is harmless: the timestamps were
    # fixed at log time, so the identical rows are deduplicated, not doubled.
    _assert_exactly(store.client, run.run_id, range(1, 1001))


def test_refused_spooled_writes_are_reported_and_dropped(make_tracker, store, tmp_path):
    real = make_tracker()
    run = real.start_run("trial-0", experiment=store.experiment_name())
    real.log(run, params={"lr": "0.1"})
    spool = Spool(tmp_path / "refused")
    spool.append(run.run_id, [["p", "lr", "0.2"], ["t", "after", "yes"], ["end", "FINISHED", 1]])
    result = sync_spool(store.uri, spool.directory)
    assert len(result["refused"]) == 1 and "lr" in result["refused"][0]
    assert result["runs"][run.run_id]["drained"]  # a refusal never blocks what follows
    assert store.client.get_run(run.run_id).data.tags["after"] == "yes"


def test_sync_to_the_wrong_store_keeps_the_spool(store, tmp_path):
    spool = Spool(tmp_path / "wrong")
    spool.append("0123456789abcdef0123456789abcdef", [["m", "k", 1.0, 1, 1]])
    result = sync_spool(store.uri, spool.directory)
    assert "not found" in result["failed"]["0123456789abcdef0123456789abcdef"]
    assert spool.has_pending("0123456789abcdef0123456789abcdef")  # nothing dropped
    with pytest.raises(TrackingError, match="no spool folder"):
        sync_spool(store.uri, tmp_path / "typo")


# -- a real server that goes away and comes back ---------------------------------------
@pytest.mark.slow
def test_server_goes_away_and_comes_back(mlflow_server, tmp_path, fast_http_env):
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import MlflowTracker

    counting = CountingClient(MlflowClient(tracking_uri=mlflow_server.uri))
    tracker = MlflowTracker(mlflow_server.uri, flush_every_points=10**9, flush_every_s=1e9,
                            spool_dir=tmp_path / "spool", retry_interval_s=0.0, client=counting)
    tracker.check_connection()
    study = tracker.start_run("study", experiment="outage", tags={layout.TAG_ROLE: layout.ROLE_STUDY})
    run = tracker.start_run("trial-0", parent=study)
    ended = tracker.start_run("trial-1", parent=study)  # will end during the outage

    _points(tracker, run, range(1, 1001))
    tracker.flush()
    assert not tracker.spool.has_pending(run.run_id)

    mlflow_server.stop()
    with pytest.raises(TrackingError):
        tracker.check_connection()
    _points(tracker, run, range(1001, 2001))
    tracker.flush()  # does not raise: kept in the spool
    tracker.log(run, tags={layout.TAG_STATE: "RUNNING"})
    tracker.log_artifact(run, {"while": "down"}, "eval/note.json")
    _points(tracker, ended, range(1, 11))
    tracker.end_run(ended, "KILLED")  # no raise; its writes wait in the spool
    assert tracker.spool.has_pending(run.run_id) and tracker.spool.has_pending(ended.run_id)

    mlflow_server.start()
    _points(tracker, run, range(2001, 3001))
    tracker.flush()  # the spool goes first, then the new points
    # The run that ended during the outage will never flush again: sent on recovery.
    assert not tracker.spool.has_pending(ended.run_id)
    tracker.log(run, tags={layout.TAG_STATE: "COMPLETE"})
    tracker.end_run(run, "FINISHED")
    assert not tracker.spool.has_pending(run.run_id)

    reader = MlflowClient(tracking_uri=mlflow_server.uri)
    _assert_exactly(reader, run.run_id, range(1, 3001))
    assert counting.metrics_accepted == 9000 + 30  # every point accepted exactly once
    _assert_exactly(reader, ended.run_id, range(1, 11))
    assert reader.get_run(ended.run_id).info.status == "KILLED"
    got = reader.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.data.tags[layout.TAG_STATE] == "COMPLETE"
    assert got.data.tags[layout.PARENT_TAG] == study.run_id
    assert [a.path for a in reader.list_artifacts(run.run_id, "eval")] == ["eval/note.json"]
