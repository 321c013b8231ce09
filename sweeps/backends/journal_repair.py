"""The Optuna journal file after a crash: find torn or corrupt records, repair them safely.

Optuna appends one JSON record per line. A process killed mid-append leaves a last line
without its newline; the next append would glue onto it and corrupt the journal for
good. Every command checks the journal before Optuna reads it (journal_file.open_journal):
a corrupt record in the middle stops it with the exact repair command (Optuna would raise
a JSONDecodeError); a torn tail is cut off, its bytes saved beside the journal, by whoever
next appends, under the journal lock (so never while another process is mid-append).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from sweeps.backends import optuna_adapter
from sweeps.errors import PathError, StudyStateError

log = logging.getLogger("sweeps")


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
