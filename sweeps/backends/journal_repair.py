"""The Optuna journal file after a crash: find torn or corrupt records, repair them safely.

Optuna appends one JSON record per line. A process killed mid-append leaves a last line
without its newline; the next append would glue onto it and corrupt the journal for
good. ``sweeps run`` checks the journal before starting workers (no one else writes then):
a torn tail is cut off (its bytes saved beside the journal); a corrupt record in the
middle stops the run with the exact repair command.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from sweeps.errors import StudyStateError

log = logging.getLogger("sweeps")


def _scan(path: Path) -> tuple[int, int, int | None]:
    """(good records, byte offset after the last good record, line number of the first bad one)."""
    good, offset = 0, 0
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.endswith(b"\n"):
                return good, offset, number  # torn: the last append never finished
            try:
                json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return good, offset, number
            good += 1
            offset += len(line)
    return good, offset, None


def check_journal(path: str | Path) -> str | None:
    """Repair a torn tail in place; refuse (with a repair command) a corrupt record inside.
    Returns a message when something was repaired, else None."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    good, offset, bad_line = _scan(path)
    if bad_line is None:
        return None
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(offset)
        rest = fh.read()
    newlines = rest.count(b"\n")
    is_tail = newlines == 0 or (newlines == 1 and rest.endswith(b"\n") and _is_last_line(rest))
    if not is_tail:
        raise StudyStateError(
            f"{path}: record {bad_line} is corrupt and {newlines - 1} more lines follow it. "
            f"To keep the {good} good records before it (a backup of the whole file is kept), run: "
            f"sweeps repair-journal {path}")
    return _truncate(path, offset, size, good, reason="torn last record (a process died mid-append)")


def _is_last_line(rest: bytes) -> bool:
    try:
        json.loads(rest)
        return False
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True


def repair_journal(path: str | Path) -> str:
    """Keep the records before the first bad one; back up the whole file first."""
    path = Path(path)
    good, offset, bad_line = _scan(path)
    if bad_line is None:
        return f"{path}: all {good} records are intact; nothing to repair"
    backup = path.with_name(f"{path.name}.bak-{int(time.time())}")
    shutil.copy2(path, backup)
    msg = _truncate(path, offset, path.stat().st_size, good, reason=f"corrupt record at line {bad_line}")
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
