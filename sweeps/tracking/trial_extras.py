"""What a trial's MLflow run holds besides its params, curves and files, as MLflow users look for
it: system metrics (``system/...``), the training and validation data as dataset inputs, the
confusion matrix as an image, and the best checkpoint as a logged model (made when the store
answers, ``trial_model``).

None of these may fail a trial: whatever cannot be recorded is named in a ``sweeps.*_error`` tag
on the run (and logged as a warning), and the trial goes on.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps.tracking.base import RunHandle, Tracker
from sweeps.tracking.confusion_image import IMAGE_FILE, render
from sweeps.tracking.system_metrics import SystemMetrics
from sweeps.tracking.trial_model import TAG_MODEL_ERROR, model_record

if TYPE_CHECKING:
    from core.results import TrainResult

log = logging.getLogger(__name__)

TAG_DATASET_ERROR = "sweeps.dataset_error"
CONTEXTS = {"train": "training", "val": "validation"}  # MLflow's usual mlflow.data.context values
SYSTEM_STEP_METRIC = "system/cpu_utilization_percentage"  # sampled at every system step


class TrialExtras:
    """Started with the trial's run (system metrics from then on); ``watch_datasets`` before
    training; ``confusion_image`` when the matrix is written; ``finish`` before the run ends.
    ``logged_up_to``: None for a new run; for a run the trial continues, the last step of each
    metric it holds (its system metrics go on after theirs, its logged model is replaced)."""

    def __init__(self, tracker: Tracker, run: RunHandle, logged_up_to: Mapping[str, int] | None = None) -> None:
        self.tracker, self.run = tracker, run
        self.datasets: dict[str, dict] = {}  # split -> described dataset, as logged
        self.continued = logged_up_to is not None
        first_step = (logged_up_to or {}).get(SYSTEM_STEP_METRIC, -1) + 1
        self.system = SystemMetrics(tracker, run, first_step=first_step).start()

    def _warn(self, tag: str, what: str, exc: BaseException) -> None:
        reason = f"{what}: {type(exc).__name__}: {exc}"[:1000]
        log.warning("run %s: %s", self.run.run_id, reason)
        try:
            self.tracker.log(self.run, tags={tag: reason})
        except Exception:  # noqa: BLE001 - the store refused even the tag: the warning above stays
            pass

    # -- dataset inputs ----------------------------------------------------------------------
    def watch_datasets(self, task: Any, also: Sequence[TrialExtras] = ()) -> None:
        """Log the datasets ``task.datasets()`` returns, when training asks for them: described
        from the objects already built (``Task.describe_dataset``), so nothing is loaded twice.
        ``also``: the other members of a population that trains on this task, whose runs get the
        same description (made once, not once per member)."""
        original = task.datasets

        def datasets() -> Any:
            built = original()
            task.datasets = original  # once: the run's own data, not an LR finder's second look
            self._log_datasets(task, built, [self, *also])
            return built

        try:
            task.datasets = datasets  # an instance attribute: only this task object, this run
        except (AttributeError, TypeError) as exc:  # a task with __slots__ or a frozen dataclass
            for extras in (self, *also):
                extras._warn(TAG_DATASET_ERROR, "datasets not logged (the task object takes no attributes)", exc)

    def not_watched(self, why: str) -> None:
        """The datasets are built elsewhere (DDP ranks): said on the run instead of logged."""
        self.tracker.log(self.run, tags={TAG_DATASET_ERROR: f"datasets not logged: {why}"})

    def _log_datasets(self, task: Any, built: Any, runs: list[TrialExtras]) -> None:
        try:
            described, missing = [], []
            for split, dataset in zip(("train", "val"), built, strict=True):
                d = dict(task.describe_dataset(dataset, split))
                if not d.get("digest"):
                    missing.append((split, type(dataset).__name__))
                    d["digest"] = "unknown"
                d["context"] = CONTEXTS[split]
                described.append(d)
        except Exception as exc:  # noqa: BLE001 - describing data is optional; training is not
            for extras in runs:
                extras._warn(TAG_DATASET_ERROR, "datasets not logged", exc)
            return
        for extras in runs:
            try:
                for split, kind in missing:
                    extras.tracker.log(extras.run, tags={f"{TAG_DATASET_ERROR}.{split}": (
                        f"no digest for the {split} dataset ({kind}): the task's describe_dataset cannot tell "
                        "its content cheaply; logged without one")})
                extras.datasets.update({split: dict(d) for split, d in zip(("train", "val"), described, strict=True)})
                extras.tracker.log_inputs(extras.run, [dict(d) for d in described])
            except Exception as exc:  # noqa: BLE001 - describing data is optional; training is not
                extras._warn(TAG_DATASET_ERROR, "datasets not logged", exc)

    # -- confusion matrix image --------------------------------------------------------------
    def confusion_image(self, matrix_json: Path, artifact_dir: str) -> None:
        try:
            # The PNG lives next to the JSON in the trial's folder, like every artifact core writes.
            out = render(matrix_json, matrix_json.with_name(IMAGE_FILE))
            self.tracker.log_artifact(self.run, out, artifact_dir)
        except Exception as exc:  # noqa: BLE001 - the JSON is logged; the picture is a convenience
            self._warn("sweeps.confusion_image_error", "confusion matrix image not logged", exc)

    # -- end of the trial --------------------------------------------------------------------
    def finish(self, number: int, params: dict, result: TrainResult | None) -> None:
        """Stop the system metrics; log the best checkpoint of a completed trial as a logged model.
        A pruned or diverged trial's is left in its run: promote never picks one, and the Models
        tab then lists the models worth comparing."""
        self.system.stop()
        if result is None or result.status != "completed" or result.checkpoint_best is None:
            return
        try:
            # Made now, or kept in the outbox with the run's other writes while the store is down.
            self.tracker.log_trial_model(self.run, model_record(number, params, result, self.datasets,
                                                                replace=self.continued))
        except Exception as exc:  # noqa: BLE001 - the checkpoint is in the run's artifacts either way
            self._warn(TAG_MODEL_ERROR, "no logged model", exc)
