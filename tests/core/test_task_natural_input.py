"""Natural input of the built-in tasks (issue 24): ``preprocess`` of what a user has gives exactly
the model input ``datasets()`` yields, and ``natural_examples`` are validation inputs in those units.
Image tasks run on small images generated here (nothing is downloaded)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from core.tasks.cifar10 import CIFAR10Task
from core.tasks.digits import DigitsTask, load_split
from core.tasks.imagefolder import ImageFolderTask
from core.tasks.synthetic import SyntheticTask


def _stacked(ds) -> torch.Tensor:
    return torch.stack([ds[i][0] for i in range(len(ds))])


# ---------------------------------------------------------------------------------- digits


def test_digits_preprocess_of_the_raw_pixels_is_the_dataset_bit_for_bit():
    from sklearn.datasets import load_digits

    task = DigitsTask(model="cnn")
    train, val = task.datasets()
    images, _, idx_train, idx_val = load_split(0.2, 0)
    raw = load_digits().images  # float64, 0..16: what a user has
    assert torch.equal(task.preprocess(torch.from_numpy(raw[idx_val])), _stacked(val))
    assert torch.equal(task.preprocess(torch.from_numpy(raw[idx_train])), _stacked(train))
    # and the dataset is what it was before preprocess existed: (x / 16 - 0.5) / 0.5 in float32, in numpy
    before = torch.from_numpy((images.astype(np.float32) / 16.0 - 0.5) / 0.5).unsqueeze(1)
    assert torch.equal(_stacked(val), before[idx_val]) and torch.equal(_stacked(train), before[idx_train])
    assert _stacked(val).dtype == torch.float32 and _stacked(val).shape[1:] == (1, 8, 8)


def test_digits_preprocess_takes_flat_rows_and_integers_and_refuses_other_shapes():
    task = DigitsTask()
    raw = task.natural_examples(20)
    expected = task.preprocess(raw)
    assert torch.equal(task.preprocess(raw.reshape(20, 64)), expected)
    assert torch.equal(task.preprocess(raw.to(torch.uint8)), expected)
    assert torch.equal(task.preprocess(raw.numpy().astype(np.int64)), expected)
    with pytest.raises(ValueError, match=r"\(N, 8, 8\) or \(N, 64\)"):
        task.preprocess(torch.zeros(3, 8, 7))


def test_digits_natural_examples_are_validation_images_as_scikit_learn_gives_them():
    from sklearn.datasets import load_digits

    task = DigitsTask(val_fraction=0.25, split_seed=1)
    _, _, _, idx_val = load_split(0.25, 1)
    examples = task.natural_examples(8)
    assert examples.dtype == torch.float64 and examples.shape == (8, 8, 8)
    assert np.array_equal(examples.numpy(), load_digits().images[idx_val[:8]])
    _, val = task.datasets()
    assert torch.equal(task.preprocess(examples), _stacked(val)[:8])
    assert "load_digits().images" in task.input_contract and "0 to 16" in task.input_contract


# ---------------------------------------------------------------------------------- cifar10


@pytest.fixture
def fake_cifar(tmp_path, monkeypatch):
    """CIFAR-10's python layout with tiny batches (torchvision's md5 checks patched away)."""
    import pickle

    from torchvision.datasets import CIFAR10

    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        with open(d / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8), "labels": list(range(6))}, f)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    monkeypatch.setattr(CIFAR10, "train_list", [[n, None] for n in names[:5]])
    monkeypatch.setattr(CIFAR10, "test_list", [[names[5], None]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": None})
    return tmp_path


def test_cifar10_preprocess_of_uint8_hwc_images_is_the_val_dataset_bit_for_bit(fake_cifar):
    task = CIFAR10Task(root=str(fake_cifar))
    _, val = task.datasets()
    natural = task.natural_examples(100)
    assert natural.dtype == torch.uint8 and natural.shape == (6, 32, 32, 3)
    assert torch.equal(task.preprocess(natural), _stacked(val))
    assert torch.equal(task.preprocess(natural.numpy().astype(np.int64)), _stacked(val))  # integers 0..255
    assert task.natural_examples(2).shape == (2, 32, 32, 3)
    with pytest.raises(ValueError, match="uint8 pixel values 0 to 255"):
        task.preprocess(natural.float() / 255)
    with pytest.raises(ValueError, match="add the batch axis"):
        task.preprocess(natural[0])


def test_cifar10_without_data_gives_no_natural_examples(tmp_path):
    assert CIFAR10Task(root=str(tmp_path / "nowhere")).natural_examples(8) is None


# ------------------------------------------------------------------------------ imagefolder


def _write_folder(root, sizes=((40, 30), (40, 30), (64, 50), (33, 47))):
    """PNG images (lossless, so reading one back gives the array written) of several sizes (w, h)."""
    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = root / split / c
            d.mkdir(parents=True)
            for i, (w, h) in enumerate(sizes):
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return root


def test_imagefolder_preprocess_resizes_crops_and_normalises_like_the_val_dataset(tmp_path):
    root = _write_folder(tmp_path)
    task = ImageFolderTask(model="resnet18", root=str(root), image_size=24)
    _, val = task.datasets()
    expected = _stacked(val)
    assert expected.shape == (8, 3, 24, 24)
    natural = [np.asarray(Image.open(path).convert("RGB")) for path, _ in val.samples]
    assert torch.equal(task.preprocess(natural), expected)  # a list of images of any sizes
    same = torch.from_numpy(np.stack(natural[:2]))  # one batch of equal sizes
    assert torch.equal(task.preprocess(same), expected[:2])
    examples = task.natural_examples(8)
    assert examples.dtype == torch.uint8 and examples.shape == (4, 30, 40, 3)  # those of the first one's size
    assert torch.equal(task.preprocess(examples), expected[[0, 1, 4, 5]])
    assert "any H and W" in task.input_contract and "24x24" in task.input_contract
    assert task.natural_input.shapes == ((-1, -1, 3),) and task.natural_input.kinds == "iu"


def test_imagefolder_without_data_gives_no_natural_examples(tmp_path):
    assert ImageFolderTask(root=str(tmp_path / "nowhere")).natural_examples(8) is None


# -------------------------------------------------------------------------------- synthetic


def test_synthetic_natural_input_is_the_model_input():
    task = SyntheticTask(shape=(3, 4, 4), n_train=16, n_val=8)
    _, val = task.datasets()
    examples = task.natural_examples(5)
    assert torch.equal(examples, _stacked(val)[:5]) and torch.equal(task.preprocess(examples), examples)
    assert "preprocess is the identity" in task.input_contract and "(N, 3, 4, 4)" in task.input_contract
