"""Local buffer for tracking writes the store could not take, and the code that sends
them, in order and exactly once, when it can.

One spool file per run: ``<spool_dir>/<run_id>.jsonl``, append-only JSON lines, fsynced
after every append, so a crash loses at most the line being written. A record is one
list (compact, order-preserving)::

    ["m", key, value, timestamp_ms, step]        metric point
    ["p", key, value]                            param
    ["t", key, value]                            tag
    ["a", local_path, artifact_dir, staged]      artifact (staged: a copy the spool owns)
    ["end", status, end_time_ms]                 terminal status

Progress is a byte offset in ``<run_id>.offset``, replaced atomically (tmp + fsync +
``os.replace``) after every batch the store accepted; a record is dropped (the file
deleted) only once everything before the end of the file has been accepted. If the
process dies between the store accepting a batch and the offset being written, that one
batch is sent again: harmless, because timestamps are fixed when a point is logged, so
the SQL stores deduplicate the identical metric rows (their primary key), an identical
param is accepted, and tags and statuses overwrite.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from sweeps.safe_names import safe_component, safe_subpath

log = logging.getLogger(__name__)

# MLflow's log_batch limits (mlflow.utils.validation): 1000 metrics, 100 params, 100 tags,
# 1000 entities, and a 1 MB request. We stay under the byte limit with a margin for
# the JSON framing the REST client adds around every entity.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000
MAX_BATCH_BYTES = 800_000
_ENTITY_OVERHEAD_BYTES = 64


class Spool:
    """The spool folder. Thread-safe; process-safe through ``flock``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._thread_lock = threading.RLock()

    # -- paths -------------------------------------------------------------------------
    def path(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.jsonl"

    def _offset_path(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.offset"

    def _files_dir(self, run_id: str) -> Path:
        return self.directory / f"{safe_component(run_id, 'run id')}.files"

    def run_ids(self) -> list[str]:
        """Runs with a spool file, oldest file first (the order they were spooled)."""
        if not self.directory.is_dir():
            return []
        stamped = []
        for p in self.directory.glob("*.jsonl"):
            with contextlib.suppress(FileNotFoundError):  # drained by another process meanwhile
                stamped.append((p.stat().st_mtime, p.stem))
        return [run_id for _, run_id in sorted(stamped)]

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
        """Append ``records`` after everything already spooled for the run, durably."""
        if not records:
            return
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
                _fsync_dir(self.directory)

    def stage_file(self, run_id: str, rel_path: str, text: str) -> Path:
        """Write ``text`` to a file the spool owns (for ``log_dict``), so the artifact can
        still be uploaded later if the store is down now. Returns its path."""
        rel = safe_subpath(rel_path, "artifact file")
        target = self._files_dir(run_id) / uuid.uuid4().hex / Path(rel).name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
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
        with contextlib.suppress(FileNotFoundError):
            self._offset_path(run_id).unlink()
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


def _fsync_dir(directory: Path) -> None:
    # A new file's directory entry is only durable once the directory is fsynced.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- sending ------------------------------------------------------------------------------
def is_transient(exc: BaseException) -> bool:
    """True when a failed write may succeed later unchanged: the store was unreachable,
    timed out, or answered 5xx/429. Anything else (4xx: a refused value, a deleted run)
    would fail again, so it must not be kept for retrying."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        code = exc.get_http_status_code()
        return code >= 500 or code == 429
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    with contextlib.suppress(ImportError):
        import requests

        if isinstance(exc, requests.exceptions.RequestException):
            return True
    with contextlib.suppress(ImportError):
        from sqlalchemy.exc import DisconnectionError, OperationalError

        if isinstance(exc, (OperationalError, DisconnectionError)):
            return True
    return False


@dataclass
class _Op:
    """One call to the store covering records[start:end]."""

    kind: str  # "batch" | "a" | "end"
    start: int
    end: int


def _plan(records: Sequence[Sequence[Any]]) -> list[_Op]:
    """Group consecutive records into as few store calls as MLflow's limits allow."""
    ops: list[_Op] = []
    i, n = 0, len(records)
    while i < n:
        kind = records[i][0]
        if kind in ("a", "end"):
            ops.append(_Op(kind, i, i + 1))
            i += 1
            continue
        start = i
        n_m = n_p = n_t = size = 0
        param_keys: set[str] = set()
        tag_keys: set[str] = set()
        while i < n and records[i][0] in ("m", "p", "t"):
            rec = records[i]
            kind, key = rec[0], rec[1]
            rec_size = _ENTITY_OVERHEAD_BYTES + len(key) + (len(rec[2]) if kind != "m" else 24)
            full = (
                n_m + n_p + n_t >= MAX_ENTITIES_PER_BATCH
                or size + rec_size > MAX_BATCH_BYTES
                or (kind == "m" and n_m >= MAX_METRICS_PER_BATCH)
                or (kind == "p" and (n_p >= MAX_PARAMS_TAGS_PER_BATCH or key in param_keys))
                # A repeated tag key starts a new batch so the later value wins on every
                # store, not only on those that happen to apply a batch in order.
                or (kind == "t" and (n_t >= MAX_PARAMS_TAGS_PER_BATCH or key in tag_keys))
            )
            if full and i > start:
                break
            if kind == "m":
                n_m += 1
            elif kind == "p":
                n_p += 1
                param_keys.add(key)
            else:
                n_t += 1
                tag_keys.add(key)
            size += rec_size
            i += 1
        ops.append(_Op("batch", start, i))
    return ops


def send_records(
    client: Any,
    run_id: str,
    records: Sequence[Sequence[Any]],
    on_done: Callable[[int], None],
    on_staged_sent: Callable[[str], None] | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Send ``records`` to the store in order, as few calls as the limits allow.

    After each call the store accepted, ``on_done(n)`` is told that records[:n] are in.
    A transient failure (see :func:`is_transient`) propagates at once, so the caller keeps
    records[n:]. A refusal (4xx) drops only what was refused and carries on: it would
    never succeed, and the records after it must not be held hostage. Returns the
    counts sent per kind and one line per refusal.
    """
    counts = {"metrics": 0, "params": 0, "tags": 0, "artifacts": 0, "statuses": 0}
    refusals: list[str] = []
    for op in _plan(records):
        chunk = records[op.start : op.end]
        try:
            if op.kind == "batch":
                _send_batch(client, run_id, chunk, counts, refusals)
            elif op.kind == "a":
                _, local, artifact_dir, staged = chunk[0]
                if not Path(local).exists():
                    refusals.append(f"run {run_id}: artifact {local!r} no longer exists; not uploaded")
                else:
                    client.log_artifact(run_id, local, artifact_dir)
                    counts["artifacts"] += 1
                    if staged and on_staged_sent is not None:
                        on_staged_sent(local)
            else:
                _, status, end_time = chunk[0]
                client.set_terminated(run_id, status=status, end_time=int(end_time))
                counts["statuses"] += 1
        except Exception as exc:
            if is_transient(exc):
                raise
            if op.kind == "a" and chunk[0][3] and on_staged_sent is not None:
                on_staged_sent(chunk[0][1])  # refused for good: the staged copy is garbage
            what = "artifact" if op.kind == "a" else "terminal status"
            refusals.append(f"run {run_id}: the store refused the {what} {list(chunk[0][1:])}: {exc}")
        on_done(op.end)
    return counts, refusals


def _send_batch(client: Any, run_id: str, chunk: Sequence[Sequence[Any]],
                counts: dict[str, int], refusals: list[str]) -> None:
    """One log_batch call; if the store refuses it, find what it refuses so the rest
    still gets in. Metrics are refused as a group (their keys and values are checked
    when logged, so a refusal means the run itself takes no writes); params and tags one
    by one (a param whose value changed on resume must not take the others with it)."""
    from mlflow.entities import Metric, Param, RunTag

    groups = {
        "metrics": [Metric(r[1], float(r[2]), int(r[3]), int(r[4])) for r in chunk if r[0] == "m"],
        "params": [Param(r[1], r[2]) for r in chunk if r[0] == "p"],
        "tags": [RunTag(r[1], r[2]) for r in chunk if r[0] == "t"],
    }

    def log(kind: str, items: list) -> None:
        client.log_batch(run_id, synchronous=True, **{kind: items})

    try:
        client.log_batch(run_id, synchronous=True, **groups)
        for kind, items in groups.items():
            counts[kind] += len(items)
        return
    except Exception as exc:
        if is_transient(exc):
            raise
    # Rare path (a refusal): resending what the store may already hold is harmless.
    for kind, items in groups.items():
        singles = [items] if kind == "metrics" else [[item] for item in items]
        for part in singles:
            if not part:
                continue
            try:
                log(kind, part)
                counts[kind] += len(part)
            except Exception as exc:
                if is_transient(exc):
                    raise
                what = f"{len(part)} metric points" if kind == "metrics" else f"{kind[:-1]} {part[0].key!r}"
                refusals.append(f"run {run_id}: the store refused {what}: {exc}")


def drain(spool: Spool, client: Any, run_id: str) -> tuple[dict[str, int], list[str], bool]:
    """Send the run's spooled records, oldest first, committing progress after every
    accepted call. Returns (counts, refusals, drained). A transient failure propagates
    after the progress so far has been committed."""
    with spool.locked():
        if not spool.has_pending(run_id):
            return {}, [], True
        entries, end = spool.read_pending(run_id)

        def on_done(n: int) -> None:
            spool.commit(run_id, entries[n - 1][0])

        records = [rec for _, rec in entries]
        counts, refusals = send_records(client, run_id, records, on_done, spool.discard_staged)
        # Everything readable is in; move past unreadable lines too so the file can go.
        spool.commit(run_id, end)
        return counts, refusals, spool.finish_if_drained(run_id)
