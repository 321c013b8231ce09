"""One MLflow run per Ray trial: a trial that starts again (a retry after a crash, a pause,
a PBT exploit, a restored experiment) continues its own run, and logs no step twice."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, RunStatus, Tracker
from sweeps.tracking.values import param_values

if TYPE_CHECKING:
    from sweeps.tracking.reader import TrackingReader


TAG_RAY_TRIAL_ID = "sweeps.ray_trial_id"  # on a trial's run: the Ray trial it belongs to


def adopt_lost_run(reader: TrackingReader, tracker: Tracker, parent: RunHandle, number: int, trial_id: str,
                   params: Mapping[str, Any]) -> RunHandle | None:
    """The run a driver killed before Ray recorded trial ``number`` in its experiment state left
    behind (RUNNING, or closed by the trial), now the run of Ray trial ``trial_id``; None if none.

    Ray restores an experiment from its last snapshot: a trial started after it is gone, so
    Ray draws it again under a new trial id and, its counter restored too, the same number.
    With the same params the new trial is that trial, and continues its run (tagged with
    the new id here, so every later lookup by id finds it). With other params it is another
    trial: the lost run is closed FAILED saying so, never left RUNNING."""
    for run in reader.find_runs(parent.experiment_id, {layout.PARENT_TAG: parent.run_id,
                                                       layout.TAG_TRIAL_NUMBER: number}):
        if run.data.tags.get(TAG_RAY_TRIAL_ID) == trial_id:
            continue
        handle = RunHandle(run.info.run_id, run.info.experiment_id, run.info.run_name or "")
        drawn = param_values(params)  # logged under their own names (objective.trial_params)
        if all(run.data.params.get(k) == v for k, v in drawn.items()):
            tracker.log(handle, tags={TAG_RAY_TRIAL_ID: trial_id})
            return handle
        if run.info.status == "RUNNING":
            reason = (f"lost: its driver was killed before Ray recorded the trial, and Ray drew trial {number} "
                      f"again with other parameters (Ray trial {trial_id})")
            tracker.log(handle, tags={layout.TAG_STATE: "FAIL", layout.TAG_ERROR: reason})
            tracker.end_run(handle, "FAILED")
    return None


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
