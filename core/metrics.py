"""The metrics a run reports after every epoch, and their directions.

Two kinds: the loop's own (the losses, the learning rate, speed and memory: every task has them)
and the task's validation metrics (``Task.metrics()``: torchmetrics metrics or any other
``EpochMetric``, reported as ``val_<name>``). ``reported_metrics`` names them all with their
direction, so the spec layer and ``train()`` refuse a monitored metric or objective the task
does not report, or a direction that contradicts the metric's, before anything is trained.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.tasks.accuracy import EpochMetric
from core.tasks.base import Task, TaskError

if TYPE_CHECKING:  # torch is imported where a run needs it: the spec layer reads names and directions
    import torch

# The loop's per-epoch metrics, each with whether higher is better (None: no direction, e.g. lr).
LOOP_METRICS: dict[str, bool | None] = {
    "train_loss": False, "val_loss": False, "lr": None, "grad_norm": False, "samples_per_s": True,
    "epoch_time_s": False, "peak_mem_mb": False, "skipped_steps": False,
}


def task_metrics(task: Task) -> dict[str, EpochMetric]:
    """The task's fresh validation metrics, keyed by their reported name ``val_<name>``."""
    lacking = classes_lacking(task)
    if lacking:
        raise TaskError(lacking)
    made = task.metrics()
    if not isinstance(made, dict) or not made:
        raise TaskError(f"task {task.name!r}: metrics() must return a non-empty dict of name -> torchmetrics "
                        f"Metric, got {type(made).__name__}")
    out = {}
    for name, metric in made.items():
        if getattr(metric, "higher_is_better", None) is None or not hasattr(metric, "update"):
            raise TaskError(f"task {task.name!r}: metrics()[{name!r}] is {type(metric).__name__}, not a torchmetrics "
                            "Metric with a direction (higher_is_better True or False); wrap it or set the attribute")
        out[f"val_{name}"] = metric
    clash = sorted(set(out) & set(LOOP_METRICS))
    if clash:
        raise TaskError(f"task {task.name!r}: metrics() name {clash[0][4:]!r} reports {clash[0]!r}, which the loop "
                        "reports itself; rename it")
    return out


def classes_lacking(task: Task) -> str | None:
    """Why a task that keeps the default metrics (accuracy over ``num_classes`` classes) cannot be
    measured, or None: torchmetrics' own error (``num_classes ... got 0``) names no task nor fix."""
    if type(task).metrics is not Task.metrics or (isinstance(task.num_classes, int) and task.num_classes >= 2):
        return None
    name = task.name if task.name != Task.name else type(task).__name__
    return (f"task {name!r} keeps the default metrics() (accuracy over num_classes classes) but its "
            f"num_classes is {task.num_classes!r}: set num_classes on the task to its number of classes (e.g. "
            f"num_classes = 3), or override metrics() and metric_directions for a task that is not classification")


def reported_metrics(task: Task) -> dict[str, bool | None]:
    """Every per-epoch metric a run of ``task`` reports, with whether higher is better."""
    built = {k: bool(m.higher_is_better) for k, m in task_metrics(task).items()}
    declared = declared_metrics(task)
    if declared is not None and declared != built:
        raise TaskError(f"task {task.name!r}: metric_directions says {_directions(declared)} but metrics() gives "
                        f"{_directions(built)}; make them agree")
    return {**LOOP_METRICS, **built}


def declared_metrics(task: Task) -> dict[str, bool] | None:
    """The task's metrics and directions as declared, without importing torch (spec validation):
    ``metric_directions``, or accuracy for a task that keeps the default ``metrics()``; None when
    only a run can tell."""
    if task.metric_directions is not None:
        return {name: direction == "maximize" for name, direction in task.metric_directions.items()}
    return {"val_acc": True} if type(task).metrics is Task.metrics else None


def _directions(metrics: dict[str, bool]) -> str:
    return ", ".join(f"{k}: {'maximize' if v else 'minimize'}" for k, v in sorted(metrics.items()))


def metric_problem(task: Task, metric: str, higher_is_better: bool | None, field: str) -> str | None:
    """Why ``metric`` (set in ``field``) cannot be monitored or optimised for ``task`` in the given
    direction (None: not given), or None when it can. The message names the task, field and fix."""
    reported = reported_metrics(task)
    if metric not in reported:
        return (f"{field}: task {task.name!r} does not report {metric!r}; it reports "
                f"{', '.join(reported)}")
    own = reported[metric]
    if higher_is_better is not None and own is not None and own != higher_is_better:
        want, have = ("maximize", "minimize") if own else ("minimize", "maximize")
        return (f"{field}: {metric!r} of task {task.name!r} is better when "
                f"{'higher' if own else 'lower'}, but the direction given is {have}; use {want}")
    return None


class ValidationMeter:
    """One epoch's validation: the summed loss and sample count, and the task's metrics updated
    with ``(task.postprocess(output), target)`` on every batch. Create once per run; ``reset``
    before each epoch, ``update`` per batch, ``compute`` at the end (summed over DDP ranks)."""

    def __init__(self, task: Task, device: torch.device) -> None:
        self.task = task
        self.metrics = {name: m.to(device) for name, m in task_metrics(task).items()}
        self.loss_sum, self.seen = 0.0, 0

    def reset(self) -> None:
        for m in self.metrics.values():
            m.reset()
        self.loss_sum, self.seen = 0.0, 0

    def update(self, output: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        n = int(target.shape[0])
        # Sum, not mean, so batches of different sizes weigh by their sample count.
        self.loss_sum += float(loss) * n
        self.seen += n
        prediction = self.task.postprocess(output.float())
        for m in self.metrics.values():
            m.update(prediction, target)

    def compute(self, all_reduce_sum) -> dict[str, float]:
        """``val_loss`` and ``val_<name>``; ``all_reduce_sum`` sums the loss over ranks (each metric
        synchronises its own states when torch.distributed is initialised)."""
        loss_sum, seen = all_reduce_sum([self.loss_sum, float(self.seen)])
        out = {"val_loss": loss_sum / max(seen, 1)}
        for name, m in self.metrics.items():
            out[name] = float(m.compute()) if seen else float("nan")
        return out


def check_loss_value(task: Task, loss: torch.Tensor) -> None:
    """The first batch's loss must be a scalar tensor: a per-sample loss would be silently summed
    or broadcast by the backward pass and the reported curves."""
    if getattr(loss, "ndim", None) != 0:
        shape = tuple(loss.shape) if hasattr(loss, "shape") else type(loss).__name__
        raise TaskError(f"task {task.name!r}: make_loss()'s loss returned {shape}, not a scalar tensor; reduce it "
                        "over the batch (e.g. .mean(), or reduction='mean')")
