"""The outbox: every write of a trial (its run, params, tags, points, dataset inputs, files and
logged model) that the store cannot take is kept and replayed in order, exactly once, by the
tracker that kept it, the next process that reaches the store, or one ``sweeps sync-tracking``.
Real stores: a sqlite store, an http URI where nothing listens, and a sqlite database held
locked by another process."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import sqlalchemy
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

from core.results import TrainResult
from sweeps.tracking import layout, sync_spool
from sweeps.tracking.send import drain
from sweeps.tracking.spool import Spool
from sweeps.tracking.trial_extras import TrialExtras
from sweeps.tracking.trial_model import MODEL_TYPE, TAG_MODEL_ID
from tests.sweeps.conftest import Store

from .conftest import CountingClient


class _Task:
    """A task whose datasets describe themselves with a digest (logged as the run's inputs)."""

    def datasets(self):
        return [0] * 5, [0] * 2

    def describe_dataset(self, dataset, split):
        return {"name": f"toy-{split}", "source": "task:toy", "digest": f"d{len(dataset)}",
                "profile": {"num_rows": len(dataset)}}


def _train(tracker, run, best, epochs=2) -> TrainResult:
    """What a trial writes through its tracker: its datasets, one point per epoch, its best
    checkpoint; returns the result its TrialExtras.finish gets."""
    task = _Task()
    extras = TrialExtras(tracker, run)
    extras.watch_datasets(task)
    task.datasets()  # training's call
    history = []
    for epoch in range(1, epochs + 1):
        history.append({"epoch": epoch, "step": epoch, "val_acc": 0.25 * epoch, "lr": 0.1})
        tracker.log_metrics(run, {"val_acc": 0.25 * epoch, "lr": 0.1}, epoch)
    tracker.log_artifact(run, best, layout.ART_CHECKPOINT_DIR)
    result = TrainResult("completed", "", epochs, epochs, history[-1], 0.25 * epochs, epochs, history,
                         checkpoint_best=best)
    extras.system.stop()
    return result, extras


def _replace(path, data: bytes) -> None:
    """Write ``path`` as core writes checkpoints: a temporary file, then ``os.replace``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _models(client, run):
    return [m for m in client.search_logged_models([run.experiment_id], filter_string=(
        f"source_run_id = '{run.run_id}'")) if m.model_type == MODEL_TYPE]


def _assert_complete(client, run, best_bytes, tmp_path):
    """The run as a trial that never saw an outage leaves it: FINISHED, one READY model named on
    the run, its two dataset inputs, each point once, the checkpoint as it was logged."""
    got = client.get_run(run.run_id)
    assert got.info.status == "FINISHED"
    models = _models(client, run)
    assert len(models) == 1 and str(models[0].status).endswith("READY")
    assert got.data.tags[TAG_MODEL_ID] == models[0].model_id and "sweeps.model_error" not in got.data.tags
    assert [(m.key, m.value, m.step) for m in models[0].metrics] == [("val_acc", 0.5, 2)]
    assert sorted(d.dataset.name for d in got.inputs.dataset_inputs) == ["toy-train", "toy-val"]
    assert [o.model_id for o in got.outputs.model_outputs] == [models[0].model_id]
    assert [p.step for p in client.get_metric_history(run.run_id, "val_acc")] == [1, 2]
    dest = tmp_path / "downloaded"
    dest.mkdir(parents=True)
    path = client.download_artifacts(run.run_id, f"{layout.ART_CHECKPOINT_DIR}/best.pt", str(dest))
    assert open(path, "rb").read() == best_bytes


def test_a_trial_ending_in_an_outage_gets_its_logged_model_inputs_and_files_from_one_sync(
        make_tracker, store, tmp_path, free_port, fast_http_env):
    """Item: trials that end while the store is down never got their logged model. Now the model
    waits in the outbox with the run's other writes, and one ``sync_spool`` call sends every run
    (two trials with dataset inputs, and the study run), ending the study run's RUNNING state."""
    up = make_tracker()
    study = up.start_run("study", experiment=store.experiment_name(), tags={layout.TAG_ROLE: layout.ROLE_STUDY})
    trials = [up.start_run(f"trial-{n}", parent=study) for n in range(2)]
    down = make_tracker(f"http://127.0.0.1:{free_port}", retry_interval_s=3600)
    kept = {}
    for n, run in enumerate(trials):
        best = tmp_path / f"trial-{n}" / "best.pt"
        best.parent.mkdir()
        best.write_bytes(f"weights of trial {n}".encode())
        result, extras = _train(down, run, best)
        extras.finish(n, {"lr": 0.1}, result)
        down.end_run(run, "FINISHED")
        kept[run.run_id] = best.read_bytes()
        _replace(best, b"a resumed trial's new best")  # the spool kept its own copy
    down.end_run(study, "FINISHED")
    assert store.client.get_run(study.run_id).info.status == "RUNNING"

    result = sync_spool(store.uri, down.spool.directory)  # one call
    assert not result["failed"] and not result["refused"]
    assert result["totals"]["inputs"] == 2 and result["totals"]["models"] == 2
    assert all(r["drained"] for r in result["runs"].values()) and set(result["runs"]) == {
        study.run_id, *(r.run_id for r in trials)}
    assert store.client.get_run(study.run_id).info.status == "FINISHED"
    for n, run in enumerate(trials):
        _assert_complete(store.client, run, kept[run.run_id], tmp_path / f"t{n}")
    assert not down.spool.run_ids() and not list(down.spool.directory.glob("*.files/*"))

    again = sync_spool(store.uri, down.spool.directory)  # nothing twice
    assert again["totals"] == dict.fromkeys(again["totals"], 0)
    assert all(len(_models(store.client, r)) == 1 for r in trials)


class _LostAnswer(CountingClient):
    """The real client; the first ``fail`` call is made on the store, then its answer is lost."""

    def __init__(self, client, fail: str) -> None:
        super().__init__(client)
        self.fail, self.failed = fail, False

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name != self.fail or self.failed:
            return attr

        def lost(*args, **kwargs):
            attr(*args, **kwargs)
            self.failed = True
            raise MlflowException("read timed out", error_code=TEMPORARILY_UNAVAILABLE)

        return lost


@pytest.mark.parametrize("fail", ["create_logged_model", "finalize_logged_model", "set_tag"])
def test_a_logged_model_replayed_after_a_lost_answer_is_made_once(make_tracker, store, tmp_path, fail):
    """The store made the model (or part of it) but its answer was lost: the record stays in the
    outbox, and its replay completes that model instead of making a second one."""
    from sweeps.tracking.trial_model import model_record

    tracker = make_tracker()
    run = tracker.start_run("trial-0", experiment=store.experiment_name())
    best = tmp_path / "best.pt"
    best.write_bytes(b"weights")
    result, _ = _train(tracker, run, best)
    tracker.flush(run)
    spool = Spool(tmp_path / "replay")
    spool.append(run.run_id, [["lm", model_record(0, {"lr": 0.1}, result, {})], ["end", "FINISHED", 1]])

    with pytest.raises(MlflowException, match="read timed out"):
        drain(spool, _LostAnswer(store.client, fail), run.run_id)
    assert spool.has_pending(run.run_id)
    counts, refusals, drained = drain(spool, store.client, run.run_id)
    assert drained and not refusals and counts["models"] == 1
    models = _models(store.client, run)
    assert len(models) == 1 and str(models[0].status).endswith("READY")
    got = store.client.get_run(run.run_id)
    assert got.data.tags[TAG_MODEL_ID] == models[0].model_id and got.info.status == "FINISHED"
    assert len(got.outputs.model_outputs) == 1


def test_a_continued_runs_replayed_model_replaces_the_earlier_one(make_tracker, store, tmp_path):
    """A trial started again (Ray) logs its model again: the replay deletes the earlier start's
    model, but never the one its own record made."""
    from sweeps.tracking.trial_model import TAG_MODEL_KEY, model_record

    tracker = make_tracker()
    run = tracker.start_run("trial-0", experiment=store.experiment_name())
    best = tmp_path / "best.pt"
    best.write_bytes(b"weights")
    result, _ = _train(tracker, run, best)
    tracker.log_trial_model(run, model_record(0, {"lr": 0.1}, result, {}))
    first = store.client.get_run(run.run_id).data.tags[TAG_MODEL_ID]
    again = model_record(0, {"lr": 0.1}, result, {}, replace=True)
    spool = Spool(tmp_path / "replay")
    spool.append(run.run_id, [["lm", again], ["lm", again]])  # the same record twice: a resent batch
    drain(spool, store.client, run.run_id)
    models = _models(store.client, run)
    assert [m.tags[TAG_MODEL_KEY] for m in models] == [again["key"]] and models[0].model_id != first


_HOLD_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
"""


@contextlib.contextmanager
def _busy_timeout_ms(ms: int) -> Iterator[None]:
    """MLflow sets SQLite's busy timeout (how long a write waits for a lock before it fails) to
    20 s at the start of every session; within this block it sets ``ms``: the same failure,
    sooner."""
    def shorter(conn, cursor, statement, parameters, context, executemany):
        if statement.strip().lower().startswith("pragma busy_timeout"):
            statement = f"PRAGMA busy_timeout = {ms};"
        return statement, parameters

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", shorter, retval=True)
    try:
        yield
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", shorter)


@pytest.mark.slow
def test_a_trial_ending_while_another_process_locks_the_sqlite_store_gets_everything_afterwards(tmp_path):
    """Item: another process holds the SQLite store locked while a trial ends (each write waits
    the busy timeout, then fails). The trial's writes, its logged model included, are kept; the
    next process that opens the store sends them."""
    from sweeps.tracking.mlflow_tracker import MlflowTracker

    store = Store(tmp_path / "store")
    tracker = MlflowTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root,
                            retry_interval_s=3600)
    run = tracker.start_run("trial-0", experiment="locked")
    best = tmp_path / "best.pt"
    best.write_bytes(b"weights")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path / "store" / "mlflow.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with _busy_timeout_ms(500):
            result, extras = _train(tracker, run, best)
            extras.finish(0, {"lr": 0.1}, result)
            tracker.end_run(run, "FINISHED")
        assert tracker.spool.has_pending(run.run_id)
        kinds = [rec[0] for _, rec in tracker.spool.read_pending(run.run_id)[0]]
        assert "lm" in kinds and "in" in kinds and kinds[-1] == "end"
    finally:
        holder.communicate("\n", timeout=60)
    _replace(best, b"a resumed trial's new best")

    later = MlflowTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root)
    later.check_connection()  # the next sweeps process: sends what waits for its store first
    assert not later.spool.run_ids()
    _assert_complete(store.client, run, b"weights", tmp_path / "t")


def test_a_store_that_refuses_every_write_says_so_in_one_line_at_once(tmp_path):
    """A transient error (unreachable, locked) is waited out while training goes on; an error of
    the store itself (here its schema: a table gone) is one line at once, not an endless wait,
    and the writes are kept for when it is fixed."""
    import sqlite3

    from sweeps.errors import TrackingError
    from sweeps.tracking.mlflow_tracker import MlflowTracker

    store = Store(tmp_path / "store")
    tracker = MlflowTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root,
                            retry_interval_s=3600, flush_every_points=10**9, flush_every_s=1e9)
    run = tracker.start_run("trial-0", experiment="schema")
    with sqlite3.connect(tmp_path / "store" / "mlflow.db") as db:
        db.execute("DROP TABLE metrics")
    tracker.log_metrics(run, {"loss": 1.0}, 1)
    with pytest.raises(TrackingError) as raised:
        tracker.flush()
    message = str(raised.value)
    assert "\n" not in message and "no such table: metrics" in message, message
    assert f"sweeps sync-tracking --uri {store.uri}" in message
    assert not tracker.store_down  # not taken for an outage to wait out
    assert [rec for _, rec in tracker.spool.read_pending(run.run_id)[0]] == [["m", "loss", 1.0, pytest.approx(0,
                                                                            abs=1e13), 1]]


def test_credentials_and_permissions_are_permanent_an_unreachable_or_locked_store_is_not():
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED

    from sweeps.tracking.store_errors import is_transient, permanent_reason

    for code, words in ((UNAUTHENTICATED, "credentials"), (PERMISSION_DENIED, "permission")):
        exc = MlflowException("API request to endpoint /api/2.0/mlflow/runs/log-batch failed", error_code=code)
        assert not is_transient(exc) and words in permanent_reason(exc)
    locked = MlflowException("(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE)
    assert is_transient(locked) and permanent_reason(locked) is None
    assert is_transient(ConnectionRefusedError()) and permanent_reason(ConnectionRefusedError()) is None
