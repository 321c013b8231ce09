"""Semantic segmentation of generated shapes: RGB images of one to ``max_shapes`` filled circles,
squares and triangles of random sizes and colours on a noisy background of another colour; the
target is the class of every pixel (0 background, 1 circle, 2 square, 3 triangle; a shape drawn
later covers an earlier one). Generated with numpy from ``data_seed`` in well under a second:
nothing is downloaded, and the same arguments give the same images in every process.

The natural input is what an image library gives: uint8 RGB, (N, H, W, 3), 0..255.
``preprocess`` turns it into the model's (N, 3, H, W) float input in [-1, 1]; the models return
per-pixel logits (N, 4, H, W), and the default cross-entropy loss and argmax ``postprocess`` of
``Task`` already fit them (PyTorch's cross-entropy takes (N, C, H, W) logits against (N, H, W)
class indices). Only the metrics are the task's own: the mean over the four classes of the
intersection over union of the whole validation set (``val_iou``, the usual mIoU) and the
per-pixel accuracy (``val_pixel_acc``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.tasks.base import Task, check_model_name, register
from core.tasks.inputs import InputSpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchmetrics import Metric

CLASSES = ("background", "circle", "square", "triangle")


class ShapesTask(Task):
    name = "shapes"
    models = ("unet", "fcn")
    classes = CLASSES
    num_classes = len(CLASSES)  # the end-of-run confusion matrix counts pixels of each class
    metric_directions = {"val_iou": "maximize", "val_pixel_acc": "maximize"}
    input_contract = ("uint8 RGB images (N, H, W, 3), values 0..255, H and W as trained; returns (N, H, W) "
                      "class indices per pixel: 0 background, 1 circle, 2 square, 3 triangle")

    def __init__(self, model: str = "unet", width: int = 16, size: int = 32, n_train: int = 512,
                 n_val: int = 128, max_shapes: int = 3, data_seed: int = 0) -> None:
        check_model_name(self.name, model, self.models)
        if size < 16 or size % 4:
            raise ValueError(f"task.args.size: {size!r} must be a multiple of 4, at least 16")
        if min(width, n_train, n_val, max_shapes) < 1:
            raise ValueError("task.args: width, n_train, n_val and max_shapes must be at least 1")
        self.model, self.width, self.size = model, width, size
        self.n_train, self.n_val, self.max_shapes, self.data_seed = n_train, n_val, max_shapes, data_seed
        self.input_shape = (3, size, size)
        self.natural_input = InputSpec(shapes=((size, size, 3),), low=0, high=255)
        self._val: tuple[np.ndarray, np.ndarray] | None = None

    def build_model(self) -> nn.Module:
        from core.tasks.shapes_models import DilatedFCN, TinyUNet  # lazy: checking a task needs no torch

        cls = TinyUNet if self.model == "unet" else DilatedFCN
        return cls(self.width, num_classes=len(CLASSES))

    def generate(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """``(images, masks)`` of ``split`` ("train" or "val"): uint8 (N, H, W, 3) and uint8
        (N, H, W) class indices. Each split has its own random stream, so changing ``n_train``
        leaves the validation images as they were."""
        if split == "val" and self._val is not None:
            return self._val
        n = self.n_train if split == "train" else self.n_val
        rng = np.random.default_rng([self.data_seed, int(split == "val")])
        out = generate_shapes(n, self.size, self.max_shapes, rng)
        if split == "val":
            self._val = out
        return out

    def datasets(self):
        import torch
        from torch.utils.data import TensorDataset

        def dataset(split: str) -> TensorDataset:
            images, masks = self.generate(split)
            return TensorDataset(self.preprocess(torch.from_numpy(images)), torch.from_numpy(masks).long())

        return dataset("train"), dataset("val")

    def preprocess(self, natural: torch.Tensor) -> torch.Tensor:
        """uint8 (N, H, W, 3) in 0..255 -> float32 (N, 3, H, W) in [-1, 1]."""
        if natural.ndim != 4 or natural.shape[-1] != 3:
            raise ValueError(f"shapes: expected RGB images shaped (N, H, W, 3), got {tuple(natural.shape)}")
        return (natural.permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.5

    def natural_examples(self, n: int) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.generate("val")[0][:n])

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

        k = len(CLASSES)
        return {"iou": MulticlassJaccardIndex(num_classes=k, average="macro"),
                "pixel_acc": MulticlassAccuracy(num_classes=k, average="micro")}

    def describe(self):
        return {"task": self.name, "model": self.model, "width": self.width, "size": self.size,
                "n_train": self.n_train, "n_val": self.n_val, "max_shapes": self.max_shapes,
                "data_seed": self.data_seed}


def generate_shapes(n: int, size: int, max_shapes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (uint8, (n, size, size, 3)) and their masks (uint8, (n, size, size))."""
    yy, xx = np.mgrid[0:size, 0:size] + 0.5  # pixel centres
    images = np.empty((n, size, size, 3), np.uint8)
    masks = np.zeros((n, size, size), np.uint8)
    for i in range(n):
        background = rng.uniform(0, 255, 3)
        image = background + rng.normal(0.0, 10.0, (size, size, 3))
        for _ in range(int(rng.integers(1, max_shapes + 1))):
            cls = int(rng.integers(1, len(CLASSES)))
            r = rng.uniform(0.15, 0.3) * size  # circumradius-like half-size
            cx, cy = rng.uniform(r, size - r, 2)
            color = rng.uniform(0, 255, 3)
            while np.abs(color - background).sum() < 150:  # visible against the background
                color = rng.uniform(0, 255, 3)
            if cls == 1:
                inside = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
            elif cls == 2:
                inside = (np.abs(xx - cx) <= 0.8 * r) & (np.abs(yy - cy) <= 0.8 * r)
            else:  # apex up: the half-width grows from 0 at the top (cy - r) to r at the base (cy + r)
                inside = (yy <= cy + r) & (np.abs(xx - cx) <= (yy - (cy - r)) / 2)
            image[inside] = color + rng.normal(0.0, 10.0, (int(inside.sum()), 3))
            masks[i][inside] = cls
        images[i] = np.clip(image, 0, 255).round().astype(np.uint8)
    return images, masks


@register("shapes")
def make_shapes(model: str = "unet", width: int = 16, size: int = 32, n_train: int = 512, n_val: int = 128,
                max_shapes: int = 3, data_seed: int = 0) -> ShapesTask:
    return ShapesTask(model=model, width=width, size=size, n_train=n_train, n_val=n_val, max_shapes=max_shapes,
                      data_seed=data_seed)
