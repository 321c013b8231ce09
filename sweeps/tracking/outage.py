"""How long a process waits out an MLflow tracking store that stopped answering, and what it says.

While the store does not answer, a tracker's outbox (``sweeps.tracking.outbox``) keeps every write
in its spool and tries the store again every ``SWEEPS_TRACKING_RETRY_S``; trials train on. The
outage is bounded by the limit the Optuna storage's is (``SWEEPS_STORAGE_WAIT_S``,
:data:`sweeps.durations.STORAGE_WAIT_S`): one line when it starts, one when the store answers
again, and past the limit the owner's check (``MlflowTracker.check_outage``, its outbox's) raises
:class:`TrackingUnavailable`, on which the process stops as SIGTERM stops it (exit 143). Only a
failed try is counted: the stop comes at the first try that fails once the limit has passed, so
within one retry interval of it. The spooled writes stay where they are, for the next sweeps
process that reaches the store or ``sweeps sync-tracking``.

A store that refuses every write (credentials, permissions, schema: ``send.StoreRefusesEveryWrite``)
is not waited for: it is one line at once.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from sweeps.durations import ENV_STORAGE_WAIT, store_wait_seconds
from sweeps.errors import StoreGone, TrackingError
from sweeps.tracking.base import RunHandle
from sweeps.tracking.sync import sync_command

log = logging.getLogger(__name__)


class TrackingUnavailable(TrackingError, StoreGone):
    """The MLflow tracking store has not answered for longer than the wait: stop as on SIGTERM."""


class TrackingOutage:
    """The outage state of one tracker's outbox (the caller holds the outbox's lock): why the store
    is down and until when it is left alone, when it stopped answering, and the error once that is
    longer ago than the wait."""

    def __init__(self, tracking_uri: str, spool_dir: Path, retry_s: float) -> None:
        self.tracking_uri, self.spool_dir, self.retry_s = tracking_uri, spool_dir, retry_s
        self.reason = ""  # the last failed try's error, in one line ("" while the store answers)
        self.until = 0.0  # monotonic time before which the store is not tried again
        self.since: float | None = None  # monotonic time of the outage's first failed try
        self.gone: TrackingUnavailable | None = None

    def failed(self, reason: str) -> None:
        """A try failed with ``reason`` (one line): the first says what is waited for."""
        now, limit = time.monotonic(), store_wait_seconds()
        self.reason, self.until = reason, now + self.retry_s
        if self.since is None:
            self.since = now
            log.warning("MLflow tracking store %s %s (%s); training goes on, writes are kept in %s and tried again "
                        "every %.0f s, for up to %.0f s (%s)", self.tracking_uri,
                        "cannot write" if reason.startswith("disk full") else "is unreachable", reason,
                        self.spool_dir, self.retry_s, limit, ENV_STORAGE_WAIT)
        if self.gone is None and now - self.since >= limit:
            self.gone = TrackingUnavailable(
                f"stopped: the MLflow tracking store {self.tracking_uri} did not answer for {now - self.since:.0f} s "
                f"({ENV_STORAGE_WAIT}={limit:g}; last error: {reason}); running trials were checkpointed and "
                f"are requeued. The writes it could not take are kept in {self.spool_dir}: the next `sweeps run` "
                f"sends them, or: {sync_command(self.tracking_uri, self.spool_dir)}")

    def answered(self) -> bool:
        """A try succeeded: the outage, if one was under way, is over. Returns whether one was."""
        if not self.reason:
            return False
        log.warning("MLflow tracking store %s answers again after %.0f s; the kept writes are being sent",
                    self.tracking_uri, time.monotonic() - (self.since or 0.0))  # since is set with reason
        self.reason, self.until, self.since, self.gone = "", 0.0, None, None
        return True

    def kept_at_end(self, run: RunHandle, status: str, writes: int, path: Path) -> None:
        """A run ended with ``writes`` of its writes kept in ``path``: where, and who sends them."""
        log.warning("MLflow tracking store %s is unreachable (%s): %d writes of run %s (%s, status %s) are kept in "
                    "%s. This process, or the next sweeps process that reaches the store, sends them; or send them "
                    "with: %s", self.tracking_uri, self.reason or "see above", writes, run.run_id, run.name, status,
                    path, sync_command(self.tracking_uri, self.spool_dir))

    def still_kept(self, runs: int) -> TrackingError:
        """The end of a study with ``runs`` runs' writes still kept, the store away past the wait."""
        waited = time.monotonic() - self.since if self.since is not None else 0.0
        return TrackingError(
            f"the MLflow tracking store {self.tracking_uri} did not answer for {waited:.0f} s "
            f"({ENV_STORAGE_WAIT}={store_wait_seconds():g}); the writes of {runs} run{'s' if runs != 1 else ''} "
            f"are still kept in {self.spool_dir}: the next `sweeps run` sends them, or: "
            f"{sync_command(self.tracking_uri, self.spool_dir)}")
