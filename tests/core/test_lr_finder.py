"""LR range test: leaves the caller's objects alone, stops on divergence, suggests a good rate."""
from __future__ import annotations

import itertools

import pytest
import torch

from core.lr_finder import lr_range_test, suggest_steepest, suggest_valley
from core.tasks.digits import DigitsTask
from core.train import train
from tests.core.helpers import fast_config


class _CountingDigits(DigitsTask):
    def __init__(self):
        super().__init__("cnn")
        self.built = []

    def build_model(self):
        model = super().build_model()
        self.built.append(model)
        return model


def test_range_test_builds_a_fresh_model_and_leaves_the_callers_untouched():
    task = _CountingDigits()
    torch.manual_seed(0)
    callers_model = task.build_model()
    before = {k: v.clone() for k, v in callers_model.state_dict().items()}
    result = lr_range_test(task, fast_config(), num_steps=30, max_epochs=None)
    assert len(task.built) == 2 and task.built[1] is not callers_model
    assert all(torch.equal(before[k], v) for k, v in callers_model.state_dict().items())
    assert result.lrs[0] == pytest.approx(1e-7)
    assert all(b > a for a, b in itertools.pairwise(result.lrs))  # exponential ramp


def test_divergence_stops_early():
    result = lr_range_test(DigitsTask("cnn"), fast_config(), num_steps=200, max_epochs=None, end_lr=100.0)
    assert result.stopped_early
    assert result.steps < 200
    assert max(result.smoothed) > 4 * min(result.smoothed) or not all(map(float.__eq__, result.losses, result.losses))


def test_cost_is_bounded_to_one_epoch_by_default():
    result = lr_range_test(DigitsTask("cnn"), fast_config(batch_size=32))
    assert result.epochs_cost <= 1.0


def test_suggestion_is_within_a_factor_of_3_of_the_best_rate_of_a_grid():
    cfg = fast_config(epochs=2, batch_size=32, scheduler="constant", weight_decay=5e-4)
    task = DigitsTask("cnn")
    suggestion = lr_range_test(task, cfg).suggestion
    grid = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    val_loss = {lr: train(task, fast_config(epochs=2, batch_size=32, scheduler="constant", weight_decay=5e-4,
                                            lr=lr)).metrics["val_loss"] for lr in grid}
    best = min(val_loss, key=val_loss.get)
    assert best / 3 <= suggestion * (1 + 1e-9) and suggestion <= best * 3, (suggestion, val_loss)  # inclusive, up to FP


def test_rules_on_a_synthetic_curve():
    lrs = [10 ** (-6 + 6 * i / 99) for i in range(100)]
    # Flat, then a steep fall centred at 1e-3, then a blow-up after 1e-1.
    import math

    loss = [2.0 - 1.5 / (1 + math.exp(-(math.log10(lr) + 3) * 4)) + (5 * (lr - 0.1) if lr > 0.1 else 0) for lr in lrs]
    steep = suggest_steepest(lrs, loss)
    assert 3e-4 < steep < 3e-3
    valley = suggest_valley(lrs, loss)
    assert 1e-4 < valley < 1e-1


def test_minimum_rule_is_a_tenth_of_the_lowest_smoothed_loss():
    from core.lr_finder import suggest_all, suggest_minimum

    lrs = [10 ** (-6 + 6 * i / 99) for i in range(100)]
    loss = [abs(i - 80) + 1.0 for i in range(100)]  # lowest at index 80
    assert suggest_minimum(lrs, loss) == pytest.approx(lrs[80] / 10)
    assert set(suggest_all(lrs, loss)) == {"steepest", "valley", "minimum"}
