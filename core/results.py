"""What ``core.train`` returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

# Every optimizer step's report. The per-epoch metrics depend on the task: core/metrics.py.
STEP_METRICS = ("train_loss", "lr", "grad_norm")

Status = Literal["completed", "pruned", "diverged", "interrupted"]


class Stop(NamedTuple):
    """Why a run ends before its last epoch: the result's status and reason."""

    status: Status
    reason: str


@dataclass
class OnnxReport:
    """Result of exporting to ONNX and checking onnxruntime against PyTorch."""

    path: Path
    max_abs_diff: float
    tolerance: float
    passed: bool
    n_inputs_checked: int
    torch_latency_ms: float
    ort_latency_ms: float
    opset: int
    exporter: str = ""  # "torchscript" or "dynamo" (core.onnx_export)

    def to_dict(self) -> dict:
        d = self.__dict__.copy()
        d["path"] = str(self.path)
        return d


@dataclass
class TrainResult:
    status: Status
    reason: str  # why the run ended ("" when completed)
    epochs_completed: int
    steps_completed: int
    metrics: dict[str, float]  # last epoch's metrics
    best_metric: float | None  # best value of cfg.monitor
    best_epoch: int | None
    history: list[dict[str, float]] = field(default_factory=list)  # one dict per epoch
    checkpoint_last: Path | None = None
    checkpoint_best: Path | None = None
    onnx: OnnxReport | None = None
    torchscript: dict | None = None  # train.export_torchscript: core.torchscript_export.TorchScriptReport.to_dict()
    confusion_matrix: list[list[int]] | None = None  # classification tasks (num_classes > 0)
    per_class_acc: list[float] | None = None
    global_batch_size: int = 0
    skipped_steps: int = 0
    diverged: dict | None = None  # status "diverged": what core/forensics.py recorded (diverged.json)
