"""``budget.trial_timeout`` on Ray: a trial with no progress for that long is stopped and failed.

A hung trial (a deadlocked data pipeline, a stuck collective) sits in code that no Python
exception reaches, so the watchdog, a thread in the trial's actor, records the reason in the
trial's MLflow run (FAILED, ``sweeps.error``, and ``sweeps.hung``) and then SIGKILLs its own
actor, as the Optuna backend's supervisor kills a hung worker. Ray sees the actor die and
retries the trial; the retry finds ``sweeps.hung`` on its run and fails at once with the same
reason, so the trial is never resumed into the same hang (not by Ray's retries, nor by the
next ``sweeps run``, which retries failed trials).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

TAG_HUNG = "sweeps.hung"


def recorded_hang(reader, run_id: str) -> str:
    """The reason the watchdog recorded on a trial's run before it killed the actor ("" if none)."""
    return reader.get_run(run_id).data.tags.get(TAG_HUNG, "")


def hung_reason(idle_s: float, setting: object) -> str:
    """The Optuna backend's words for the same event (supervisor._check_hung)."""
    return f"hung: no progress for {idle_s:.0f} s (budget.trial_timeout={setting})"


class HangWatchdog:
    """Calls ``on_hung(reason)`` once no :meth:`beat` came for ``limit_s`` seconds (counted from
    :meth:`start`), then SIGKILLs this process. ``run_trial`` beats at every optimizer step."""

    def __init__(self, limit_s: float, setting: object, on_hung: Callable[[str], None]) -> None:
        self.limit_s, self.setting, self.on_hung = limit_s, setting, on_hung
        self._last = time.monotonic()
        self._paused = 0
        self._done = threading.Event()

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not counted: the time the trial waits on Ray (``tune.report`` blocks until the driver
        takes the result), which is the driver's progress, not the trial's."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def start(self) -> HangWatchdog:
        self._last = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="sweeps-hang-watchdog").start()
        return self

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.limit_s / 4)):
            idle = time.monotonic() - self._last
            if idle >= self.limit_s and not self._paused:
                try:
                    self.on_hung(hung_reason(idle, self.setting))
                finally:
                    os.kill(os.getpid(), signal.SIGKILL)  # the hung thread cannot be stopped any other way
                return
