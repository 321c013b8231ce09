"""Each trial's best checkpoint as an MLflow 3 ``LoggedModel`` (the experiment's Models view):
the trial's run as its source, the trial's hyperparameters as its params, and the best epoch's
metrics linked to it and to the dataset they were measured on, so
``mlflow.search_logged_models(order_by=[{"field_name": "metrics.val_acc", "ascending": False}])``
ranks the trials' models.

The weights are not uploaded a second time: the model's only artifact is ``checkpoint.json``,
naming the run artifacts that hold them (``checkpoints/best.pt``, ``onnx/model.onnx``).
``sweeps promote`` logs the servable pyfunc model beside it (``sweeps.model_logging``) and tags
it with this model's id.

A logged model needs the id the store gives it, so it cannot wait in the spool: while the store
is down, or the run still has spooled writes, none is created and the run says so in a tag.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle
from sweeps.tracking.local_runs import is_local

if TYPE_CHECKING:
    from core.results import TrainResult
    from sweeps.tracking.mlflow_tracker import MlflowTracker

MODEL_TYPE = "sweeps-trial"  # the logged models of trials (promote's are "model", see model_logging)
TAG_MODEL_ID = "sweeps.model_id"  # on the trial run: its logged model
TAG_MODEL_ERROR = "sweeps.model_error"  # on the trial run: why it has none although it has a best checkpoint
TAG_CHECKPOINT_MODEL = "sweeps.checkpoint_model_id"  # on promote's model: the trial's logged model it serves
CHECKPOINT_FILE = "checkpoint.json"


def model_name(number: int) -> str:
    return f"trial-{number}"


def _epoch_timestamps(client: Any, run_id: str, keys: list[str], step: int) -> dict[str, tuple[float, int]]:
    """(value, timestamp) of each key's point at ``step`` as the store holds it. Logging the same
    point again with the model id (same timestamp, step and value) adds it to the model only:
    the SQL stores keep one row per identical point, so the run's curves stay as they were."""
    found = {}
    for key in keys:
        points = [m for m in client.get_metric_history(run_id, key) if m.step == step]
        if points:
            last = max(points, key=lambda m: m.timestamp)
            found[key] = (last.value, last.timestamp)
    return found


def _dataset_of(key: str, datasets: dict[str, dict]) -> dict | None:
    split = "val" if key.startswith("val_") else "train" if key.startswith("train_") else None
    return datasets.get(split) if split else None


def log_trial_model(tracker: MlflowTracker, run: RunHandle, number: int, params: dict, result: TrainResult,
                    datasets: dict[str, dict], replace: bool = False) -> str:
    """Create, fill and finalize the trial's logged model; returns its id. ``datasets``: the
    trial's described datasets by split ("train", "val"), as logged as the run's inputs.
    ``replace``: the run continues (a Ray trial started again), and the model an earlier start
    logged is deleted: a trial has one model, its latest best checkpoint."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    tracker.flush(run)  # the best epoch's points are in the store: their timestamps are reused
    down = tracker.store_down
    # A run made during an outage is known to the store by another id once its spool is sent.
    run = RunHandle(tracker.store_run_id(run.run_id), run.experiment_id, run.name)
    if down or tracker.spool.has_pending(run.run_id) or is_local(run.run_id):
        raise RuntimeError(f"the tracking store is unreachable ({down or 'writes still spooled'}); "
                           "no logged model for this trial")
    client = tracker.client
    if replace:
        for old in client.search_logged_models([run.experiment_id], filter_string=f"source_run_id = '{run.run_id}'"):
            if old.model_type == MODEL_TYPE:
                client.delete_logged_model(old.model_id)
    best_epoch = int(result.best_epoch or 0)
    epoch = next((h for h in result.history if h.get("epoch") == best_epoch), {})
    # The metrics measured on a dataset (what ranks models); lr, throughput and the like stay the run's.
    keys = [k for k, v in epoch.items() if _dataset_of(k, {"val": {}, "train": {}}) is not None
            and isinstance(v, (int, float))]
    points = _epoch_timestamps(client, run.run_id, keys, best_epoch)
    model = client.create_logged_model(
        run.experiment_id, name=model_name(number), source_run_id=run.run_id, model_type=MODEL_TYPE,
        params={k: str(v) for k, v in params.items()},
        tags={layout.TAG_TRIAL_NUMBER: str(number), "sweeps.best_epoch": str(best_epoch),
              "sweeps.checkpoint": f"runs:/{run.run_id}/{layout.ART_CHECKPOINT_DIR}/best.pt"})
    with tempfile.TemporaryDirectory(prefix="sweeps-model-") as tmp:
        Path(tmp, CHECKPOINT_FILE).write_text(json.dumps({
            "run_id": run.run_id, "best_epoch": best_epoch, "best_metric": result.best_metric,
            "checkpoint": f"runs:/{run.run_id}/{layout.ART_CHECKPOINT_DIR}/best.pt",
            "onnx": f"runs:/{run.run_id}/{layout.ART_ONNX_DIR}/model.onnx" if result.onnx is not None else None,
        }, indent=2))
        client.log_model_artifacts(model.model_id, tmp)
    metrics = []
    for key, (value, ts) in points.items():
        ds = _dataset_of(key, datasets)
        linked = {"dataset_name": ds["name"], "dataset_digest": ds["digest"]} if ds and ds.get("digest") else {}
        metrics.append(Metric(key, value, ts, best_epoch, model_id=model.model_id, **linked))
    if metrics:
        client.log_batch(run.run_id, metrics=metrics, synchronous=True)
    client.log_outputs(run.run_id, [LoggedModelOutput(model.model_id, step=best_epoch)])
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return str(model.model_id)
