"""Tasks with one planted bug each, for ``sweeps check`` (tests/sweeps/test_check_command.py),
named by specs as ``task.target: tests.sweeps.check_tasks:<factory>``."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from core.tasks import task
from core.tasks.base import Task, TaskError
from core.tasks.digits import DigitsTask


class _Shifted(Dataset):
    """Labels 1..10 for a 10-class task: the off-by-one of 1-based class ids."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        return x, y + 1


class _Noisy(Dataset):
    """Random noise added on every read: training augmentation applied to validation."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        return x + 0.1 * torch.randn_like(x), y


class _IgnoresInput(nn.Module):
    """Trains (its Linear gets gradients) but feeds it ones instead of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(torch.ones_like(x.flatten(1)))


class LabelsOutOfRange(DigitsTask):
    def datasets(self):
        train, val = super().datasets()
        return _Shifted(train), _Shifted(val)


class ValidationLabelsOutOfRange(DigitsTask):
    def datasets(self):
        train, val = super().datasets()
        return train, _Shifted(val)


class AugmentedValidation(DigitsTask):
    def datasets(self):
        train, val = super().datasets()
        return train, _Noisy(val)


class IgnoresInput(DigitsTask):
    def build_model(self):
        return _IgnoresInput()


@task
def labels_out_of_range(model: str = "mlp") -> DigitsTask:
    return LabelsOutOfRange(model)


@task
def validation_labels_out_of_range(model: str = "mlp") -> DigitsTask:
    return ValidationLabelsOutOfRange(model)


@task
def augmented_validation(model: str = "mlp") -> DigitsTask:
    return AugmentedValidation(model)


@task
def ignores_input(model: str = "mlp") -> DigitsTask:
    return IgnoresInput(model)


class NoData(DigitsTask):
    def datasets(self):
        raise TaskError("task 'no_data': no data at /nowhere; put the files there or set task.args.root")


class ModelTypo(DigitsTask):
    def build_model(self):
        return nn.Linera(64, 10)  # type: ignore[attr-defined]  # the typo is the planted bug


@task
def no_data(model: str = "mlp") -> DigitsTask:
    return NoData(model)


@task
def model_typo(model: str = "mlp") -> DigitsTask:
    return ModelTypo(model)


class NanInputs(DigitsTask):
    """Three NaN pixels and one infinite one in three train images: bad data, not a bad learning rate."""

    def datasets(self):
        from core.tasks.tensor_data import TensorPairDataset

        train, val = super().datasets()
        x = train.x.clone()
        x[5, 0, 0, 0] = x[5, 0, 1, 1] = x[40, 0, 3, 3] = float("nan")
        x[9, 0, 2, 2] = float("inf")
        return TensorPairDataset(x, train.y), val


@task
def nan_inputs(model: str = "mlp") -> DigitsTask:
    return NanInputs(model)


class _NanOutput(nn.Module):
    """A model whose every output is NaN: each trial diverges at its first step, whatever its learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.flatten(1)) * float("nan")


class AlwaysDiverges(DigitsTask):
    def build_model(self):
        return _NanOutput()


@task
def always_diverges(model: str = "mlp") -> DigitsTask:
    return AlwaysDiverges(model)


def _blobs(n: int, seed: int) -> TensorDataset:
    """Three well separated 2-D Gaussian blobs: an easy three-class problem."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=gen)
    centres = torch.tensor([[-3.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    return TensorDataset(centres[labels] + 0.7 * torch.randn(n, 2, generator=gen), labels)


@task("three_blobs")
class ThreeBlobs(Task):
    """A user's classification task as docs/STUDY_SPEC.md describes one: build_model, datasets and
    num_classes, the rest left at the defaults."""

    num_classes = 3

    def build_model(self) -> nn.Module:
        return nn.Linear(2, 3)  # the blobs are linearly separable

    def datasets(self):
        return _blobs(600, seed=0), _blobs(150, seed=1)


@task("three_blobs_without_num_classes")
class ThreeBlobsWithoutNumClasses(ThreeBlobs):
    """The same task that forgets num_classes: the default metrics cannot count its classes."""

    num_classes = 0
