"""A running trial's two signs of life, kept apart because they answer different questions.

* **Alive** (Optuna's heartbeat on RDB storage, read by every machine's stale-trial check):
  the worker process is there. A thread records it every heartbeat interval for as long as
  the trial runs, as ``Study.optimize``'s heartbeat thread does, whatever the trial is doing
  (loading its data, a long step, the ONNX export of a large model). When the trial's beats
  came only from its steps, a set-up or an export longer than the grace period had a live
  trial failed as stale and its result dropped.
* **Progressing** (the worker's beat file, read by the local supervisor for
  ``budget.trial_timeout``): the trial moved. Touched by the trial itself at each step and
  report, so a deadlocked trial is still caught while its process stays alive.
"""
from __future__ import annotations

import threading
from pathlib import Path

import optuna

from sweeps.backends import optuna_adapter


class TrialAlive:
    """Records the trial's heartbeat every interval from a daemon thread until :meth:`stop`."""

    def __init__(self, study: optuna.Study, trial_id: int) -> None:
        self._study, self._trial_id = study, trial_id
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="sweeps-trial-alive", daemon=True)

    @classmethod
    def start(cls, study: optuna.Study, trial_id: int) -> TrialAlive | None:
        """Called when the worker has taken a trial; ``None`` where the storage keeps no heartbeats."""
        if not optuna_adapter.heartbeat_enabled(study):
            return None
        alive = cls(study, trial_id)
        optuna_adapter.record_heartbeat(study, trial_id)  # at once: the trial is alive from its first moment
        alive.thread.start()
        return alive

    def stop(self) -> None:
        """Called when the trial's outcome is known, before it is told to the study."""
        self._stop.set()
        self.thread.join(timeout=30)  # a beat stuck on an unreachable database: the thread is a daemon

    def _loop(self) -> None:
        interval = optuna_adapter.heartbeat_interval_seconds(self._study)
        while not self._stop.wait(interval / 2):  # twice per interval: a late beat stays inside it
            try:
                optuna_adapter.record_heartbeat(self._study, self._trial_id)
            except Exception:  # noqa: BLE001 - a database blip; the next beat retries, the grace covers it
                continue


def progress_beat(beat_file: Path | None):
    """The trial's progress mark: touches the beat file (no file, no mark)."""

    def beat() -> None:
        if beat_file is not None:
            beat_file.touch()

    beat()
    return beat
