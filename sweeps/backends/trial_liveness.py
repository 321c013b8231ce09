"""A running trial's signs of life, and the timer that fails the trials whose worker died.

Two signs, kept apart because they answer different questions:

* **Alive** (Optuna's heartbeat on RDB storage, read by every machine's stale-trial check):
  the worker process is there. :class:`HeldTrials` records it from a thread every heartbeat
  interval from the ask until the trial's outcome is known, as ``Study.optimize``'s heartbeat
  thread does, whatever the trial is doing (waiting in a pack, loading its data, a long step, the
  ONNX export of a large model): a set-up or an export longer than the grace period must not have
  a live trial failed as stale.
* **Progressing** (the worker's beat file, read by the local supervisor for
  ``budget.trial_timeout``): the trial moved. Touched by the trial itself at each step and
  report (:func:`progress_beat`), so a deadlocked trial is still caught while its process stays
  alive.

A worker that dies mid-trial (SIGKILL, a lost machine) leaves its trial RUNNING with a heartbeat
that stops. Workers fail such trials before they ask for a new one, but while every live worker
is busy in a long trial nobody asks, and the dead trial would wait for the end of someone else's
trial. So every ``sweeps run`` and ``sweeps worker`` process runs one :class:`StaleTrialMonitor`:
a daemon thread that calls :func:`~sweeps.backends.optuna_recovery.fail_stale_trials` about every
heartbeat interval. A failed trial is requeued (WAITING), and the next worker to ask (an idle one
polls) takes it.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import optuna

from sweeps.backends import optuna_adapter, optuna_attrs, optuna_storage
from sweeps.backends.optuna_recovery import fail_stale_trials
from sweeps.spec.model import StudySpec

log = logging.getLogger("sweeps")
MIN_INTERVAL_S = 0.5  # never poll the database faster than this, whatever the settings say


class HeldTrials:
    """The trials a worker has asked for and not yet told the study the outcome of, kept alive in
    the storage (Optuna's heartbeat, RDB storage) from the ask to the outcome: one thread records a
    beat for each every half interval, as ``Study.optimize``'s heartbeat thread does for its trial,
    whatever the trial is doing (waiting in a pack while another population trains, loading its
    data, a long step, the ONNX export). Without heartbeats (a journal) it only asks."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study
        self._enabled = optuna_adapter.heartbeat_enabled(study)
        self._ids: set[int] = set()
        self._lock = threading.Lock()  # guards the set; never held across a database call
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="sweeps-trial-alive", daemon=True)

    def ask(self, worker: str) -> optuna.Trial:
        """A new trial, asked under the ask lock: named for ``worker`` (its supervisor finds it if the
        process dies) and alive (its first beat) before the lock is released. The stale-trial check
        looks for trials that never beat under the same lock, so it never takes one being asked for
        one whose worker died before its first beat."""
        trial = self._study.ask()
        trial.set_user_attr(optuna_attrs.ATTR_WORKER, worker)
        if self._enabled:
            trial_id = optuna_adapter.trial_id_of(trial)
            optuna_adapter.record_heartbeat(self._study, trial_id)
            with self._lock:
                self._ids.add(trial_id)
                if self.thread.ident is None:  # not started yet
                    self.thread.start()
        return trial

    def release(self, trial: optuna.Trial) -> None:
        """Called when the trial's outcome is known, before it is told to the study."""
        with self._lock:
            self._ids.discard(optuna_adapter.trial_id_of(trial))

    def stop(self) -> None:
        """When the worker is done asking: no more beats for anything."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)  # a beat stuck on an unreachable database: the thread is a daemon

    def _loop(self) -> None:
        interval = optuna_adapter.heartbeat_interval_seconds(self._study)
        while not self._stop.wait(interval / 2):  # twice per interval: a late beat stays inside it
            with self._lock:
                held = sorted(self._ids)
            for trial_id in held:
                try:
                    optuna_adapter.record_heartbeat(self._study, trial_id)
                except Exception:  # noqa: BLE001 - a database blip; the next beat retries, the grace covers it
                    continue


def progress_beat(beat_file: Path | None):
    """The trial's progress mark: touches the beat file (no file, no mark)."""

    def beat() -> None:
        if beat_file is not None:
            beat_file.touch()

    beat()
    return beat


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
        heartbeat_s, grace_s = optuna_storage.heartbeat_settings()
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
            storage = optuna_storage.open_storage(self.spec, create=False, pooled=False)
            self._study = optuna.load_study(study_name=self.study_name, storage=storage)
        failed = fail_stale_trials(self._study, lambda: optuna_storage.ask_lock(self.spec))
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
