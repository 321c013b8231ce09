"""The task contract of core.train: the task's loss and metrics drive the run, and a task that
breaks the contract is refused before any step with a message naming the task and the field."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from core.metrics import metric_problem, reported_metrics
from core.reporting import RecordingReporter
from core.tasks.base import Task, TaskError
from core.tasks.digits import DigitsTask
from core.train import train
from tests.core.helpers import fast_config


class LineTask(Task):
    """y = 3x - 1 from noisy points: a regression the loop must serve without classification."""

    name = "line"
    input_shape = (1,)
    metric_directions = {"val_rmse": "minimize", "val_mae": "minimize"}

    def __init__(self, loss_shape: str = "scalar") -> None:
        self.loss_shape = loss_shape

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.rand(256, 1, generator=g) * 2 - 1
        y = 3 * x - 1 + 0.01 * torch.randn(256, 1, generator=g)
        return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])

    def make_loss(self, cfg):
        if self.loss_shape == "per-sample":
            return lambda out, target: (out - target).pow(2).squeeze(1)
        return nn.MSELoss()

    def metrics(self):
        # Imported where used: torchmetrics loads its whole package (seconds), which every test
        # process would otherwise pay while collecting.
        from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError

        return {"rmse": MeanSquaredError(squared=False), "mae": MeanAbsoluteError()}

    def postprocess(self, output):
        return output


def test_a_regression_task_trains_on_its_own_loss_and_reports_its_own_metrics():
    rec = RecordingReporter()
    result = train(LineTask(), fast_config(epochs=15, lr=0.3, monitor="val_rmse", monitor_mode="min"), reporter=rec)
    first, last = result.history[0], result.history[-1]
    assert {"val_rmse", "val_mae", "val_loss", "train_loss"} <= set(last) and "val_acc" not in last
    assert last["val_rmse"] < 0.1 < first["train_loss"]
    # val_rmse is the square root of the mean squared error, val_loss (MSE) the loss itself
    assert last["val_rmse"] == pytest.approx(last["val_loss"] ** 0.5, rel=1e-4)
    assert result.best_metric == min(h["val_rmse"] for h in result.history)
    assert result.confusion_matrix is None  # no classes to count


def test_a_loss_that_is_not_a_scalar_is_refused_before_any_step():
    rec = RecordingReporter()
    with pytest.raises(TaskError, match=r"task 'line': make_loss\(\)'s loss returned \(32,\), not a scalar"):
        train(LineTask("per-sample"), fast_config(monitor="val_rmse", monitor_mode="min"), reporter=rec)
    assert rec.steps == []


def test_a_monitored_metric_the_task_does_not_report_is_refused_naming_the_task_and_field():
    with pytest.raises(TaskError, match=r"train.monitor.*task 'line' does not report 'val_acc'.*val_rmse"):
        train(LineTask(), fast_config(monitor="val_acc", monitor_mode="max"))


def test_a_direction_that_contradicts_the_metric_is_refused():
    with pytest.raises(TaskError, match=r"'val_rmse' of task 'line' is better when lower, but the direction given "
                                        r"is maximize; use minimize"):
        train(LineTask(), fast_config(monitor="val_rmse", monitor_mode="max"))


def test_classification_keeps_accuracy_and_the_directions_come_from_the_metrics():
    directions = reported_metrics(DigitsTask(model="mlp"))
    assert directions["val_acc"] is True and directions["val_loss"] is False and directions["lr"] is None
    assert reported_metrics(LineTask())["val_rmse"] is False
    assert metric_problem(LineTask(), "val_mae", False, "objective.metric") is None


def test_metrics_without_a_direction_are_refused():
    from torchmetrics.regression import MeanSquaredError

    class Undirected(MeanSquaredError):
        higher_is_better = None  # a user's metric that never said which way is better

    class NoDirection(LineTask):
        def metrics(self):
            return {"mse": Undirected()}

    with pytest.raises(TaskError, match=r"task 'line': metrics\(\)\['mse'\] is Undirected, not a torchmetrics "
                                        r"Metric with a direction"):
        reported_metrics(NoDirection())


def test_declared_directions_that_disagree_with_the_metrics_are_refused():
    class Misdeclared(LineTask):
        metric_directions = {"val_rmse": "maximize", "val_mae": "minimize"}

    with pytest.raises(TaskError, match=r"task 'line': metric_directions says val_mae: minimize, val_rmse: maximize "
                                        r"but metrics\(\) gives val_mae: minimize, val_rmse: minimize"):
        train(Misdeclared(), fast_config(monitor="val_rmse", monitor_mode="min"))
