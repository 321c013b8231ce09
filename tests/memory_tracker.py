"""A Tracker that keeps every call in memory, for tests of what run_trial tells a tracker."""
from __future__ import annotations

from sweeps.tracking.base import RunHandle


class MemoryTracker:
    """Every Tracker call, kept in memory: params, metric points (step, values), tags (dataset
    inputs and the trial's model under ``datasets`` and ``model``) and the final status."""

    def __init__(self) -> None:
        self.params, self.metrics, self.tags, self.status = {}, [], {}, None

    def start_run(self, run, *, experiment=None, parent=None, tags=None):
        self.tags.update(tags or {})
        return RunHandle(run_id=str(run), experiment_id=parent.experiment_id if parent else "", name=str(run))

    def log(self, run, *, params=None, tags=None):
        self.params.update(params or {})
        self.tags.update(tags or {})

    def log_metrics(self, run, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_artifact(self, run, artifact, path=None):
        pass

    def log_inputs(self, run, datasets):
        self.tags["datasets"] = list(datasets)

    def log_trial_model(self, run, described):
        self.tags["model"] = dict(described)

    def flush(self, run=None):
        pass

    def store_run_id(self, run_id):
        return run_id

    def end_run(self, run, status="FINISHED"):
        self.status = status
