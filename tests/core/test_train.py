"""core.train: resume equivalence, accumulation equivalence, divergence, precision, accuracy."""
from __future__ import annotations

import math

import pytest
import torch

from core import checkpoint as ckpt
from core.reporting import Decision, RecordingReporter
from core.tasks.base import TaskError
from core.tasks.digits import DigitsTask
from core.tasks.synthetic import SyntheticTask
from core.train import train
from tests.core.helpers import fast_config


def _weights(path):
    return ckpt.load_checkpoint(path)["model"]


def test_resume_is_bitwise_identical_to_a_straight_run(tmp_path):
    task = DigitsTask("cnn")
    cfg = fast_config(epochs=4, scheduler="onecycle", lr=0.1, save_checkpoints=True, mixup_alpha=0.2)
    straight = train(task, cfg, out_dir=tmp_path / "straight")

    half = fast_config(epochs=4, scheduler="onecycle", lr=0.1, save_checkpoints=True, mixup_alpha=0.2)
    first = train(task, half, out_dir=tmp_path / "split", reporter=_StopAfter(epoch=2))
    assert first.status == "interrupted" and first.epochs_completed == 2
    resumed = train(task, half, out_dir=tmp_path / "split", resume=True)

    assert resumed.epochs_completed == 4 and resumed.steps_completed == straight.steps_completed
    a, b = _weights(tmp_path / "straight" / "last.pt"), _weights(tmp_path / "split" / "last.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed.history == straight.history or all(
        h1[k] == h2[k] for h1, h2 in zip(resumed.history, straight.history, strict=True) for k in h1 if "time" not in k
        and k not in ("samples_per_s", "peak_mem_mb"))


def test_resume_mid_epoch_after_interrupt_is_bitwise_identical(tmp_path):
    task = DigitsTask("mlp")
    cfg = fast_config(epochs=2, scheduler="cosine", warmup_epochs=0.5, save_checkpoints=True)
    straight = train(task, cfg, out_dir=tmp_path / "a")
    first = train(task, cfg, out_dir=tmp_path / "b", reporter=_InterruptAtStep(30))
    assert first.status == "interrupted" and first.steps_completed == 30
    resumed = train(task, cfg, out_dir=tmp_path / "b", resume=True)
    assert resumed.steps_completed == straight.steps_completed
    a, b = _weights(tmp_path / "a" / "last.pt"), _weights(tmp_path / "b" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.history[-1]["val_loss"] == straight.history[-1]["val_loss"]


def test_gradient_accumulation_matches_one_large_batch():
    # SGD without momentum state differences: 32 x 1 step against 8 x 4 micro-steps.
    task = SyntheticTask("mlp", shape=(16,), n_train=256, n_val=32)
    big = train(task, fast_config(epochs=1, batch_size=32, grad_accum_steps=1, lr=0.1, save_checkpoints=False),
                reporter=(rec_big := RecordingReporter()))
    small = train(task, fast_config(epochs=1, batch_size=8, grad_accum_steps=4, lr=0.1, save_checkpoints=False),
                  reporter=(rec_small := RecordingReporter()))
    assert big.steps_completed == small.steps_completed == 8
    # Same data order is not guaranteed between batch sizes, so compare on a fixed order:
    # the sampler shuffles indices identically (same seed, same epoch), and batches of 8 x 4
    # consume the same 32 indices per optimizer step as one batch of 32.
    for (_, m_big), (_, m_small) in zip(rec_big.steps, rec_small.steps, strict=True):
        assert m_big["train_loss"] == pytest.approx(m_small["train_loss"], abs=1e-6)
        assert m_big["grad_norm"] == pytest.approx(m_small["grad_norm"], abs=1e-5)
    assert big.metrics["val_loss"] == pytest.approx(small.metrics["val_loss"], abs=1e-6)


def test_accumulation_remainder_makes_a_final_smaller_step():
    task = SyntheticTask("mlp", shape=(8,), n_train=100, n_val=20)  # 13 micro-batches of 8
    result = train(task, fast_config(epochs=2, batch_size=8, grad_accum_steps=4))
    assert result.steps_completed == 2 * math.ceil(13 / 4)


def test_nan_loss_stops_the_run_with_its_reason_and_keeps_the_last_good_checkpoint(tmp_path):
    task = DigitsTask("mlp")
    train(task, fast_config(epochs=1, save_checkpoints=True), out_dir=tmp_path)
    good = _weights(tmp_path / "last.pt")
    poisoned = _PoisonedTask(after_calls=5)
    result = train(poisoned, fast_config(epochs=2, save_checkpoints=True), out_dir=tmp_path)
    assert result.status == "diverged"
    assert "non-finite loss nan at step" in result.reason
    after = _weights(tmp_path / "last.pt")
    assert all(torch.equal(good[k], after[k]) for k in good)


def test_bf16_autocast_trains_on_cpu():
    result = train(DigitsTask("cnn"), fast_config(epochs=2, precision="bf16", lr=0.1, scheduler="onecycle"))
    assert result.status == "completed"
    assert result.metrics["val_acc"] > 0.85


def test_fp16_on_cpu_is_refused_with_a_fix():
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="fp16.*CUDA.*bf16"):
        train(DigitsTask("mlp"), fast_config(precision="fp16"))


def test_digits_cnn_reaches_97_percent_within_10_epochs():
    result = train(DigitsTask("cnn"), fast_config(epochs=8, lr=0.3, scheduler="onecycle", weight_decay=5e-4,
                                                  monitor="val_acc", monitor_mode="max"))
    assert result.best_metric >= 0.97


def test_pruning_decision_stops_the_run():
    rec = RecordingReporter(prune_after_epoch=1)
    result = train(DigitsTask("mlp"), fast_config(epochs=5), reporter=rec)
    assert result.status == "pruned" and result.epochs_completed == 1
    assert len(rec.epochs) == 1


def test_step_and_epoch_metrics_are_reported():
    rec = RecordingReporter()
    result = train(DigitsTask("mlp"), fast_config(epochs=2), reporter=rec)
    assert [s for s, _ in rec.steps] == list(range(1, result.steps_completed + 1))
    assert set(rec.steps[0][1]) == {"train_loss", "lr", "grad_norm"}
    epoch_metrics = rec.epochs[-1][1]
    for key in ("train_loss", "val_loss", "val_acc", "lr", "samples_per_s", "epoch_time_s",
                "peak_mem_mb", "grad_norm"):
        assert key in epoch_metrics and math.isfinite(epoch_metrics[key])


def test_freeze_backbone_phase_keeps_backbone_weights_fixed_then_trains_them():
    task = _BackboneDigits()
    rec = _BackboneAtEpochEnd(task)
    built = task.build_model()  # seeded: the model train() builds starts with these weights
    initial, initial_head = _backbone_weights(built), _head_weights(built)
    result = train(task, fast_config(epochs=3, freeze_backbone_epochs=2, backbone_lr_mult=0.1), reporter=rec)
    assert result.status == "completed" and [e for e, _ in rec.epochs] == [1, 2, 3]
    assert initial and rec.backbone[1].keys() == initial.keys() and rec.head[1].keys() == initial_head.keys()
    # Epochs 1 and 2 (frozen): the backbone stays exactly as built while the head trains.
    for epoch in (1, 2):
        for name, w in rec.backbone[epoch].items():
            assert torch.equal(w, initial[name]), f"{name} changed in frozen epoch {epoch}"
    assert not all(torch.equal(w, initial_head[name]) for name, w in rec.head[1].items())
    assert not all(torch.equal(w, rec.head[1][name]) for name, w in rec.head[2].items())
    # Epoch 3 (after freeze_backbone_epochs): every backbone parameter trains.
    for name, w in rec.backbone[3].items():
        assert not torch.equal(w, initial[name]), f"{name} did not change in epoch 3, after the freeze"


def _backbone_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.features.named_parameters()}


def _head_weights(model) -> dict[str, torch.Tensor]:
    backbone = {id(p) for p in model.features.parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in backbone}


class _BackboneAtEpochEnd(RecordingReporter):
    """Copies the model's backbone and head weights as each epoch ends (report_epoch)."""

    def __init__(self, task: _BackboneDigits) -> None:
        super().__init__()
        self.task = task
        self.backbone: dict[int, dict[str, torch.Tensor]] = {}
        self.head: dict[int, dict[str, torch.Tensor]] = {}

    def report_epoch(self, epoch, step, metrics):
        self.backbone[epoch] = _backbone_weights(self.task.last_model)
        self.head[epoch] = _head_weights(self.task.last_model)
        return super().report_epoch(epoch, step, metrics)


@pytest.mark.parametrize("sizes, which", [((0, 64), "train"), ((256, 0), "validation")])
def test_an_empty_dataset_fails_before_any_step_naming_the_task_and_the_dataset(sizes, which):
    rec = RecordingReporter()
    task = SyntheticTask("mlp", shape=(8,), n_train=sizes[0], n_val=sizes[1])
    with pytest.raises(TaskError, match=rf"task 'synthetic' \(.*'n_train': {sizes[0]}.*\) returned an empty "
                                        rf"{which} dataset") as info:
        train(task, fast_config(epochs=1), rec)
    assert isinstance(info.value, ValueError)
    assert rec.steps == [] and rec.epochs == []


def test_a_step_limited_or_tiny_dataset_still_trains():
    tiny = train(SyntheticTask("mlp", shape=(8,), n_train=1, n_val=1), fast_config(epochs=1))
    assert tiny.status == "completed" and tiny.steps_completed == 1
    limited = train(DigitsTask("mlp"), fast_config(epochs=1, max_steps_per_epoch=3))
    assert limited.status == "completed" and limited.steps_completed == 3


class _StopAfter(RecordingReporter):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.stop_epoch = epoch

    def report_epoch(self, epoch, step, metrics):
        super().report_epoch(epoch, step, metrics)
        return Decision.INTERRUPT if epoch >= self.stop_epoch else Decision.CONTINUE


class _InterruptAtStep(RecordingReporter):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.stop_step = step

    def report_step(self, step, metrics):
        super().report_step(step, metrics)
        return Decision.INTERRUPT if step >= self.stop_step else Decision.CONTINUE


class _PoisonedTask(DigitsTask):
    """A digits MLP whose forward returns NaN after a number of calls."""

    def __init__(self, after_calls: int) -> None:
        super().__init__("mlp")
        self.after_calls = after_calls

    def build_model(self):
        model = super().build_model()
        calls = {"n": 0}

        def hook(_module, _inputs, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] > self.after_calls else output

        model.register_forward_hook(hook)
        return model


class _BackboneDigits(DigitsTask):
    def __init__(self) -> None:
        super().__init__("cnn")
        self.last_model = None

    def build_model(self):
        torch.manual_seed(0)
        self.last_model = super().build_model()
        return self.last_model

    def backbone(self, model):
        return model.features
