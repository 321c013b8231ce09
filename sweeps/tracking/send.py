"""Sending tracking records (the spool's format, ``sweeps.tracking.spool``) to the store: in
order, in as few calls as MLflow's limits allow, telling a transient failure (keep the
records, retry later) from a refusal (drop what was refused, report it, go on).

Used by a tracker's ``outbox.Outbox`` for every write, and by ``drain`` for what waited in the spool.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweeps.errors import TrackingError
from sweeps.tracking.local_runs import TAG_CLIENT_ID, is_local, store_id_for
from sweeps.tracking.mlflow_adapter import sql_metric_writer
from sweeps.tracking.spool import Spool
from sweeps.tracking.store_errors import is_transient, permanent_reason, stops_sending
from sweeps.tracking.trial_model import TAG_MODEL_ERROR, make_trial_model

log = logging.getLogger(__name__)

# MLflow's log_batch limits (mlflow.utils.validation): 1000 metrics, 100 params, 100 tags,
# 1000 entities, and a 1 MB request. We stay under the byte limit with a margin for
# the JSON framing the REST client adds around every entity.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000
MAX_BATCH_BYTES = 800_000
_ENTITY_OVERHEAD_BYTES = 64


class StoreRefusesEveryWrite(TrackingError):
    """The store can take no write until someone fixes it (credentials, permissions, its
    schema): waiting would not help, so it is said at once, in one line. The writes are kept."""


_ONE_CALL = ("a", "dt", "open", "end", "in", "lm", "new")  # records that are one store call each, never batched
# What send_records counts, per kind of write (``sweeps sync-tracking`` reports the same keys).
COUNT_KEYS = ("metrics", "params", "tags", "artifacts", "inputs", "models", "statuses")


@dataclass
class _Op:
    """One call to the store covering records[start:end]."""

    kind: str  # "batch" | one of _ONE_CALL
    start: int
    end: int


def _plan(records: Sequence[Sequence[Any]]) -> list[_Op]:
    """Group consecutive records into as few store calls as MLflow's limits allow."""
    ops: list[_Op] = []
    i, n = 0, len(records)
    while i < n:
        kind = records[i][0]
        if kind in _ONE_CALL:
            ops.append(_Op(kind, i, i + 1))
            i += 1
            continue
        start = i
        n_m = n_p = n_t = size = 0
        param_keys: set[str] = set()
        tag_keys: set[str] = set()
        while i < n and records[i][0] in ("m", "p", "t"):
            rec = records[i]
            kind, key = rec[0], rec[1]
            rec_size = _ENTITY_OVERHEAD_BYTES + len(key) + (len(rec[2]) if kind != "m" else 24)
            full = (
                n_m + n_p + n_t >= MAX_ENTITIES_PER_BATCH
                or size + rec_size > MAX_BATCH_BYTES
                or (kind == "m" and n_m >= MAX_METRICS_PER_BATCH)
                or (kind == "p" and (n_p >= MAX_PARAMS_TAGS_PER_BATCH or key in param_keys))
                # A repeated tag key starts a new batch so the later value wins on every
                # store, not only on those that happen to apply a batch in order.
                or (kind == "t" and (n_t >= MAX_PARAMS_TAGS_PER_BATCH or key in tag_keys))
            )
            if full and i > start:
                break
            if kind == "m":
                n_m += 1
            elif kind == "p":
                n_p += 1
                param_keys.add(key)
            else:
                n_t += 1
                tag_keys.add(key)
            size += rec_size
            i += 1
        ops.append(_Op("batch", start, i))
    return ops


def send_records(
    client: Any,
    run_id: str,
    records: Sequence[Sequence[Any]],
    on_done: Callable[[int], None],
    on_staged_sent: Callable[[str], None] | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Send ``records`` to the store in order, as few calls as the limits allow.

    After each call the store accepted, ``on_done(n)`` is told that records[:n] are in.
    A transient failure (see :func:`is_transient`) propagates at once, so the caller keeps
    records[n:], and so does a store refusing every write (:class:`StoreRefusesEveryWrite`,
    one line). A refusal (4xx) drops only what was refused and carries on: it would
    never succeed, and the records after it must not be held hostage. Returns the
    counts sent per kind and one line per refusal.
    """
    counts = dict.fromkeys(COUNT_KEYS, 0)
    refusals: list[str] = []
    for op in _plan(records):
        chunk = records[op.start : op.end]
        try:
            if op.kind == "batch":
                _send_batch(client, run_id, chunk, counts, refusals)
            elif op.kind == "a":
                _, local, artifact_dir, staged = chunk[0]
                if not Path(local).exists():
                    refusals.append(f"run {run_id}: artifact {local!r} no longer exists; not uploaded")
                else:
                    client.log_artifact(run_id, local, artifact_dir)
                    counts["artifacts"] += 1
                    if staged and on_staged_sent is not None:
                        on_staged_sent(local)
            elif op.kind == "in":
                _log_inputs(client, run_id, chunk[0][1])
                counts["inputs"] += 1
            elif op.kind == "lm":
                make_trial_model(client, run_id, chunk[0][1])
                counts["models"] += 1
            elif op.kind == "new":  # drain() creates the run from its spool's head; a copy later is inert
                pass
            elif op.kind == "dt":
                _delete_tag(client, run_id, chunk[0][1])
                counts["tags"] += 1
            else:
                status, end_time = ("RUNNING", None) if op.kind == "open" else chunk[0][1:]
                if end_time is None:
                    client.update_run(run_id, status=status)
                else:
                    client.set_terminated(run_id, status=status, end_time=int(end_time))
                counts["statuses"] += 1
        except Exception as exc:
            if is_transient(exc):
                raise
            if (reason := permanent_reason(exc)) is not None:  # every later write would fail alike
                raise StoreRefusesEveryWrite(reason) from exc
            if op.kind == "a" and chunk[0][3] and on_staged_sent is not None:
                on_staged_sent(chunk[0][1])  # refused for good: the staged copy is garbage
            if op.kind == "lm":  # the run says why it has no model, as when it is refused at once
                refusals.append(f"run {run_id}: no logged model: {type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    client.set_tag(run_id, TAG_MODEL_ERROR, f"no logged model: {type(exc).__name__}: {exc}"[:1000])
            else:
                what = {"a": "artifact", "dt": "tag removal", "in": "dataset inputs"}.get(op.kind, "status")
                refusals.append(f"run {run_id}: the store refused the {what} {list(chunk[0][1:])}: {exc}")
        on_done(op.end)
    return counts, refusals


def _log_inputs(client: Any, run_id: str, described: Sequence[Mapping[str, Any]]) -> None:
    """``log_inputs``, tried twice when its insert broke the store's unique key: two workers logging
    the same dataset at once (their first trials start together) may both find it missing and both
    insert it. The other's row is committed by then, so the second try links the run to it."""
    try:
        client.log_inputs(run_id, datasets=dataset_inputs(described))
    except Exception as exc:
        if not _duplicate_insert(exc):
            raise
        client.log_inputs(run_id, datasets=dataset_inputs(described))


def _duplicate_insert(exc: BaseException) -> bool:
    """An SQL store's unique key broken by a concurrent insert: MLflow wraps SQLAlchemy's error in
    this process, and a tracking server sends it back as its text (a 400 naming the driver's
    IntegrityError or, from psycopg, UniqueViolation)."""
    with contextlib.suppress(ImportError):
        from sqlalchemy.exc import IntegrityError  # lazy: only an SQL store raises it

        if isinstance(exc.__cause__, IntegrityError):
            return True
    text = str(exc)
    return "IntegrityError" in text or "UniqueViolation" in text


def dataset_inputs(described: Sequence[Mapping[str, Any]]) -> list[Any]:
    """MLflow DatasetInputs of ``["in", described]`` records: one dict per dataset with its
    ``name``, ``digest``, ``source``, ``profile`` (a dict) and ``context`` (training, validation)."""
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    return [DatasetInput(Dataset(name=d["name"], digest=d["digest"], source_type=d.get("source_type", "code"),
                                 source=json.dumps({"uri": d["source"]}), profile=json.dumps(d.get("profile") or {})),
                         tags=[InputTag(MLFLOW_DATASET_CONTEXT, d["context"])]) for d in described]


def _delete_tag(client: Any, run_id: str, key: str) -> None:
    """Remove a tag; one that is not there (never set, or removed by a resent record) is fine."""
    from mlflow.exceptions import MlflowException

    try:
        client.delete_tag(run_id, key)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST" or "No tag" not in str(exc):
            raise


def _send_batch(client: Any, run_id: str, chunk: Sequence[Sequence[Any]],
                counts: dict[str, int], refusals: list[str]) -> None:
    """One log_batch call (its metric points written directly on MLflow's own SQL store:
    ``mlflow_adapter.sql_metric_writer``); if the store refuses it, find what it refuses so the rest
    still gets in. Metrics are refused as a group (their keys and values are checked
    when logged, so a refusal means the run itself takes no writes); params and tags one
    by one (a param whose value changed on resume must not take the others with it)."""
    from mlflow.entities import Metric, Param, RunTag

    groups: dict[str, list[Any]] = {
        "metrics": [Metric(r[1], float(r[2]), int(r[3]), int(r[4])) for r in chunk if r[0] == "m"],
        "params": [Param(r[1], r[2]) for r in chunk if r[0] == "p"],
        "tags": [RunTag(r[1], r[2]) for r in chunk if r[0] == "t"],
    }

    write_metrics = sql_metric_writer(client) if groups["metrics"] else None

    def log(kind: str, items: list) -> None:
        if kind == "metrics" and write_metrics is not None:
            write_metrics(run_id, items)
        else:
            client.log_batch(run_id, synchronous=True, **{kind: items})

    try:
        if write_metrics is not None:  # MLflow's own SQL store: the points without an ORM object each
            write_metrics(run_id, groups["metrics"])
            counts["metrics"] += len(groups["metrics"])
            groups["metrics"] = []
        if groups["params"] or groups["tags"] or groups["metrics"]:
            client.log_batch(run_id, synchronous=True, **groups)
        for kind, items in groups.items():
            counts[kind] += len(items)
        return
    except Exception as exc:
        if stops_sending(exc):
            raise
    # Rare path (a refusal): resending what the store may already hold is harmless.
    for kind, items in groups.items():
        singles = [items] if kind == "metrics" else [[item] for item in items]
        for part in singles:
            if not part:
                continue
            try:
                log(kind, part)
                counts[kind] += len(part)
            except Exception as exc:
                if stops_sending(exc):
                    raise
                what = f"{len(part)} metric points" if kind == "metrics" else f"{kind[:-1]} {part[0].key!r}"
                refusals.append(f"run {run_id}: the store refused {what}: {exc}")


def drain(spool: Spool, client: Any, run_id: str) -> tuple[dict[str, int], list[str], bool]:
    """Send the run's spooled records, oldest first, committing progress after every
    accepted call. Returns (counts, refusals, drained). A transient failure propagates
    after the progress so far has been committed."""
    with spool.locked():
        if not spool.has_pending(run_id):
            return {}, [], True
        entries, end = spool.read_pending(run_id)
        target = run_id
        if is_local(run_id):  # made while the store was down: create it first (exactly once)
            head = entries[0][1] if entries and entries[0][1][0] == "new" else None
            found = store_id_for(spool.directory, client, run_id, head)
            if found is None:
                # Writes of another machine's local run (its trial failed from here) wait until that
                # machine sends the creation; or this is not the sweep's store. Kept, not refused.
                log.warning("run %s is not on the store yet (no run tagged %s=%s, and this spool does not create "
                            "it); its %d writes are kept", run_id, TAG_CLIENT_ID, run_id, len(entries))
                return {}, [], False
            target = found
            if head is not None:
                spool.commit(run_id, entries[0][0])
                entries = entries[1:]

        def on_done(n: int) -> None:
            spool.commit(run_id, entries[n - 1][0])

        records = [rec for _, rec in entries]
        counts, refusals = send_records(client, target, records, on_done, spool.discard_staged)
        # Everything readable is in; move past unreadable lines too so the file can go.
        spool.commit(run_id, end)
        return counts, refusals, spool.finish_if_drained(run_id)
