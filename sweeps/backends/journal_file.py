"""The Optuna journal file as sweeps opens it: checked first, appended under a lock that
cannot spin or hang. The one module that knows how Optuna's journal lock works.

Optuna's own ``JournalFileSymlinkLock`` is a symlink ``<journal>.lock`` pointing at the journal
path as given. A process killed mid-append leaves it behind; when that path was relative the
link dangles from its own folder, ``os.stat`` on it fails, and ``acquire`` retries at once,
forever, at 100% CPU (the failing stat skips both its sleep and its grace period). Here:

- paths handed to Optuna are absolute, so even Optuna's own lock would find the target;
- :class:`JournalLock` takes an ``flock`` on ``<journal>.appendlock`` first. The kernel drops
  an flock when its holder dies, so a sweeps writer never waits on a dead one: holding the
  flock and still finding the ``.lock`` link means its owner died mid-append, and the link is
  removed. The link itself is still taken, so a plain Optuna process appending to the same
  journal waits for us (the reverse does not hold: a sweeps journal is written by sweeps
  processes; a plain Optuna writer's link could be taken for a dead one's). Waiting for a live
  holder is bounded (``SWEEPS_JOURNAL_LOCK_WAIT_S``) and ends in an error that names the lock,
  the holder's pid and what to do;
- every append first cuts a torn last record left by a writer that died (under the lock no
  one else is mid-append), so the next record never glues onto it;
- :func:`open_journal` refuses a journal with a corrupt record inside (Optuna would raise a
  JSONDecodeError traceback) with the ``sweeps repair-journal`` command, and refuses to touch
  a non-empty file that is not a journal at all.

Fault point ``journal_mid_append`` (``SWEEPS_FAULT``): write half a record, then SIGKILL.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from core.diskfull import describe_disk_full
from core.faults import Fault, armed, stop_here
from sweeps.backends import optuna_adapter
from sweeps.backends.journal_repair import check_journal, check_journal_file, corrupt_message, find_damage
from sweeps.errors import DiskFullError, StudyStateError

log = logging.getLogger("sweeps")

ENV_LOCK_WAIT = "SWEEPS_JOURNAL_LOCK_WAIT_S"
LOCK_WAIT_S = 120.0  # an append takes milliseconds; a holder this slow is stuck or stopped
LINK_SUFFIX = optuna_adapter.JOURNAL_LOCK_SUFFIX  # ".lock": Optuna's own link, so plain Optuna waits for us
FLOCK_SUFFIX = ".appendlock"


def lock_wait_seconds() -> float:
    text = os.environ.get(ENV_LOCK_WAIT, "").strip()
    if not text:
        return LOCK_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise StudyStateError(f"{ENV_LOCK_WAIT}={text!r} is not a number of seconds > 0; unset it to wait "
                              f"the default {LOCK_WAIT_S:.0f} s, or set e.g. {ENV_LOCK_WAIT}=300")
    return value


class JournalLock(JournalFileSymlinkLock):
    """Optuna's symlink lock (its public lock class, for ``lock_obj``), taken under an flock so
    a dead holder never blocks; no grace period: a stale link is known stale at once."""

    def __init__(self, journal: Path) -> None:
        super().__init__(str(os.path.abspath(journal)), grace_period=None)
        self.journal = Path(os.path.abspath(journal))
        self.link = Path(f"{self.journal}{LINK_SUFFIX}")
        self.flock_path = Path(f"{self.journal}{FLOCK_SUFFIX}")
        self._fh: IO[str] | None = None

    def acquire(self) -> bool:
        fh = open(self.flock_path, "a+")
        try:
            self._wait_for_flock(fh)
            self._take_link()
            fh.seek(0)
            fh.truncate()
            fh.write(str(os.getpid()))  # for the message of whoever waits on us
            fh.flush()
        except BaseException:
            fh.close()  # drops the flock too
            raise
        self._fh = fh
        return True

    def release(self) -> None:
        try:
            os.unlink(self.link)
        except FileNotFoundError:
            pass
        finally:
            if self._fh is not None:  # unlocking after the unlink: a link seen under the flock is stale
                self._fh.close()
                self._fh = None

    def _wait_for_flock(self, fh) -> None:
        wait_s = lock_wait_seconds()
        deadline = time.monotonic() + wait_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    fh.seek(0)
                    raise StudyStateError(self._held_message(fh.read().strip() or "?", wait_s)) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)

    def _held_message(self, pid: str, wait_s: float) -> str:
        return (f"journal lock {self.flock_path} (for {self.journal}) is still held by pid {pid} after "
                f"{wait_s:g} s; an append takes milliseconds, so that process is stuck or stopped. Check it "
                f"with `ps -p {pid}`: stop it (kill {pid}) and the lock is released when it exits. If no such "
                f"process runs, remove the lock safely with: rm -f {self.flock_path} {self.link}. To wait longer, "
                f"set {ENV_LOCK_WAIT} (seconds)")

    def _take_link(self) -> None:
        for _ in range(2):
            try:
                os.symlink(str(self.journal), self.link)
                return
            except FileExistsError:
                # Under the flock no sweeps process is appending: the owner died mid-append.
                log.warning("removing the stale journal lock %s (left by a process killed while appending)",
                            self.link)
                try:
                    os.unlink(self.link)
                except FileNotFoundError:
                    pass
        os.symlink(str(self.journal), self.link)  # raises what keeps failing


class SweepsJournalBackend(JournalFileBackend):
    """Optuna's file backend with :class:`JournalLock`, torn-tail repair and a clear disk-full error."""

    def __init__(self, journal: Path) -> None:
        self.journal = Path(os.path.abspath(journal))
        self.lock = JournalLock(self.journal)
        super().__init__(str(self.journal), lock_obj=self.lock)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        # Same bytes as JournalFileBackend.append_logs writes.
        data = ("\n".join(json.dumps(r, separators=(",", ":")) for r in logs) + "\n").encode("utf-8")
        self.lock.acquire()
        try:
            cut_torn_tail(self.journal)
            with open(self.journal, "ab") as fh:
                if armed(Fault.JOURNAL_MID_APPEND):
                    fh.write(data[: max(1, len(data) // 2)])
                    fh.flush()
                    os.fsync(fh.fileno())
                    stop_here(Fault.JOURNAL_MID_APPEND)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            full = describe_disk_full(exc, self.journal.parent)
            if full is None:
                raise
            raise DiskFullError(f"{full}; cannot append to the Optuna journal {self.journal}. Free space "
                                "there, then rerun: the study resumes (a partly written record is cut)") from exc
        finally:
            self.lock.release()


def cut_torn_tail(journal: Path) -> None:
    """With the journal lock held: cut a last record that has no newline (its writer died)."""
    with open(journal, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() == 0:
            return
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
    check_journal(journal)  # cuts the tail (and says so), or refuses a corrupt record inside


def open_journal(path: str | Path, create: bool) -> JournalStorage:
    """The journal storage at ``path`` (made absolute), checked before Optuna reads it.

    Refuses, writing nothing: a folder, a non-empty file that is not a journal, a corrupt
    record inside (with the repair command). A writer (``create``) also cuts a bad last
    record under the lock; a reader leaves it (Optuna's reader skips it, and it may be an
    append in progress)."""
    journal = Path(os.path.abspath(path))
    damage = None
    if journal.exists():
        check_journal_file(journal)
        damage = find_damage(journal)
        if damage is not None and damage[0] == "middle":
            raise StudyStateError(corrupt_message(journal, damage))
    backend = SweepsJournalBackend(journal)
    # A writer takes the lock once at the start when a dead writer left its tail or its lock link:
    # the repair is said here, by the command the user ran, not later by a worker.
    if create and (damage is not None or os.path.lexists(backend.lock.link)):
        backend.lock.acquire()
        try:
            if damage is not None:
                check_journal(journal)  # under the lock no one is mid-append: the bad tail is a dead writer's
        finally:
            backend.lock.release()
    return JournalStorage(backend)
