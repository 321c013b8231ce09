"""The Tracker on MLflow: explicit run ids through ``MlflowClient``, batched metrics, and
a local spool so an MLflow outage never loses points nor stops training.

Never uses ``mlflow.start_run`` or any fluent "active run": several trials in one
process (threads) or many processes write to different runs through handles.
"""
from __future__ import annotations

import json
import logging
import posixpath
import re
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from sweeps.errors import TrackingError
from sweeps.safe_names import safe_component, safe_subpath
from sweeps.tracking.base import RunHandle, RunStatus, check_status
from sweeps.tracking.layout import PARENT_TAG
from sweeps.tracking.spool import Spool, drain, is_transient, send_records
from sweeps.tracking.store_errors import disk_full_error, disk_full_raised, short_reason, store_folder
from sweeps.tracking.sync import (apply_fast_fail_http_defaults, check_store, is_database_uri, is_http_uri,
                                  sync_command)

log = logging.getLogger(__name__)

MAX_PARAM_VAL_LENGTH = 6000  # mlflow.utils.validation
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250
DEFAULT_SPOOL_DIR = Path("runs") / ".mlflow_spool"
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def sanitize_key(key: object) -> str:
    """A key MLflow accepts for a param, metric or tag: only letters, digits and
    ``_ - . : / space``; no empty, '.' or '..' components; at most 250 characters."""
    text = _BAD_KEY_CHARS.sub("_", str(key))
    parts = ["__" if p == ".." else p for p in text.split("/") if p not in ("", ".")]
    return ("/".join(parts) or "_")[:MAX_KEY_LENGTH]


def _truncate(value: object, limit: int, key: str, what: str) -> str:
    """Stringify; cut to ``limit`` characters ending in a note that says so."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    note = f"...[truncated: {len(text)} chars in full]"
    log.warning("%s %r is %d characters; MLflow keeps %d, so it was truncated", what, key, len(text), limit)
    return text[: limit - len(note)] + note


class MlflowTracker:
    """A :class:`sweeps.tracking.base.Tracker` writing to the MLflow store at
    ``tracking_uri`` (``http(s)://``, ``sqlite:///``, ``postgresql://``, ``file:``).

    ``flush_every_s`` / ``flush_every_points``: ``log_metrics`` sends the buffer once it
    is this old or holds this many points. ``spool_dir``: where writes the store could
    not take wait (one file per run). ``artifact_root``: where experiments created here
    keep artifacts (``<root>/<experiment name>``); None lets the store decide.
    ``retry_interval_s``: after a failure, how long to spool without trying the store.
    ``client``: an ``MlflowClient`` (or a wrapper around one) to use instead of a new one.

    Thread-safe; one per process (it holds locks and a buffer: pass ``RunHandle`` values
    between processes, not the tracker).
    """

    def __init__(
        self,
        tracking_uri: str,
        flush_every_s: float = 5.0,
        flush_every_points: int = 2000,
        spool_dir: str | Path = DEFAULT_SPOOL_DIR,
        artifact_root: str | Path | None = None,
        retry_interval_s: float = 30.0,
        client: Any = None,
    ) -> None:
        self.tracking_uri = str(tracking_uri)
        if is_http_uri(self.tracking_uri):
            apply_fast_fail_http_defaults()
        self.flush_every_s = float(flush_every_s)
        self.flush_every_points = int(flush_every_points)
        self.retry_interval_s = float(retry_interval_s)
        self.spool = Spool(spool_dir)
        self._store_dir = store_folder(self.tracking_uri, spool_dir)  # where a full disk would be
        self.artifact_root = _artifact_root(artifact_root)
        # Built on first use: MLflow opens (and for SQL stores migrates or retries for
        # minutes) at construction, which check_connection must be able to run first.
        self._client = client
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the buffer; held for microseconds
        # Serialises every send and spool write, so a run's writes reach the store (or
        # the spool) in the order they were made, whichever thread triggers the flush.
        self._send_lock = threading.RLock()
        self._buffer: dict[str, list[list[Any]]] = {}
        self._n_buffered = 0
        self._last_flush = time.monotonic()
        self._metric_keys: dict[str, str] = {}
        self._down_until = 0.0  # monotonic time before which we do not try the store
        self._down_reason = ""
        # Runs this tracker spooled for: sent as soon as the store answers again, even
        # those that ended meanwhile and will not flush again.
        self._spooled: set[str] = set()

    @property
    def client(self) -> Any:
        """The MlflowClient, created on first use (raises TrackingError if it cannot be)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    from mlflow.tracking import MlflowClient

                    try:
                        self._client = MlflowClient(tracking_uri=self.tracking_uri)
                    except Exception as exc:
                        raise disk_full_error(exc, f"opening {self.tracking_uri}", self._store_dir) or TrackingError(
                            f"cannot open the MLflow tracking store {self.tracking_uri!r}: {exc}. Check "
                            f"the URI (for sqlite, that its folder can be created and written)."
                        ) from exc
        return self._client

    def warm_up(self) -> None:
        """Before the first call, where a process can spare the time (a worker waiting for its
        go): import MLflow's client, and its SQL store for a database URI (1 to 2 s), so the
        first call does not. Opens nothing: the store may not exist yet."""
        import mlflow.tracking  # noqa: F401 - imported for its side effect

        if is_database_uri(self.tracking_uri):
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

    # -- connection and experiments ------------------------------------------------------
    def check_connection(self) -> None:
        """Before training: raise TrackingError (URI + fix) unless the store answers."""
        check_store(self.tracking_uri, lambda: self.client)

    def get_or_create_experiment(self, name: str) -> str:
        """Study start/resume: the id of experiment ``name``, created if missing."""
        from mlflow.exceptions import MlflowException

        exp = self._call("look up experiment", name, self.client.get_experiment_by_name, name)
        if exp is None:
            location = None
            if self.artifact_root is not None:
                location = f"{self.artifact_root}/{safe_component(name, 'experiment name')}"
            try:
                return self.client.create_experiment(name, artifact_location=location)
            except MlflowException as exc:
                # RESOURCE_ALREADY_EXISTS: a parallel worker created it first; use theirs.
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise self._error("create experiment", name, exc) from exc
            exp = self._call("look up experiment", name, self.client.get_experiment_by_name, name)
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {name!r} (id {exp.experiment_id}) at {self.tracking_uri} is "
                f"deleted. Restore it (`mlflow experiments restore --experiment-id "
                f"{exp.experiment_id}`) or name the study's experiment differently."
            )
        return exp.experiment_id

    # -- runs ----------------------------------------------------------------------------
    def start_run(
        self,
        experiment_id: str,
        name: str,
        parent: RunHandle | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> RunHandle:
        """Study or trial start: a new run, nested under ``parent`` when given."""
        all_tags = self._tag_values(tags or {})
        if parent is not None:
            all_tags[PARENT_TAG] = parent.run_id  # what makes the MLflow UI nest the run
        run = self._call(
            "create run", name, self.client.create_run, experiment_id, tags=all_tags, run_name=name
        )
        return RunHandle(run.info.run_id, run.info.experiment_id, run.info.run_name or name)

    def find_run(self, experiment_id: str, tags: Mapping[str, Any]) -> RunHandle | None:
        """Resume/readers: the newest non-deleted run carrying all of ``tags``."""
        wanted = self._tag_values(tags)
        clauses = []
        for key, value in wanted.items():
            if "'" not in value:  # MLflow's filter grammar has no escapes; check the rest below
                clauses.append(f"tags.`{key}` = '{value}'")
        token = None
        while True:
            page = self._call(
                "search runs", str(wanted), self.client.search_runs, [experiment_id],
                filter_string=" and ".join(clauses), max_results=200,
                order_by=["attributes.start_time DESC"], page_token=token,
            )
            for run in page:
                if all(run.data.tags.get(k) == v for k, v in wanted.items()):
                    return RunHandle(run.info.run_id, run.info.experiment_id, run.info.run_name or "")
            token = page.token
            if not token:
                return None

    def log_params(self, run: RunHandle, params: Mapping[str, Any]) -> None:
        """Once per run: hyperparameters, stringified, truncated to MLflow's limit."""
        records = []
        for key, value in params.items():
            k = self._key(key, "param")
            records.append(["p", k, _truncate(value, MAX_PARAM_VAL_LENGTH, k, "param")])
        self._submit(run.run_id, records)

    def set_tags(self, run: RunHandle, tags: Mapping[str, Any]) -> None:
        """On state changes: tags, a later value replacing an earlier one."""
        self._submit(run.run_id, [["t", k, v] for k, v in self._tag_values(tags).items()])

    # -- metrics -------------------------------------------------------------------------
    def log_metrics(self, run: RunHandle, metrics: Mapping[str, float], step: int) -> None:
        """Every step/epoch: buffer the points (timestamped now); flush when due."""
        ts = int(time.time() * 1000)
        step = int(step)
        keys = self._metric_keys
        try:
            points = [["m", keys.get(n) or self._metric_key(n), float(v), ts, step] for n, v in metrics.items()]
        except (TypeError, ValueError) as exc:
            bad = {n: v for n, v in metrics.items() if not isinstance(v, (int, float))}
            raise TrackingError(
                f"metrics {bad!r} of run {run.run_id} at step {step} are not numbers ({exc}); "
                f"log floats (call .item() on tensors)"
            ) from exc
        with self._lock:
            buf = self._buffer.get(run.run_id)
            if buf is None:
                self._buffer[run.run_id] = points
            else:
                buf.extend(points)
            self._n_buffered += len(points)
            # O(1): a counter and a clock read decide whether this call does any I/O.
            due = (
                self._n_buffered >= self.flush_every_points
                or time.monotonic() - self._last_flush >= self.flush_every_s
            )
        if due:
            self._flush_due()

    def _flush_due(self) -> None:
        """log_metrics found the buffer due (old or large enough): send it now."""
        self.flush()

    def _metric_key(self, name: object) -> str:
        key = self._metric_keys[name] = self._key(name, "metric")  # once per name, not per point
        return key

    def flush(self, run: RunHandle | None = None) -> None:
        """Epoch ends, before reads, end_run: send buffered points of ``run`` (or all)."""
        with self._send_lock:
            # Take the points out while holding the send lock: a second flusher cannot
            # overtake us and reach the store with newer points first.
            with self._lock:
                if run is None:
                    taken, self._buffer = self._buffer, {}
                    self._n_buffered = 0
                else:
                    points = self._buffer.pop(run.run_id, [])
                    taken = {run.run_id: points} if points else {}
                    self._n_buffered -= len(points)
                self._last_flush = time.monotonic()
            errors = []
            for run_id, points in taken.items():
                try:
                    self._submit(run_id, points)
                except TrackingError as exc:  # refused points: report all runs, not the first
                    errors.append(str(exc))
            if errors:
                raise TrackingError("\n".join(errors))

    def close(self) -> None:
        """When the process is done with the tracker: send every buffered point."""
        self.flush()

    # -- artifacts -----------------------------------------------------------------------
    def log_artifact(self, run: RunHandle, local_path: str | Path, artifact_path: str | None = None) -> None:
        """When a file is final: upload it under ``artifact_path`` (safe, relative)."""
        if artifact_path is not None:
            artifact_path = safe_subpath(artifact_path, "artifact path")
        path = Path(local_path)
        if not path.exists():
            raise TrackingError(f"artifact {str(path)!r} for run {run.run_id} does not exist; nothing to upload")
        self._submit(run.run_id, [["a", str(path.resolve()), artifact_path, False]])

    def log_dict(self, run: RunHandle, obj: Any, artifact_file: str) -> None:
        """Store ``obj`` as JSON (YAML for .yaml/.yml) at ``artifact_file`` in the run."""
        rel = safe_subpath(artifact_file, "artifact file")
        if rel.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(obj, sort_keys=False)
        else:
            text = json.dumps(obj, indent=2, default=str)
        # Staged in the spool folder, so it can still be sent later if the store is down.
        staged = self.spool.stage_file(run.run_id, rel, text)
        self._submit(run.run_id, [["a", str(staged), posixpath.dirname(rel) or None, True]])

    # -- end -----------------------------------------------------------------------------
    def end_run(self, run: RunHandle, status: RunStatus = "FINISHED") -> None:
        """Once per run: flush, then set the terminal status. Never raises for the store:
        whatever it cannot take now stays in the spool, with a warning saying how to send it."""
        with self._send_lock:
            self._end(run, status, *self._take_last(run, status))

    def _take_last(self, run: RunHandle, status: RunStatus) -> tuple[list[list[Any]], int]:
        """end_run's first half, under the send lock: check ``status``, take the run's buffered
        points out of the buffer, and stamp the run's end time (ms)."""
        check_status(status)
        end_ms = int(time.time() * 1000)
        with self._lock:
            points = self._buffer.pop(run.run_id, [])
            self._n_buffered -= len(points)
        return points, end_ms

    def _end(self, run: RunHandle, status: RunStatus, points: list[list[Any]], end_ms: int) -> None:
        """The run's last points and its status (set at ``end_ms``), sent as end_run sends them."""
        with self._send_lock:
            try:
                # One submission: the store gets one try (not one per part) even while it
                # is considered down, and the status can never overtake the last points.
                self._submit(run.run_id, points + [["end", status, end_ms]], force=True)
            except TrackingError as exc:  # refused writes: loud, but the trial itself is over
                log.error("%s", exc)
            pending = self.spool.has_pending(run.run_id)
        if pending:
            log.warning(
                "MLflow tracking store %s is unreachable (%s): %d writes of run %s (%s, status %s) "
                "are kept in %s. This process sends them if the store comes back while it runs; "
                "otherwise send them with: %s",
                self.tracking_uri, self._down_reason or "see above", self.spool.pending_count(run.run_id),
                run.run_id, run.name, status, self.spool.path(run.run_id),
                sync_command(self.tracking_uri, self.spool.directory),
            )

    # -- internals -----------------------------------------------------------------------
    def _submit(self, run_id: str, records: list[list[Any]], force: bool = False) -> None:
        """Send ``records`` in order after anything already spooled for the run; spool
        what the store cannot take now. ``force`` tries the store even while it is
        considered down (end_run: the last chance to send without a sync command)."""
        if not records:
            return
        with self._send_lock:
            down = time.monotonic() < self._down_until and not force
            if down or self.spool.has_pending(run_id):
                # Older writes wait in the spool: queue behind them to keep the order.
                self._spool(run_id, records)
                if not down:
                    self._drain(run_id)
                return
            sent = 0

            def on_done(n: int) -> None:
                nonlocal sent
                sent = n

            try:
                _, refusals = send_records(self.client, run_id, records, on_done, self.spool.discard_staged)
            except Exception as exc:
                if not is_transient(exc):  # send_records lets only transient ones out
                    raise
                self._spool(run_id, records[sent:])
                self._mark_down(exc)
                return
            self._mark_up()
            if refusals:
                raise TrackingError(f"MLflow store {self.tracking_uri} refused writes:\n" + "\n".join(refusals))

    def _spool(self, run_id: str, records: list[list[Any]]) -> None:
        with disk_full_raised(f"keeping MLflow writes of run {run_id}", self.spool.directory):  # nowhere left
            self.spool.append(run_id, records)
        self._spooled.add(run_id)

    def _drain(self, run_id: str) -> None:
        """Send the run's spool; on success, also the spools of runs that ended (and
        so will not flush again) while the store was down."""
        try:
            counts, refusals, drained = drain(self.spool, self.client, run_id)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._mark_down(exc)
            return
        if drained:
            self._spooled.discard(run_id)
        if self._down_reason:
            log.info("MLflow store %s reachable again; sent spooled writes of run %s: %s",
                     self.tracking_uri, run_id, counts)
        self._mark_up()
        if refusals:
            raise TrackingError(f"MLflow store {self.tracking_uri} refused spooled writes:\n" + "\n".join(refusals))

    def _mark_down(self, exc: BaseException) -> None:
        reason = short_reason(exc, self._store_dir)  # one line, a full disk named
        if not self._down_reason:  # warn once per outage, not on every flush
            log.warning("MLflow tracking store %s %s (%s); training goes on, writes are kept in %s and retried "
                        "every %.0f s", self.tracking_uri, "cannot write" if reason.startswith("disk full")
                        else "unreachable", reason, self.spool.directory, self.retry_interval_s)
        self._down_reason = reason
        self._down_until = time.monotonic() + self.retry_interval_s

    def _mark_up(self) -> None:
        was_down = bool(self._down_reason)
        self._down_reason = ""
        self._down_until = 0.0
        if not was_down:
            return
        for run_id in sorted(self._spooled):
            if self._down_reason:  # it went away again while we were catching up
                break
            try:
                self._drain(run_id)
            except TrackingError as exc:  # a refusal in another run: report, don't fail this call
                log.error("%s", exc)

    def _key(self, key: object, what: str) -> str:
        clean = sanitize_key(key)
        if clean != key:
            log.warning("%s name %r is not valid in MLflow; logged as %r", what, key, clean)
        return clean

    def _tag_values(self, tags: Mapping[str, Any]) -> dict[str, str]:
        out = {}
        for key, value in tags.items():
            k = self._key(key, "tag")
            out[k] = _truncate(value, MAX_TAG_VAL_LENGTH, k, "tag")
        return out

    def _call(self, what: str, subject: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self._error(what, subject, exc) from exc

    def _error(self, what: str, subject: str, exc: BaseException) -> TrackingError:
        hint = (
            "The store is unreachable: start it or fix the tracking URI, then resume the study."
            if is_transient(exc) else "The store refused the request: see the reason above."
        )
        return (disk_full_error(exc, f"MLflow {what} for {subject!r} at {self.tracking_uri}", self._store_dir)
                or TrackingError(f"MLflow {what} failed for {subject!r} at {self.tracking_uri}: {exc}. {hint}"))


def _artifact_root(root: str | Path | None) -> str | None:
    if root is None:
        return None
    text = str(root)
    if "://" in text or text.startswith(("mlflow-artifacts:", "file:")):
        return text.rstrip("/")
    return str(Path(text).resolve())  # a relative root would depend on the worker's cwd
