"""The digits task's cached split: the same arrays scikit-learn gives, rebuilt when damaged,
and no scikit-learn import in a worker once the cache holds the split."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.tasks import digits
from core.tasks.digits import DigitsTask, load_split, split_cache_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SWEEPS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same(a: tuple, b: tuple) -> bool:
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


def test_cached_split_is_what_scikit_learn_gives(cache_dir):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    train, val = train_test_split(np.arange(1797), test_size=0.2, random_state=0, stratify=data.target)
    first = load_split(0.2, 0)
    path = split_cache_file(0.2, 0)
    assert path.is_file() and path.parent.parent == cache_dir
    again = load_split(0.2, 0)  # read back from the file
    assert _same(first, again)
    assert np.array_equal(again[0], data.images) and np.array_equal(again[1], data.target)
    assert np.array_equal(again[2], train) and np.array_equal(again[3], val)
    assert len(again[3]) == 360 and np.bincount(again[1][again[3]]).min() >= 35  # stratified


def test_datasets_are_identical_with_and_without_the_cache(cache_dir, monkeypatch):
    cold = DigitsTask("mlp").datasets()  # computes and writes the cache
    warm = DigitsTask("mlp").datasets()
    monkeypatch.setattr(digits, "split_cache_file", lambda *_: None)
    none = DigitsTask("mlp").datasets()
    for a, b, c in zip(cold, warm, none, strict=True):
        x = [torch.stack([a[i][0] for i in range(len(a))]) for a in (a, b, c)]
        y = [torch.tensor([a[i][1] for i in range(len(a))]) for a in (a, b, c)]
        assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2])
        assert torch.equal(y[0], y[1]) and torch.equal(y[0], y[2])
    assert float(x[0].min()) == -1.0 and float(x[0].max()) == 1.0


def test_each_split_has_its_own_file(cache_dir):
    a, b = load_split(0.2, 0), load_split(0.2, 1)
    assert split_cache_file(0.2, 0) != split_cache_file(0.2, 1)
    assert not np.array_equal(a[3], b[3])
    assert len(load_split(0.3, 0)[3]) == 540


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_arrays", "float_indices"])
def test_a_damaged_cache_file_is_rebuilt(cache_dir, damage):
    good = load_split(0.2, 0)
    path = split_cache_file(0.2, 0)
    if damage == "garbage":
        path.write_bytes(b"not an npz file")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "wrong_arrays":  # a readable file whose arrays do not fit together
        np.savez(path, images=good[0][:10], labels=good[1], train=good[2], val=good[3])
    else:  # the right numbers, but not as indices
        np.savez(path, images=good[0], labels=good[1], train=good[2].astype(float), val=good[3].astype(float))
    assert _same(load_split(0.2, 0), good)
    assert _same(load_split(0.2, 0), good)  # the file was replaced with a sound one
    assert not list(path.parent.glob(".*.tmp"))


def test_an_unwritable_cache_folder_is_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("SWEEPS_CACHE_DIR", str(blocker))
    first = load_split(0.2, 0)
    assert len(first[0]) == 1797 and not split_cache_file(0.2, 0).exists()


def _fresh_process(code: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SWEEPS_CACHE_DIR": str(cache)})


@pytest.mark.slow
def test_a_worker_with_the_cache_never_imports_scikit_learn(tmp_path):
    """Without the cache, digits' datasets() imports scikit-learn; with it, it does not."""
    code = ("import sys\n"
            "from core.tasks.base import make_task\n"
            "task = make_task('digits', model='mlp')\n"
            "task.datasets()\n"
            "print('datasets', 'sklearn' in sys.modules)\n")
    cold = _fresh_process(code, tmp_path / "cache")
    assert cold.returncode == 0 and cold.stdout.split() == ["datasets", "True"], cold.stderr
    warm = _fresh_process(code, tmp_path / "cache")
    assert warm.returncode == 0 and warm.stdout.split() == ["datasets", "False"], warm.stderr


def test_cnn_depth_adds_conv_blocks_and_depth_two_is_the_original_model():
    shallow, base, deep = (DigitsTask("cnn", width=8, depth=d).build_model() for d in (1, 2, 3))
    convs = [sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) for net in (shallow, base, deep)]
    assert convs == [1, 2, 3]
    # Depth 2 keeps the layer names and shapes of the model before depth existed: old checkpoints load.
    assert {k: tuple(v.shape) for k, v in base.state_dict().items() if k.startswith("features")} == {
        "features.0.weight": (8, 1, 3, 3), "features.0.bias": (8,), "features.1.weight": (8,), "features.1.bias": (8,),
        "features.1.running_mean": (8,), "features.1.running_var": (8,), "features.1.num_batches_tracked": (),
        "features.3.weight": (16, 8, 3, 3), "features.3.bias": (16,), "features.4.weight": (16,),
        "features.4.bias": (16,), "features.4.running_mean": (16,), "features.4.running_var": (16,),
        "features.4.num_batches_tracked": ()}
    x = torch.zeros(2, 1, 8, 8)
    assert [tuple(net.eval()(x).shape) for net in (shallow, base, deep)] == [(2, 10)] * 3
    count = [sum(p.numel() for p in net.parameters()) for net in (shallow, base, deep)]
    assert count[0] < count[1] < count[2]
    with pytest.raises(ValueError, match="task.args.depth: 0 is not allowed"):
        DigitsTask("cnn", depth=0)
    with pytest.raises(ValueError, match="use depth >= 1 with model cnn"):
        DigitsTask("mlp", depth=3)
