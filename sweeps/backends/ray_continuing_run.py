"""One MLflow run per Ray trial: a trial that starts again (a retry after a crash, a pause,
a PBT exploit, a restored experiment) continues its own run, and logs no step twice."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, RunStatus, Tracker

if TYPE_CHECKING:
    from sweeps.tracking.reader import TrackingReader


def logged_up_to(reader: TrackingReader, run_id: str) -> dict[str, int]:
    """The last step of every metric the run holds."""
    keys = reader.get_run(run_id).data.metrics
    return {key: max((m.step for m in reader.metric_history(run_id, key)), default=-1) for key in keys}


class ContinuingTracker:
    """The trial's Tracker, around the actor's own. A Ray trial that starts again (a retry
    after a crash, a pause, a PBT exploit, a restored experiment) continues its own MLflow
    run ``existing``: ``start_run`` reopens it (RUNNING again, the stale end-of-run tags
    removed), and its params and resolved config, logged at the first start, are kept
    (PBT's new params are in tags). With ``existing`` None it is the inner tracker."""

    _STALE_TAGS = (layout.TAG_PRUNED, layout.TAG_ERROR, "sweeps.reason", "sweeps.traceback")

    def __init__(self, inner: Tracker, existing: RunHandle | None,
                 logged_up_to: Mapping[str, int] | None = None) -> None:
        # Public: TrialExtras reaches the MlflowTracker through ``inner`` and asks ``existing``
        # whether the run continues (its system metrics go on from their last step).
        self.inner, self.existing = inner, existing
        # The last step of each metric the run already holds: the trial resumes from its last
        # Ray checkpoint, which may be behind what it had logged when its driver or actor died;
        # the steps it trains again are not logged a second time (one point per step).
        self.logged_up_to = dict(logged_up_to or {})

    def start_run(self, run: str | RunHandle, *, experiment: str | None = None,
                  parent: RunHandle | None = None, tags: Mapping[str, Any] | None = None) -> RunHandle:
        if self.existing is None:
            return self.inner.start_run(run, experiment=experiment, parent=parent, tags=tags)
        return self.inner.start_run(self.existing, tags={**dict.fromkeys(self._STALE_TAGS), **(tags or {})})

    def log(self, run: RunHandle, *, params: Mapping[str, Any] | None = None,
            tags: Mapping[str, Any] | None = None) -> None:
        self.inner.log(run, params=params if self.existing is None else None, tags=tags)

    def log_metrics(self, run: RunHandle, metrics: Mapping[str, float], step: int) -> None:
        if self.logged_up_to:
            metrics = {k: v for k, v in metrics.items() if step > self.logged_up_to.get(k, -1)}
            if not metrics:
                return
        self.inner.log_metrics(run, metrics, step)

    def log_artifact(self, run: RunHandle, artifact: Any, path: str | None = None) -> None:
        if self.existing is None or path != layout.ART_CONFIG:
            self.inner.log_artifact(run, artifact, path)

    def end_run(self, run: RunHandle, status: RunStatus = "FINISHED") -> None:
        self.inner.end_run(run, status)
