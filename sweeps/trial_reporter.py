"""The Reporter a trial's training talks to: its metrics and artifacts go to the trial's tracked
run (a continued run's old points left out), its stop, pruning and heartbeat to the backend's
:class:`~sweeps.trial_control.TrialControl`."""
from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from core.reporting import Decision
from sweeps.model_logging import TORCHSCRIPT_DIR
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, Tracker
from sweeps.tracking.trial_extras import TrialExtras
from sweeps.trial_control import TrialControl

_ARTIFACT_DIRS = {
    "checkpoint_best": layout.ART_CHECKPOINT_DIR, "onnx": layout.ART_ONNX_DIR, "onnx_report": layout.ART_ONNX_DIR,
    "confusion_matrix": layout.ART_EVAL_DIR, "lr_finder": layout.ART_LR_FINDER_DIR,
    "diverged": "diagnostics",  # diverged.json (core/forensics.py)
    "torchscript": TORCHSCRIPT_DIR, "torchscript_report": TORCHSCRIPT_DIR,  # model.ts + its parity report
    "profile": "profile",  # train.profile: Chrome traces and top-operator tables (core/profiling.py)
}


def new_points(metrics: Mapping[str, float], step: int, logged_up_to: Mapping[str, int] | None) -> dict[str, float]:
    """``metrics`` less those a continued run already holds at ``step`` (or later)."""
    return {k: v for k, v in metrics.items() if step > (logged_up_to or {}).get(k, -1)}


class TrialReporter:
    """core.reporting.Reporter for one tracked trial. ``logged_up_to``: None for a new run; for a
    continued one, the last step of each metric it holds (see ``TrialSpec.logged_up_to``)."""

    def __init__(self, tracker: Tracker, run: RunHandle, objective: str, control: TrialControl,
                 logged_up_to: Mapping[str, int] | None = None, extras: TrialExtras | None = None) -> None:
        self.tracker, self.run, self.objective = tracker, run, objective
        self.extras = extras  # the confusion matrix is also drawn, when the run records extras
        self.control, self.logged_up_to = control, logged_up_to
        self.intermediate: dict[int, float] = {}
        self._last_beat = 0.0

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffered by the tracker (no I/O on this path); a continued run's old steps are left out."""
        points = new_points(metrics, step, self.logged_up_to) if self.logged_up_to else metrics
        if points:
            self.tracker.log_metrics(self.run, points, step)

    def report_step(self, step: int, metrics: dict[str, float]) -> Decision:
        self.control.stop.stepping()  # stop at a step from now on
        self.log_metrics({layout.STEP_METRIC_PREFIX + k: v for k, v in metrics.items()}, step)
        now = time.monotonic()
        if now - self._last_beat > 1.0:
            self._last_beat = now
            self.control.heartbeat()
        return Decision.INTERRUPT if self.control.stop.is_set() else Decision.CONTINUE

    def report_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> Decision:
        # Buffered too: the tracker sends a batch every few seconds and at the end of the run.
        # A synchronous flush here cost about a tenth of a short epoch (benchmarks/RESULTS.md).
        self.log_metrics(metrics, epoch)
        self.control.heartbeat()
        if self.control.stop.is_set():
            return Decision.INTERRUPT
        value = metrics[self.objective]
        self.intermediate[epoch] = value
        return Decision.PRUNE if self.control.should_prune(epoch, value) else Decision.CONTINUE

    def resumed(self, epochs: list[tuple[int, int, dict[str, float]]],
                steps: list[tuple[int, dict[str, float]]]) -> None:
        # A retry resumes in a new run: without these it would lack every point the checkpoint
        # holds (all of them, when the checkpoint is the final epoch's). Logged as report_step and
        # report_epoch log them; the pruner is not asked again about epochs it has answered.
        prefix = layout.STEP_METRIC_PREFIX
        if epochs or steps:  # the run says where its own training began
            self.tracker.log(self.run, tags={"sweeps.resumed_from_epoch": epochs[-1][0] if epochs else 0,
                                            "sweeps.resumed_from_step": steps[-1][0] if steps else 0})
        for epoch, _, metrics in epochs:  # the pruner is not asked again about these epochs
            if self.objective in metrics:
                self.intermediate[epoch] = metrics[self.objective]
        if self.logged_up_to is not None:  # a continued run holds its own points already
            return
        for step, metrics in steps:
            self.tracker.log_metrics(self.run, {prefix + k: v for k, v in metrics.items()}, step)
        for epoch, _, metrics in epochs:
            self.tracker.log_metrics(self.run, metrics, epoch)
        self.control.heartbeat()

    def log_artifact(self, path: Path, kind: str) -> None:
        if kind in _ARTIFACT_DIRS:
            self.tracker.log_artifact(self.run, path, _ARTIFACT_DIRS[kind])
        if kind == "confusion_matrix" and self.extras is not None:
            self.extras.confusion_image(path, _ARTIFACT_DIRS[kind])
