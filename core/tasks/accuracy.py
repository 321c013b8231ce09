"""The default validation metric, accuracy, counted without torchmetrics; and what a task's
validation metric is (:class:`EpochMetric`: a torchmetrics ``Metric`` is one).

Importing torchmetrics loads its whole package (the image metrics reach torchvision.models, the
audio ones SciPy's signal module): seconds in every worker, for a count of correct predictions.
Tasks that need more (a Jaccard index, a regression error) use torchmetrics, which is loaded only
in their trials.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported where a run needs it: the spec layer reads names and directions
    import torch


class EpochMetric(Protocol):
    """A validation metric: updated with ``(postprocess(output), target)`` on every validation
    batch, computed at the epoch's end (over every DDP rank), reset before the next epoch;
    ``higher_is_better`` is its direction."""

    higher_is_better: bool | None

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None: ...

    def compute(self) -> Any: ...

    def reset(self) -> None: ...

    def to(self, device: torch.device) -> Any: ...


class Accuracy:
    """The share of predictions equal to their target, over every element of every batch (what
    torchmetrics' ``MulticlassAccuracy(average="micro")`` gives). ``preds`` are class scores with
    the classes in dimension 1 (probabilities or logits: the highest counts) or class indices
    shaped like ``target``. Under DDP the counts are summed over the ranks when computed."""

    higher_is_better: bool | None = True

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._correct: torch.Tensor | int = 0  # a tensor on the batches' device: no sync per batch
        self._total = 0

    def to(self, device: torch.device) -> Accuracy:
        self._device = device
        return self

    def reset(self) -> None:
        self._correct, self._total = 0, 0

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        predicted = preds.argmax(dim=1) if preds.ndim == target.ndim + 1 else preds
        if predicted.shape != target.shape:
            raise ValueError(f"accuracy: predictions of shape {tuple(preds.shape)} do not fit targets of shape "
                             f"{tuple(target.shape)}; give class scores (N, C, ...) or class indices (N, ...)")
        self._correct = (predicted == target).sum() + self._correct
        self._total += target.numel()

    def compute(self) -> torch.Tensor:
        import torch  # lazy, as at the top: naming and checking a task loads no torch
        import torch.distributed as dist

        counts = torch.stack([torch.as_tensor(self._correct, dtype=torch.float64, device=self._device),
                              torch.tensor(float(self._total), dtype=torch.float64, device=self._device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        return counts[0] / counts[1].clamp(min=1)
