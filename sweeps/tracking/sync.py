"""Sending what a sweep spooled while the tracking store was down: :func:`sync_spool`
(``sweeps sync-tracking --uri URI --spool DIR``), the command quoted in warnings, and how long a
tracker leaves an unreachable store alone before it tries again.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sweeps.durations import env_seconds
from sweeps.errors import TrackingError
from sweeps.tracking.local_runs import is_local
from sweeps.tracking.send import COUNT_KEYS, StoreRefusesEveryWrite, drain
from sweeps.tracking.spool import Spool, store_key
from sweeps.tracking.store_checks import apply_fast_fail_http_defaults, check_store, is_http_uri
from sweeps.tracking.store_errors import is_transient

log = logging.getLogger(__name__)
ENV_RETRY_S = "SWEEPS_TRACKING_RETRY_S"
RETRY_S = 30.0  # after a failed write, how long a tracker spools without trying the store


def retry_seconds() -> float:
    """How long a tracker leaves an unreachable store alone (``SWEEPS_TRACKING_RETRY_S``, default 30)."""
    return env_seconds(ENV_RETRY_S, RETRY_S)


def sync_command(tracking_uri: str, spool_dir: str | Path) -> str:
    """The command that sends a spool later; quoted in warnings and errors."""
    return f"sweeps sync-tracking --uri {tracking_uri} --spool {spool_dir}"


def kept_until_fixed(tracking_uri: str, spool_dir: str | Path, exc: BaseException) -> TrackingError:
    """The one line for a store that refuses every write (``send.StoreRefusesEveryWrite``), whose
    writes wait in the spool ``spool_dir``."""
    return TrackingError(f"MLflow tracking store {tracking_uri} {exc}; the writes are kept in {spool_dir}: once "
                         f"it is fixed, send them with: {sync_command(tracking_uri, spool_dir)}")


def sync_spool(tracking_uri: str, spool_dir: str | Path, client: Any = None) -> dict:
    """Send every run's spooled writes to the store at ``tracking_uri``, oldest spool
    first, each run's writes in order; called by ``sweeps sync-tracking``.

    Raises TrackingError (before sending anything) when the store cannot be reached.
    Returns::

        {"runs": {run_id: {"metrics": n, "params": n, "tags": n, "artifacts": n, "inputs": n,
                           "models": n, "statuses": n, "drained": bool}},
         "totals": {"metrics": n, ...},
         "refused": [one line per write the store refused (dropped: it never would accept it)],
         "failed": {run_id: reason}   # run unknown to this store, or the store went
                                      # away mid-sync: the spool is kept, run again later
        }

    Safe to run again, and safe to interrupt: progress is committed per batch.
    """
    from mlflow.tracking import MlflowClient

    if is_http_uri(tracking_uri):
        apply_fast_fail_http_defaults()
    spool = Spool(spool_dir)
    if not spool.directory.is_dir():
        raise TrackingError(
            f"no spool folder at {str(spool.directory)!r}: nothing to send. Pass the folder the "
            f"sweep's warning named (the default is runs/.mlflow_spool)."
        )
    made: list[Any] = [client]

    def get_client() -> Any:
        if made[0] is None:
            made[0] = MlflowClient(tracking_uri=tracking_uri)
        return made[0]

    check_store(tracking_uri, get_client)
    client = get_client()
    totals = dict.fromkeys(COUNT_KEYS, 0)
    result: dict[str, Any] = {"runs": {}, "totals": totals, "refused": [], "failed": {}}
    for run_id in spool.run_ids():
        stamped = spool.store_of(run_id)
        if is_local(run_id) and stamped is not None and stamped != store_key(tracking_uri):
            # Not yet on any store: only the store it was made for can say it is the wrong one.
            result["failed"][run_id] = f"run {run_id} was made for the store {stamped}, not {store_key(tracking_uri)}"
            log.error("%s; its spool is kept (sync it with --uri set to that store)", result["failed"][run_id])
            continue
        try:
            # A run the store does not know means the wrong --uri: every write would be
            # refused and dropped, so keep the spool and say so instead. A run made during an
            # outage (a local id) is created by the drain, exactly once.
            if not is_local(run_id):
                client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - whatever the store answers, this run cannot be synced there
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            reason = f"run {run_id} not found at {tracking_uri} ({first}): is --uri the store the sweep used?"
            result["failed"][run_id] = reason
            log.error("%s; its spool is kept", reason)
            continue
        try:
            counts, refusals, drained = drain(spool, client, run_id)
        except StoreRefusesEveryWrite as exc:  # so would every other run's: one line, at once
            raise TrackingError(f"MLflow tracking store {tracking_uri} {exc}; nothing more was sent") from exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            result["failed"][run_id] = f"{type(exc).__name__}: {exc}"
            log.warning("sync of run %s stopped, the store failed (%s); run the sync again", run_id, exc)
            continue
        for key, n in counts.items():
            totals[key] += n
        result["runs"][run_id] = {**{k: counts.get(k, 0) for k in totals}, "drained": drained}
        result["refused"].extend(refusals)
        for line in refusals:
            log.error("%s", line)
    return result
