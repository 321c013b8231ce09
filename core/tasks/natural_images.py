"""Natural input of the image tasks (cifar10, imagefolder): RGB images as a user loads them,
``uint8`` arrays shaped (height, width, 3) with values 0 to 255 (``numpy.asarray(PIL.Image.open(p)
.convert("RGB"))``), and the way from them to the model input.

``preprocess_images`` runs the task's own validation transform on each image through PIL, the
path its ``datasets()`` takes, so the model input it returns is the dataset's, bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def _one_image(image: Any) -> np.ndarray:
    arr = image.numpy() if hasattr(image, "numpy") else np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"natural image input: expected RGB images shaped (height, width, 3), got an image "
                         f"shaped {tuple(arr.shape)}")
    if arr.dtype != np.uint8:
        if arr.dtype.kind not in "iu" or arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"natural image input: expected uint8 pixel values 0 to 255, got dtype {arr.dtype}"
                             + ("" if arr.dtype.kind in "iu" else " (scale floats back to 0..255 integers)"))
        arr = arr.astype(np.uint8)
    return arr


def images_of(natural: torch.Tensor | np.ndarray | Sequence[Any]) -> list[np.ndarray]:
    """The images of a batch: an (N, H, W, 3) array or tensor, or a sequence of (H, W, 3) images
    of any sizes; each checked to be RGB with integer values 0 to 255."""
    shape = tuple(getattr(natural, "shape", ()))
    if len(shape) == 3 and shape[-1] == 3 and getattr(natural, "dtype", None) != np.dtype(object):
        raise ValueError(f"natural image input: expected a batch (N, height, width, 3), got one image shaped "
                         f"{shape}; add the batch axis (x[None])")
    return [_one_image(image) for image in natural]


def preprocess_images(natural: torch.Tensor | np.ndarray | Sequence[Any],
                      transform: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """Model-input batch of ``natural`` images: ``transform`` (a task's validation transform,
    which takes a PIL image) applied to each, stacked."""
    import torch
    from PIL import Image

    images = images_of(natural)
    if not images:
        raise ValueError("natural image input: the batch is empty")
    return torch.stack([transform(Image.fromarray(image)) for image in images])


def same_size_batch(images: Sequence[np.ndarray], n: int) -> torch.Tensor | None:
    """Up to ``n`` of ``images`` that have the first one's size, as one (k, H, W, 3) uint8 batch."""
    import torch

    if n <= 0 or not images:
        return None
    first = images[0].shape
    kept = [image for image in images if image.shape == first][:n]
    return torch.from_numpy(np.stack(kept))
