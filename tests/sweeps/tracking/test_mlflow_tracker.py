"""The Tracker contract against a real MLflow store (sqlite + file artifacts), read back with
MlflowClient: tests taking ``any_tracker`` run on every implementation (in-process
MlflowTracker, WriterProcessTracker); the others are about MlflowTracker's batching. The only
wrapper is a call counter around the real client."""
from __future__ import annotations

import json
import threading
import time

import pytest

from sweeps.errors import TrackingError, UnsafeNameError
from sweeps.tracking import MlflowTracker, RunHandle, Tracker, layout
from sweeps.tracking.mlflow_tracker import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH, sanitize_key

from .conftest import CountingClient, pick_free_port


def _study(tracker: MlflowTracker, store) -> tuple[str, RunHandle]:
    eid = tracker.get_or_create_experiment(store.experiment_name())
    parent = tracker.start_run(eid, "study", tags={layout.TAG_ROLE: layout.ROLE_STUDY})
    return eid, parent


def test_is_a_tracker(any_tracker):
    assert isinstance(any_tracker(), Tracker)


def test_nested_parent_and_child_runs(any_tracker, store):
    tracker = any_tracker()
    eid, parent = _study(tracker, store)
    child = tracker.start_run(
        eid, "trial-3", parent=parent,
        tags={layout.TAG_ROLE: layout.ROLE_TRIAL, layout.TAG_TRIAL_NUMBER: 3},
    )
    assert child == RunHandle(child.run_id, eid, "trial-3")

    got = store.client.get_run(child.run_id)
    assert got.data.tags[layout.PARENT_TAG] == parent.run_id  # what nests it in the UI
    assert got.data.tags[layout.TAG_TRIAL_NUMBER] == "3"
    assert got.info.run_name == "trial-3"
    assert layout.PARENT_TAG not in store.client.get_run(parent.run_id).data.tags
    exp = store.client.get_experiment(eid)
    assert exp.artifact_location.endswith(f"artifacts/{exp.name}")
    import mlflow

    assert mlflow.active_run() is None  # never the fluent global run


def test_get_or_create_experiment_is_idempotent_and_refuses_deleted(any_tracker, store):
    tracker = any_tracker()
    name = store.experiment_name()
    eid = tracker.get_or_create_experiment(name)
    assert tracker.get_or_create_experiment(name) == eid
    store.client.delete_experiment(eid)
    with pytest.raises(TrackingError, match="deleted.*restore"):
        tracker.get_or_create_experiment(name)
    with pytest.raises(UnsafeNameError):
        tracker.get_or_create_experiment("../escape")


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
    n = 20_000
    before = list(client.used)
    for step in range(1, n + 1):
        tracker.log_metrics(run, {"step/train_loss": 0.5}, step=step)
    assert client.used == before and client.calls.get("log_batch", 0) == 0  # nothing sent until a flush is due
    assert tracker.spool.run_ids() == []  # nor written to disk
    tracker.flush(run)
    assert client.calls["log_batch"] == n // 1000


def test_a_non_numeric_metric_is_a_clear_error(any_tracker, store):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    with pytest.raises(TrackingError, match="'val_acc': 'high'.*not numbers"):
        tracker.log_metrics(run, {"val_loss": 0.1, "val_acc": "high"}, step=1)
    tracker.flush()
    assert store.client.get_run(run.run_id).data.metrics == {}  # nothing half-logged


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


def test_timestamps_are_taken_when_logged_not_when_flushed(any_tracker, store):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    before = int(time.time() * 1000)
    tracker.log_metrics(run, {"val_acc": 0.5}, step=1)
    after = int(time.time() * 1000)
    time.sleep(0.3)
    tracker.flush(run)
    (point,) = store.client.get_metric_history(run.run_id, "val_acc")
    assert before <= point.timestamp <= after


@pytest.mark.parametrize("status", ["FINISHED", "FAILED", "KILLED"])
def test_end_run_flushes_then_sets_the_status(any_tracker, store, status):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    tracker.log_metrics(run, {"val_loss": 1.25}, step=1)
    tracker.end_run(run, status)
    tracker.flush()  # before a read: end_run may return before its writes are in (the writer's)
    got = store.client.get_run(run.run_id)
    assert got.info.status == status
    assert got.info.end_time is not None
    assert got.data.metrics["val_loss"] == 1.25


def test_end_run_refuses_an_unknown_status(any_tracker, store):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    with pytest.raises(ValueError, match="FINISHED, FAILED, KILLED"):
        tracker.end_run(run, "PRUNED")  # type: ignore[arg-type]


def test_params_are_stringified_truncated_and_keys_sanitized(any_tracker, store):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    tracker.log_params(run, {"lr": 0.001, "layers": [64, 32], "long": "x" * 7000,
                             "bad key!": 1, "a/../b": 2, None: 3})
    tracker.set_tags(run, {"note": "y" * 9000})
    params = store.client.get_run(run.run_id).data.params
    assert params["lr"] == "0.001" and params["layers"] == "[64, 32]"
    assert len(params["long"]) == MAX_PARAM_VAL_LENGTH
    assert params["long"].endswith("...[truncated: 7000 chars in full]")
    assert params["bad key_"] == "1" and params["a/__/b"] == "2" and params["None"] == "3"
    tag = store.client.get_run(run.run_id).data.tags["note"]
    assert len(tag) == MAX_TAG_VAL_LENGTH and "truncated: 9000" in tag


def test_sanitize_key():
    assert sanitize_key("step/train_loss") == "step/train_loss"
    assert sanitize_key("/lead//x/./y/") == "lead/x/y"
    assert sanitize_key("..") == "__"
    assert sanitize_key("") == "_"
    assert sanitize_key("é ok:1-2.3") == "é ok:1-2.3"
    assert len(sanitize_key("k" * 400)) == 250


def test_changing_a_param_is_a_clear_error_and_is_not_spooled(any_tracker, store):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    tracker.log_params(run, {"lr": 0.1})
    tracker.log_params(run, {"lr": 0.1})  # same value again (a resume) is fine
    with pytest.raises(TrackingError, match="refused.*lr"):
        tracker.log_params(run, {"lr": 0.2, "bs": 32})
    assert not tracker.spool.has_pending(run.run_id)  # a refusal would never succeed later


def test_find_run(any_tracker, store):
    tracker = any_tracker()
    eid = tracker.get_or_create_experiment(store.experiment_name())
    study = {layout.TAG_ROLE: layout.ROLE_STUDY, layout.TAG_STUDY: "lr_bs"}
    assert tracker.find_run(eid, study) is None
    first = tracker.start_run(eid, "study", tags=study)
    other = tracker.start_run(eid, "other", tags={**study, layout.TAG_STUDY: "other's"})
    trial = tracker.start_run(eid, "trial-7", parent=first,
                              tags={layout.TAG_ROLE: layout.ROLE_TRIAL, layout.TAG_TRIAL_NUMBER: 7})
    assert tracker.find_run(eid, study) == first
    assert tracker.find_run(eid, {layout.TAG_STUDY: "other's"}) == other  # a quote in the value
    assert tracker.find_run(eid, {layout.TAG_TRIAL_NUMBER: 7}) == trial
    assert tracker.find_run(eid, {**study, layout.TAG_BACKEND: "optuna"}) is None
    time.sleep(0.01)
    newer = tracker.start_run(eid, "study", tags=study)
    assert tracker.find_run(eid, study) == newer  # the most recently started wins
    store.client.delete_run(newer.run_id)
    assert tracker.find_run(eid, study) == first  # deleted runs are not found


def test_log_artifact_and_log_dict(any_tracker, store, tmp_path):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    ckpt = tmp_path / "best.pt"
    ckpt.write_bytes(b"\x00weights")
    tracker.log_artifact(run, ckpt, layout.ART_CHECKPOINT_DIR)
    tracker.log_dict(run, {"train": {"lr": 0.1}, "seed": 1}, layout.ART_CONFIG)

    names = {a.path for a in store.client.list_artifacts(run.run_id, layout.ART_CHECKPOINT_DIR)}
    assert names == {"checkpoints/best.pt"}
    local = store.client.download_artifacts(run.run_id, layout.ART_CONFIG, str(tmp_path / "dl"))
    assert json.loads(open(local).read()) == {"train": {"lr": 0.1}, "seed": 1}
    assert not any(tracker.spool.directory.glob("*.files/*"))  # staged copy removed once sent
    with pytest.raises(TrackingError, match="does not exist"):
        tracker.log_artifact(run, tmp_path / "missing.pt")


@pytest.mark.parametrize("bad", ["../x", "/abs", "%2e%2e/x", "a\\b", "a\x00b", "%252e%252e/x", "a/../../b"])
def test_artifact_paths_that_escape_are_refused(any_tracker, store, tmp_path, bad):
    tracker = any_tracker()
    _, run = _study(tracker, store)
    f = tmp_path / "f.txt"
    f.write_text("x")
    with pytest.raises(UnsafeNameError, match="artifact path"):
        tracker.log_artifact(run, f, bad)
    with pytest.raises(UnsafeNameError, match="artifact file"):
        tracker.log_dict(run, {"a": 1}, bad + ".json" if "\x00" not in bad else bad)
    assert store.client.list_artifacts(run.run_id) == []


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


def test_threads_log_to_their_own_runs(any_tracker, store):
    tracker = any_tracker()
    eid, parent = _study(tracker, store)
    runs = [tracker.start_run(eid, f"trial-{i}", parent=parent) for i in range(4)]

    def work(run: RunHandle) -> None:
        for step in range(1, 501):
            tracker.log_metrics(run, {"loss": step}, step)
            if step % 100 == 0:
                tracker.set_tags(run, {"last": step})
        tracker.end_run(run, "FINISHED")

    threads = [threading.Thread(target=work, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracker.flush()
    for run in runs:
        hist = store.client.get_metric_history(run.run_id, "loss")
        assert sorted(m.step for m in hist) == list(range(1, 501))
        got = store.client.get_run(run.run_id)
        assert got.info.status == "FINISHED" and got.data.tags["last"] == "500"
