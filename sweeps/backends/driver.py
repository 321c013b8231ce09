"""What a study's driver (``sweeps run``) does the same way on both backends (Optuna and Ray).

- **Signals** outside the backend's own handling (:class:`DriverSignals`), and the verdict of a
  driver stopped by one (:func:`stopped_by`).
- **The budget's outcome**: what ``sweeps run`` says and exits with when a study stops short of
  its budget, so that a script or a CI job reads the same exit code and message whichever
  backend ran the study: 0 when the budget finished (or ``budget.timeout`` ended this
  invocation, which the next ``sweeps run`` continues), 128 + the signal's number after a
  signal, 1 otherwise, and 1 when every trial ended without a result (pruned, failed or
  rejected: nothing to compare or promote).
- **The run lock**: one ``sweeps run`` of a study at a time. A second one would race the first:
  on Optuna journal storage for the trials the first one's workers are running (it would take
  them for orphans), on Ray for the experiment folder it restores. The lock is an ``flock`` on
  ``<...>.runlock``: the kernel drops it when its holder dies, so a killed run never blocks the
  next one. The file keeps the holder's pid, for the message of whoever is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sweeps.errors import StudyStateError
from sweeps.stop_signals import STOP_SIGNALS, after_hangup

if TYPE_CHECKING:
    from sweeps.backends.base import StudyResult

EXIT_BUDGET_UNMET = 1
REASONS_SHOWN = 3  # the most common end reasons named when no trial completed


# ---- signals --------------------------------------------------------------------------------
class DriverSignals:
    """SIGINT, SIGTERM and SIGHUP (:data:`~sweeps.stop_signals.STOP_SIGNALS`) that reach a driver
    (``sweeps run``) outside the part where its backend takes them (the Optuna supervisor, Ray's
    fit): while it starts (the store, the parent run, ``ray.init``: seconds) and while it ends
    (the summary, the Pareto tags, closing the study run). They are recorded, not fatal: the
    driver skips what is left to run, closes the study run KILLED and exits 128+n, as a signal
    mid-study does, instead of dying with the study run RUNNING. ``ray.init`` installs Ray's own
    SIGTERM handler (``sys.exit(15)``): :meth:`around_ray_init` puts this one back and turns
    that exit into the recorded signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> DriverSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def _record(self, signum, _frame) -> None:
        after_hangup(signum)
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def around_ray_init(self):
        try:
            yield
        except SystemExit as exc:
            if exc.code != signal.SIGTERM:
                raise
            self.signum = self.signum or signal.SIGTERM  # Ray's handler took a SIGTERM during ray.init
        finally:
            self.reinstall()

    def reinstall(self) -> None:
        """Take the stop signals back from a library that set its own (``ray.init``) or reset
        them (``ray.shutdown``)."""
        if self._old:
            for s in STOP_SIGNALS:
                signal.signal(s, self._record)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


def stopped_by(signum: int, then: str) -> tuple[str, int]:
    """The verdict of a driver stopped by ``signum`` (both backends): its words and exit code 128+n."""
    return f"stopped by {signal.Signals(signum).name}; {then}", 128 + signum


# ---- the budget's outcome ----------------------------------------------------------------------
def max_failures_stop(max_failures: int) -> tuple[str, int]:
    """``budget.max_failures`` trials failed in a row: the study stops."""
    return f"stopped: {max_failures} trials failed in a row (budget.max_failures)", EXIT_BUDGET_UNMET


def unfinished_stop(done: int, total: int, failed: int, spec_path: object) -> tuple[str, int]:
    """Nothing is left to run in this invocation, yet fewer than ``total`` trials finished
    (the rest failed): the exit code must not say the budget finished."""
    return (f"stopped with {done} of {total} trials finished: {failed} failed; see the reasons with "
            f"`sweeps status {spec_path}`; the next sweeps run retries them", EXIT_BUDGET_UNMET)


def failures_in_a_row(states: list[str]) -> int:
    """How many trials failed in a row at the end of ``states`` (trial end states in the
    order the trials ended): a COMPLETE or PRUNED trial resets the count."""
    count = 0
    for state in states:
        count = count + 1 if state == "FAIL" else 0
    return count


def no_trial_completed(result: StudyResult, spec_path: object) -> str | None:
    """Why the study has no result although every trial of it has ended (none is running or
    waiting to resume), or None when one completed: every trial pruned (diverged, say), failed or
    rejected leaves nothing to compare or promote, which an exit code of 0 would hide. The most
    common end reasons are named, each with its count."""
    ended = [t for t in result.trials if t.state in ("PRUNED", "FAIL")]
    if not ended or any(t.state not in ("PRUNED", "FAIL") for t in result.trials):
        return None
    reasons = Counter(f"{t.state.lower()}: {(t.reason or 'no reason recorded').splitlines()[0][:160]}"
                      for t in ended)
    named = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(REASONS_SHOWN))
    more = f"; and {len(reasons) - REASONS_SHOWN} other reasons" if len(reasons) > REASONS_SHOWN else ""
    return (f"no trial of study {result.name!r} completed: all {len(ended)} ended without a result ({named}{more}); "
            f"nothing to compare or promote. See each trial's reason with `sweeps status {spec_path}`")


# ---- the run lock ----------------------------------------------------------------------------
@contextlib.contextmanager
def run_lock(path: Path, study_name: str) -> Iterator[None]:
    """Hold the run lock at ``path`` (its folder must exist) for the ``with`` block, or raise
    :class:`StudyStateError` naming the pid that holds it. Never waits: the other run may
    last hours, and its user should decide whether to stop it."""
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise StudyStateError(f"study {study_name!r} is already being run by another sweeps process "
                                  f"(pid {fh.read().strip() or '?'}); wait for it or stop it first") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_lock_held(path: Path) -> bool:
    """Whether some process holds the run lock at ``path`` now (no lock file: nobody)."""
    if not path.exists():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False
