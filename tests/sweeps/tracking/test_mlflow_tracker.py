"""What is particular to MlflowTracker, against a real MLflow store (sqlite + file artifacts),
read back with MlflowClient: batching and flushing, no I/O per logged point, the connection
check, what is never spooled. The Tracker contract every implementation meets is in
test_tracker_contract.py. The only wrapper is a call counter around the real client."""
from __future__ import annotations

import logging
import time

import pytest

from sweeps.errors import TrackingError
from sweeps.tracking import MlflowTracker, RunHandle, layout
from sweeps.tracking.values import sanitize_key

from .conftest import CountingClient, pick_free_port


def _study(tracker: MlflowTracker, store) -> tuple[str, RunHandle]:
    parent = tracker.start_run("study", experiment=store.experiment_name(), tags={layout.TAG_ROLE: layout.ROLE_STUDY})
    return parent.experiment_id, parent


@pytest.mark.slow
def test_metrics_are_batched_complete_and_in_order(make_tracker, store):
    counting = CountingClient(store.client)
    tracker = make_tracker(client=counting, flush_every_points=2000, flush_every_s=1e9)
    _, run = _study(tracker, store)
    n = 5000
    for step in range(1, n + 1):
        tracker.log_metrics(run, {"step/train_loss": 1.0 / step, "step/lr": step * 1e-4,
                                  "step/grad_norm": float(step % 7)}, step=step)
    tracker.flush()

    for key, f in [("step/train_loss", lambda s: 1.0 / s), ("step/lr", lambda s: s * 1e-4),
                   ("step/grad_norm", lambda s: float(s % 7))]:
        hist = sorted(store.client.get_metric_history(run.run_id, key), key=lambda m: (m.step, m.timestamp))
        assert [m.step for m in hist] == list(range(1, n + 1))
        assert [m.value for m in hist] == pytest.approx([f(s) for s in range(1, n + 1)])
    # 15,000 points: 8 flushes of ~2,000 points, each 2-3 calls of at most 1,000 metrics.
    assert 15 <= counting.calls["log_batch"] <= 30


class _EveryUse(CountingClient):
    """The real client (counting its writes), also recording every attribute used on it."""

    def __init__(self, client) -> None:
        super().__init__(client)
        self.used: list[str] = []

    def __getattr__(self, name):
        self.used.append(name)
        return super().__getattr__(name)


def test_log_metrics_is_cheap_and_does_no_io(make_tracker, store):
    """log_metrics only buffers until a flush is due (a store round trip is milliseconds,
    buffering microseconds): no use of the store at all, and nothing written to the spool."""
    client = _EveryUse(store.client)
    tracker = make_tracker(client=client, flush_every_points=10**9, flush_every_s=1e9)
    _, run = _study(tracker, store)
    n = 3_000  # three of MLflow's 1,000-point batches once flushed
    before = list(client.used)
    for step in range(1, n + 1):
        tracker.log_metrics(run, {"step/train_loss": 0.5}, step=step)
    assert client.used == before and client.calls.get("log_batch", 0) == 0  # nothing sent until a flush is due
    assert tracker.spool.run_ids() == []  # nor written to disk
    tracker.flush(run)
    assert client.calls["log_batch"] == n // 1000


def test_flush_triggers_on_points_and_on_age(make_tracker, store):
    counting = CountingClient(store.client)
    tracker = make_tracker(client=counting, flush_every_points=10, flush_every_s=1e9)
    _, run = _study(tracker, store)
    for step in range(1, 10):
        tracker.log_metrics(run, {"m": step}, step)
    assert counting.calls.get("log_batch", 0) == 0
    tracker.log_metrics(run, {"m": 10}, 10)  # the 10th point makes the flush due
    assert counting.calls["log_batch"] == 1

    aged = make_tracker(client=counting, flush_every_points=10**9, flush_every_s=0.05)
    aged.log_metrics(run, {"m": 11}, 11)  # young buffer: kept
    time.sleep(0.1)
    aged.log_metrics(run, {"m": 12}, 12)  # buffer older than 50 ms: sent
    assert counting.calls["log_batch"] == 2
    assert len(store.client.get_metric_history(run.run_id, "m")) == 12


def test_sanitize_key():
    assert sanitize_key("step/train_loss") == "step/train_loss"
    assert sanitize_key("/lead//x/./y/") == "lead/x/y"
    assert sanitize_key("..") == "__"
    assert sanitize_key("") == "_"
    assert sanitize_key("é ok:1-2.3") == "é ok:1-2.3"
    assert len(sanitize_key("k" * 400)) == 250


def test_a_refused_param_is_not_spooled(make_tracker, store):
    tracker = make_tracker()
    _, run = _study(tracker, store)
    tracker.log(run, params={"lr": 0.1})
    with pytest.raises(TrackingError, match="refused.*lr"):
        tracker.log(run, params={"lr": 0.2, "bs": 32})
    assert not tracker.spool.has_pending(run.run_id)  # a refusal would never succeed later


def test_a_stored_object_is_staged_in_the_spool_until_sent(make_tracker, store):
    tracker = make_tracker()
    _, run = _study(tracker, store)
    tracker.log_artifact(run, {"seed": 1}, layout.ART_CONFIG)
    assert store.client.list_artifacts(run.run_id, "config")[0].path == layout.ART_CONFIG
    assert not any(tracker.spool.directory.glob("*.files/*"))  # staged copy removed once sent


def test_flush_sends_what_log_metrics_buffered(make_tracker, store):
    tracker = make_tracker(flush_every_points=10**9, flush_every_s=1e9)
    _, run = _study(tracker, store)
    tracker.log_metrics(run, {"val_acc": 0.5}, step=1)
    assert store.client.get_run(run.run_id).data.metrics == {}  # buffered
    tracker.flush(run)
    assert store.client.get_run(run.run_id).data.metrics == {"val_acc": 0.5}


def test_check_connection(make_tracker, store, tmp_path, fast_http_env, monkeypatch):
    make_tracker().check_connection()  # the real store answers

    dead = f"http://127.0.0.1:{pick_free_port()}"
    attempts = _count_connection_attempts(monkeypatch)
    with pytest.raises(TrackingError) as err:
        make_tracker(dead).check_connection()
    # Fails fast: one connection attempt, with a timeout, not MLflow's minutes of retries.
    assert len(attempts) == 1 and isinstance(attempts[0], (int, float)), attempts
    assert dead in str(err.value) and "mlflow server" in str(err.value)

    (tmp_path / "a_file").write_text("not a folder")
    missing = f"sqlite:///{tmp_path / 'a_file' / 'm.db'}"
    with pytest.raises(TrackingError, match="MLflow tracking store .*a_file"):
        make_tracker(missing).check_connection()


def _count_connection_attempts(monkeypatch) -> list:
    """Each TCP connection attempt HTTP clients make from now on (urllib3, under requests and
    MLflow's client), as the connect timeout it was given."""
    from urllib3.util import connection

    real, attempts = connection.create_connection, []

    def counted(address, timeout=None, *args, **kwargs):
        attempts.append(timeout)
        return real(address, timeout, *args, **kwargs)

    monkeypatch.setattr(connection, "create_connection", counted)
    return attempts


def test_an_outage_is_said_by_the_tracker_not_by_each_http_retry(make_tracker, fast_http_env, caplog):
    """A run started and ended while the server is down: the tracker's lines say it (what is kept,
    where, how to send it); urllib3's line per retried request, dozens in a minute's outage of a
    study, is dropped."""
    down = make_tracker(f"http://127.0.0.1:{pick_free_port()}", retry_interval_s=0)
    with caplog.at_level(logging.WARNING):
        run = down.start_run("trial-0", parent=RunHandle("0" * 32, "0", "study"))
        down.log(run, params={"lr": 0.1})
        down.end_run(run, "FINISHED")
    assert down.spool.has_pending(run.run_id)
    assert [r for r in caplog.records if r.name.startswith("urllib3")] == []
    assert any("unreachable" in r.getMessage() for r in caplog.records if r.name.startswith("sweeps"))
