"""The built-in tasks that are not classification, end to end: a small study of each through
`sweeps run` (pruning on), then `sweeps report`, `sweeps promote` (the ONNX model re-verified,
the registered model loaded back) and `sweeps rerun` of the promoted trial (the same objective,
bitwise). diabetes is a regression minimising `val_rmse`; shapes a segmentation maximising
`val_iou`."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sweeps import cli
from tests.sweeps.study_helpers import save_spec, tiny_spec

pytestmark = pytest.mark.slow

DIABETES = {
    "task": {"name": "diabetes", "model": "mlp", "args": {"width": 16}},
    "train": {"epochs": 4, "batch_size": 32, "optimizer": "adamw", "scheduler": "constant", "export_onnx": True},
    "search": {"lr": {"type": "float", "low": 1.0e-4, "high": 3.0e-2, "log": True}},
    "objective": {"metric": "val_rmse", "direction": "minimize"},
    "pruner": {"name": "asha", "min_resource": 1, "reduction_factor": 3},
    "budget": {"n_trials": 6, "max_failures": 1},
}
SHAPES = {
    "task": {"name": "shapes", "model": "unet", "args": {"width": 8, "size": 24, "n_train": 128, "n_val": 16}},
    "train": {"epochs": 3, "batch_size": 8, "optimizer": "adamw", "scheduler": "constant", "export_onnx": True},
    "search": {"lr": {"type": "float", "low": 3.0e-3, "high": 2.0e-2, "log": True}},
    "objective": {"metric": "val_iou", "direction": "maximize"},
    "pruner": {"name": "asha", "min_resource": 1, "reduction_factor": 3},
    "budget": {"n_trials": 3, "max_failures": 1},
}


def _in(folder: Path, argv: list[str]) -> int:
    before = os.getcwd()
    os.chdir(folder)  # the spec's runs/ paths are relative to the working directory
    try:
        return cli.main(argv)
    finally:
        os.chdir(before)


def _trial_runs(client, name: str) -> dict[int, object]:
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], "tags.`sweeps.role` = 'trial'", max_results=100)
    return {int(r.data.tags["sweeps.trial_number"]): r for r in runs}


def _curve(client, run_id: str, metric: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, metric)}


def _sweep(tmp_path: Path, name: str, changes: dict, capsys) -> tuple[Path, object, dict[int, object]]:
    """Run the study, then check what every study gets: its report and a promoted best trial."""
    from mlflow.tracking import MlflowClient

    spec = save_spec(tmp_path, tiny_spec(name, **changes))
    assert _in(tmp_path, ["run", str(spec), "--quiet"]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = _trial_runs(client, name)
    assert len(runs) == changes["budget"]["n_trials"]
    metric = changes["objective"]["metric"]
    for run in runs.values():  # every trial reports the task's metrics, per epoch, in MLflow
        assert metric in run.data.metrics and "val_loss" in run.data.metrics

    assert _in(tmp_path, ["report", str(spec), "--no-log"]) == 0
    page = (tmp_path / "runs" / name / "report.html").read_text()
    assert metric in page and changes["objective"]["direction"] in page

    capsys.readouterr()
    assert _in(tmp_path, ["promote", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "ONNX re-verified" in out and f"{name}@champion -> version 1" in out
    mv = client.get_model_version_by_alias(name, "champion")
    assert float(mv.tags["sweeps.onnx_max_abs_diff"]) <= float(mv.tags["sweeps.onnx_tolerance"])
    complete = {n: r for n, r in runs.items() if r.data.tags.get("sweeps.state") == "COMPLETE"}
    sign = 1.0 if changes["objective"]["direction"] == "minimize" else -1.0
    best = min(complete, key=lambda n: (sign * complete[n].data.metrics["objective"], n))  # a tie: the first
    assert mv.run_id == runs[best].info.run_id and mv.tags["sweeps.metric"] == metric

    # The rerun of the promoted trial trains it again to the same objective, bit for bit.
    # With the original's thread count: CPU kernels split their sums by thread (sweeps rerun --threads).
    threads = re.match(r"cpu \((\d+) threads?\)", runs[best].data.tags["sweeps.device"]).group(1)
    assert _in(tmp_path, ["rerun", str(spec), "--trial", str(best), "--threads", threads]) == 0
    assert "identical" in capsys.readouterr().out
    [rerun] = client.search_runs([runs[best].info.experiment_id],
                                 f"tags.`rerun_of` = '{runs[best].info.run_id}' and tags.`sweeps.role` = 'rerun'")
    assert rerun.data.tags["sweeps.rerun.verdict"] == "identical"
    assert rerun.data.metrics["objective"] == runs[best].data.metrics["objective"]
    assert _curve(client, rerun.info.run_id, metric) == _curve(client, runs[best].info.run_id, metric)
    return spec, client, runs


def _load_champion(uri: str, name: str):
    """The registered model, loaded through pyfunc: natural input in, the task's predictions out."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        return mlflow.pyfunc.load_model(f"models:/{name}@champion")
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI")
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


def _champion_and_checkpoint(tmp_path: Path, name: str, client, task, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The champion's predictions from ``n`` natural examples, and what the champion trial's own
    best checkpoint predicts from them through the task's preprocess and postprocess."""
    mv = client.get_model_version_by_alias(name, "champion")
    number = int(mv.tags["sweeps.trial_number"])
    model = task.build_model()
    best = tmp_path / "runs" / name / f"trial-{number:04d}" / "best.pt"
    model.load_state_dict(torch.load(best, weights_only=True)["model"])
    natural = task.natural_examples(n)
    with torch.inference_mode():
        expected = task.postprocess(model.eval()(task.preprocess(natural))).numpy()
    return np.asarray(_load_champion(client.tracking_uri, name).predict(natural.numpy())), expected


def test_diabetes_regression_study_end_to_end_with_pruning_that_minimises(tmp_path, capsys):
    spec, client, runs = _sweep(tmp_path, "diabetes_e2e", DIABETES, capsys)
    states = {n: r.data.tags.get("sweeps.state") for n, r in runs.items()}
    assert "PRUNED" in states.values() and "COMPLETE" in states.values(), states
    first = {n: _curve(client, r.info.run_id, "val_rmse")[1] for n, r in runs.items()}
    assert all(25.0 < v < 400.0 for v in first.values())  # in the target's units, not standardised
    # ASHA lets a trial that is the best so far at its rung go on: with minimize, the trial with the
    # lowest val_rmse after epoch 1 must have trained past it (with maximize it would be pruned there).
    lowest = min(first, key=lambda n: first[n])
    assert len(_curve(client, runs[lowest].info.run_id, "val_rmse")) > 1, (first, states)
    for n, run in runs.items():
        if states[n] == "PRUNED":
            assert run.data.tags["sweeps.pruned"] == "true" and run.info.status == "FINISHED"
            epochs = len(_curve(client, run.info.run_id, "val_rmse"))
            assert epochs < DIABETES["train"]["epochs"]

    # The champion predicts, from natural rows, what the trial's own best checkpoint predicts.
    from core.tasks.diabetes import DiabetesTask

    task = DiabetesTask(model="mlp", width=16)
    predicted, expected = _champion_and_checkpoint(tmp_path, "diabetes_e2e", client, task, 16)
    assert predicted.shape == (16,) and np.allclose(predicted, expected, atol=1e-3), (predicted, expected)


def test_shapes_segmentation_study_end_to_end(tmp_path, capsys):
    spec, client, runs = _sweep(tmp_path, "shapes_e2e", SHAPES, capsys)
    for run in runs.values():
        value = run.data.metrics["val_iou"]
        assert 0.0 <= value <= 1.0 and not math.isnan(value)

    from core.tasks.shapes import ShapesTask

    task = ShapesTask(model="unet", width=8, size=24, n_train=128, n_val=16)
    predicted, expected = _champion_and_checkpoint(tmp_path, "shapes_e2e", client, task, 4)
    assert predicted.shape == (4, 24, 24) and np.array_equal(predicted, expected)
