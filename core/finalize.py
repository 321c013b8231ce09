"""End of a completed run: evaluate the best weights and export them to ONNX.

Kept apart from the loop so ``train.py`` stays readable; runs on rank 0 only.
"""
from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from core import checkpoint as ckpt
from core.config import TrainConfig
from core.evaluation import confusion_matrix
from core.io_utils import save_json_atomic
from core.onnx_export import OnnxParityError, export_and_verify, write_report_json
from core.reporting import Reporter
from core.results import TrainResult
from core.tasks.base import Task

ONNX_SAMPLES = 256  # validation inputs compared between PyTorch and onnxruntime


def best_model(model: nn.Module, out: Path) -> nn.Module:
    """A copy of ``model`` holding the best checkpoint's weights (the model a trial is judged by)."""
    best = copy.deepcopy(ckpt.unwrap_model(model))
    if (out / ckpt.BEST).exists():
        best.load_state_dict(ckpt.strip_prefixes(ckpt.load_checkpoint(out / ckpt.BEST)["model"]))
    return best


def finalize_run(task: Task, cfg: TrainConfig, model: nn.Module, val_ds: Dataset, device: torch.device,
                 out: Path, reporter: Reporter, result: TrainResult) -> None:
    model = best_model(model, out)
    if result.checkpoint_best is not None:
        reporter.log_artifact(result.checkpoint_best, "checkpoint_best")

    batch = max(cfg.batch_size, 64)
    loader = DataLoader(val_ds, batch_size=batch, shuffle=False, collate_fn=task.collate_fn)
    if task.num_classes > 0:  # classes to count (classification, segmentation); not for regression
        matrix, per_class = confusion_matrix(model, loader, task.num_classes, device, task.postprocess)
        result.confusion_matrix, result.per_class_acc = matrix, per_class
        cm_path = out / "confusion_matrix.json"
        save_json_atomic({"matrix": matrix, "per_class_acc": per_class}, cm_path)
        reporter.log_artifact(cm_path, "confusion_matrix")

    if not cfg.export_onnx:
        return
    # The first validation inputs, as the loader batches them (a stream has no indexing).
    sample = torch.cat([x for x, _ in itertools.islice(loader, math.ceil(ONNX_SAMPLES / batch))])[:ONNX_SAMPLES]
    report_path = out / "onnx_parity.json"
    try:
        report = export_and_verify(model, sample, out / "model.onnx", tolerance=cfg.onnx_tolerance)
    except OnnxParityError as exc:
        # The trial keeps its metrics, but its model is marked unusable: promote skips it.
        report = exc.report
        result.reason = str(exc)
    result.onnx = report
    write_report_json(report, report_path)
    if report.passed:
        reporter.log_artifact(out / "model.onnx", "onnx")
    reporter.log_artifact(report_path, "onnx_report")
