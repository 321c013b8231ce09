"""The Tracker interface: everything code that writes a study's runs may do.

Runs are addressed by explicit :class:`RunHandle` values, never by a global "active run",
so threads and processes can write to different runs without stepping on each other.
A study is a parent run; each trial is a child run nested under it (see
``sweeps.tracking.layout`` for the names every writer and reader agrees on).

Who calls what, in order:
  study start/resume  ``start_run(name, experiment=...)``, or ``start_run(handle)`` to reopen
                      the parent a reader found (``sweeps.tracking.reader``)
  per trial           ``start_run(name, parent=study)``, ``log(run, params=..., tags=...)``
  while training      ``log_metrics`` on every step/epoch (buffers only), ``log_artifact``
                      when a file is final, ``log_inputs`` when the datasets are built
  end of trial        ``log_trial_model`` (a completed trial's best checkpoint), ``log(run,
                      tags=...)`` (state), ``end_run`` (flushes, then the status)
  before reading back ``flush`` (the buffered points reach the store), ``store_run_id`` (the id
                      a reader finds the run by)

Every implementation honours every call; none is probed for. Reading runs back is another
interface (``sweeps.tracking.reader.TrackingReader``), and so is the life of the object behind a
Tracker (``MlflowTracker.check_connection``, ``close``), which only the code that made it calls.
A trial that continues its earlier run (a Ray trial started again) is a mode of the trial
(``sweeps.trial.TrialSpec.continues``), not of the Tracker.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

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

    def start_run(self, run: str | RunHandle, *, experiment: str | None = None,
                  parent: RunHandle | None = None, tags: Mapping[str, Any] | None = None) -> RunHandle:
        """Called when a study starts (``experiment`` = its experiment's name, created if
        missing, safe when workers race to create it), when a trial or rerun starts
        (``parent`` = the study's run: the new run goes into the parent's experiment and the
        UI nests it), and when a run continues: ``run`` is then the handle of an existing run
        (a resumed study's parent, a Ray trial started again), which is RUNNING again.
        Otherwise ``run`` is the new run's name. ``tags`` are set either way."""
        ...

    def log(self, run: RunHandle, *, params: Mapping[str, Any] | None = None,
            tags: Mapping[str, Any] | None = None) -> None:
        """Called once per run with the resolved hyperparameters (``params``: values
        stringified, truncated to the store's limit with a note, keys the store would refuse
        sanitized), and whenever the run's state changes (``tags``: a later value replaces an
        earlier one; None removes the tag)."""
        ...

    def log_metrics(self, run: RunHandle, metrics: Mapping[str, float], step: int) -> None:
        """Called on every optimizer step and every epoch. Only buffers (the timestamp is
        taken now); the points are sent in batches once the buffer is large or old enough,
        and by ``end_run``. Must be cheap enough to call per step. If the store is
        unreachable the points are kept locally and retried later, never lost or raised
        into training."""
        ...

    def log_artifact(self, run: RunHandle, artifact: str | Path | Mapping[str, Any] | list,
                     path: str | None = None) -> None:
        """Called when a file is final (config, checkpoint, ONNX model, report): ``artifact``
        is its local path, uploaded into the folder ``path`` of the run (None: its root).
        Also called to store an object (resolved config, summary): ``artifact`` is a dict or
        list, stored as the file ``path`` (JSON; YAML for .yaml/.yml). ``path`` must be a safe
        relative path."""
        ...

    def log_inputs(self, run: RunHandle, datasets: list[dict[str, Any]]) -> None:
        """Called once the trial's datasets are built: each one described (``name``, ``source``,
        ``digest``, ``context`` = training or validation, ``profile``; ``Task.describe_dataset``),
        recorded as the run's dataset inputs. Kept locally like every write while the store is down."""
        ...

    def log_trial_model(self, run: RunHandle, described: Mapping[str, Any]) -> None:
        """Called once a trial completed: its best checkpoint as the run's logged model
        (``sweeps.tracking.trial_model.model_record``; ``replace`` in it: the run's earlier one is
        removed). Made after the run's buffered points; kept locally while the store is down."""
        ...

    def flush(self, run: RunHandle | None = None) -> None:
        """Called before its caller reads a run back: the buffered points of ``run`` (None: of
        every run) are sent; what the store cannot take now is kept locally."""
        ...

    def store_run_id(self, run_id: str) -> str:
        """The id the store knows run ``run_id`` by, for a reader: itself, or for a run started
        while the store was down (under a local id) the store's id once it was created there."""
        ...

    def end_run(self, run: RunHandle, status: RunStatus = "FINISHED") -> None:
        """Called exactly once when a run ends: sends its buffered points, then sets the
        terminal status (FINISHED, FAILED or KILLED). If the store is down, the points and
        the status are kept locally with a warning saying how to send them; nothing is
        raised into training."""
        ...
