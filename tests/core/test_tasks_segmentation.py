"""The shapes task (semantic segmentation of generated images): the data and its determinism,
the natural input and preprocess, the per-pixel loss, postprocess, the metrics and their
directions, and the models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from core.config import TrainConfig
from core.metrics import reported_metrics
from core.tasks.base import TaskError, builtin_task_names, make_task
from core.tasks.shapes import CLASSES, ShapesTask, generate_shapes


def _stack(ds) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.stack([ds[i][1] for i in range(len(ds))])


def test_registered_with_its_models_and_arguments():
    assert "shapes" in builtin_task_names()
    task = make_task("shapes", model="fcn", args={"size": 24, "n_train": 8, "n_val": 4})
    assert isinstance(task, ShapesTask) and task.input_shape == (3, 24, 24) and task.num_classes == len(CLASSES)
    assert "uint8" in task.input_contract and "(N, H, W)" in task.input_contract
    with pytest.raises(TaskError, match="not offered"):
        make_task("shapes", model="resnet18")
    with pytest.raises(ValueError, match="multiple of 4"):
        ShapesTask(size=30)


def test_the_data_is_deterministic_and_holds_every_class():
    a, b = ShapesTask(n_train=64, n_val=32), ShapesTask(n_train=64, n_val=32)
    for split in ("train", "val"):
        (ia, ma), (ib, mb) = a.generate(split), b.generate(split)
        assert np.array_equal(ia, ib) and np.array_equal(ma, mb)
        assert ia.dtype == np.uint8 and ia.shape[1:] == (32, 32, 3) and ma.dtype == np.uint8
        assert set(np.unique(ma)) == set(range(len(CLASSES)))
    assert len(a.generate("train")[0]) == 64 and len(a.generate("val")[0]) == 32
    other = ShapesTask(n_train=64, n_val=32, data_seed=1)
    assert not np.array_equal(other.generate("val")[1], a.generate("val")[1])
    # Validation images do not depend on the size of the training set.
    assert np.array_equal(ShapesTask(n_train=8, n_val=32).generate("val")[0], a.generate("val")[0])
    assert not np.array_equal(a.generate("train")[0][:32], a.generate("val")[0])


def test_generated_shapes_are_the_masked_pixels():
    images, masks = generate_shapes(16, 32, 1, np.random.default_rng(0))
    for image, mask in zip(images, masks, strict=True):
        inside, outside = image[mask > 0].astype(float), image[mask == 0].astype(float)
        assert 0.02 < (mask > 0).mean() < 0.5
        assert np.abs(inside.mean(0) - outside.mean(0)).sum() > 60  # the shape stands out of the background


def test_datasets_are_preprocessed_natural_images_with_long_masks():
    task = ShapesTask(n_train=16, n_val=8)
    train, val = task.datasets()
    x, y = _stack(val)
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and -1.0 <= float(x.min()) <= float(x.max()) <= 1.0
    assert y.shape == (8, 32, 32) and y.dtype == torch.int64
    natural = task.natural_examples(100)
    assert natural.shape == (8, 32, 32, 3) and natural.dtype == torch.uint8
    assert torch.equal(task.preprocess(natural), x)
    assert torch.equal(y, torch.from_numpy(task.generate("val")[1]).long())
    assert len(train) == 16 and torch.equal(_stack(ShapesTask(n_train=16, n_val=8).datasets()[0])[0], _stack(train)[0])
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        task.preprocess(natural[0])


def test_loss_is_a_per_pixel_scalar_and_postprocess_gives_class_maps():
    task = ShapesTask(n_train=4, n_val=4)
    _, y = _stack(task.datasets()[1])
    perfect = torch.nn.functional.one_hot(y, len(CLASSES)).permute(0, 3, 1, 2).float() * 20.0
    loss = task.make_loss(TrainConfig())
    assert loss(perfect, y).ndim == 0 and float(loss(perfect, y)) < 1e-6
    assert float(loss(torch.zeros_like(perfect), y)) == pytest.approx(np.log(len(CLASSES)), rel=1e-5)
    predictions = task.postprocess(perfect)
    assert predictions.shape == y.shape and torch.equal(predictions, y)


def test_metrics_maximise_and_a_perfect_prediction_scores_one():
    task = ShapesTask(n_train=4, n_val=16)
    _, y = _stack(task.datasets()[1])
    metrics = task.metrics()
    assert set(metrics) == {"iou", "pixel_acc"} and all(m.higher_is_better for m in metrics.values())
    assert reported_metrics(task)["val_iou"] is True  # the declared directions agree with the metrics
    for m in metrics.values():
        m.update(y[:10].clone(), y[:10])
        m.update(y[10:].clone(), y[10:])
    assert float(metrics["iou"].compute()) == 1.0 and float(metrics["pixel_acc"].compute()) == 1.0
    background = task.metrics()
    for m in background.values():  # everything predicted background
        m.update(torch.zeros_like(y), y)
    share = float((y == 0).float().mean())
    assert float(background["pixel_acc"].compute()) == pytest.approx(share)
    assert float(background["iou"].compute()) == pytest.approx(share / len(CLASSES), rel=1e-5)  # mean over classes


@pytest.mark.parametrize("model", ["unet", "fcn"])
def test_models_give_per_pixel_logits_at_any_size(model):
    torch.manual_seed(0)
    net = ShapesTask(model=model, width=4).build_model().eval()
    with torch.no_grad():
        assert net(torch.randn(2, 3, 32, 32)).shape == (2, len(CLASSES), 32, 32)
        assert net(torch.randn(1, 3, 24, 16)).shape == (1, len(CLASSES), 24, 16)


def test_a_short_training_run_learns_to_segment(tmp_path):
    from core.train import train

    task = ShapesTask(width=8, size=24, n_train=256, n_val=48)
    cfg = TrainConfig(epochs=6, batch_size=16, lr=1e-2, optimizer="adamw", scheduler="constant", num_workers=0,
                      seed=0, monitor="val_iou", monitor_mode="max", export_onnx=True)
    result = train(task, cfg, out_dir=tmp_path)
    iou = [epoch["val_iou"] for epoch in result.history]
    loss = [epoch["val_loss"] for epoch in result.history]
    assert result.status == "completed" and loss[-1] < loss[0] and max(iou) > iou[0] + 0.1, (iou, loss)
    assert 0.0 <= min(iou) and max(iou) <= 1.0 and "val_pixel_acc" in result.history[-1]
    assert result.best_metric == max(iou)
    # The end-of-run confusion matrix counts every validation pixel; the ONNX model gives the same logits.
    assert sum(map(sum, result.confusion_matrix)) == 48 * 24 * 24 and len(result.per_class_acc) == len(CLASSES)
    assert result.onnx is not None and result.onnx.passed
