"""scikit-learn's handwritten digits: 1,797 real 8x8 images, 10 classes, shipped with the package.

Nothing is downloaded. The train/val split is stratified and fixed by ``split_seed``
(not by the run seed), so every trial of a study validates on the same images.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from core.tasks.base import Task, TensorPairDataset, check_model_name, register


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks and a linear head; about 20k parameters at width 16."""

    def __init__(self, width: int = 16, dropout: float = 0.1, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsMLP(nn.Module):
    def __init__(self, width: int = 64, dropout: float = 0.1, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsTask(Task):
    name = "digits"
    models = ("cnn", "mlp")
    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(self, model: str = "cnn", val_fraction: float = 0.2, width: int | None = None,
                 dropout: float = 0.1, split_seed: int = 0) -> None:
        check_model_name(self.name, model, self.models)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"task.args.val_fraction: {val_fraction!r} must be in (0, 1)")
        self.model = model
        self.val_fraction = val_fraction
        self.width = width if width is not None else (16 if model == "cnn" else 64)
        self.dropout = dropout
        self.split_seed = split_seed

    def build_model(self) -> nn.Module:
        if self.model == "cnn":
            return DigitsCNN(self.width, self.dropout)
        return DigitsMLP(self.width, self.dropout)

    def warm_up(self) -> None:
        import sklearn.datasets  # noqa: F401 - the first datasets() call is then cheap (about 1 s)
        import sklearn.model_selection  # noqa: F401

    def datasets(self):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        data = load_digits()
        x = (data.images.astype(np.float32) / 16.0 - 0.5) / 0.5  # [0, 16] -> [-1, 1]
        y = data.target.astype(np.int64)
        idx_train, idx_val = train_test_split(
            np.arange(len(y)), test_size=self.val_fraction, random_state=self.split_seed, stratify=y
        )
        x_t = torch.from_numpy(x).unsqueeze(1)  # N, 1, 8, 8
        y_t = torch.from_numpy(y)
        return (TensorPairDataset(x_t[idx_train], y_t[idx_train]),
                TensorPairDataset(x_t[idx_val], y_t[idx_val]))

    def describe(self):
        return {"task": self.name, "model": self.model, "width": self.width,
                "val_fraction": self.val_fraction, "split_seed": self.split_seed}


@register("digits")
def make_digits(model: str = "cnn", val_fraction: float = 0.2, width: int | None = None,
                dropout: float = 0.1, split_seed: int = 0) -> DigitsTask:
    return DigitsTask(model=model, val_fraction=val_fraction, width=width, dropout=dropout, split_seed=split_seed)
