"""The one module of sweeps that touches MLflow's private API (names starting with ``_``).

MLflow may move or drop a private name in any release, without a deprecation warning. Keeping
every such use here makes an upgrade a review of one short file: re-check each function below
against the new MLflow's source, then update :data:`MLFLOW_CHECKED` (tests/test_private_apis.py
fails until then, and fails if any other module of core/, sweeps/ or dashboards/ reaches into a
private name of MLflow, Ray or Optuna). Each function says why MLflow's public API does not do it.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow.entities import Metric

MLFLOW_CHECKED = "3.17.2"  # the MLflow version every function below was read against


@contextlib.contextmanager
def fluent_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for a moment: ``log_model`` and the SQL registry
    store (which looks the logged model up to create a version) read it, not the client's.

    The public ``mlflow.set_tracking_uri`` could not put the process back as it was: an unset
    URI reads back from ``get_tracking_uri`` as the resolved default, and setting that would pin
    it for the rest of the process. MLflow's ``_use_tracking_uri`` restores the unset state."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri  # lazy: mlflow, only to promote

    with _use_tracking_uri(uri):
        yield


# Dialects whose INSERT has ON CONFLICT (SQLAlchemy's sqlite and postgresql insert constructs).
_UPSERT_DIALECTS = ("sqlite", "postgresql")


def sql_metric_writer(client: Any) -> Callable[[str, Sequence[Metric]], None] | None:
    """For an ``MlflowClient`` on MLflow's own SQL store (SQLite or PostgreSQL): a function that
    writes a run's metric points as ``log_batch`` does, in one transaction, or None (a tracking
    server, another database, or a wrapper around the client: those go through ``log_batch``).

    ``log_batch`` builds an ORM object per point (``SqlMetric``) and reads every key's latest
    value back before it updates ``latest_metrics``: about 0.07 ms a point once torch is loaded,
    where a study of small trials logs hundreds of thousands (README, benchmarks item 11). This
    writes the same rows with two SQL statements, about 0.0065 ms a point: an INSERT of every
    point that skips one the run already holds (``log_batch`` skips those too) and an upsert of
    each key's latest point that keeps the stored one where it is later by (step, timestamp,
    value), MLflow's order. It runs in the store's ``ManagedSessionMaker`` (the same SQLite
    pragmas and error translation: an unreachable database is ``TEMPORARILY_UNAVAILABLE``),
    checks the run is active with the store's own ``_get_run`` and ``_check_run_is_active``,
    validates each point with MLflow's ``_validate_metric``, stores NaN and infinities as
    ``sanitize_metric_value`` does and retries a deadlock as ``_log_metrics`` does
    (``_run_with_deadlock_retry``). tests/scaleout/test_mlflow_sql_metrics.py compares its rows
    with ``log_batch``'s."""
    import mlflow  # lazy, as in every function here: MLflow loads where a store is used, not at import
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient

    if type(client) is not MlflowClient or mlflow.get_active_model_id() is not None:
        return None  # an active model: log_batch also writes the points as that logged model's metrics
    store = client._tracking_client.store
    if not isinstance(store, SqlAlchemyStore) or store.engine.dialect.name not in _UPSERT_DIALECTS:
        return None
    # Another MLflow than the one read (pyproject allows any 3.x): without the store's names this
    # uses, its points go through log_batch rather than fail as refused.
    if not all(hasattr(store, name) for name in _STORE_NAMES):
        return None
    return functools.partial(_write_metrics, store)


_STORE_NAMES = ("ManagedSessionMaker", "_get_run", "_check_run_is_active", "_run_with_deadlock_retry",
                "sanitize_metric_value")


def _write_metrics(store: Any, run_id: str, metrics: Sequence[Metric]) -> None:
    import sqlalchemy as sa
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from mlflow.utils.validation import _validate_metric, _validate_run_id
    from sqlalchemy.dialects import postgresql, sqlite

    insert: Any = sqlite.insert if store.engine.dialect.name == "sqlite" else postgresql.insert
    _validate_run_id(run_id)
    rows: list[dict[str, Any]] = []
    latest: dict[str, dict[str, Any]] = {}
    for i, m in enumerate(metrics):  # refusals name the point as log_batch's do
        _validate_metric(m.key, m.value, m.timestamp, m.step, path="" if len(metrics) == 1 else f"metrics[{i}]")
        is_nan, value = store.sanitize_metric_value(m.value)
        row = {"run_uuid": run_id, "key": m.key, "value": value, "timestamp": m.timestamp, "step": m.step,
               "is_nan": is_nan}
        rows.append(row)
        held = latest.get(m.key)
        if held is None or (m.step, m.timestamp, value) > (held["step"], held["timestamp"], held["value"]):
            latest[m.key] = row
    if not rows:
        return
    points = insert(SqlMetric.__table__).on_conflict_do_nothing()
    table = SqlLatestMetric.__table__
    newest = insert(table)
    newest = newest.on_conflict_do_update(
        index_elements=[table.c.key, table.c.run_uuid],
        set_={c: newest.excluded[c] for c in ("value", "timestamp", "step", "is_nan")},
        where=sa.tuple_(newest.excluded.step, newest.excluded.timestamp, newest.excluded.value)
        > sa.tuple_(table.c.step, table.c.timestamp, table.c.value))
    # Keys in one order in every transaction, as MLflow locks them: two writers of one run cannot
    # deadlock on PostgreSQL by taking the same rows in opposite orders.
    newest_rows = [latest[key] for key in sorted(latest)]

    def transaction() -> None:
        with store.ManagedSessionMaker(read_only=False) as session:
            store._check_run_is_active(store._get_run(run_uuid=run_id, session=session))
            session.execute(points, rows)
            session.execute(newest, newest_rows)

    store._run_with_deadlock_retry(transaction)  # a deadlock all the same is retried, as log_batch does
