"""NaN or infinity in a task's data is a problem of the data, reported as one: the run fails with
DataError naming the dataset and the count (a sweep marks the trial FAIL with that reason), not
"diverged: non-finite loss", which a study would take as a result about its hyperparameters."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import IterableDataset

from core.reporting import RecordingReporter
from core.tasks.base import DataError
from core.tasks.synthetic import SyntheticTask
from core.train import train
from tests.core.helpers import fast_config
from tests.sweeps.check_tasks import NanInputs


def test_nan_in_in_memory_training_data_fails_the_run_before_any_step_naming_the_dataset_and_count():
    rec = RecordingReporter()
    with pytest.raises(DataError) as caught:
        train(NanInputs("mlp"), fast_config(epochs=1), rec)
    assert str(caught.value) == (
        "task 'digits': its train dataset (digits-train) holds 4 NaN or infinite values (4 in its inputs), in 3 of "
        "its 1437 samples (the first: sample 5): a problem of the data, not of the hyperparameters (every step on "
        "them gives a non-finite loss); drop or repair those samples in datasets()")
    assert rec.steps == [] and rec.epochs == []


class _NanTargets(SyntheticTask):
    """A regression-like task whose validation targets hold an infinity (TensorDataset)."""

    def datasets(self):
        from torch.utils.data import TensorDataset

        train_ds, val_ds = super().datasets()
        y = val_ds.y.float()
        y[3] = float("inf")
        return train_ds, TensorDataset(val_ds.x, y)


def test_an_infinite_validation_target_is_refused_too():
    with pytest.raises(DataError, match=r"its validation dataset \(synthetic-val\) holds 1 NaN or infinite values "
                                         r"\(1 in its targets\), in 1 of its 8 samples \(the first: sample 3\)"):
        train(_NanTargets("mlp", shape=(8,), n_train=32, n_val=8), fast_config(epochs=1))


class _Stream(IterableDataset):
    """64 samples read one by one (not in memory); sample 20 holds a NaN."""

    def __len__(self) -> int:
        return 64

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for i in range(64):
            x = torch.randn(8, generator=gen)
            if i == 20:
                x[2] = float("nan")
            yield x, i % 4


class _StreamTask(SyntheticTask):
    def datasets(self):
        return _Stream(), _Stream()


def test_nan_in_a_stream_stops_at_its_step_as_a_data_problem_with_the_batchs_record(tmp_path):
    rec = RecordingReporter()
    task = _StreamTask("mlp", shape=(8,), num_classes=4)
    with pytest.raises(DataError) as caught:
        train(task, fast_config(epochs=2, batch_size=16, max_steps_per_epoch=4), rec, out_dir=tmp_path)
    message = str(caught.value)
    assert message.startswith("the train dataset holds NaN or infinite values: the micro-batch 1 of epoch 1 "
                              "(step 2) has 1 in its inputs, so its loss is nan: a problem of the data"), message
    assert len(rec.steps) == 1  # the first batch trained; the second, holding sample 20, stopped the run
    record = json.loads((tmp_path / "diverged.json").read_text())
    assert record["input_stats"]["nonfinite"] == 1 and record["global_step"] == 2
