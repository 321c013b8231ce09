"""The outbox of one tracker: every MLflow write goes through it, to the store in the order it
was made or, while the store is away, into the spool (``sweeps.tracking.spool``), from which it
is sent, still in order, once the store answers again.

What is kept: a run's writes whenever the store does not take them (a transient failure, or the
store is considered down), and every write after them, so nothing overtakes what waits; a run
made while the store is down (a local id, ``local_runs``) keeps all its writes behind its creation.
When it is retried: after a failure the store is left alone for ``retry_interval_s``
(``SWEEPS_TRACKING_RETRY_S``), except for a run's last submission (``end_run``), which is always
tried; then the next write, or ``check_outage``, tries it again. The first success after an outage
sends this tracker's kept runs, then any other process's kept for the same store.
When an outage outlasts ``SWEEPS_STORAGE_WAIT_S``: ``check_outage`` raises ``TrackingUnavailable``
and ``send_spooled`` stops retrying (the outage clock and its messages: ``sweeps.tracking.outage``).
A store that refuses every write is said at once (``sync.kept_until_fixed``), its writes kept.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sweeps.errors import TrackingError
from sweeps.tracking.base import RunHandle
from sweeps.tracking.local_runs import is_local, known_store_id
from sweeps.tracking.outage import TrackingOutage
from sweeps.tracking.send import StoreRefusesEveryWrite, drain, send_records
from sweeps.tracking.spool import Spool
from sweeps.tracking.store_errors import disk_full_raised, is_transient, short_reason
from sweeps.tracking.sync import kept_until_fixed

log = logging.getLogger(__name__)

MAX_PAUSE_S = 5.0  # the longest pause between two tries at the end of a study


class Outbox:
    """Sends the writes of one tracker to the MLflow store at ``tracking_uri`` in order, keeping
    in ``spool`` what the store cannot take now. ``client`` returns the ``MlflowClient`` (built on
    first use, so it may raise ``TrackingError``); ``store_dir`` is where a full disk would be.

    ``lock`` serialises every send and spool write, so a run's writes reach the store (or the
    spool) in the order they were made, whichever thread sends them; a caller that takes writes
    out of a buffer holds it across taking and submitting them, so no other sender overtakes it.
    """

    def __init__(self, tracking_uri: str, spool: Spool, store_dir: Path, retry_interval_s: float,
                 client: Callable[[], Any]) -> None:
        self.tracking_uri = tracking_uri
        self.spool = spool
        self.retry_interval_s = retry_interval_s
        self._store_dir = store_dir
        self._client = client
        self.lock = threading.RLock()
        self._outage = TrackingOutage(tracking_uri, spool.directory, retry_interval_s)  # is it down
        self._next_look = 0.0  # monotonic time before which check_outage tries nothing
        # Runs this tracker spooled for: sent as soon as the store answers again, even
        # those that ended meanwhile and will not flush again.
        self._spooled: set[str] = set()
        self._store_ids: dict[str, str] = {}  # local run id -> the store's, once created

    @property
    def store_down(self) -> str:
        """Why the store is down now, or "" (a run is then made under a local id, ``local_runs``)."""
        return self._outage.reason if time.monotonic() < self._outage.until else ""

    def store_run_id(self, run_id: str) -> str:
        """The store's id of ``run_id``: itself, or for a run made during an outage the id the
        store gave it once created (until then the local id)."""
        if not is_local(run_id):
            return run_id
        if run_id not in self._store_ids and not self.spool.has_pending(run_id):
            known = known_store_id(self.spool.directory, run_id)
            if known is not None:
                self._store_ids[run_id] = known
        return self._store_ids.get(run_id, run_id)

    # -- sending -------------------------------------------------------------------------
    def submit(self, run_id: str, records: list[list[Any]], force: bool = False) -> None:
        """Send ``records`` in order after anything already spooled for the run; spool
        what the store cannot take now. ``force`` tries the store even while it is
        considered down (end_run: the last chance to send without a sync command)."""
        if not records:
            return
        with self.lock:
            run_id = self.store_run_id(run_id)
            down = time.monotonic() < self._outage.until and not force
            # A local run not yet created on the store queues behind its own creation.
            if down or self.spool.has_pending(run_id) or is_local(run_id):
                # Older writes wait in the spool: queue behind them to keep the order.
                self.keep(run_id, records)
                if not down:
                    self._drain(run_id)
                return
            sent = 0

            def on_done(n: int) -> None:
                nonlocal sent
                sent = n

            try:
                _, refusals = send_records(self._client(), run_id, records, on_done, self.spool.discard_staged)
            except StoreRefusesEveryWrite as exc:
                self.keep(run_id, records[sent:])
                raise kept_until_fixed(self.tracking_uri, self.spool.directory, exc) from exc
            except Exception as exc:
                if not is_transient(exc):  # send_records lets only transient ones out
                    raise
                self.keep(run_id, records[sent:])
                self.mark_down(exc)
                return
            self._mark_up()
            if refusals:
                raise TrackingError(f"MLflow store {self.tracking_uri} refused writes:\n" + "\n".join(refusals))

    def send_last(self, run_id: str, records: list[list[Any]]) -> bool:
        """A run's last writes, in one submission: the store gets one try (not one per part) even
        while it is considered down. A refusal is logged, not raised (the trial itself is over).
        Returns whether writes of the run are still kept (then say so: :meth:`kept_at_end`)."""
        with self.lock:
            try:
                self.submit(run_id, records, force=True)
            except TrackingError as exc:  # refused writes: loud, but the trial itself is over
                log.error("%s", exc)
            return self.spool.has_pending(run_id)

    def kept_at_end(self, run: RunHandle, status: str) -> None:
        """The warning for a run that ended with writes kept: how many, where, who sends them."""
        self._outage.kept_at_end(run, status, self.spool.pending_count(run.run_id), self.spool.path(run.run_id))

    def keep(self, run_id: str, records: list[list[Any]]) -> None:
        """Append ``records`` to the run's spool, sent when the store answers again."""
        with disk_full_raised(f"keeping MLflow writes of run {run_id}", self.spool.directory):  # nowhere left
            self.spool.append(run_id, records)
        self._spooled.add(run_id)

    def _drain(self, run_id: str) -> None:
        """Send the run's spool; on success, also the spools of runs that ended (and
        so will not flush again) while the store was down."""
        try:
            counts, refusals, drained = drain(self.spool, self._client(), run_id)
        except StoreRefusesEveryWrite as exc:
            raise kept_until_fixed(self.tracking_uri, self.spool.directory, exc) from exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.mark_down(exc)
            return
        if drained:
            self._spooled.discard(run_id)
        if self._outage.reason:
            log.info("MLflow store %s reachable again; sent spooled writes of run %s: %s",
                     self.tracking_uri, run_id, counts)
        self._mark_up()
        if refusals:
            raise TrackingError(f"MLflow store {self.tracking_uri} refused spooled writes:\n" + "\n".join(refusals))

    # -- the outage ----------------------------------------------------------------------
    def mark_down(self, exc: BaseException) -> None:
        """A try failed with the transient ``exc``: the store is left alone for the retry interval."""
        with self.lock:  # start_run's failed creation comes without it
            self._outage.failed(short_reason(exc, self._store_dir))  # one line, a full disk named

    def _mark_up(self) -> None:
        if self._outage.answered():
            self.drain_waiting()

    def check_outage(self) -> None:
        """Cheap enough for every step: raise ``TrackingUnavailable`` once the store has not answered
        for longer than the wait; when a retry is due, try the writes kept for this store first."""
        now = time.monotonic()
        if now >= max(self._outage.until, self._next_look):
            self._next_look = now + self.retry_interval_s
            self._try_kept()
        if self._outage.gone is not None:
            raise self._outage.gone

    def send_spooled(self) -> None:
        """Send the writes kept for this store, trying again with backoff while it does not answer,
        until the outage has lasted the wait; then raise TrackingError counting the runs still kept."""
        pause = 0.25
        while self._try_kept() and self._outage.reason:  # kept, and the store did not take them
            if self._outage.gone is not None:
                raise self._outage.still_kept(len(self.spool.run_ids(store=self.tracking_uri)))
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)

    def _try_kept(self) -> list[str]:
        """Try the store with the oldest run kept for it (taken: the rest follows); the runs that were kept."""
        waiting = self.spool.run_ids(store=self.tracking_uri)
        if waiting:
            try:
                with self.lock:
                    self._drain(waiting[0])
            except TrackingError as exc:  # refused: said, and no sign of an outage
                log.error("%s", exc)
        return waiting

    def drain_waiting(self) -> None:
        """Send every spool waiting for this store: this tracker's, then any other process's
        (one that ended or died during an outage), so no one has to run the sync by hand."""
        for run_id in dict.fromkeys([*sorted(self._spooled), *self.spool.run_ids(store=self.tracking_uri)]):
            if self._outage.reason:  # it went away again while we were catching up
                break
            try:
                with self.lock:
                    self._drain(run_id)
            except TrackingError as exc:  # a refusal in another run: report, don't fail this call
                log.error("%s", exc)
