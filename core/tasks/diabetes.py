"""Regression on scikit-learn's diabetes data: 442 patients, ten baseline variables (age, sex,
body mass index, blood pressure and six blood serum measurements), and a quantitative measure of
disease progression one year later (25 to 346). Shipped with scikit-learn; nothing is downloaded.

What a user has is a patient's row as ``load_diabetes(scaled=False)`` gives it (age in years,
sex 1 or 2, ...): the natural input. ``preprocess`` standardises it with the train split's
mean and standard deviation; the model predicts the target standardised the same way, the loss
is the mean squared error in those units (so one learning rate range suits every model), and
``postprocess`` turns the prediction back into the target's units, in which ``val_rmse`` and
``val_mae`` are reported. The split is fixed by ``split_seed`` (not by the run seed), so every
trial of a study validates on the same patients; it is cached like the digits task's
(``core/tasks/array_cache.py``), so a fresh worker does not import scikit-learn.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.tasks.array_cache import cached_arrays, is_split, sklearn_cache_file
from core.tasks.base import Loss, Task, check_model_name, register
from core.tasks.inputs import InputSpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchmetrics import Metric

    from core.config import TrainConfig

FEATURES = ("age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6")


class DiabetesTask(Task):
    name = "diabetes"
    models = ("mlp", "linear")
    input_shape = (len(FEATURES),)
    metric_directions = {"val_rmse": "minimize", "val_mae": "minimize"}
    input_contract = ("float rows (N, 10) of age, sex, bmi, bp, s1..s6 in the units of scikit-learn's "
                      "load_diabetes(scaled=False); returns (N,) predicted disease progression one year later "
                      "(the target's units, about 25 to 346)")
    natural_input = InputSpec(shapes=((len(FEATURES),),))  # measurements: no declared range, finite

    def __init__(self, model: str = "mlp", width: int = 64, depth: int = 2, dropout: float = 0.0,
                 val_fraction: float = 0.2, split_seed: int = 0) -> None:
        check_model_name(self.name, model, self.models)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"task.args.val_fraction: {val_fraction!r} must be in (0, 1)")
        if depth < 1 or width < 1:
            raise ValueError(f"task.args: depth ({depth!r}, hidden layers of the mlp) and width ({width!r}) "
                             "must be at least 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"task.args.dropout: {dropout!r} must be in [0, 1)")
        self.model, self.width, self.depth, self.dropout = model, width, depth, dropout
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self._arrays: tuple[np.ndarray, ...] | None = None
        self._moments: tuple[np.ndarray, np.ndarray, float, float] | None = None

    # ---- data -----------------------------------------------------------------------------
    def _split(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            self._arrays = load_split(self.val_fraction, self.split_seed)
        return self._arrays

    def _stats(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """Mean and standard deviation of the train split's features (float32) and target."""
        if self._moments is None:
            x, y, train, _ = self._split()
            x_train = x[train].astype(np.float32)
            self._moments = (x_train.mean(0), x_train.std(0), float(y[train].mean()), float(y[train].std()))
        return self._moments

    def datasets(self):
        import torch
        from torch.utils.data import TensorDataset

        x, y, train, val = self._split()
        inputs = self.preprocess(torch.from_numpy(x.astype(np.float32)))
        target = torch.from_numpy(y.astype(np.float32))  # natural units: what the metrics compare with
        return (TensorDataset(inputs[train], target[train]), TensorDataset(inputs[val], target[val]))

    def natural_examples(self, n: int) -> torch.Tensor:
        import torch

        x, _, _, val = self._split()
        return torch.from_numpy(x[val[:n]])  # float64, as load_diabetes gives them (the signature's dtype)

    def preprocess(self, natural: torch.Tensor) -> torch.Tensor:
        import torch

        mean, std, _, _ = self._stats()
        natural = natural.float()
        return (natural - torch.from_numpy(mean).to(natural.device)) / torch.from_numpy(std).to(natural.device)

    # ---- model, loss, metrics ---------------------------------------------------------------
    def build_model(self) -> nn.Module:
        from torch import nn

        if self.model == "linear":
            return nn.Linear(len(FEATURES), 1)
        layers: list[nn.Module] = []
        width_in = len(FEATURES)
        for _ in range(self.depth):
            layers += [nn.Linear(width_in, self.width), nn.ReLU()]
            layers += [nn.Dropout(self.dropout)] if self.dropout > 0 else []
            width_in = self.width
        return nn.Sequential(*layers, nn.Linear(width_in, 1))

    def make_loss(self, cfg: TrainConfig) -> Loss:
        """Mean squared error between the model's output (N, 1) and the natural target (N,)
        standardised with the train split's statistics."""
        import torch.nn.functional as F

        _, _, mean, std = self._stats()

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(output.float().squeeze(1), (target.float() - mean) / std)

        return loss

    def postprocess(self, output: torch.Tensor) -> torch.Tensor:
        """(N, 1) standardised predictions -> (N,) in the target's units."""
        _, _, mean, std = self._stats()
        return output.float().squeeze(1) * std + mean

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError

        return {"rmse": MeanSquaredError(squared=False), "mae": MeanAbsoluteError()}

    def describe(self):
        return {"task": self.name, "model": self.model, "width": self.width, "depth": self.depth,
                "dropout": self.dropout, "val_fraction": self.val_fraction, "split_seed": self.split_seed}


def split_cache_file(val_fraction: float, split_seed: int):
    return sklearn_cache_file("diabetes", "split", f"val{val_fraction!r}-seed{split_seed}")


def load_split(val_fraction: float, split_seed: int) -> tuple[np.ndarray, ...]:
    """``(features, target, train indices, val indices)``: features (442, 10) and target (442,)
    as float64, exactly what ``load_diabetes(scaled=False)`` gives, and a random split fixed by
    ``split_seed``; from the cache when it holds a sound copy."""
    return cached_arrays(split_cache_file(val_fraction, split_seed), ("x", "y", "train", "val"),
                         lambda: _split_with_sklearn(val_fraction, split_seed), _sound)


def _split_with_sklearn(val_fraction: float, split_seed: int) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_diabetes

    data = load_diabetes(scaled=False)
    n = len(data.target)
    order = np.random.default_rng(split_seed).permutation(n)
    n_val = max(1, round(n * val_fraction))
    return (data.data.astype(np.float64), data.target.astype(np.float64),
            np.sort(order[n_val:]).astype(np.int64), np.sort(order[:n_val]).astype(np.int64))


def _sound(x: np.ndarray, y: np.ndarray, train: np.ndarray, val: np.ndarray) -> bool:
    n = len(x)
    return (n > 0 and x.shape == (n, len(FEATURES)) and y.shape == (n,) and x.dtype == y.dtype == np.float64
            and bool(np.isfinite(x).all() and np.isfinite(y).all()) and is_split(n, train, val) and len(val) > 0)


@register("diabetes")
def make_diabetes(model: str = "mlp", width: int = 64, depth: int = 2, dropout: float = 0.0,
                  val_fraction: float = 0.2, split_seed: int = 0) -> DiabetesTask:
    return DiabetesTask(model=model, width=width, depth=depth, dropout=dropout, val_fraction=val_fraction,
                        split_seed=split_seed)
