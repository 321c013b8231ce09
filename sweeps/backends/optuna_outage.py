"""Waiting out an outage of the Optuna storage: a PostgreSQL restart or failover, a connection
reset, a SQLite database locked for a while.

Every call a process makes to its RDB storage goes through :meth:`OutageWait.call` (the storage
is wrapped once, in :func:`sweeps.backends.optuna_adapter.outage_tolerant`). A transient error
(the server cannot be reached, closed the connection, is starting up or shutting down) is retried
with backoff, while trials train on in their own threads, for up to ``SWEEPS_STORAGE_WAIT_S``
seconds (default :data:`sweeps.durations.STORAGE_WAIT_S`, a limit the MLflow tracking store
shares: ``sweeps.tracking.outage``), with one line saying what is waited for and one when
it answers again. Past the limit :class:`StorageUnavailable` is raised (at once, from then on,
while the storage stays down): a worker stops as a SIGTERM stops it (its trial checkpoints, its
run is closed, the trial is requeued by the heartbeat once the storage is back) and so does
``sweeps run``, exit 143, saying why. Any other database error (credentials, permissions, a
schema that is not Optuna's) is permanent: one clear line at once (:func:`permanent_message`).

A storage that does not answer the first time a process opens it is an error at once: a wrong
host or port must not be waited on for minutes. Only a storage this process has used is waited for.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from optuna.exceptions import StorageInternalError
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from sweeps.durations import ENV_STORAGE_WAIT, store_wait_seconds
from sweeps.errors import BackendError, StoreGone, cause_chain

log = logging.getLogger("sweeps")
MAX_PAUSE_S = 5.0  # the longest pause between two tries: a storage that is back is used within seconds

# SQLSTATEs a retry clears: connection exceptions (class 08), the server shutting down or starting
# up (57P01-57P03), a serialization failure or deadlock (40001, 40P01), too many connections (53300).
_TRANSIENT_STATES = frozenset({"57P01", "57P02", "57P03", "40001", "40P01", "53300"})
_TRANSIENT_WORDS = (
    "connection refused", "no route to host", "name or service not known", "server closed the connection",
    "could not connect", "connection reset",
    "connection timed out", "timeout expired", "the database system is starting up",
    "the database system is shutting down", "the database system is in recovery mode",
    "terminating connection", "ssl syscall error", "no connection to the server", "connection already closed",
    "connection is closed", "broken pipe", "network is unreachable", "could not receive data",
    "could not send data", "could not translate host name", "database is locked",
)
TRANSIENT, PERMANENT = "transient", "permanent"
T = TypeVar("T")


class StorageUnavailable(BackendError, StoreGone):
    """The storage has not answered for longer than the wait allows: the process stops as on SIGTERM."""



def classify(exc: BaseException) -> str | None:
    """TRANSIENT, PERMANENT, or None for an error that is not the database's (a study that does
    not exist, a finished trial updated: Optuna's own answers, passed on as they are)."""
    database = False
    for link in cause_chain(exc):
        if isinstance(link, DBAPIError) and link.connection_invalidated:
            return TRANSIENT
        state = getattr(link, "pgcode", None) or getattr(link, "sqlstate", None)
        if isinstance(state, str) and (state.startswith("08") or state in _TRANSIENT_STATES):
            return TRANSIENT
        if any(word in str(link).lower() for word in _TRANSIENT_WORDS):
            return TRANSIENT
        database = database or isinstance(link, (StorageInternalError, SQLAlchemyError))
    return PERMANENT if database else None


def root_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost error that says something (Optuna wraps the database's
    own message; SQLAlchemy's pool adds wordless ones of its own under it)."""
    said = [link for link in cause_chain(exc) if str(link).strip() not in ("", "()")] or [exc]
    root = said[-1]
    return f"{type(root).__name__}: {(str(root).strip() or '?').splitlines()[0]}"


def permanent_message(where: str, exc: BaseException) -> str:
    cause = root_cause(exc)
    low = cause.lower()
    if "password" in low or "authentication" in low or ("role" in low and "does not exist" in low):
        fix = "check the user and password in the storage URL"
    elif "permission denied" in low or "must be owner" in low:
        fix = "grant that user the rights Optuna needs on the database (it creates and writes its tables)"
    elif "does not exist" in low or "no such table" in low or "undefinedcolumn" in low or "column" in low:
        fix = "the database's tables are not this Optuna's (another schema, or dropped); point storage: at " \
              "Optuna's database, or upgrade it with `optuna storage upgrade`"
    else:
        fix = "a retry will not clear it: check the URL, the server's log and the credentials"
    return f"storage: {where} refused the request ({cause}); {fix}"


class OutageWait:
    """The outage state of one storage in this process, shared by its threads (the trial, its
    heartbeat, the stale-trial monitor): one line when an outage starts and one when it ends."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.answered = False  # whether this process has used the storage: only then is an outage waited for
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the outage under way
        self._given_up = False
        self._back_at = -float("inf")  # monotonic time the last outage ended

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)``, tried again through a transient error until the wait is over."""
        pause = 0.25
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if classify(exc) != TRANSIENT or not self.answered:
                    raise
                self._failed(exc)  # raises StorageUnavailable past the limit
                time.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)
                continue
            self._answered()
            return result

    def quiet_for(self, seconds: float) -> bool:
        """Whether an outage is under way or ended less than ``seconds`` ago: heartbeats could not
        be recorded meanwhile, so silence then is no sign of a dead worker."""
        with self._lock:
            return self._since is not None or time.monotonic() - self._back_at < seconds

    def _failed(self, exc: BaseException) -> None:
        limit = store_wait_seconds()
        with self._lock:
            now = time.monotonic()
            if self._since is None:
                self._since = now
                log.warning("the Optuna storage %s does not answer (%s); waiting up to %.0f s (%s) for it to "
                            "come back, while trials train on", self.where, root_cause(exc), limit, ENV_STORAGE_WAIT)
            if self._given_up or now - self._since >= limit:
                self._given_up = True
                raise StorageUnavailable(
                    f"stopped: the Optuna storage {self.where} did not answer for {limit:.0f} s ({ENV_STORAGE_WAIT}; "
                    f"last error {root_cause(exc)}); running trials were checkpointed. Once it is back, run the "
                    "same command: their trials are requeued and resume from the checkpoint") from exc

    def _answered(self) -> None:
        if self.answered and self._since is None:
            return
        with self._lock:
            self.answered = True
            if self._since is not None:
                log.warning("the Optuna storage %s answers again after %.0f s", self.where,
                            time.monotonic() - self._since)
                self._since, self._given_up, self._back_at = None, False, time.monotonic()


_WAITS: dict[str, OutageWait] = {}
_WAITS_LOCK = threading.Lock()


def outage_wait(where: str) -> OutageWait:
    """The one :class:`OutageWait` of this process for the storage at ``where`` (a redacted URL)."""
    with _WAITS_LOCK:
        return _WAITS.setdefault(where, OutageWait(where))
