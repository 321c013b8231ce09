"""The Tracker on MLflow: the Tracker calls (runs, params and tags, buffered and batched metric
points, artifacts, dataset inputs, the trial's logged model) made into write records with explicit
run ids and handed to the tracker's ``outbox.Outbox``, which sends them in order or keeps them
while the store is away, so an MLflow outage never loses points nor stops training (runs made
during one: ``local_runs``). Never the fluent "active run": threads and processes write to their
runs through handles, each process through its own MlflowTracker (benchmarks/README.md, tracking
overhead).
"""
from __future__ import annotations

import json
import os
import posixpath
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sweeps.errors import SweepsError, TrackingError
from sweeps.safe_names import safe_subpath
from sweeps.tracking.base import RunHandle, RunStatus, check_status
from sweeps.tracking.experiments import experiment_id_of
from sweeps.tracking.layout import PARENT_TAG, artifact_root_uri
from sweeps.tracking.local_runs import TAG_CLIENT_ID, new_client_id, new_run_record
from sweeps.tracking.outbox import Outbox
from sweeps.tracking.spool import Spool
from sweeps.tracking.store_checks import apply_fast_fail_http_defaults, check_store, is_http_uri
from sweeps.tracking.store_errors import call_error, disk_full_error, is_transient, store_folder
from sweeps.tracking.sync import retry_seconds
from sweeps.tracking.values import clean_key, param_values, tag_values

DEFAULT_SPOOL_DIR = Path("runs") / ".mlflow_spool"


class MlflowTracker:
    """A :class:`sweeps.tracking.base.Tracker` writing to the MLflow store at
    ``tracking_uri`` (``http(s)://``, ``sqlite:///``, ``postgresql://``, ``file:``).

    ``flush_every_s`` / ``flush_every_points``: ``log_metrics`` sends the buffer once it
    is this old or holds this many points. ``spool_dir``: where writes the store could
    not take wait (one file per run). ``artifact_root``: where experiments created here
    keep artifacts (``<root>/<experiment name>``); None lets the store decide.
    ``retry_interval_s``: after a failure, how long to spool without trying the store
    (None: ``SWEEPS_TRACKING_RETRY_S``, default 30).
    ``client``: an ``MlflowClient`` (or a wrapper around one) to use instead of a new one.

    Besides the Tracker calls, its owner (the code that made it) calls ``check_connection``
    before training, ``check_outage`` while trials train (to stop when the store has been away past
    the wait, ``tracking.outage``), ``close`` when done, and, at the end of a study,
    ``send_spooled``. ``check_outage``, ``send_spooled`` and ``store_down`` are its ``outbox``'s
    (``tracking.outbox``). Reads go through a ``sweeps.tracking.reader.TrackingReader``.

    Thread-safe; one per process (it holds locks and a buffer: pass ``RunHandle`` values
    between processes, not the tracker).
    """

    def __init__(self, tracking_uri: str, flush_every_s: float = 5.0, flush_every_points: int = 2000,
                 spool_dir: str | Path = DEFAULT_SPOOL_DIR, artifact_root: str | Path | None = None,
                 retry_interval_s: float | None = None, client: Any = None) -> None:
        self.tracking_uri = str(tracking_uri)
        if is_http_uri(self.tracking_uri):
            apply_fast_fail_http_defaults()
            # Else MLflow prints "View run/experiment at <url>" for every run that ends (2 lines a trial).
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.flush_every_s = float(flush_every_s)
        self.flush_every_points = int(flush_every_points)
        self.retry_interval_s = retry_seconds() if retry_interval_s is None else float(retry_interval_s)
        self.spool = Spool(spool_dir, store=self.tracking_uri)
        self._store_dir = store_folder(self.tracking_uri, spool_dir)  # where a full disk would be
        self.artifact_root = artifact_root_uri(artifact_root)
        # Built on first use: MLflow opens (and for SQL stores migrates or retries for
        # minutes) at construction, which check_connection must be able to run first.
        self._made_client = client
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the buffer; held for microseconds
        # Every write goes through it: sent in order, or kept while the store is away.
        self.outbox = Outbox(self.tracking_uri, self.spool, self._store_dir, self.retry_interval_s,
                             lambda: self._client)
        self._buffer: dict[str, list[list[Any]]] = {}
        self._n_buffered = 0
        self._last_flush = time.monotonic()
        self._metric_keys: dict[object, str] = {}

    @property
    def _client(self) -> Any:
        """The MlflowClient, created on first use (raises TrackingError if it cannot be)."""
        if self._made_client is None:
            with self._client_lock:
                if self._made_client is None:
                    from mlflow.tracking import MlflowClient

                    try:
                        self._made_client = MlflowClient(tracking_uri=self.tracking_uri)
                    except Exception as exc:
                        raise disk_full_error(exc, f"opening {self.tracking_uri}", self._store_dir) or TrackingError(
                            f"cannot open the MLflow tracking store {self.tracking_uri!r}: {exc}. Check "
                            f"the URI (for sqlite, that its folder can be created and written)."
                        ) from exc
        return self._made_client

    # -- the life of this object (its owner's calls, not the Tracker interface) -----------
    def check_connection(self) -> None:
        """Before training: raise TrackingError (URI + fix) unless the store answers."""
        check_store(self.tracking_uri, lambda: self._client)
        self.outbox.drain_waiting()  # what any process left for this store (an outage, a crash) goes first

    def flush(self, run: RunHandle | None = None) -> None:
        """Before its owner reads a run back (and by log_metrics when due): send the buffered
        points of ``run`` (or of every run) in batches; what the store cannot take is spooled."""
        with self.outbox.lock:
            # Take the points out while holding the outbox's lock: a second flusher cannot
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
                    self.outbox.submit(run_id, points)
                except TrackingError as exc:  # refused points: report all runs, not the first
                    errors.append(str(exc))
            if errors:
                raise TrackingError("\n".join(errors))

    def close(self) -> None:
        """When the process is done with the tracker: send every buffered point."""
        self.flush()

    def check_outage(self) -> None:
        """While trials train, cheap enough for every step: raise ``TrackingUnavailable`` once the
        store has not answered for longer than the wait. When a retry is due it tries the writes
        kept for this store (this process's or its workers'), so an owner that writes little (a
        driver between trials) sees an outage start, end and outlast the wait as its workers do."""
        self.outbox.check_outage()

    def send_spooled(self) -> None:
        """At the end of a study, its runs closed: send the writes kept for this store, trying again
        with backoff while it does not answer, until the outage has lasted the wait. Raises
        TrackingError (exit 1) counting the runs still kept and naming the command that sends them."""
        self.outbox.send_spooled()

    # -- runs ----------------------------------------------------------------------------
    def start_run(self, run: str | RunHandle, *, experiment: str | None = None,
                  parent: RunHandle | None = None, tags: Mapping[str, Any] | None = None) -> RunHandle:
        """A new run named ``run`` in ``experiment`` (or the parent's, nested under it); or
        the existing run ``run`` (a handle) RUNNING again, with ``tags``."""
        if isinstance(run, RunHandle):
            # Through the outbox like every write: queued behind whatever of the run still waits
            # in the spool (its last status, say), so the store ends up saying RUNNING.
            self.outbox.submit(run.run_id, [["open"], *self._tag_records(tags or {})])
            return run
        if parent is not None:
            experiment_id = parent.experiment_id
        elif experiment is not None:
            experiment_id = self._experiment_id(experiment)
        else:
            raise ValueError(f"start_run({run!r}) needs the experiment's name or the parent run")
        all_tags = {k: v for k, v in tag_values(tags or {}).items() if v is not None}
        if parent is not None:
            all_tags[PARENT_TAG] = parent.run_id  # what makes the MLflow UI nest the run
        all_tags[TAG_CLIENT_ID] = client_id = new_client_id()  # makes a replayed creation exactly-once
        if not self.store_down:
            try:
                made = self._client.create_run(experiment_id, tags=all_tags, run_name=run)
                return RunHandle(made.info.run_id, made.info.experiment_id, made.info.run_name or run)
            except Exception as exc:
                if not is_transient(exc):
                    raise self._error("create run", run, exc) from exc
                self.outbox.mark_down(exc)
        # The store is down: the trial goes on under its client id; the run is made when the
        # store answers again, everything written meanwhile queued behind (local_runs).
        self.outbox.keep(client_id, [new_run_record(experiment_id, run, all_tags)])
        return RunHandle(client_id, experiment_id, run)

    def store_run_id(self, run_id: str) -> str:
        """The store's id of ``run_id``: itself, or for a run made during an outage the id the
        store gave it once created (until then the local id)."""
        return self.outbox.store_run_id(run_id)

    def _experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created if missing."""
        try:
            return experiment_id_of(self._client, name, self.artifact_root, self.tracking_uri)
        except SweepsError:  # a deleted experiment, an unsafe name: said already
            raise
        except Exception as exc:
            raise self._error("look up experiment", name, exc) from exc

    def log(self, run: RunHandle, *, params: Mapping[str, Any] | None = None,
            tags: Mapping[str, Any] | None = None) -> None:
        """Hyperparameters (once per run) and state tags, sent now (they are few)."""
        records = [["p", k, v] for k, v in param_values(params or {}).items()]
        self.outbox.submit(run.run_id, records + self._tag_records(tags or {}))

    def _tag_records(self, tags: Mapping[str, Any]) -> list[list[Any]]:
        return [["t", k, v] if v is not None else ["dt", k] for k, v in tag_values(tags).items()]

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
            self.flush()

    def _metric_key(self, name: object) -> str:
        key = self._metric_keys[name] = clean_key(name, "metric")  # once per name, not per point
        return key

    # -- artifacts -----------------------------------------------------------------------
    def log_artifact(self, run: RunHandle, artifact: str | Path | Mapping[str, Any] | list,
                     path: str | None = None) -> None:
        """A final file uploaded into the folder ``path``; or an object stored as the file ``path``."""
        if not isinstance(artifact, (str, os.PathLike)):
            self._log_object(run, artifact, path)
            return
        if path is not None:
            path = safe_subpath(path, "artifact path")
        local = Path(artifact)
        if not local.exists():
            raise TrackingError(f"artifact {str(local)!r} for run {run.run_id} does not exist; nothing to upload")
        self.outbox.submit(run.run_id, [["a", str(local.resolve()), path, False]])

    def _log_object(self, run: RunHandle, obj: Any, artifact_file: str | None) -> None:
        """``obj`` as JSON (YAML for .yaml/.yml) at ``artifact_file`` in the run."""
        if artifact_file is None:
            raise ValueError(f"log_artifact of a {type(obj).__name__} for run {run.run_id} needs the file's path")
        rel = safe_subpath(artifact_file, "artifact file")
        if rel.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(obj, sort_keys=False)
        else:
            text = json.dumps(obj, indent=2, default=str)
        # Staged in the spool folder, so it can still be sent later if the store is down.
        staged = self.spool.stage_file(run.run_id, rel, text)
        self.outbox.submit(run.run_id, [["a", str(staged), posixpath.dirname(rel) or None, True]])

    def log_inputs(self, run: RunHandle, datasets: list[dict[str, Any]]) -> None:
        """Dataset inputs (dicts, see ``send.dataset_inputs``): sent now, or spooled like every write."""
        self.outbox.submit(run.run_id, [["in", list(datasets)]])

    def log_trial_model(self, run: RunHandle, described: Mapping[str, Any]) -> None:
        """The trial's logged model (``trial_model.model_record``), made after the run's points (it
        reuses their timestamps): now, or when the store answers again, like every write."""
        self.flush(run)
        self.outbox.submit(run.run_id, [["lm", dict(described)]])

    @property
    def store_down(self) -> str:
        """Why the store is down now, or "" (a run is then made under a local id, ``local_runs``)."""
        return self.outbox.store_down

    # -- end -----------------------------------------------------------------------------
    def end_run(self, run: RunHandle, status: RunStatus = "FINISHED") -> None:
        """Once per run: flush, then set the terminal status. Never raises for the store:
        whatever it cannot take now stays in the spool, with a warning saying how to send it."""
        check_status(status)
        end_ms = int(time.time() * 1000)
        with self.outbox.lock:  # taken with the points: no flush of the run can overtake its status
            with self._lock:
                points = self._buffer.pop(run.run_id, [])
                self._n_buffered -= len(points)
            # One submission, so the status can never overtake the last points.
            kept = self.outbox.send_last(run.run_id, points + [["end", status, end_ms]])
        if kept:
            self.outbox.kept_at_end(run, status)

    # -- internals -----------------------------------------------------------------------
    def _error(self, what: str, subject: str, exc: BaseException) -> TrackingError:
        return call_error(what, subject, self.tracking_uri, exc, self._store_dir)
