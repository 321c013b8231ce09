"""Small tasks whose data is randomly augmented with torch, numpy and python's ``random``, as a
map-style dataset or a stream, and one whose samples need the task's collate_fn. For
tests/core/test_data_resume.py; they train in a fraction of a second on CPU."""
from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from core.tasks.base import Task

N_TRAIN, N_VAL, CLASSES = 192, 64, 4


def _data(n: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((N_TRAIN + N_VAL, 1, 8, 8), generator=gen)
    proj = torch.randn((64, CLASSES), generator=gen)
    y = (x.flatten(1) @ proj).argmax(1)
    return x[offset:offset + n], y[offset:offset + n]


def augment(img: torch.Tensor) -> torch.Tensor:
    """A flip (python random), a shift (numpy) and noise (torch)."""
    if random.random() < 0.5:
        img = img.flip(-1)
    img = torch.roll(img, int(np.random.randint(-1, 2)), dims=-2)
    return img + 0.1 * torch.randn_like(img)


class AugmentedImages(Dataset):
    def __init__(self, n: int, offset: int, augmented: bool) -> None:
        self.x, self.y = _data(n, offset)
        self.augmented = augmented

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return augment(self.x[i]) if self.augmented else self.x[i], int(self.y[i])


class AugmentedStream(IterableDataset):
    """The samples in a fixed order, each loader worker taking every k-th one, augmented."""

    def __init__(self, n: int, offset: int, augmented: bool = True) -> None:
        self.x, self.y = _data(n, offset)
        self.augmented = augmented

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.x), step):
            yield augment(self.x[i]) if self.augmented else self.x[i], int(self.y[i])


class AugmentedTask(Task):
    """A tiny CNN with dropout on 1x8x8 images; train data augmented, validation not."""

    name = "augmented"
    models = ("cnn",)
    num_classes = CLASSES
    input_shape = (1, 8, 8)

    def __init__(self, stream: bool = False) -> None:
        self.stream = stream

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(),
                             nn.Linear(4 * 64, CLASSES))

    def datasets(self):
        if self.stream:
            return AugmentedStream(N_TRAIN, 0), AugmentedStream(N_VAL, N_TRAIN, augmented=False)
        return AugmentedImages(N_TRAIN, 0, True), AugmentedImages(N_VAL, N_TRAIN, False)


class Sequences(Dataset):
    """1-D sequences of 3 to 8 values: they do not stack without padding."""

    def __init__(self, n: int, offset: int) -> None:
        x, self.y = _data(n, offset)
        self.x = [row.flatten()[: 3 + (i % 6)] for i, row in enumerate(x)]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


class PaddedSequencesTask(Task):
    """Its collate_fn pads each batch's sequences to the longest: (batch, 1, length) inputs."""

    name = "padded"
    models = ("conv1d",)
    num_classes = CLASSES
    input_shape = (1, 8)

    def __init__(self) -> None:
        self.collated = 0  # batches collated in this process

    def collate_fn(self, samples):
        self.collated += 1
        seqs = nn.utils.rnn.pad_sequence([s for s, _ in samples], batch_first=True)
        return seqs.unsqueeze(1), torch.tensor([label for _, label in samples])

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Conv1d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                             nn.Linear(8, CLASSES))

    def datasets(self):
        return Sequences(N_TRAIN, 0), Sequences(N_VAL, N_TRAIN)
