"""Batches gathered from tensors already in memory, without a DataLoader.

A dataset that is only tensors (a built-in task's ``TensorPairDataset``, or torch's
``TensorDataset``) needs no loader: a DataLoader over it indexes each sample in Python, stacks
the samples again (collate) and, on a GPU, copies every batch from the host. Here the tensors
are placed on the training device once and each batch is one gather by the batch's indices. The
indices are :class:`core.data.KeyedBatches`' (the same order, epoch by epoch, and the same start
when a run resumes mid-epoch) and the gathered values equal what the loader's collate gives, so
a run trains bitwise the same either way (tests/core/test_in_memory_batches.py).

Only the exact types qualify: a subclass may override ``__getitem__`` (augmentation, its own
randomness), and a task's ``collate_fn`` is the task's to run; those go through the DataLoader.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, TensorDataset

from core.tasks.tensor_data import TensorPairDataset

if TYPE_CHECKING:
    from core.data import KeyedBatches

# The most of the device's free memory a dataset may take there, measured as each one (train, then
# validation) is placed; a larger one stays on the host and each batch is gathered there, then
# copied (still no per-sample Python work). Under DDP each rank places the whole dataset.
DEVICE_SHARE = 0.25


def dataset_tensors(ds: Dataset, collate_fn: object) -> tuple[torch.Tensor, ...] | None:
    """The tensors a batch is gathered from when ``ds`` is only tensors (all on one device), else
    None: the DataLoader then fetches and collates it as before.

    A ``TensorPairDataset`` item's label is ``int(y[i])``, which the loader's collate turns into an
    int64 tensor of shape (B,): integer or boolean labels of one element each are converted the same
    way once. Float labels keep the loader, where ``int()`` truncates and refuses NaN and infinity
    with a clear error (a bulk conversion would turn them into INT64_MIN silently)."""
    if collate_fn is not None:
        return None
    if type(ds) is TensorPairDataset:
        x, y = ds.x, ds.y
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return None  # e.g. numpy arrays, which the loader's collate turns into tensors
        if y.is_floating_point() or y.is_complex() or (len(y) and y[0].numel() != 1):
            return None
        tensors: tuple[torch.Tensor, ...] = (x, y.reshape(len(y)).to(torch.int64))
    elif type(ds) is TensorDataset:
        tensors = tuple(ds.tensors)
    else:
        return None
    if len({t.device for t in tensors}) != 1:
        return None  # the batch's indices live on one device
    return tensors


def stored_tensors(ds: Dataset) -> dict[str, torch.Tensor]:
    """The tensors an in-memory dataset holds, by role ("inputs", "targets", then "tensor 2", ...):
    a ``TensorPairDataset``'s x and y, a ``TensorDataset``'s tensors; empty for any other dataset,
    whose samples exist only when it is read."""
    if isinstance(ds, TensorPairDataset):
        held = [ds.x, ds.y]
    elif isinstance(ds, TensorDataset):
        held = list(ds.tensors)
    else:
        return {}
    roles = ["inputs", "targets"] + [f"tensor {i}" for i in range(2, len(held))]
    return {role: torch.as_tensor(t) for role, t in zip(roles, held, strict=False)}


def place(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device`` when they take at most ``DEVICE_SHARE`` of its free memory,
    else left where they are (the loop copies each gathered batch)."""
    if device.type != "cuda" or all(t.device == device for t in tensors):
        return tensors
    free, _ = torch.cuda.mem_get_info(device)
    if sum(t.numel() * t.element_size() for t in tensors) > DEVICE_SHARE * free:
        return tensors
    return tuple(t.to(device) for t in tensors)


class InMemoryBatches:
    """One rank's batches of an in-memory dataset, in ``keys``' order: what ``make_train_loader``
    (and ``make_val_loader``) return instead of a DataLoader. ``len()`` is the batches of an epoch,
    ``epoch(e, start)`` yields ``(i, batch)`` from batch ``start``; iterating it yields epoch 0's
    batches (validation, whose order does not change)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], keys: KeyedBatches) -> None:
        self.tensors, self.keys = tensors, keys

    @classmethod
    def of(cls, ds: Dataset, collate_fn: object, device: torch.device, keys: KeyedBatches) -> InMemoryBatches | None:
        """``ds``'s batches in ``keys``' order, its tensors placed on ``device``; None when ``ds`` is
        not only tensors (:func:`dataset_tensors`) and the DataLoader fetches it."""
        tensors = dataset_tensors(ds, collate_fn)
        return None if tensors is None else cls(place(tensors, device), keys)

    def __len__(self) -> int:
        return self.keys.batches

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
        order = torch.as_tensor(self.keys.indices(epoch), dtype=torch.int64, device=self.tensors[0].device)
        size = self.keys.batch_size
        for b in range(start, self.keys.batches):
            index = order[b * size:(b + 1) * size]
            yield b, tuple(t.index_select(0, index) for t in self.tensors)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return (batch for _, batch in self.epoch(0))
