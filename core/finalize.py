"""End of a completed run: evaluate the best weights and export them to ONNX and TorchScript.

Kept apart from the loop so ``train.py`` stays readable; runs on rank 0 only.
"""
from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from core import checkpoint as ckpt
from core.config import TrainConfig
from core.data import KeyedBatches
from core.evaluation import confusion_matrix
from core.in_memory import InMemoryBatches
from core.io_utils import save_json_atomic
from core.onnx_export import OnnxParityError, export_and_verify, write_report_json
from core.reporting import Reporter
from core.results import TrainResult
from core.tasks.base import Task
from core.torchscript_export import TorchScriptError, TorchScriptReport, export_torchscript

ONNX_SAMPLES = 256  # validation inputs compared between PyTorch and onnxruntime (and TorchScript)
TORCHSCRIPT_FILE = "model.ts"


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
    loader = batches_in_order(val_ds, batch, task, device)
    if task.num_classes > 0:  # classes to count (classification, segmentation); not for regression
        matrix, per_class = confusion_matrix(model, loader, task.num_classes, device, task.postprocess)
        result.confusion_matrix, result.per_class_acc = matrix, per_class
        cm_path = out / "confusion_matrix.json"
        save_json_atomic({"matrix": matrix, "per_class_acc": per_class}, cm_path)
        reporter.log_artifact(cm_path, "confusion_matrix")

    if not (cfg.export_onnx or cfg.export_torchscript):
        return
    # The first validation inputs, as the loader batches them (a stream has no indexing).
    sample = torch.cat([x for x, _ in itertools.islice(loader, math.ceil(ONNX_SAMPLES / batch))])[:ONNX_SAMPLES]
    if cfg.export_onnx:
        _export_onnx(model, sample, cfg, out, reporter, result)
    if cfg.export_torchscript:
        _export_torchscript(model, sample, cfg, out, reporter, result)


def batches_in_order(ds: Dataset, batch: int, task: Task, device: torch.device) -> DataLoader | InMemoryBatches:
    """``ds``'s batches in order; an in-memory tensor dataset is gathered as training gathers it
    (one index_select a batch, not a __getitem__ a sample)."""
    if not isinstance(ds, IterableDataset):  # a stream has no length to key batches by
        keys = KeyedBatches(range(len(ds)), batch)  # type: ignore[arg-type]
        gathered = InMemoryBatches.of(ds, task.collate_fn, device, keys)
        if gathered is not None:
            return gathered
    return DataLoader(ds, batch_size=batch, shuffle=False, collate_fn=task.collate_fn)


def _export_onnx(model: nn.Module, sample: torch.Tensor, cfg: TrainConfig, out: Path, reporter: Reporter,
                 result: TrainResult) -> None:
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


def _export_torchscript(model: nn.Module, sample: torch.Tensor, cfg: TrainConfig, out: Path, reporter: Reporter,
                        result: TrainResult) -> None:
    """``model.ts`` checked against eager (core/torchscript_export.py). A model that cannot be compiled
    or fails the check keeps its metrics; the report and the run's reason say why."""
    mode = cfg.export_torchscript
    assert mode is not None  # the caller checks it
    try:
        report = export_torchscript(model, sample, out / TORCHSCRIPT_FILE, mode, tolerance=cfg.onnx_tolerance)
    except TorchScriptError as exc:
        report = TorchScriptReport(str(out / TORCHSCRIPT_FILE), mode, math.inf, cfg.onnx_tolerance, False, 0,
                                   error=str(exc))
    if report.error:
        result.reason = "; ".join(r for r in (result.reason, report.error) if r)
    result.torchscript = report.to_dict()
    report_path = save_json_atomic(report.to_dict(), out / "torchscript_parity.json")
    if report.passed:
        reporter.log_artifact(out / TORCHSCRIPT_FILE, "torchscript")
    reporter.log_artifact(report_path, "torchscript_report")
