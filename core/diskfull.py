"""Recognise a full disk in an exception, and say so in one line with the free space.

A full disk rarely says so: torch.save reports ``[enforce fail at inline_container.cc:672]
. unexpected pos 704 vs 598`` (or ``PytorchStreamWriter failed writing file data/0: file
write failed``), SQLite ``database or disk is full``, MLflow wraps either, and only a plain
write gives ``OSError(ENOSPC)``. :func:`describe_disk_full` turns all of them into
``disk full: <path> has <N> MB free`` so a trial's failure reason and the orchestrator's
message name the folder to clean up. Stdlib only (``core`` and ``sweeps`` both use it).
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# Messages of libraries that lose the errno on the way up (lower case).
_FULL_TEXTS = (
    "no space left on device",
    "disk quota exceeded",
    "database or disk is full",  # SQLite (SQLITE_FULL), also through SQLAlchemy and MLflow
    "file write failed",  # torch's PytorchStreamWriter
)
_TORCH_UNEXPECTED_POS = ("inline_container.cc", "unexpected pos")  # torch.save's zip writer lost bytes


def _chain(exc: BaseException | None):
    """``exc``, then its causes and contexts (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` or anything in its chain means the disk (or quota) is full."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        text = str(e).lower()
        if any(t in text for t in _FULL_TEXTS) or all(t in text for t in _TORCH_UNEXPECTED_POS):
            return True
    return False


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing folder)."""
    p = Path(path).absolute()
    for folder in (p, *p.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def _megabytes(n: int) -> str:
    mb = n / 1e6
    return f"{mb:.1f}" if mb < 10 else f"{mb:.0f}"


def describe_disk_full(exc: BaseException | None, path: str | os.PathLike | None) -> str | None:
    """``"disk full: <path> has <N> MB free"`` when ``exc`` means a full disk, else None.

    ``path``: where the write went (a file or folder); None uses the filename the OSError
    names, else the working directory."""
    if not is_disk_full(exc):
        return None
    if path is None:
        path = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None) or "."
    free = free_bytes(path)
    room = "unknown space" if free is None else f"{_megabytes(free)} MB"
    return f"disk full: {path} has {room} free"
