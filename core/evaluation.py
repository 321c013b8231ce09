"""Post-training evaluation: the confusion matrix and per-class accuracy on a loader.

``save_json_atomic`` is re-exported from :mod:`core.io_utils` so callers that write an
evaluation result can import both from here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from core.io_utils import save_json_atomic

__all__ = ["confusion_matrix", "save_json_atomic"]


def confusion_matrix(model: nn.Module, loader: Iterable, num_classes: int, device: torch.device | str,
                     postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[list[list[int]], list[float]]:
    """Count predictions of ``model`` over every batch of ``loader``: for each target element (a
    sample's label, or a pixel's class in a dense-prediction task) the class ``postprocess``
    (default: argmax over dim 1) predicts for it.

    Returns ``(matrix, per_class_acc)`` where ``matrix[t][p]`` is the number of samples of
    true class ``t`` predicted as ``p`` (rows sum to the class counts, the whole matrix to
    the number of samples), and ``per_class_acc[t] = matrix[t][t] / sum(matrix[t])`` --
    the recall of class ``t``; NaN for a class with no samples in ``loader`` (its accuracy
    is undefined, and 0.0 would read as "always wrong").

    The model runs in eval mode under ``torch.inference_mode``; its previous train/eval
    mode is restored afterwards, so this can be called between training epochs.
    The loader must yield ``(inputs, labels)`` batches; ``postprocess(model output)`` must have
    the labels' shape.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    device = torch.device(device)
    # Counts accumulate on the device as one flat histogram, so there is a single
    # device->host copy at the end instead of one sync per batch.
    counts = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for inputs, labels in loader:
                inputs = inputs.to(device, non_blocking=True)
                labels = torch.as_tensor(labels).to(device, non_blocking=True).long()
                output = model(inputs)
                preds = postprocess(output) if postprocess is not None else output.argmax(dim=1)
                if preds.shape != labels.shape:
                    raise ValueError(
                        f"confusion_matrix: the predictions have shape {tuple(preds.shape)} (model output "
                        f"{tuple(output.shape)}), the labels {tuple(labels.shape)}; expected the same"
                    )
                preds, labels = preds.long().reshape(-1), labels.reshape(-1)
                # An out-of-range label would silently land in another cell of the flat
                # histogram, so check it (one small sync per batch is cheap next to a forward).
                if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
                    raise ValueError(
                        f"confusion_matrix: labels must be in [0, {num_classes}), "
                        f"got a batch with min {int(labels.min())} and max {int(labels.max())}"
                    )
                counts += torch.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
    finally:
        model.train(was_training)
    matrix = counts.view(num_classes, num_classes).cpu().tolist()
    per_class_acc = [
        row[i] / total if (total := sum(row)) else float("nan") for i, row in enumerate(matrix)
    ]
    return matrix, per_class_acc
