"""Issue 24: the regression champion, loaded in a fresh process with only the README's lines,
predicts raw diabetes rows with the RMSE its trial reported (within 1%)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from core.tasks.diabetes import DiabetesTask
from tests.sweeps.serving_helpers import promoted_study, readme_predictions
from tests.sweeps.study_helpers import tiny_spec

TASK_ARGS = {"depth": 2, "width": 32, "val_fraction": 0.2}
# The study the README's regression snippet loads (models:/diabetes_lr_wd@champion): one trial.
DIABETES_CHAMPION = tiny_spec(
    "diabetes_lr_wd", description="issue 24: the README's regression champion, loaded with natural rows",
    task={"name": "diabetes", "model": "mlp", "args": TASK_ARGS},
    train={"epochs": 12, "batch_size": 32, "optimizer": "adamw", "scheduler": "cosine", "export_onnx": True},
    search={"lr": {"type": "float", "low": 0.005, "high": 0.01, "log": True}},
    objective={"metric": "val_rmse", "direction": "minimize"},
    budget={"n_trials": 1, "max_failures": 1})


@pytest.mark.slow
def test_the_readme_lines_load_the_regression_champion_with_its_trials_rmse(tmp_path):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "repo"
    promoted_study(root, DIABETES_CHAMPION)
    task = DiabetesTask(model="mlp", **TASK_ARGS)
    rows = task.natural_examples(10_000).numpy().astype(np.float64)  # every validation row, as load_diabetes gives
    target = task.datasets()[1].tensors[1].numpy()
    assert len(rows) == len(target) == 88

    predictions, stdout = readme_predictions("load-regression-champion", root, rows, tmp_path / "scratch")
    assert predictions.shape == (len(target),)
    rmse = math.sqrt(float(np.mean((predictions.astype(np.float64) - target) ** 2)))

    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    version = client.get_model_version_by_alias("diabetes_lr_wd", "champion")
    reported = float(version.tags["sweeps.metric_value"])  # the trial's best val_rmse, the promoted weights'
    assert version.tags["sweeps.metric"] == "val_rmse" and version.tags["sweeps.metric_direction"] == "minimize"
    assert rmse == pytest.approx(reported, rel=0.01), (rmse, reported)
    assert rmse < 70  # better than predicting the mean (the target's std is about 77)
    printed = stdout.strip().splitlines()[-1]
    assert printed.startswith("[") and len(printed.strip("[]").split()) == 3  # the README's three predictions
