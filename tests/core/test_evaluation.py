"""Confusion matrix and atomic JSON writes."""
from __future__ import annotations

import errno
import json
import math
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from core.evaluation import confusion_matrix, save_json_atomic
from core.io_utils import atomic_write_bytes
from core.tasks.tensor_data import TensorPairDataset


class _Lookup(nn.Module):
    """Predicts the class stored in the input's first feature: a model with known outputs."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return nn.functional.one_hot(x[:, 0].long(), self.num_classes).float() + 0 * self.dummy


def test_confusion_matrix_matches_hand_count():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 0])
    preds = torch.tensor([0, 1, 0, 1, 2, 2, 2, 0, 2, 0])
    ds = TensorPairDataset(preds.float().unsqueeze(1), labels)
    model = _Lookup(4)
    model.train()
    matrix, acc = confusion_matrix(model, DataLoader(ds, batch_size=3), num_classes=4, device="cpu")
    assert matrix == [
        [3, 1, 0, 0],  # class 0: 4 samples, one predicted as 1
        [0, 1, 1, 0],
        [1, 0, 3, 0],
        [0, 0, 0, 0],  # class 3 never occurs
    ]
    assert sum(map(sum, matrix)) == len(ds)
    assert acc[:3] == [3 / 4, 1 / 2, 3 / 4]
    assert math.isnan(acc[3])
    assert model.training, "the model's train mode must be restored"


def test_confusion_matrix_on_a_real_model_sums_to_samples():
    torch.manual_seed(0)
    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    model = nn.Sequential(nn.Linear(6, 3))
    matrix, acc = confusion_matrix(model, DataLoader(TensorPairDataset(x, y), batch_size=16), 3, torch.device("cpu"))
    assert sum(map(sum, matrix)) == 50
    assert [sum(row) for row in matrix] == torch.bincount(y, minlength=3).tolist()
    with torch.no_grad():
        pred = model(x).argmax(1)
    for c in range(3):
        expected = ((pred == c) & (y == c)).sum().item() / (y == c).sum().item()
        assert acc[c] == pytest.approx(expected)


def test_confusion_matrix_rejects_out_of_range_labels():
    ds = TensorPairDataset(torch.zeros(2, 1), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="labels must be in"):
        confusion_matrix(_Lookup(3), DataLoader(ds, batch_size=2), 3, "cpu")


def test_save_json_atomic_writes_strict_json(tmp_path):
    target = tmp_path / "cm.json"
    save_json_atomic({"acc": [0.5, float("nan")], "n": np.int64(3), "arr": np.array([1.0, 2.0]),
                      "path": tmp_path}, target)
    data = json.loads(target.read_text())  # the default parser would also accept NaN; check the text
    assert "NaN" not in target.read_text()
    assert data == {"acc": [0.5, None], "n": 3, "arr": [1.0, 2.0], "path": str(tmp_path)}
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o644)
    assert os.listdir(tmp_path) == ["cm.json"]


def test_save_json_atomic_unserialisable_leaves_old_file(tmp_path):
    target = tmp_path / "cm.json"
    save_json_atomic({"v": 1}, target)
    with pytest.raises(TypeError):
        save_json_atomic({"v": object()}, target)
    assert json.loads(target.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["cm.json"]


def test_atomic_write_enospc_keeps_previous_file_and_removes_temp(tmp_path):
    target = tmp_path / "matrix.json"
    save_json_atomic({"v": "old"}, target)

    def full_disk(f):
        f.write(b'{"v": "ne')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as info:
        atomic_write_bytes(target, full_disk)
    assert info.value.errno == errno.ENOSPC
    assert json.loads(target.read_text()) == {"v": "old"}
    assert os.listdir(tmp_path) == ["matrix.json"]


def test_atomic_write_keeps_existing_mode(tmp_path):
    target = tmp_path / "secret.json"
    target.write_text("{}")
    os.chmod(target, 0o600)
    atomic_write_bytes(target, lambda f: f.write(b"{}"))
    assert os.stat(target).st_mode & 0o777 == 0o600
