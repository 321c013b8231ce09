"""The one way ``core.train`` talks to the outside world.

The caller (a sweep trial, a rerun, a benchmark, a test) passes a Reporter into
``train()``. core never imports mlflow, optuna or ray: a sweep backend implements a
Reporter that forwards metrics to its tracker and answers pruning decisions.
Under DDP only rank 0 holds the real reporter; its decisions are broadcast.
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Protocol, runtime_checkable

EpochReport = tuple[int, int, dict[str, float]]  # report_epoch's arguments: (epoch, step, metrics)
StepReport = tuple[int, dict[str, float]]  # report_step's arguments: (step, metrics)


class Decision(enum.Enum):
    """What the reporter wants the loop to do next."""

    CONTINUE = "continue"
    PRUNE = "prune"  # the study's pruner gave up on this trial: stop, status "pruned"
    INTERRUPT = "interrupt"  # SIGTERM/Ctrl-C or a deadline: save a checkpoint, stop, status "interrupted"


@runtime_checkable
class Reporter(Protocol):
    """Receives metrics and artifacts from ``core.train`` and can stop it."""

    def report_step(self, step: int, metrics: dict[str, float]) -> Decision:
        """Called after every optimizer step with ``train_loss``, ``lr``, ``grad_norm``
        (``step`` counts optimizer steps from 1, across epochs). Must be cheap: buffer,
        don't send. Returning INTERRUPT stops the run at this step."""
        ...

    def report_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> Decision:
        """Called after every epoch's validation (``epoch`` counts from 1) with the epoch
        metrics (train/val loss and accuracy, lr, samples/s, epoch time, peak memory).
        The answer decides pruning: PRUNE ends the run as "pruned"."""
        ...

    def resumed(self, epochs: list[EpochReport], steps: list[StepReport]) -> None:
        """Called once, before any new step, when ``train`` resumes from a checkpoint, with what
        that checkpoint recorded: every epoch as ``(epoch, step, metrics)`` and every optimizer
        step as ``(step, metrics)``, the arguments ``report_epoch`` and ``report_step`` got for
        them (possibly in a process that died before they were stored). A reporter writing to a
        fresh run logs them first, so the run ends with the whole curves; the run is resumed
        even from the final epoch's checkpoint, when no epoch is left to report."""
        ...

    def log_artifact(self, path: Path, kind: str) -> None:
        """Called when a file worth keeping is final: ``kind`` is one of "config",
        "checkpoint_best", "checkpoint_last", "onnx", "onnx_report", "confusion_matrix",
        "lr_finder", "diverged" (core/forensics.py), "torchscript", "torchscript_report",
        "profile" (core/profiling.py).
        The file stays where it is; the reporter may copy it."""
        ...


class NullReporter:
    """Keeps nothing and never stops the run: for plain ``train()`` calls and tests."""

    def report_step(self, step: int, metrics: dict[str, float]) -> Decision:
        return Decision.CONTINUE

    def report_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> Decision:
        return Decision.CONTINUE

    def resumed(self, epochs: list[EpochReport], steps: list[StepReport]) -> None:
        return None

    def log_artifact(self, path: Path, kind: str) -> None:
        return None


class RecordingReporter(NullReporter):
    """Keeps every step and epoch in memory; ``prune_after_epoch`` simulates a pruner."""

    def __init__(self, prune_after_epoch: int | None = None) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.epochs: list[tuple[int, dict[str, float]]] = []
        self.artifacts: list[tuple[Path, str]] = []
        # What a resumed run was handed (Reporter.resumed), in the shapes of steps and epochs
        # above: resumed_steps + steps is the run's whole step curve.
        self.resumed_steps: list[tuple[int, dict[str, float]]] = []
        self.resumed_epochs: list[tuple[int, dict[str, float]]] = []
        self.resumed_calls = 0
        self.prune_after_epoch = prune_after_epoch

    def report_step(self, step: int, metrics: dict[str, float]) -> Decision:
        self.steps.append((step, dict(metrics)))
        return Decision.CONTINUE

    def report_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> Decision:
        self.epochs.append((epoch, dict(metrics)))
        if self.prune_after_epoch is not None and epoch >= self.prune_after_epoch:
            return Decision.PRUNE
        return Decision.CONTINUE

    def resumed(self, epochs: list[EpochReport], steps: list[StepReport]) -> None:
        self.resumed_calls += 1
        self.resumed_epochs.extend((epoch, dict(metrics)) for epoch, _, metrics in epochs)
        self.resumed_steps.extend((step, dict(metrics)) for step, metrics in steps)

    def log_artifact(self, path: Path, kind: str) -> None:
        self.artifacts.append((Path(path), kind))
