"""Dead workers' trials failed on a timer, not only when some worker happens to look.

On RDB storage a worker that dies mid-trial (SIGKILL, a lost machine) leaves its trial RUNNING
with a heartbeat that stops. Workers also fail such trials before they ask for a new one, but
while every live worker is busy in a long trial nobody asks, and the dead trial would wait for
the end of someone else's trial. So every ``sweeps run`` and ``sweeps worker`` process runs one
:class:`StaleTrialMonitor`: a daemon thread that calls
:func:`~sweeps.backends.optuna_study.fail_stale_trials` about every heartbeat interval. A failed
trial is requeued (WAITING), and the next worker to ask (an idle one polls) takes it.
"""
from __future__ import annotations

import logging
import threading

import optuna

from sweeps.backends import optuna_adapter, optuna_study
from sweeps.spec.model import StudySpec

log = logging.getLogger("sweeps")
MIN_INTERVAL_S = 0.5  # never poll the database faster than this, whatever the settings say


def check_interval_seconds(heartbeat_s: float, grace_s: float) -> float:
    """How often the monitor looks: every heartbeat interval, and at least four times per grace
    period, so a dead trial is failed at most about a quarter of the grace after it went stale."""
    return max(MIN_INTERVAL_S, min(float(heartbeat_s), grace_s / 4))


class StaleTrialMonitor:
    """A thread failing (and requeuing) the study's stale trials until :meth:`stop`.

    It reads and writes through its own storage, so it never shares a database session with the
    trial running in this process, connecting only for each check (every process of a 64-worker
    cluster runs one: held connections would take a share of the server's ``max_connections``)."""

    def __init__(self, spec: StudySpec, study_name: str) -> None:
        self.spec, self.study_name = spec, study_name
        heartbeat_s, grace_s = optuna_study.heartbeat_settings()
        self.interval_s = check_interval_seconds(heartbeat_s, grace_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="sweeps-stale-trials", daemon=True)
        self._study: optuna.Study | None = None
        self._said = ""  # the last error reported: a database outage is said once, not every poll

    @classmethod
    def start_for(cls, spec: StudySpec, study: optuna.Study) -> StaleTrialMonitor | None:
        """A started monitor for ``study``; None on journal storage (no heartbeats there: the
        one ``sweeps run`` holding the run lock fails its own dead workers' trials)."""
        if not spec.is_rdb_storage() or not optuna_adapter.heartbeat_enabled(study):
            return None
        monitor = cls(spec, study.study_name)
        monitor.thread.start()
        return monitor

    def stop(self) -> None:
        """Stop the thread and close its connections; a check under way finishes first."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)  # a check stuck on an unreachable database: the thread is a daemon
        rdb = optuna_adapter.rdb_of(optuna_adapter.storage_of(self._study)) if self._study is not None else None
        if rdb is not None:
            rdb.engine.dispose()

    def check_now(self) -> list[int]:
        """One check: the numbers of the trials it failed (and requeued)."""
        if self._study is None:
            storage = optuna_study.open_storage(self.spec, create=False, pooled=False)
            self._study = optuna.load_study(study_name=self.study_name, storage=storage)
        failed = optuna_study.fail_stale_trials(self._study)
        for number in failed:
            log.warning("trial %d: its worker stopped sending heartbeats for more than %s s; failed as stale "
                        "and requeued", number, optuna_adapter.heartbeat_grace_seconds(self._study))
        return failed

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_now()
                self._said = ""
            except Exception as exc:  # noqa: BLE001 - a database hiccup must not end the monitor
                text = f"{type(exc).__name__}: {exc}".splitlines()[0]
                if text != self._said:
                    log.warning("checking for dead workers' trials failed (%s); trying again every %.1f s",
                                text, self.interval_s)
                    self._said = text
