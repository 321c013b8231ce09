"""The Optuna journal file as sweeps opens it: checked first, appended under a lock that
cannot spin or hang, repaired after a crash. The one module that knows how Optuna's journal
lock works.

Optuna appends one JSON record per line. A process killed mid-append leaves a last line
without its newline; the next append would glue onto it and corrupt the journal for good.
Every command checks the journal before Optuna reads it (:func:`open_journal`): a corrupt
record in the middle stops it with the exact repair command (:func:`repair_journal`, which
``sweeps repair-journal`` runs); a torn tail is cut off, its bytes saved beside the journal, by
whoever next appends, under the journal lock (so never while another process is mid-append).

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
import shutil
import time
from pathlib import Path
from typing import IO, Any

from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from core.diskfull import describe_disk_full
from core.faults import Fault, armed, stop_here
from sweeps.backends import optuna_adapter
from sweeps.errors import DiskFullError, PathError, StudyStateError

log = logging.getLogger("sweeps")

ENV_LOCK_WAIT = "SWEEPS_JOURNAL_LOCK_WAIT_S"
LOCK_WAIT_S = 120.0  # an append takes milliseconds; a holder this slow is stuck or stopped
LINK_SUFFIX = optuna_adapter.JOURNAL_LOCK_SUFFIX  # ".lock": Optuna's own link, so plain Optuna waits for us
FLOCK_SUFFIX = ".appendlock"


# ---- finding and repairing damage ------------------------------------------------------------
def _problem(line: bytes) -> str | None:
    """What is wrong with one journal line ending in a newline, or None: not JSON, or a record of
    a kind (``op_code``) this Optuna does not know (a newer Optuna's, or one written by hand),
    on which Optuna's reader stops with a bare ``AssertionError: Should not reach.``."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "is corrupt"
    kind = record.get("op_code") if isinstance(record, dict) else None
    if isinstance(kind, bool) or not isinstance(kind, int) or kind not in optuna_adapter.JOURNAL_OP_CODES:
        known = sorted(optuna_adapter.JOURNAL_OP_CODES)
        return (f"has an unknown kind (op_code {kind!r}; this Optuna knows {known[0]}-{known[-1]}: written by "
                "a newer Optuna or by hand)")
    return None


def _scan(path: Path) -> tuple[int, int, int | None]:
    """(good records, byte offset after the last good record, line number of the first bad one)."""
    good, offset = 0, 0
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.endswith(b"\n"):
                return good, offset, number  # torn: the last append never finished
            if _problem(line) is not None:
                return good, offset, number
            good += 1
            offset += len(line)
    return good, offset, None


def find_damage(path: str | Path) -> tuple[str, int, int, int] | None:
    """Read-only: None when every record is intact, else (kind, good records, byte offset
    after them, line number of the first bad one). ``kind`` is "tail" when only the last
    line is bad (a torn or garbled last append, which Optuna's reader skips), "middle" when
    lines follow it (Optuna's reader raises JSONDecodeError on it)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    good, offset, bad_line = _scan(path)
    if bad_line is None:
        return None
    with open(path, "rb") as fh:
        fh.seek(offset)
        rest = fh.read()
    newlines = rest.count(b"\n")
    is_tail = newlines == 0 or (newlines == 1 and rest.endswith(b"\n") and _is_last_line(rest))
    return ("tail" if is_tail else "middle"), good, offset, bad_line


def corrupt_message(path: str | Path, damage: tuple[str, int, int, int]) -> str:
    """The message for a corrupt record in the middle of the journal: where, and the repair command."""
    _, good, offset, bad_line = damage
    with open(path, "rb") as fh:
        fh.seek(offset)
        rest = fh.read()
    following = rest.count(b"\n") - 1
    what = _problem(rest.split(b"\n", 1)[0] + b"\n") or "is corrupt"
    return (f"{path}: line {bad_line}: record {bad_line} {what} and {following} more "
            f"line{'s' if following != 1 else ''} follow it, so Optuna cannot read the study. To keep the "
            f"{good} good records before it (a backup of the whole file is kept), run: sweeps repair-journal {path}")


def check_journal(path: str | Path) -> str | None:
    """Repair a torn tail in place; refuse (with a repair command) a corrupt record inside.
    Returns a message when something was repaired, else None. Cutting the tail is safe only
    while no other process appends (the run lock, or the journal lock of journal_file)."""
    path = Path(path)
    damage = find_damage(path)
    if damage is None:
        return None
    kind, good, offset, _ = damage
    if kind == "middle":
        raise StudyStateError(corrupt_message(path, damage))
    return _truncate(path, offset, path.stat().st_size, good, reason="torn last record (a process died mid-append)")


def looks_like_journal(path: str | Path) -> bool:
    """Whether a non-empty file is an Optuna journal: one of its first lines is a JSON object
    with an ``op_code`` (Optuna writes that key first, so a torn first record counts too)."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    if head.lstrip().startswith(b'{"op_code"'):
        return True
    for line in head.splitlines()[:5]:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and "op_code" in record:
            return True
    return False


def check_journal_file(path: Path) -> None:
    """Refuse (exit 2, naming the file and the fix) a path that is not a readable journal file:
    missing, a folder, or not a journal. Nothing is written."""
    if path.is_dir():
        raise PathError(f"{path} is a folder, not an Optuna journal file; name the journal file "
                              f"inside it, e.g. {path / 'study.journal'}")
    if not path.exists():
        raise PathError(f"{path} does not exist; name an Optuna journal file, e.g. runs/<study>.journal "
                              "(the study's storage: key, or runs/<name>.journal by default)")
    if path.stat().st_size and not looks_like_journal(path):
        raise PathError(f"{path} is not an Optuna journal (no Optuna record in its first lines); "
                              "nothing was changed. Check the path: a study's storage: names an Optuna journal file "
                        "(by default runs/<study name>.journal) or a file that does not exist yet")


def _is_last_line(rest: bytes) -> bool:
    """Whether the one bad line left is a garbled last append (not JSON); a whole record of an
    unknown kind is no torn write and is never cut silently."""
    try:
        json.loads(rest)
        return False
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True


def repair_journal(path: str | Path) -> str:
    """Keep the records before the first bad one; back up the whole file first."""
    path = Path(path)
    check_journal_file(path)
    good, offset, bad_line = _scan(path)
    if bad_line is None:
        return f"{path}: all {good} records are intact; nothing to repair"
    backup = path.with_name(f"{path.name}.bak-{int(time.time())}")
    shutil.copy2(path, backup)
    with open(path, "rb") as fh:
        fh.seek(offset)
        what = _problem(fh.readline()) or "is corrupt"
    what = "corrupt" if what == "is corrupt" else "record of an unknown kind"
    msg = _truncate(path, offset, path.stat().st_size, good, reason=f"{what} at line {bad_line}")
    return f"{msg}; the original is kept at {backup}"


def _truncate(path: Path, offset: int, size: int, good: int, reason: str) -> str:
    with open(path, "rb") as fh:
        fh.seek(offset)
        dropped = fh.read()
    saved = path.with_name(f"{path.name}.torn-{int(time.time())}")
    saved.write_bytes(dropped)
    with open(path, "r+b") as fh:
        fh.truncate(offset)
        fh.flush()
        os.fsync(fh.fileno())
    msg = (f"{path}: {reason}: kept {good} intact records, cut {size - offset} bytes "
           f"(saved in {saved})")
    log.warning(msg)
    return msg


# ---- the lock and the backend -----------------------------------------------------------------
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
