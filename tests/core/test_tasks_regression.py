"""The diabetes task (regression): its data and split, the natural input and preprocess, the loss
in standardised units, predictions and metrics in the target's units, and a short training run."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from core.config import TrainConfig
from core.metrics import reported_metrics
from core.tasks import diabetes
from core.tasks.base import TaskError, builtin_task_names, make_task
from core.tasks.diabetes import DiabetesTask, load_split, split_cache_file


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _stack(ds) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.stack([ds[i][1] for i in range(len(ds))])


def test_registered_with_its_models_and_arguments():
    assert "diabetes" in builtin_task_names()
    task = make_task("diabetes", model="linear", args={"val_fraction": 0.25})
    assert isinstance(task, DiabetesTask) and task.input_shape == (10,) and task.num_classes == 0
    assert "load_diabetes(scaled=False)" in task.input_contract
    with pytest.raises(TaskError, match="not offered"):
        make_task("diabetes", model="cnn")
    with pytest.raises(ValueError, match="val_fraction"):
        DiabetesTask(val_fraction=1.0)


def test_the_data_is_scikit_learns_raw_diabetes_split_by_split_seed(cache_dir):
    from sklearn.datasets import load_diabetes

    data = load_diabetes(scaled=False)
    x, y, train, val = load_split(0.2, 0)
    assert np.array_equal(x, data.data) and np.array_equal(y, data.target)
    assert len(val) == 88 and len(train) == 354 and not set(train) & set(val)
    assert split_cache_file(0.2, 0).is_file()
    again = load_split(0.2, 0)  # from the cache file
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip((x, y, train, val), again, strict=True))
    assert not np.array_equal(load_split(0.2, 1)[3], val)  # another seed, another split


def test_datasets_are_deterministic_and_the_same_without_the_cache(cache_dir, monkeypatch):
    first = DiabetesTask().datasets()
    monkeypatch.setattr(diabetes, "split_cache_file", lambda *_: None)
    second = DiabetesTask().datasets()
    for a, b in zip(first, second, strict=True):
        (xa, ya), (xb, yb) = _stack(a), _stack(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.dtype == torch.float32 and xa.shape[1:] == (10,) and ya.dtype == torch.float32 and ya.ndim == 1
    x_train, y_train = _stack(first[0])
    # Standardised with the train split's own statistics; targets stay in natural units.
    assert torch.allclose(x_train.mean(0), torch.zeros(10), atol=1e-5)
    assert torch.allclose(x_train.std(0, unbiased=False), torch.ones(10), atol=1e-4)
    assert 25 <= float(y_train.min()) and float(y_train.max()) <= 346


def test_preprocess_of_the_natural_examples_is_the_validation_input(cache_dir):
    task = DiabetesTask()
    x_val, _ = _stack(task.datasets()[1])
    natural = task.natural_examples(1000)
    assert natural.shape == (88, 10) and natural.dtype == torch.float64  # as load_diabetes gives them
    assert 19 <= float(natural[:, 0].min()) and float(natural[:, 0].max()) <= 79  # age in years: natural units
    assert torch.equal(task.preprocess(natural), x_val)
    assert torch.equal(task.preprocess(natural.float()), x_val)  # float32 rows work the same
    assert torch.equal(task.natural_examples(5), natural[:5])


def test_loss_is_a_scalar_in_standardised_units_and_postprocess_gives_natural_units(cache_dir):
    task = DiabetesTask()
    _, y_val = _stack(task.datasets()[1])
    loss = task.make_loss(TrainConfig())
    _, _, mean, std = task._stats()
    standardised = ((y_val - mean) / std).unsqueeze(1)  # the output a perfect model gives
    assert loss(standardised, y_val).ndim == 0 and float(loss(standardised, y_val)) < 1e-10
    assert float(loss(torch.zeros_like(standardised), y_val)) == pytest.approx(
        float(((y_val - mean) / std).pow(2).mean()), rel=1e-5)
    predictions = task.postprocess(standardised)
    assert predictions.shape == y_val.shape and torch.allclose(predictions, y_val, atol=1e-3)


def test_metrics_rmse_and_mae_minimise_and_are_in_the_targets_units(cache_dir):
    task = DiabetesTask()
    metrics = task.metrics()
    assert set(metrics) == {"rmse", "mae"}
    assert all(m.higher_is_better is False for m in metrics.values())  # minimize
    assert {k: reported_metrics(task)[k] for k in ("val_rmse", "val_mae")} == {"val_rmse": False, "val_mae": False}
    target = torch.tensor([100.0, 200.0, 50.0, 150.0])
    for m in metrics.values():
        m.update(target.clone(), target)
    assert float(metrics["rmse"].compute()) == 0.0 and float(metrics["mae"].compute()) == 0.0
    fresh = task.metrics()
    for m in fresh.values():  # updated in two batches, as validation does
        m.update(target[:3] + torch.tensor([10.0, -10.0, 0.0]), target[:3])
        m.update(target[3:] + 20.0, target[3:])
    assert float(fresh["rmse"].compute()) == pytest.approx(math.sqrt((100 + 100 + 0 + 400) / 4))
    assert float(fresh["mae"].compute()) == pytest.approx(10.0)


@pytest.mark.parametrize("model", ["mlp", "linear"])
def test_models_map_rows_to_one_output(model):
    torch.manual_seed(0)
    net = DiabetesTask(model=model, width=8, depth=3, dropout=0.1).build_model().eval()
    assert net(torch.randn(5, 10)).shape == (5, 1)
    assert DiabetesTask(model=model).describe()["model"] == model


@pytest.mark.parametrize(("model", "lr"), [("mlp", 2e-3), ("linear", 3e-2)])
def test_a_short_training_run_lowers_the_validation_rmse(model, lr, cache_dir, tmp_path):
    from core.train import train

    task = DiabetesTask(model=model, width=32)
    cfg = TrainConfig(epochs=6, batch_size=32, lr=lr, optimizer="adamw", scheduler="constant", num_workers=0,
                      seed=0, monitor="val_rmse", monitor_mode="min", export_onnx=model == "mlp")
    result = train(task, cfg, out_dir=tmp_path)
    rmse = [epoch["val_rmse"] for epoch in result.history]
    loss = [epoch["val_loss"] for epoch in result.history]
    assert result.status == "completed" and loss[-1] < loss[0] and rmse[-1] < rmse[0], (rmse, loss)
    assert 40.0 < min(rmse) < 65.0  # the target's units: its standard deviation is 77
    assert result.best_metric == min(rmse) and result.confusion_matrix is None  # no classes to count
    if model == "mlp":
        assert result.onnx is not None and result.onnx.passed
