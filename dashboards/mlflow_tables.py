"""The tables read from MLflow: each trial's per-epoch metric histories, and the study's
LR-finder curve (the ``lr_finder/lr_finder.json`` artifact of the parent run).

Names follow :mod:`sweeps.tracking.layout`: per-epoch metrics under their core names with
step = epoch (1-based); the LR-finder curve under ``layout.ART_LR_FINDER_DIR``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from typing import Any

import pandas as pd

from sweeps.backends.base import StudyResult
from sweeps.tracking import layout
from sweeps.tracking.reader import TrackingReader

CURVE_METRICS = ("val_acc", "val_loss", "train_loss")
CURVE_KEYS = ("run_id", "number", "state", "epoch")
LR_FINDER_FILE = f"{layout.ART_LR_FINDER_DIR}/lr_finder.json"
LR_FINDER_COLUMNS = ("lr", "loss", "smoothed", "suggestion")
PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def curve_metrics(objective: str) -> tuple[str, ...]:
    """The per-epoch metrics of the learning curves: val_acc, val_loss, train_loss and the objective."""
    return CURVE_METRICS if objective in CURVE_METRICS else (*CURVE_METRICS, objective)


def is_missing(exc: BaseException) -> bool:
    """True for MLflow's "no such run/experiment" (a run deleted, or a store that is not the study's)."""
    return getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def _history(reader: TrackingReader, run_id: str, key: str) -> dict[int, float]:
    """{epoch: value} of one metric; a step logged twice (a resumed trial) keeps its latest value.
    A run the store does not have has no history (the caller falls back to the study's values)."""
    try:
        history = reader.metric_history(run_id, key)
    except Exception as exc:
        if is_missing(exc):
            return {}
        raise
    points = sorted(history, key=lambda m: (m.step, m.timestamp))
    return {int(m.step): float(m.value) for m in points}


def curves_table(result: StudyResult, reader: TrackingReader | None = None,
                 metrics: tuple[str, ...] = CURVE_METRICS) -> pd.DataFrame:
    """One row per (trial, epoch): run_id, number, state, epoch, then one column per metric.

    Histories come from the trial's MLflow run (``reader.metric_history``). A trial whose
    run has no history of the objective (no reader, no run, or a store that lost it) falls back
    to the study's own intermediate values for the objective column. Trials with no point at
    all have no rows."""
    rows: list[dict[str, Any]] = []
    for t in sorted(result.trials, key=lambda t: t.number):
        series: dict[str, dict[int, float]] = {m: {} for m in metrics}
        if reader is not None and t.run_id:
            for m in metrics:
                series[m] = _history(reader, t.run_id, m)
        if result.metric in series and not series[result.metric] and t.intermediate:
            series[result.metric] = {int(k): float(v) for k, v in t.intermediate.items()}
        epochs = sorted(set().union(*series.values()))
        for epoch in epochs:
            row: dict[str, Any] = {"run_id": t.run_id, "number": t.number, "state": t.state, "epoch": epoch}
            row.update({m: series[m].get(epoch, math.nan) for m in metrics})
            rows.append(row)
    df = pd.DataFrame(rows, columns=[*CURVE_KEYS, *metrics])
    return df.astype({"number": "int64", "epoch": "int64", **{m: "float64" for m in metrics}})


@contextlib.contextmanager
def _no_progress_bar():
    """MLflow draws a progress bar on stderr for every download; one small JSON file needs none."""
    old = os.environ.get(PROGRESS_BAR_ENV)
    os.environ[PROGRESS_BAR_ENV] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PROGRESS_BAR_ENV, None)
        else:
            os.environ[PROGRESS_BAR_ENV] = old


def empty_lr_finder() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="float64") for c in LR_FINDER_COLUMNS})


def lr_finder_table(reader: TrackingReader | None, parent_run_id: str | None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The study's LR range test: (table of lr, loss, smoothed, suggestion per step; its summary:
    suggestion, rule, suggestions of every rule, narrowed range, steps). Empty and {} when the
    study did not run one (no ``lr_finder/lr_finder.json`` on the parent run)."""
    if reader is None or not parent_run_id:
        return empty_lr_finder(), {}
    try:
        listed = reader.list_artifacts(parent_run_id, layout.ART_LR_FINDER_DIR)
    except Exception as exc:
        if is_missing(exc):
            return empty_lr_finder(), {}
        raise
    if LR_FINDER_FILE not in listed:
        return empty_lr_finder(), {}
    with tempfile.TemporaryDirectory() as tmp, _no_progress_bar():
        data = json.loads(reader.download_artifact(parent_run_id, LR_FINDER_FILE, tmp).read_text())
    lrs, losses = list(data.get("lrs", [])), list(data.get("losses", []))
    smoothed = list(data.get("smoothed", [])) or [math.nan] * len(lrs)
    n = min(len(lrs), len(losses), len(smoothed))
    suggestion = data.get("suggestion")
    df = pd.DataFrame({"lr": lrs[:n], "loss": losses[:n], "smoothed": smoothed[:n],
                       "suggestion": [math.nan if suggestion is None else float(suggestion)] * n})
    info = {k: data.get(k) for k in ("suggestion", "rule", "suggestions", "narrowed", "steps", "stopped_early")}
    return df.astype("float64"), info
