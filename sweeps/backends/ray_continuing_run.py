"""One MLflow run per Ray trial: a trial that starts again (a retry after a crash, a pause,
a PBT exploit, a restored experiment) continues its own run, and logs no step twice: the run
a trial continues (found by its Ray trial id, or a lost one adopted) and what that run already
holds go into the trial's description (``sweeps.trial.TrialSpec.continues``, ``logged_up_to``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, Tracker
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
        drawn = param_values(params)  # logged under their own names (trial.trial_params)
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

