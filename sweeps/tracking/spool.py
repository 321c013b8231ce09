"""The outbox of every MLflow write a trial makes: what the store could not take is kept here,
and ``sweeps.tracking.send`` sends it, in order and exactly once, when it can (the tracker that
kept it, the next sweeps process that reaches the store, or ``sweeps sync-tracking``).

One spool file per run: ``<spool_dir>/<run_id>.jsonl``, append-only JSON lines, fsynced
after every append, so a crash loses at most the line being written. A record is one
list (compact, order-preserving)::

    ["m", key, value, timestamp_ms, step]        metric point
    ["p", key, value]                            param
    ["t", key, value]                            tag
    ["dt", key]                                  tag removed (a missing tag is no error)
    ["a", local_path, artifact_dir, staged]      artifact (staged: a copy the spool owns)
    ["open"]                                     run RUNNING again (it continues)
    ["end", status, end_time_ms]                 terminal status
    ["in", [{name, digest, source, profile, context}]]  dataset inputs (training, validation)
    ["lm", {key, number, params, best_epoch, ...}]  the trial's logged model
                                                 (``sweeps.tracking.trial_model.model_record``)
    ["new", experiment_id, run_name, tags]        create the run (first record of a run made
                                                 while the store was down: sweeps.tracking.local_runs)

A spool made by a tracker names its store in ``<run_id>.store`` (the URI, password masked), so
a process draining everything waiting for its store never sends another store's runs to it.

Progress is a byte offset in ``<run_id>.offset``, replaced atomically (tmp + fsync +
``os.replace``) after every batch the store accepted; a record is dropped (the file
deleted) only once everything before the end of the file has been accepted. If the
process dies between the store accepting a batch and the offset being written, that one
batch is sent again: harmless, because timestamps are fixed when a point is logged, so
the SQL stores deduplicate the identical metric rows (their primary key), an identical
param is accepted, and tags and statuses overwrite; a logged model is found again by the key
its record carries (``trial_model.make_trial_model``).

A file to upload is kept as the spool's own copy once it is spooled (a hard link where the
folders share a file system, else a copy): the trial folder's ``best.pt`` may be replaced by
the time the store answers, and what is sent is the file as it was logged.

Appends and drains take an exclusive ``flock`` on ``<spool_dir>/.lock`` so two
processes writing the same run (workers updating the study's parent run) or a
``sweeps sync-tracking`` started while a sweep runs cannot interleave or resend.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sweeps.safe_names import safe_component, safe_subpath
from sweeps.store_urls import redact_url

log = logging.getLogger(__name__)

class Spool:
    """The spool folder. Thread-safe; process-safe through ``flock``."""

    def __init__(self, directory: str | Path, store: str | None = None) -> None:
        self.directory = Path(directory)
        self.store = store_key(store) if store else None  # stamped on the runs spooled here
        self._thread_lock = threading.RLock()

    # -- paths -------------------------------------------------------------------------
    def path(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.jsonl"

    def _offset_path(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.offset"

    def _files_dir(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.files"

    def _store_path(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.store"

    def run_ids(self, store: str | None = None) -> list[str]:
        """Runs with a spool file, oldest file first (the order they were spooled); with
        ``store``, only those a tracker of that store spooled."""
        if not self.directory.is_dir():
            return []
        stamped = []
        for p in self.directory.glob("*.jsonl"):
            with contextlib.suppress(FileNotFoundError):  # drained by another process meanwhile
                stamped.append((p.stat().st_mtime, p.stem))
        ids = [run_id for _, run_id in sorted(stamped)]
        if store is None:
            return ids
        wanted = store_key(store)
        return [r for r in ids if self.store_of(r) == wanted]

    def store_of(self, run_id: str) -> str | None:
        """The store (password masked) whose tracker spooled the run; None if not recorded."""
        with contextlib.suppress(FileNotFoundError):
            return self._store_path(run_id).read_text(encoding="utf-8").strip() or None
        return None

    def has_pending(self, run_id: str) -> bool:
        """True while records for ``run_id`` wait to be sent. One ``stat``: called on
        every flush, so it must stay cheap."""
        return self.path(run_id).exists()

    # -- locking -----------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive access to the spool across threads and processes."""
        with self._thread_lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / ".lock", "a+b") as fh:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    # -- writing -----------------------------------------------------------------------
    def append(self, run_id: str, records: Sequence[Sequence[Any]]) -> None:
        """Append ``records`` after everything already spooled for the run, durably. A file to
        upload is appended as the spool's own copy (:meth:`keep_file`)."""
        if not records:
            return
        records = [["a", str(self.keep_file(run_id, r[1])), r[2], True]
                   if r[0] == "a" and not r[3] and Path(r[1]).exists() else r for r in records]
        data = "".join(json.dumps(list(r), separators=(",", ":")) + "\n" for r in records)
        with self.locked():
            path = self.path(run_id)
            created = not path.exists()
            with open(path, "ab") as fh:
                # A crash mid-write can leave a torn last line; start on a fresh line so
                # the torn one stays isolated (read_pending skips it) instead of
                # corrupting the first new record.
                if not created and fh.tell() > 0:
                    with open(path, "rb") as rd:
                        rd.seek(-1, os.SEEK_END)
                        if rd.read(1) != b"\n":
                            fh.write(b"\n")
                fh.write(data.encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())
            if created:
                if self.store:
                    self._store_path(run_id).write_text(self.store, encoding="utf-8")
                _fsync_dir(self.directory)

    def stage_file(self, run_id: str, rel_path: str, text: str) -> Path:
        """Write ``text`` to a file the spool owns (for ``log_dict``), so the artifact can
        still be uploaded later if the store is down now. Returns its path."""
        rel = safe_subpath(rel_path, "artifact file")
        target = self._files_dir(run_id) / uuid.uuid4().hex / Path(rel).name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        return target

    def keep_file(self, run_id: str, local: str | Path) -> Path:
        """The spool's own copy of ``local`` (same name), for an upload that waits for the store."""
        source = Path(local)
        target = self._files_dir(run_id) / uuid.uuid4().hex / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)  # the same bytes, even once the original is replaced (os.replace)
        except OSError:  # another file system, or one without hard links
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy2(source, target)
        return target

    def discard_staged(self, path: str | Path) -> None:
        """Delete a staged copy once the store has it (its folder is per-file)."""
        folder = Path(path).parent
        if folder.parent.name.endswith(".files") and folder.parent.parent == self.directory:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                folder.parent.rmdir()  # only succeeds once the last staged file is gone

    # -- reading and progress ----------------------------------------------------------
    def read_pending(self, run_id: str) -> tuple[list[tuple[int, list[Any]]], int]:
        """Records not yet accepted by the store, each with the byte offset just past
        it (the value to commit once it is accepted), and the offset of the end of the
        file. Call under ``locked()``: appends hold the same lock, so a line without its
        newline here is the torn tail of a crashed append, never one still being written.
        Unreadable lines are skipped with a warning (committing past them is the caller's
        choice once the records around them are in)."""
        path = self.path(run_id)
        start = self._read_offset(run_id)
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read()
        except FileNotFoundError:
            return [], start
        out: list[tuple[int, list[Any]]] = []
        pos = start
        for line in data.splitlines(keepends=True):
            end = pos + len(line)
            try:
                rec = json.loads(line) if line.endswith(b"\n") else None
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, list) and rec:
                out.append((end, rec))
            else:
                log.warning("spool %s: skipping an unreadable or torn line at byte %d", path, pos)
            pos = end
        return out, pos

    def commit(self, run_id: str, offset: int) -> None:
        """Record that everything before ``offset`` reached the store. Atomic: a crash
        leaves the old or the new offset, never a partial one."""
        target = self._offset_path(run_id)
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(str(int(offset)))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)

    def finish_if_drained(self, run_id: str) -> bool:
        """Delete the run's spool once every byte of it was accepted. Call under
        ``locked()`` so no append can slip in between the check and the delete."""
        path = self.path(run_id)
        if not path.exists():
            return True
        if self._read_offset(run_id) < path.stat().st_size:
            return False
        path.unlink()
        for done in (self._offset_path(run_id), self._store_path(run_id)):
            with contextlib.suppress(FileNotFoundError):
                done.unlink()
        return True

    def pending_count(self, run_id: str) -> int:
        """How many records of the run wait to be sent (for messages)."""
        with self.locked():
            return len(self.read_pending(run_id)[0])

    def _read_offset(self, run_id: str) -> int:
        try:
            return int(self._offset_path(run_id).read_text(encoding="ascii").strip() or 0)
        except FileNotFoundError:
            return 0


def store_key(uri: str) -> str:
    """How a spool names its store: the URI with any password masked (never on disk in clear)."""
    return redact_url(str(uri))


def _fsync_dir(directory: Path) -> None:
    # A new file's directory entry is only durable once the directory is fsynced.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
