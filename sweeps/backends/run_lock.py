"""The study's run lock: one ``sweeps run`` of a study at a time, on either backend.

A second ``sweeps run`` of the same study would race the first: on Optuna journal storage
for the trials the first one's workers are running (it would take them for orphans), on Ray
for the experiment folder it restores. The lock is an ``flock`` on ``<...>.runlock``: the
kernel drops it when its holder dies, so a killed run never blocks the next one. The file
keeps the holder's pid, for the message of whoever is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from sweeps.errors import StudyStateError


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
