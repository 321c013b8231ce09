"""Atomic file writes: a reader sees either the old file or the complete new one, never half of one.

Every writer goes to a temporary file in the *same directory* as the target (so the final
``os.replace`` is a rename within one filesystem, which POSIX makes atomic), fsyncs it, then
renames it over the target and fsyncs the directory so the rename itself survives a crash.
On any exception -- including ``OSError(ENOSPC)`` from a full disk -- the temporary file is
removed and the previous target file is left untouched.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# Mode for a file that did not exist before; an existing file keeps its own mode. mkstemp
# creates 0600 files, which would hide reports from a dashboard running as another user.
_NEW_FILE_MODE = 0o644


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory entry (a rename or a new file) to disk; a no-op where unsupported."""
    if os.name != "posix":  # Windows cannot open a directory; its renames are journaled anyway
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (e.g. certain network mounts) refuse fsync on directories
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, writer_fn: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` atomically: ``writer_fn(f)`` writes to ``f``, an open binary temp file.

    Returns the final path. The target's directory must exist. If ``writer_fn`` or any later
    step raises, the temp file is deleted, the exception propagates, and ``path`` is unchanged.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            writer_fn(f)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mode = _NEW_FILE_MODE
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        # BaseException, so a KeyboardInterrupt mid-write leaves no stray temp file either.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)
    return path


def _strict_json(obj: Any) -> Any:
    """Replace NaN/inf floats with None: strict JSON has no such values and browsers reject them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def save_json_atomic(obj: Any, path: str | os.PathLike, *, indent: int | None = 2) -> Path:
    """Serialise ``obj`` as strict JSON (NaN/inf become ``null``) and write it atomically.

    Serialisation happens before the temp file is created, so an unserialisable object
    raises ``TypeError`` without touching the disk.
    """
    data = json.dumps(_strict_json(obj), indent=indent, allow_nan=False, default=_json_default)
    payload = (data + "\n").encode("utf-8")
    return atomic_write_bytes(path, lambda f: f.write(payload))


def _json_default(value: Any) -> Any:
    """Encode the few non-JSON types that reports commonly hold (paths, numpy/torch values)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    to_list = getattr(value, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(to_list):
        return _strict_json(to_list())
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
