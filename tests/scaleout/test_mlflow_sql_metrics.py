"""Metric points written straight to MLflow's SQL store (``mlflow_adapter.sql_metric_writer``) end
as ``MlflowClient.log_batch`` leaves them: the same history rows and the same latest value per key
(what the MLflow UI's run table shows), on SQLite and on PostgreSQL, with NaN, infinities, steps
out of order, points repeated inside a batch and a batch sent twice (a retry after a lost answer).
A run that takes no writes refuses them as ``log_batch`` does, so the sender drops and reports them
alike."""
from __future__ import annotations

import math

import pytest
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from sweeps.tracking.mlflow_adapter import sql_metric_writer
from tests.sweeps.study_helpers import migrated_store

TS = 1_800_000_000_000


def _batches() -> list[list[Metric]]:
    first = [Metric("loss", 1.0 / (s + 1), TS + s, s) for s in range(40)]
    first += [Metric("odd", math.nan, TS, 0), Metric("odd", math.inf, TS + 1, 1), Metric("odd", -math.inf, TS + 2, 2)]
    first += [Metric("loss", 0.5, TS, 3), Metric("loss", 0.5, TS, 3)]  # the same point twice in one batch
    late_first = [Metric("late", 5.0, TS + 10, 10), Metric("late", 3.0, TS + 20, 5)]  # step 10 stays latest
    tie = [Metric("tie", 1.0, TS, 7), Metric("tie", 2.0, TS, 7)]  # same step and time: the larger value is latest
    earlier = [Metric("loss", 9.0, TS - 5, 2), Metric("odd", math.nan, TS + 3, 3)]
    return [first, late_first, tie, list(first), earlier]  # list(first): the batch sent again


def _rows(client: MlflowClient, run_id: str) -> tuple[dict, dict]:
    run = client.get_run(run_id)
    history = {key: sorted((m.step, m.timestamp, repr(m.value)) for m in client.get_metric_history(run_id, key))
               for key in run.data.metrics}  # repr: NaN equals NaN
    latest = {key: repr(value) for key, value in run.data.metrics.items()}
    return history, latest


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def client(request, tmp_path) -> MlflowClient:
    if request.param == "sqlite":
        return MlflowClient(migrated_store(tmp_path))
    return MlflowClient(request.getfixturevalue("fresh_db")())


def test_points_end_in_the_store_as_log_batch_leaves_them(client):
    experiment = client.create_experiment("metrics")
    by_mlflow, by_writer = (client.create_run(experiment).info.run_id for _ in range(2))
    write = sql_metric_writer(client)
    assert write is not None
    for batch in _batches():
        client.log_batch(by_mlflow, metrics=batch, synchronous=True)
        write(by_writer, batch)
    history, latest = _rows(client, by_writer)
    assert (history, latest) == _rows(client, by_mlflow)
    assert latest["late"] == "5.0" and latest["tie"] == "2.0" and latest["odd"] == "nan"
    assert len(history["loss"]) == 40 + 1 + 1  # 40 steps, step 3 again at another time, step 2 again
    assert [v for _, _, v in history["odd"]] == ["nan", "1.7976931348623157e+308", "-1.7976931348623157e+308", "nan"]


def test_a_deleted_run_refuses_the_points_as_log_batch_does(client):
    run_id = client.create_run(client.create_experiment("deleted")).info.run_id
    client.delete_run(run_id)
    points = [Metric("loss", 1.0, TS, 0)]
    with pytest.raises(MlflowException) as by_mlflow:
        client.log_batch(run_id, metrics=points, synchronous=True)
    with pytest.raises(MlflowException) as by_writer:
        sql_metric_writer(client)(run_id, points)
    assert by_writer.value.error_code == by_mlflow.value.error_code == "INVALID_PARAMETER_VALUE"
    assert client.get_metric_history(run_id, "loss") == []


def test_a_bad_metric_is_refused_before_anything_is_written(tmp_path):
    client = MlflowClient(migrated_store(tmp_path))
    run_id = client.create_run(client.create_experiment("bad")).info.run_id
    points = [Metric("fine", 1.0, TS, 0), Metric("../up", 1.0, TS, 0)]
    with pytest.raises(MlflowException) as by_mlflow:
        client.log_batch(run_id, metrics=points, synchronous=True)
    with pytest.raises(MlflowException) as by_writer:
        sql_metric_writer(client)(run_id, points)
    assert by_writer.value.error_code == "INVALID_PARAMETER_VALUE"
    assert "metrics[1]" in by_writer.value.message and "metrics[1]" in by_mlflow.value.message  # names the point
    assert client.get_run(run_id).data.metrics == {}


def test_only_mlflows_own_client_on_an_sql_store_gets_the_writer(tmp_path):
    class Wrapper:  # a wrapper's log_batch may count or fail on purpose: it keeps its own path
        def __init__(self, inner):
            self.inner = inner

    client = MlflowClient(migrated_store(tmp_path))
    assert sql_metric_writer(client) is not None
    assert sql_metric_writer(Wrapper(client)) is None
    assert sql_metric_writer(MlflowClient("http://127.0.0.1:9")) is None


def test_log_batch_keeps_what_the_writer_would_not_write_as_it_does(tmp_path, monkeypatch):
    """An active logged model (log_batch also records the points as its metrics), and an MLflow
    whose store lacks a name the writer uses (it would fail where log_batch stores the points)."""
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    client = MlflowClient(migrated_store(tmp_path))
    # What MlflowClient.log_batch asks (mlflow.set_active_model, or MLFLOW_ACTIVE_MODEL_ID, which
    # MLflow reads once per thread and keeps: set for real it would outlive this test).
    monkeypatch.setattr(mlflow, "get_active_model_id", lambda: "m-0123456789abcdef")
    assert sql_metric_writer(client) is None
    monkeypatch.undo()
    assert sql_metric_writer(client) is not None
    monkeypatch.delattr(SqlAlchemyStore, "_run_with_deadlock_retry")
    assert sql_metric_writer(client) is None
