"""CIFAR-10 from a local copy, with ResNet-18 adapted to 32x32 images.

Nothing is downloaded: the python-version archive must already be extracted under
``root`` (``<root>/cifar-10-batches-py``). torch and torchvision are imported inside functions
so that looking the task up (``core.tasks.base.resolve_factory``) stays cheap.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from core.tasks.base import Task, TaskError, block_names, check_model_name, register
from core.tasks.inputs import InputSpec
from core.tasks.natural_images import preprocess_images

if TYPE_CHECKING:  # imported where the model is built: checking a task needs no torch
    from torch import nn

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_DIRNAME = "cifar-10-batches-py"  # what the archive extracts to; torchvision's base_folder
# Per-channel statistics of the 50k training images (the values used across the literature).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def resnet18_cifar(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised, with the stem adapted to 32x32 inputs.

    The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks 32x32 to 8x8 before the first
    block and costs several points of accuracy; a 3x3 stride-1 conv without pooling keeps
    the full resolution, the usual CIFAR variant.
    """
    from torch import nn
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    # Same init torchvision applies to every conv in ResNet.__init__ (the replacement missed it).
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


class CIFAR10Task(Task):
    """CIFAR-10 classification: 50k train / 10k test images (the test split is the val set)."""

    name = "cifar10"
    models = ("resnet18",)
    num_classes = 10
    input_shape = (3, 32, 32)
    input_contract = ("a uint8 array of RGB images shaped (N, 32, 32, 3) with values 0 to 255 (height, width, "
                      "channel, as PIL or CIFAR-10's python batches give them); returns each image's class index "
                      "0 to 9 in CIFAR-10's label order")
    natural_input = InputSpec(kinds="iu", shapes=((32, 32, 3),), low=0, high=255)  # integer pixels, as PIL gives

    def __init__(self, model: str = "resnet18", root: str = "data", augment: bool = True,
                 checkpoint_blocks: list[str] | tuple[str, ...] = ()) -> None:
        # No file access here: a spec is validated by instantiating its task, before any data exists.
        check_model_name(self.name, model, self.models)
        self.checkpoint_blocks = block_names(self.name, checkpoint_blocks)  # e.g. [layer1, layer2, layer3]
        self.model = model
        self.root = str(root)
        self.augment = bool(augment)

    @property
    def data_dir(self) -> str:
        return os.path.join(self.root, CIFAR10_DIRNAME)

    def build_model(self) -> nn.Module:
        return resnet18_cifar(num_classes=self.num_classes)

    def transforms(self):
        """``(train_transform, val_transform)``; train adds crop+flip augmentation when ``augment``."""
        from torchvision import transforms as T

        normalize = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        val = T.Compose(normalize)
        if not self.augment:
            return val, val
        train = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *normalize])
        return train, val

    def datasets(self):
        from torchvision.datasets import CIFAR10

        if not os.path.isdir(self.data_dir):
            raise TaskError(missing_data_message(self.root))
        train_tf, val_tf = self.transforms()
        try:
            train = CIFAR10(self.root, train=True, transform=train_tf, download=False)
            val = CIFAR10(self.root, train=False, transform=val_tf, download=False)
        except RuntimeError as exc:
            # torchvision checks the md5 of every batch file; its own message suggests
            # download=True, which this offline project never does.
            raise TaskError(
                f"task cifar10: the data under {os.path.abspath(self.data_dir)} is incomplete or corrupted "
                f"({exc}). {missing_data_message(self.root, intro=False)}"
            ) from exc
        return train, val

    def preprocess(self, natural):
        """uint8 RGB images (N, 32, 32, 3) -> the normalised (N, 3, 32, 32) batch ``datasets()``
        yields for them: the validation transform, applied to each image as the dataset does."""
        return preprocess_images(natural, self.transforms()[1])

    def natural_examples(self, n: int):
        """The first ``n`` test-split images, uint8 (n, 32, 32, 3); None without the local data."""
        import torch

        if n <= 0 or not os.path.isdir(self.data_dir):
            return None
        from torchvision.datasets import CIFAR10

        try:
            val = CIFAR10(self.root, train=False, download=False)
        except RuntimeError:  # incomplete or corrupted: datasets() says so, with the fix
            return None
        return torch.from_numpy(val.data[:n].copy())

    def describe(self):
        return {"task": self.name, "model": self.model, "root": self.root, "augment": self.augment}


def missing_data_message(root: str, intro: bool = True) -> str:
    """How to put CIFAR-10 under ``root``; shared by the missing- and corrupted-data errors."""
    target = os.path.abspath(os.path.join(root, CIFAR10_DIRNAME))
    head = f"task cifar10: no CIFAR-10 data at {target}. " if intro else ""
    return (
        f"{head}Nothing is downloaded automatically: get the python version, {CIFAR10_URL}, "
        f"and extract it so that {target} exists "
        f"(e.g. `tar -xzf cifar-10-python.tar.gz -C {os.path.abspath(root)}`), "
        "or set task.args.root to the folder that contains cifar-10-batches-py."
    )


@register("cifar10")
def make_cifar10(model: str = "resnet18", root: str = "data", augment: bool = True,
                 checkpoint_blocks: list[str] | tuple[str, ...] = ()) -> CIFAR10Task:
    return CIFAR10Task(model=model, root=root, augment=augment, checkpoint_blocks=checkpoint_blocks)
