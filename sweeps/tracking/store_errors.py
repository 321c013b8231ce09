"""Store errors in one line: a full disk named as such, everything else by its first line.

SQLAlchemy's errors carry the whole statement and its parameters (dozens of lines), and
MLflow logs each one with a traceback before re-raising it; a full disk then printed hundreds
of lines per trial without ever saying "disk full". The tracker words its warnings and errors
with :func:`short_reason`, raises :func:`disk_full_error` for a full disk, and
:func:`quiet_store_errors_said_by_tracker` drops MLflow's own copy of errors the tracker reports itself (and
urllib3's line per retried request to a server that is down).
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from core.diskfull import describe_disk_full
from sweeps.errors import TrackingDiskFullError, TrackingError
from sweeps.store_urls import sqlite_path

# Errors of the store itself, not of one write; a SQL store's OperationalError (which MLflow
# answers as 503, "try again") says so only in its text.
_PERMANENT = re.compile(r"no such (table|column)|relation \S+ does not exist|column \S+ does not exist|"
                        r"readonly database|read-only|permission denied|access denied|password authentication failed",
                        re.IGNORECASE)


def permanent_reason(exc: BaseException) -> str | None:
    """One line saying why the store refuses every write (HTTP 401/403, a schema or permission
    error of its database), or None for an error of one write or one that may pass."""
    from mlflow.exceptions import MlflowException  # lazy: this module loads before MLflow is needed

    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if isinstance(exc, MlflowException) and exc.get_http_status_code() in (401, 403):
        what = "credentials" if exc.get_http_status_code() == 401 else "permission"
        return (f"refuses the {what} of this process (HTTP {exc.get_http_status_code()}): {first}; set "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an account "
                "that may write")
    said = next((line.strip() for line in str(exc).splitlines() if _PERMANENT.search(line)), None)
    if said is not None:  # the line that says it (MLflow's SQL errors start with SQLAlchemy's hints)
        return f"cannot be written: {said[:300]}; fix the store (its schema: `mlflow db upgrade URI`; its permissions)"
    return None


def is_transient(exc: BaseException) -> bool:
    """True when a failed write may succeed later unchanged: the store was unreachable,
    timed out, was locked, or answered 5xx/429. Anything else (4xx: a refused value, a deleted
    run; a store refusing every write, :func:`permanent_reason`) would fail again, so it must
    not be retried."""
    return permanent_reason(exc) is None and _unreachable(exc)


def stops_sending(exc: BaseException) -> bool:
    """True when no write can go now: the store is unreachable (:func:`is_transient`) or refuses
    every write (:func:`permanent_reason`); the error text is scanned once."""
    return permanent_reason(exc) is not None or _unreachable(exc)


def _unreachable(exc: BaseException) -> bool:
    """The store did not answer, timed out, was locked, or answered 5xx/429."""
    from mlflow.exceptions import MlflowException  # lazy: this module loads before MLflow is needed

    if isinstance(exc, MlflowException):
        code = exc.get_http_status_code()
        return code >= 500 or code == 429
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    with contextlib.suppress(ImportError):
        import requests

        if isinstance(exc, requests.exceptions.RequestException):
            return True
    with contextlib.suppress(ImportError):
        from sqlalchemy.exc import DisconnectionError, OperationalError

        if isinstance(exc, (OperationalError, DisconnectionError)):
            return True
    return False


def store_folder(tracking_uri: str, spool_dir: str | Path) -> Path:
    """Where a store write goes on this machine: the SQLite file's folder, else the spool."""
    path = sqlite_path(tracking_uri)
    return path.absolute().parent if path is not None else Path(spool_dir).absolute()


def short_reason(exc: BaseException, where: str | Path) -> str:
    """The full disk holding ``where``, else the error's first line (SQLAlchemy appends the statement)."""
    full = describe_disk_full(exc, where)
    if full is not None:
        return full
    lines = [ln for ln in str(exc).strip().splitlines() if not ln.startswith("(raised as a result of")]
    return lines[0][:300] if lines else type(exc).__name__


def disk_full_error(exc: BaseException, what: str, where: str | Path) -> TrackingDiskFullError | None:
    """A one-line error for ``what`` failing because ``where``'s disk is full; None otherwise."""
    full = describe_disk_full(exc, where)
    if full is None:
        return None
    return TrackingDiskFullError(f"{what} failed: {full}. Free space there, then resume the study (sweeps run "
                                 "SPEC); writes kept in the spool are sent then, or with sweeps sync-tracking")


@contextlib.contextmanager
def disk_full_raised(what: str, where: str | Path) -> Iterator[None]:
    """Turn an OSError of a full disk inside the block into :func:`disk_full_error`'s error."""
    try:
        yield
    except OSError as exc:
        full = disk_full_error(exc, what, where)
        if full is None:
            raise
        raise full from exc


class _HandledByTracker(logging.Filter):
    """Drop MLflow's "SQLAlchemy database error" log records and urllib3's "Retrying ..." line
    per retried HTTP request (dozens in a minute's outage of a server): the error reaches the
    tracker, which reports it in one line (or raises it with a message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("SQLAlchemy database error", "Retrying ("))


_FILTER = _HandledByTracker()


def quiet_store_errors_said_by_tracker() -> None:
    for name in ("mlflow.store.db.utils", "urllib3.connectionpool"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


quiet_store_errors_said_by_tracker()  # on import: every process with a tracker reports store errors itself


def call_error(what: str, subject: str, tracking_uri: str, exc: BaseException,
               store_dir: str | Path) -> TrackingError:
    """The error to raise for the store call ``what`` on ``subject`` that failed with ``exc``: a
    full disk named, else the reason and whether to start the store or fix the request."""
    hint = ("The store is unreachable: start it or fix the tracking URI, then resume the study."
            if is_transient(exc) else "The store refused the request: see the reason above.")
    return (disk_full_error(exc, f"MLflow {what} for {subject!r} at {tracking_uri}", store_dir)
            or TrackingError(f"MLflow {what} failed for {subject!r} at {tracking_uri}: {exc}. {hint}"))
