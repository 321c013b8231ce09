"""scikit-learn's handwritten digits: 1,797 real 8x8 images, 10 classes, shipped with the package.

Nothing is downloaded. The train/val split is stratified and fixed by ``split_seed``
(not by the run seed), so every trial of a study validates on the same images.

The images and the split are cached in a small ``.npz`` (``core/tasks/array_cache.py``:
``SWEEPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/sweeps``, else ``~/.cache/sweeps``), keyed by
scikit-learn's version: importing scikit-learn costs every fresh worker process more CPU time
than a short trial trains (benchmarks/README.md, orchestration). Without a usable cache folder,
scikit-learn is used every time.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.tasks.array_cache import cached_arrays, is_split, sklearn_cache_file
from core.tasks.base import Task, check_model_name, register
from core.tasks.inputs import InputSpec

if TYPE_CHECKING:
    from torch import nn


class DigitsTask(Task):
    name = "digits"
    models = ("cnn", "mlp")
    num_classes = 10
    input_shape = (1, 8, 8)
    input_contract = ("an array of raw 8x8 digit images shaped (N, 8, 8) or (N, 64), floats or integers, with pixel "
                      "values 0 to 16, as scikit-learn's load_digits().images gives them; returns each image's "
                      "digit, 0 to 9")
    natural_input = InputSpec(shapes=((8, 8), (64,)), low=0, high=16)

    def __init__(self, model: str = "cnn", val_fraction: float = 0.2, width: int | None = None,
                 dropout: float = 0.1, split_seed: int = 0, depth: int = 2) -> None:
        check_model_name(self.name, model, self.models)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"task.args.val_fraction: {val_fraction!r} must be in (0, 1)")
        self.model = model
        self.val_fraction = val_fraction
        self.width = width if width is not None else (16 if model == "cnn" else 64)
        self.dropout = dropout
        self.split_seed = split_seed
        if depth < 1 or (model != "cnn" and depth != 2):
            raise ValueError(f"task.args.depth: {depth!r} is not allowed; use depth >= 1 with model cnn "
                             "(the mlp has two hidden layers)")
        self.depth = depth  # conv blocks of the CNN

    def build_model(self) -> nn.Module:
        from core.tasks.digits_models import DigitsCNN, DigitsMLP  # lazy: checking a task needs no torch

        if self.model == "cnn":
            return DigitsCNN(self.width, self.dropout, depth=self.depth)
        return DigitsMLP(self.width, self.dropout)

    def datasets(self):
        import torch

        from core.tasks.tensor_data import TensorPairDataset  # lazy: checking a task needs no torch

        images, labels, idx_train, idx_val = load_split(self.val_fraction, self.split_seed)
        x_t = self.preprocess(torch.from_numpy(images))  # N, 1, 8, 8
        y_t = torch.from_numpy(labels.astype(np.int64))
        return (TensorPairDataset(x_t[idx_train], y_t[idx_train]),
                TensorPairDataset(x_t[idx_val], y_t[idx_val]))

    def preprocess(self, natural):
        """Raw pixel values 0 to 16, (N, 8, 8) or (N, 64), floats or integers -> float32
        (N, 1, 8, 8) in [-1, 1]: ``(x / 16 - 0.5) / 0.5``, in float32, each step exact."""
        import torch

        x = torch.as_tensor(natural)
        if x.ndim not in (2, 3) or x.shape[1:].numel() != 64:
            raise ValueError(f"digits input: expected raw 8x8 images shaped (N, 8, 8) or (N, 64), got shape "
                             f"{tuple(x.shape)}")
        return (x.reshape(len(x), 1, 8, 8).to(torch.float32) / 16.0 - 0.5) / 0.5

    def natural_examples(self, n: int):
        """The first ``n`` validation images as scikit-learn gives them: float64 (n, 8, 8), 0 to 16."""
        import torch

        images, _, _, idx_val = load_split(self.val_fraction, self.split_seed)
        return torch.from_numpy(images[idx_val[:max(n, 0)]].astype(np.float64))

    def describe(self):
        return {"task": self.name, "model": self.model, "width": self.width, "depth": self.depth,
                "val_fraction": self.val_fraction, "split_seed": self.split_seed}


def split_cache_file(val_fraction: float, split_seed: int) -> Path | None:
    """Where the split for these arguments is cached; None without scikit-learn's metadata."""
    return sklearn_cache_file("digits", "split", f"val{val_fraction!r}-seed{split_seed}")


def load_split(val_fraction: float, split_seed: int) -> tuple[np.ndarray, ...]:
    """``(images, labels, train indices, val indices)``: images as uint8 in [0, 16], N x 8 x 8,
    exactly what ``load_digits`` and a stratified ``train_test_split`` give, from the cache
    when it holds a sound copy, else computed with scikit-learn and cached."""
    return cached_arrays(split_cache_file(val_fraction, split_seed), ("images", "labels", "train", "val"),
                         lambda: _split_with_sklearn(val_fraction, split_seed), _sound)


def _split_with_sklearn(val_fraction: float, split_seed: int) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    labels = data.target.astype(np.int64)
    idx_train, idx_val = train_test_split(
        np.arange(len(labels)), test_size=val_fraction, random_state=split_seed, stratify=labels)
    return data.images.astype(np.uint8), labels, idx_train.astype(np.int64), idx_val.astype(np.int64)


def _sound(images: np.ndarray, labels: np.ndarray, train: np.ndarray, val: np.ndarray) -> bool:
    """Arrays that fit together: N 8x8 uint8 images, N labels, and indices (integers, as they
    index tensors) that split 0..N-1 into train and val."""
    n = len(images)
    return (n > 0 and images.shape == (n, 8, 8) and images.dtype == np.uint8 and labels.shape == (n,)
            and int(labels.min()) >= 0 and int(labels.max()) < DigitsTask.num_classes and is_split(n, train, val))


@register("digits")
def make_digits(model: str = "cnn", val_fraction: float = 0.2, width: int | None = None,
                dropout: float = 0.1, split_seed: int = 0, depth: int = 2) -> DigitsTask:
    return DigitsTask(model=model, val_fraction=val_fraction, width=width, dropout=dropout, split_seed=split_seed,
                      depth=depth)
