"""In-memory datasets of the built-in tasks (a module of its own: it imports torch, which naming
and checking a task, as spec validation does, does not need)."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class TensorPairDataset(Dataset):
    """(inputs, labels) tensors as a Dataset; indexing returns (x, int label)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        assert len(x) == len(y)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])
