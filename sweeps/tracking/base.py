"""The Tracker interface: where a sweep writes its runs, params, metrics and artifacts.

Runs are addressed by explicit :class:`RunHandle` values, never by a global "active run",
so threads and processes can write to different runs without stepping on each other.
A study is a parent run; each trial is a child run nested under it (see
``sweeps.tracking.layout`` for the names every writer and reader agrees on).

Who calls what, in order:
  before training   ``check_connection`` (fail fast with a clear message),
                    ``get_or_create_experiment``, ``find_run`` (reuse the study's parent
                    run on resume) or ``start_run``
  per trial         ``start_run(parent=study)``, ``log_params``, ``set_tags``
  while training    ``log_metrics`` on every step/epoch (buffers only), ``log_artifact``
                    when a file is final
  end of trial      ``set_tags`` (state), ``end_run`` (flushes, then sets the status)
  before a read     ``flush`` (everything written before it is in the store)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol, runtime_checkable

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
RUN_STATUSES: tuple[str, ...] = ("FINISHED", "FAILED", "KILLED")


def check_status(status: str) -> None:
    """What ``end_run`` takes: one of RUN_STATUSES, or a ValueError naming them."""
    if status not in RUN_STATUSES:
        raise ValueError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}")


@dataclass(frozen=True)
class RunHandle:
    """Names one run in the tracking store. Cheap to copy, safe to pass between threads
    and (pickled) between processes."""

    run_id: str
    experiment_id: str
    name: str


@runtime_checkable
class Tracker(Protocol):
    """Writes a study's runs to a tracking store. Implementations must be thread-safe."""

    def check_connection(self) -> None:
        """Called once before any training starts. Raises ``TrackingError`` naming the
        tracking URI and what to do when the store cannot be reached; returns quickly
        (seconds, not minutes of retries) either way."""
        ...

    def get_or_create_experiment(self, name: str) -> str:
        """Called when a study starts or resumes: the experiment id for ``name``,
        created if missing. Safe when several workers race to create it."""
        ...

    def start_run(
        self,
        experiment_id: str,
        name: str,
        parent: RunHandle | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> RunHandle:
        """Called when a study starts (``parent=None``) or a trial starts (``parent`` =
        the study's run, so the UI nests it). ``tags`` are set at creation."""
        ...

    def find_run(self, experiment_id: str, tags: Mapping[str, Any]) -> RunHandle | None:
        """Called on resume and by readers: the most recently started, not deleted run
        in the experiment whose tags include all of ``tags``; None if there is none."""
        ...

    def log_params(self, run: RunHandle, params: Mapping[str, Any]) -> None:
        """Called once per run with the resolved hyperparameters. Values are
        stringified; values over the store's limit are truncated with a note; keys the
        store would refuse are sanitized."""
        ...

    def set_tags(self, run: RunHandle, tags: Mapping[str, Any]) -> None:
        """Called whenever the run's state changes (trial state, best trial so far).
        A later value for the same key replaces the earlier one."""
        ...

    def log_metrics(self, run: RunHandle, metrics: Mapping[str, float], step: int) -> None:
        """Called on every optimizer step and every epoch. Only buffers (the timestamp
        is taken now); the points are sent by ``flush``, which runs by itself when the
        buffer is large or old enough. Must be cheap enough to call per step."""
        ...

    def flush(self, run: RunHandle | None = None) -> None:
        """Called at epoch ends, before reading a run back, and by ``end_run``: sends
        buffered points (of ``run``, or of every run) in batches. If the store is
        unreachable the points are kept locally and retried later, never lost or raised
        into training."""
        ...

    def log_artifact(self, run: RunHandle, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Called when a file is final (config, checkpoint, ONNX model, report):
        uploads it under ``artifact_path`` (a safe relative path) in the run."""
        ...

    def log_dict(self, run: RunHandle, obj: Any, artifact_file: str) -> None:
        """Called to store a JSON-serializable object (resolved config, summary) as the
        artifact ``artifact_file`` (a safe relative path ending in .json)."""
        ...

    def end_run(self, run: RunHandle, status: RunStatus = "FINISHED") -> None:
        """Called exactly once when a run ends: flushes its buffered points, then sets
        the terminal status (FINISHED, FAILED or KILLED). If the store is down, the
        points and the status are kept locally with a warning saying how to send them;
        nothing is raised into training. It may return before they are in the store (a
        writer process writes them, in order, while the next trial starts): ``flush``
        waits for them, as before any read."""
        ...
