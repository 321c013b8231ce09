"""Your own images in class folders, with any torchvision classification model.

Layout (torchvision ``ImageFolder``; class index = position of the folder name in sorted order)::

    <root>/train/<class_name>/*.png|jpg|...
    <root>/val/<class_name>/*.png|jpg|...     # the same class folders as train

Models are built with ``torchvision.models.get_model(name, weights=None, num_classes=n)``,
so the head already has one output per class folder. Pretrained weights come only from a
local file (``pretrained_weights``): nothing is downloaded.

The constructor touches no files -- a spec is validated by instantiating its task, possibly on
a machine without the data -- so folder and weight errors surface in ``num_classes``,
``build_model()`` and ``datasets()``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from core.tasks.base import Task, TaskError, register
from core.tasks.inputs import InputSpec
from core.tasks.natural_images import preprocess_images, same_size_batch

if TYPE_CHECKING:  # imported where models and weights are handled: checking a task needs no torch
    import torch
    from torch import nn

# Models known to work end to end (head found, train-mode forward returns plain logits).
# Other torchvision classification models are accepted too, except those below.
COMMON_MODELS = ("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large",
                 "efficientnet_b0", "convnext_tiny", "regnet_y_400mf")
# These return an extra auxiliary output in train mode, which the training loop cannot consume.
UNSUPPORTED_MODELS = ("googlenet", "inception_v3")
# Attribute that holds the classification head, by torchvision family: resnet/regnet/shufflenet
# use `fc`; mobilenet/efficientnet/convnext/densenet/vgg use `classifier`; vit `heads`; swin `head`.
HEAD_ATTRS = ("fc", "classifier", "heads", "head")
# torchvision's pretrained weights were trained on inputs normalised with ImageNet statistics.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Keys under which training scripts commonly nest a state dict inside a checkpoint.
_NESTED_STATE_KEYS = ("model", "state_dict", "model_state_dict")
# Prefixes that DistributedDataParallel and torch.compile add to parameter names.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _torchvision_models() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def head_attr(model: nn.Module) -> str:
    """Name of the child module that is the classification head (see ``HEAD_ATTRS``)."""
    children = dict(model.named_children())
    for attr in HEAD_ATTRS:
        if attr in children:
            return attr
    raise TaskError(
        f"cannot find the classification head of {type(model).__name__}: "
        f"none of its children is named {', '.join(HEAD_ATTRS)}"
    )


class ImageFolderTask(Task):
    name = "imagefolder"
    models = COMMON_MODELS
    # Integer RGB pixels of any height and width: preprocess resizes and crops.
    natural_input = InputSpec(kinds="iu", shapes=((-1, -1, 3),), low=0, high=255)

    def __init__(self, model: str = "resnet18", root: str = "data", image_size: int = 224,
                 pretrained_weights: str | None = None, augment: bool = True) -> None:
        if model in UNSUPPORTED_MODELS or (model not in COMMON_MODELS and model not in _torchvision_models()):
            raise TaskError(
                f"task.model: {model!r} is not offered by task 'imagefolder'; choose one of "
                f"{', '.join(COMMON_MODELS)} or another torchvision classification model "
                f"(torchvision.models.list_models(), except {', '.join(UNSUPPORTED_MODELS)})"
            )
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
            raise TaskError(f"task.args.image_size: {image_size!r} must be an integer of at least 16 (pixels)")
        self.model = model
        self.root = str(root)
        self.image_size = image_size
        self.pretrained_weights = None if pretrained_weights is None else str(pretrained_weights)
        self.augment = bool(augment)
        self.input_shape = (3, image_size, image_size)
        self.input_contract = (
            "a uint8 array of RGB images shaped (N, H, W, 3) with values 0 to 255, any H and W, as "
            "numpy.asarray(PIL.Image.open(path).convert('RGB')) gives them (resized so the short side is "
            f"{round(image_size / 0.875)}, centre-cropped to {image_size}x{image_size} and normalised inside); "
            "returns each image's class index, the position of its class folder in sorted order")
        self._classes: list[str] | None = None

    # ------------------------------------------------------------------ classes
    @property
    def classes(self) -> list[str]:
        """Class names = the sub-folders of ``<root>/train``, sorted; scanned once, on first use."""
        if self._classes is None:
            from torchvision.datasets.folder import find_classes

            train_dir = os.path.join(self.root, "train")
            if not os.path.isdir(train_dir):
                raise TaskError(self._missing_dir_message(train_dir))
            try:
                self._classes = find_classes(train_dir)[0]
            except FileNotFoundError as exc:  # a train dir without any class sub-folder
                raise TaskError(f"task imagefolder: {exc}; expected {train_dir}/<class_name>/<images>") from exc
        return self._classes

    @property
    def num_classes(self) -> int:  # type: ignore[override]  # a lazy property instead of a constant
        return len(self.classes)

    def _missing_dir_message(self, path: str) -> str:
        return (
            f"task imagefolder: folder {os.path.abspath(path)} does not exist. Expected "
            f"{os.path.abspath(self.root)}/train/<class>/<images> and "
            f"{os.path.abspath(self.root)}/val/<class>/<images>, with the same class folders in both; "
            "set task.args.root to the folder that holds train/ and val/"
        )

    # ------------------------------------------------------------------- models
    def build_model(self) -> nn.Module:
        from torchvision.models import get_model

        model = get_model(self.model, weights=None, num_classes=self.num_classes)
        if self.pretrained_weights is not None:
            load_pretrained(model, self.pretrained_weights)
        return model

    def backbone(self, model: nn.Module) -> nn.Module | None:
        """Everything but the head (``fc`` for resnets, ``classifier`` for most others), or None.

        None when no ``pretrained_weights`` were given: a randomly initialised backbone gains
        nothing from a smaller learning rate or a freeze phase (see ``Task.backbone``).

        The returned ``nn.ModuleDict`` holds the model's own child modules (no copies), so
        ``set(task.backbone(model).parameters())`` is exactly the set of backbone Parameter
        objects: the trainer puts them in their own optimizer group (``backbone_lr_mult``) and
        sets ``requires_grad=False`` on them to freeze. It is a parameter container, not a
        runnable feature extractor -- do not call it.
        """
        if self.pretrained_weights is None:
            return None
        from torch import nn

        model = _unwrap(model)
        head = head_attr(model)
        return nn.ModuleDict({n: m for n, m in model.named_children() if n != head})

    # --------------------------------------------------------------------- data
    def transforms(self):
        """``(train_transform, val_transform)``: ImageNet-style crops at ``image_size``."""
        from torchvision import transforms as T

        normalize = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        # Resize the short side to size/0.875 then centre-crop: torchvision's evaluation recipe.
        val = T.Compose([T.Resize(round(self.image_size / 0.875)), T.CenterCrop(self.image_size), *normalize])
        if not self.augment:
            return val, val
        train = T.Compose([T.RandomResizedCrop(self.image_size), T.RandomHorizontalFlip(), *normalize])
        return train, val

    def datasets(self):
        from torchvision.datasets import ImageFolder

        classes = self.classes  # checks root/train
        val_dir = os.path.join(self.root, "val")
        if not os.path.isdir(val_dir):
            raise TaskError(self._missing_dir_message(val_dir))
        train_tf, val_tf = self.transforms()
        try:
            train = ImageFolder(os.path.join(self.root, "train"), transform=train_tf)
            val = ImageFolder(val_dir, transform=val_tf)
        except FileNotFoundError as exc:  # raised for a class folder without any image
            raise TaskError(f"task imagefolder: {exc}") from exc
        if val.classes != classes:
            # ImageFolder numbers classes by sorted folder name within each split, so any
            # difference would silently map val labels onto the wrong classes.
            only_train = sorted(set(classes) - set(val.classes))
            only_val = sorted(set(val.classes) - set(classes))
            raise TaskError(
                f"task imagefolder: train and val must have the same class folders; "
                f"only in train: {only_train or 'none'}, only in val: {only_val or 'none'} "
                f"(under {os.path.abspath(self.root)})"
            )
        return train, val

    def preprocess(self, natural):
        """uint8 RGB images (N, H, W, 3), or a sequence of (H, W, 3) images of any sizes, -> the
        (N, 3, image_size, image_size) batch the validation transform makes of them (through PIL,
        as ``datasets()`` does: resize, centre crop, normalisation)."""
        return preprocess_images(natural, self.transforms()[1])

    def natural_examples(self, n: int):
        """Up to ``n`` validation images of the first one's size, uint8 (k, H, W, 3) as the dataset's
        loader reads them; None without the local data."""
        val_dir = os.path.join(self.root, "val")
        if n <= 0 or not os.path.isdir(val_dir):
            return None
        import numpy as np
        from torchvision.datasets import ImageFolder

        try:
            val = ImageFolder(val_dir)
        except FileNotFoundError:  # no image in a class folder: datasets() says so
            return None
        images = [np.asarray(val.loader(path)) for path, _ in val.samples[:4 * n]]
        return same_size_batch(images, n)

    def describe(self) -> dict[str, Any]:
        return {"task": self.name, "model": self.model, "root": self.root, "image_size": self.image_size,
                "pretrained_weights": self.pretrained_weights, "augment": self.augment}


def _unwrap(model: nn.Module) -> nn.Module:
    """The user model inside a torch.compile / DistributedDataParallel wrapper."""
    from torch import nn

    model = getattr(model, "_orig_mod", model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


def _read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Load a state dict (or a checkpoint that nests one) from a local file, tensors only."""
    import torch

    if not os.path.isfile(path):
        raise TaskError(
            f"task.args.pretrained_weights: file {os.path.abspath(path)} does not exist "
            "(a local state_dict saved with torch.save; nothing is downloaded)"
        )
    try:
        # weights_only=True: unpickling an arbitrary file could run code; tensors and dicts suffice.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors have many types; all mean "not a usable file"
        raise TaskError(f"task.args.pretrained_weights: cannot load {os.path.abspath(path)} "
                        f"as a state dict ({exc})") from exc
    for key in _NESTED_STATE_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise TaskError(
            f"task.args.pretrained_weights: {os.path.abspath(path)} holds no state dict "
            f"(expected a dict of tensors, optionally under one of {', '.join(_NESTED_STATE_KEYS)})"
        )
    out = {}
    for name, tensor in state.items():
        for prefix in _WRAPPER_PREFIXES:
            while name.startswith(prefix):
                name = name[len(prefix):]
        out[name] = tensor
    return out


def load_pretrained(model: nn.Module, path: str) -> list[str]:
    """Copy weights from the local file ``path`` into ``model``; return the skipped head keys.

    Head entries whose shape differs from the model's (e.g. a 1000-class ImageNet head vs.
    this folder's classes) are skipped, leaving the new head randomly initialised. Any other
    mismatch -- a missing or unexpected backbone key, a backbone shape difference -- means the
    file is for another architecture and raises TaskError rather than training half-loaded.
    """
    state = _read_state_dict(path)
    own = model.state_dict()
    head_prefix = head_attr(model) + "."
    skipped = [k for k in state if k.startswith(head_prefix) and k in own and state[k].shape != own[k].shape]
    for key in skipped:
        del state[key]
    unexpected = sorted(set(state) - set(own))
    missing = sorted(k for k in set(own) - set(state) if not k.startswith(head_prefix))
    wrong_shape = sorted(k for k in state if k in own and state[k].shape != own[k].shape)
    if unexpected or missing or wrong_shape:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")

        problems = [f"{len(keys)} {what}: {few(keys)}" for what, keys in
                    (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong_shape))
                    if keys]
        raise TaskError(
            f"task.args.pretrained_weights: {os.path.abspath(path)} does not fit model "
            f"{type(model).__name__} ({'; '.join(problems)}); was it saved from the same task.model?"
        )
    model.load_state_dict(state, strict=False)  # strict=False only because head keys may be absent
    return skipped


@register("imagefolder")
def make_imagefolder(model: str = "resnet18", root: str = "data", image_size: int = 224,
                     pretrained_weights: str | None = None, augment: bool = True) -> ImageFolderTask:
    return ImageFolderTask(model=model, root=root, image_size=image_size,
                           pretrained_weights=pretrained_weights, augment=augment)
