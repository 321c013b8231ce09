"""Random tensors of a configurable shape, for benchmarks and tests.

Labels come from a fixed random linear map of the inputs, so the task is learnable
and a loss curve means something. Data depends only on ``data_seed``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.tasks.base import Task, block_names, check_model_name, register
from core.tasks.inputs import InputSpec

if TYPE_CHECKING:  # imported where the model and data are built: checking a task needs no torch
    from torch import nn


class SyntheticTask(Task):
    name = "synthetic"
    models = ("mlp", "cnn", "resnet18")

    def __init__(self, model: str = "mlp", shape: tuple[int, ...] | list[int] = (3, 32, 32),
                 num_classes: int = 10, n_train: int = 512, n_val: int = 128, width: int = 32,
                 data_seed: int = 0, checkpoint_blocks: list[str] | tuple[str, ...] = ()) -> None:
        check_model_name(self.name, model, self.models)
        self.checkpoint_blocks = block_names(self.name, checkpoint_blocks)
        self.model = model
        self.input_shape = tuple(int(s) for s in shape)
        self.num_classes = num_classes
        self.natural_input = InputSpec(shapes=(self.input_shape,))  # random features: finite, no range
        self.n_train, self.n_val, self.width, self.data_seed = n_train, n_val, width, data_seed
        shape_text = ", ".join(str(s) for s in self.input_shape)
        self.input_contract = (f"a float32 array shaped (N, {shape_text}) of random features with no natural units, "
                               "so the input is the model input itself (preprocess is the identity); returns each "
                               f"input's class index, 0 to {num_classes - 1}")

    def build_model(self) -> nn.Module:
        from torch import nn

        numel = 1
        for s in self.input_shape:
            numel *= s
        if self.model == "mlp":
            return nn.Sequential(nn.Flatten(), nn.Linear(numel, self.width), nn.ReLU(),
                                 nn.Linear(self.width, self.num_classes))
        if self.model == "cnn":
            c = self.input_shape[0]
            return nn.Sequential(nn.Conv2d(c, self.width, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                 nn.Linear(self.width * 16, self.num_classes))
        from core.tasks.cifar10 import resnet18_cifar  # lazy: only the resnet model needs the cifar10 task

        return resnet18_cifar(num_classes=self.num_classes, in_channels=self.input_shape[0])

    def datasets(self):
        import torch

        from core.tasks.tensor_data import TensorPairDataset  # lazy: checking a task needs no torch

        gen = torch.Generator().manual_seed(self.data_seed)
        n = self.n_train + self.n_val
        x = torch.randn((n, *self.input_shape), generator=gen)
        proj = torch.randn((x[0].numel(), self.num_classes), generator=gen)
        y = (x.flatten(1) @ proj).argmax(dim=1)
        return (TensorPairDataset(x[: self.n_train], y[: self.n_train]),
                TensorPairDataset(x[self.n_train:], y[self.n_train:]))

    def natural_examples(self, n: int):
        """The first ``n`` validation inputs: the natural input is the model input (identity)."""
        _, val = self.datasets()
        return val.x[:max(n, 0)].clone()

    def describe(self):
        return {"task": self.name, "model": self.model, "shape": list(self.input_shape),
                "num_classes": self.num_classes, "n_train": self.n_train}


@register("synthetic")
def make_synthetic(model: str = "mlp", shape: list[int] | tuple[int, ...] = (3, 32, 32), num_classes: int = 10,
                   n_train: int = 512, n_val: int = 128, width: int = 32, data_seed: int = 0,
                   checkpoint_blocks: list[str] | tuple[str, ...] = ()) -> SyntheticTask:
    return SyntheticTask(model, shape, num_classes, n_train, n_val, width, data_seed, checkpoint_blocks)
