"""Each trial's best checkpoint as an MLflow 3 ``LoggedModel`` (the experiment's Models view):
the trial's run as its source, the trial's hyperparameters as its params, and the best epoch's
metrics linked to it and to the dataset they were measured on, so
``mlflow.search_logged_models(order_by=[{"field_name": "metrics.val_acc", "ascending": False}])``
ranks the trials' models.

The weights are not uploaded a second time: the model's only artifact is ``checkpoint.json``,
naming the run artifacts that hold them (``checkpoints/best.pt``, ``onnx/model.onnx``).
``sweeps promote`` logs the servable pyfunc model beside it (``sweeps.model_logging``) and tags
it with this model's id.

A logged model is one write of the run's outbox (``sweeps.tracking.spool``, record ``"lm"``): it
is made now when the store answers, else kept and made when the store answers again, after the
run's points (whose timestamps it reuses). Made at most once: the record carries a key, stamped
on the model as ``sweeps.model_key``, and a replay finds and completes that model instead of
making a second one.
"""
from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps.tracking import layout

if TYPE_CHECKING:
    from core.results import TrainResult

MODEL_TYPE = "sweeps-trial"  # the logged models of trials (promote's are "model", see model_logging)
TAG_MODEL_ID = "sweeps.model_id"  # on the trial run: its logged model
TAG_MODEL_ERROR = "sweeps.model_error"  # on the trial run: why it has none although it has a best checkpoint
TAG_CHECKPOINT_MODEL = "sweeps.checkpoint_model_id"  # on promote's model: the trial's logged model it serves
TAG_MODEL_KEY = "sweeps.model_key"  # on the logged model: the key of the outbox record that made it
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


def model_record(number: int, params: dict, result: TrainResult, datasets: dict[str, dict],
                 replace: bool = False) -> dict:
    """What ``make_trial_model`` needs, as JSON for the outbox: the trial's number and params, its
    best epoch and the metrics of that epoch measured on a dataset (what ranks models), the datasets
    ("train", "val": name and digest) and a fresh key. ``replace``: the run continues (a Ray trial
    started again), and models an earlier start logged are deleted: a trial has one model."""
    best_epoch = int(result.best_epoch or 0)
    epoch = next((h for h in result.history if h.get("epoch") == best_epoch), {})
    # lr, throughput and the like stay the run's.
    keys = [k for k, v in epoch.items() if _dataset_of(k, {"val": {}, "train": {}}) is not None
            and isinstance(v, (int, float))]
    return {"key": uuid.uuid4().hex, "number": int(number), "params": {k: str(v) for k, v in params.items()},
            "best_epoch": best_epoch, "best_metric": result.best_metric, "onnx": result.onnx is not None,
            "keys": keys, "replace": bool(replace),
            "datasets": {split: {"name": d.get("name"), "digest": d.get("digest")} for split, d in datasets.items()}}


def make_trial_model(client: Any, run_id: str, rec: dict) -> str:
    """Create, fill and finalize the logged model of ``model_record`` ``rec`` in the store's run
    ``run_id``, or complete the one an earlier try of the same record made; returns its id.
    Every step may be repeated: the artifacts are overwritten, identical metric points are kept
    once, and the output link and the tags are only added where missing."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    run = client.get_run(run_id)
    experiment_id, number, best_epoch = run.info.experiment_id, int(rec["number"]), int(rec["best_epoch"])
    mine = None
    for old in client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'"):
        if old.tags.get(TAG_MODEL_KEY) == rec["key"]:
            mine = old
        elif rec.get("replace") and old.model_type == MODEL_TYPE:
            client.delete_logged_model(old.model_id)
    if mine is not None and str(mine.status).endswith("READY"):
        _tag_run(client, run, mine.model_id)
        return str(mine.model_id)
    datasets = rec.get("datasets") or {}
    points = _epoch_timestamps(client, run_id, list(rec.get("keys") or []), best_epoch)
    model = mine or client.create_logged_model(
        experiment_id, name=model_name(number), source_run_id=run_id, model_type=MODEL_TYPE,
        params=dict(rec.get("params") or {}),
        tags={layout.TAG_TRIAL_NUMBER: str(number), "sweeps.best_epoch": str(best_epoch), TAG_MODEL_KEY: rec["key"],
              "sweeps.checkpoint": f"runs:/{run_id}/{layout.ART_CHECKPOINT_DIR}/best.pt"})
    with tempfile.TemporaryDirectory(prefix="sweeps-model-") as tmp:
        Path(tmp, CHECKPOINT_FILE).write_text(json.dumps({
            "run_id": run_id, "best_epoch": best_epoch, "best_metric": rec.get("best_metric"),
            "checkpoint": f"runs:/{run_id}/{layout.ART_CHECKPOINT_DIR}/best.pt",
            "onnx": f"runs:/{run_id}/{layout.ART_ONNX_DIR}/model.onnx" if rec.get("onnx") else None,
        }, indent=2))
        client.log_model_artifacts(model.model_id, tmp)
    metrics = []
    for key, (value, ts) in points.items():
        ds = _dataset_of(key, datasets)
        linked = {"dataset_name": ds["name"], "dataset_digest": ds["digest"]} if ds and ds.get("digest") else {}
        metrics.append(Metric(key, value, ts, best_epoch, model_id=model.model_id, **linked))
    if metrics:
        client.log_batch(run_id, metrics=metrics, synchronous=True)
    outputs = run.outputs.model_outputs if run.outputs is not None else []
    if not any(o.model_id == model.model_id for o in outputs):
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=best_epoch)])
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    _tag_run(client, run, model.model_id)
    return str(model.model_id)


def _tag_run(client: Any, run: Any, model_id: str) -> None:
    """The run names its model; a ``sweeps.model_error`` an earlier try left is removed."""
    client.set_tag(run.info.run_id, TAG_MODEL_ID, model_id)
    if TAG_MODEL_ERROR in run.data.tags:
        client.delete_tag(run.info.run_id, TAG_MODEL_ERROR)
