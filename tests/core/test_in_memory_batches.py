"""A dataset that is only tensors is gathered batch by batch without a DataLoader
(core/in_memory.py): the same batches in the same order, so a run trains bitwise the same as
through the loader; anything else still goes through the loader."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from core.data import TrainBatches, make_train_loader, make_val_loader
from core.distributed import DistContext
from core.finalize import batches_in_order
from core.in_memory import InMemoryBatches
from core.reporting import RecordingReporter
from core.tasks.digits import DigitsTask
from core.tasks.tensor_data import TensorPairDataset
from core.train import train
from tests.core.helpers import StopAt, fast_config

CPU = torch.device("cpu")
TIMINGS = ("samples_per_s", "epoch_time_s", "peak_mem_mb")


class ThroughLoader(TensorPairDataset):
    """The same data, but a subclass (which may override __getitem__): it goes through the DataLoader."""


class TensorsThroughLoader(TensorDataset):
    """Likewise for a TensorDataset."""


class DigitsThroughLoader(DigitsTask):
    def datasets(self):
        train_ds, val_ds = super().datasets()
        return ThroughLoader(train_ds.x, train_ds.y), ThroughLoader(val_ds.x, val_ds.y)


def _curves(reporter: RecordingReporter):
    epochs = [(e, {k: v for k, v in m.items() if k not in TIMINGS}) for e, m in reporter.epochs]
    return reporter.steps, epochs


def test_tensor_datasets_skip_the_loader_and_anything_else_keeps_it():
    cfg = fast_config(batch_size=10)
    x, y = torch.randn(25, 3), torch.arange(25)
    assert isinstance(make_train_loader(TensorPairDataset(x, y), cfg, CPU, DistContext()), InMemoryBatches)
    assert isinstance(make_train_loader(TensorDataset(x, y), cfg, CPU, DistContext()), InMemoryBatches)
    assert isinstance(make_val_loader(TensorDataset(x, y), cfg, CPU, DistContext()), InMemoryBatches)
    assert isinstance(make_train_loader(ThroughLoader(x, y), cfg, CPU, DistContext()), TrainBatches)
    with_collate = make_train_loader(TensorDataset(x, y), cfg, CPU, DistContext(), collate_fn=lambda b: b)
    assert isinstance(with_collate, TrainBatches)
    assert isinstance(make_val_loader(ThroughLoader(x, y), cfg, CPU, DistContext()), DataLoader)
    # What the loader's per-sample int(y[i]) and collate decide keeps the loader: float labels (int()
    # truncates, and refuses NaN and infinity by name), several labels per sample, numpy arrays
    # (collate makes them tensors), tensors on different devices.
    for kept in (TensorPairDataset(x, y.float()), TensorPairDataset(x, y.reshape(-1, 1).repeat(1, 2)),
                 TensorPairDataset(x.numpy(), y.numpy()), TensorDataset(x, torch.empty(25, device="meta"))):
        assert isinstance(make_train_loader(kept, cfg, CPU, DistContext()), TrainBatches)
    with pytest.raises(ValueError, match="cannot convert float NaN to integer"):
        nan = TensorPairDataset(x, torch.full((25,), float("nan")))
        list(make_train_loader(nan, cfg, CPU, DistContext()).epoch(0))


@pytest.mark.parametrize("labels", [torch.randint(0, 7, (23,), dtype=torch.int32),  # collate makes int() int64
                                    torch.randint(0, 7, (23, 1)),  # a label column: int() flattens it
                                    torch.rand(23) > 0.5])
def test_every_epochs_batches_equal_the_loaders_values_dtypes_and_order_also_from_a_mid_epoch_start(labels):
    cfg = fast_config(batch_size=4, seed=3, max_steps_per_epoch=5)
    x = torch.randn(23, 2, 3)
    gathered = make_train_loader(TensorPairDataset(x, labels), cfg, CPU, DistContext())
    loaded = make_train_loader(ThroughLoader(x, labels), cfg, CPU, DistContext())
    assert isinstance(gathered, InMemoryBatches) and len(gathered) == len(loaded) == 5
    for epoch, start in ((1, 0), (2, 0), (2, 3)):
        ours, theirs = list(gathered.epoch(epoch, start)), list(loaded.epoch(epoch, start))
        assert [i for i, _ in ours] == [i for i, _ in theirs] == list(range(start, 5))
        for (_, (xa, ya)), (_, (xb, yb)) in zip(ours, theirs, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb) and ya.dtype == yb.dtype == torch.int64
            assert ya.shape == yb.shape == (len(xa),)
    first, second = (torch.cat([b[1] for _, b in gathered.epoch(e)]) for e in (1, 2))
    assert not torch.equal(first, second)  # reshuffled each epoch

    val_ours = list(make_val_loader(TensorDataset(x, labels), cfg, CPU, DistContext()))
    val_theirs = list(make_val_loader(TensorsThroughLoader(x, labels), cfg, CPU, DistContext()))
    assert len(val_ours) == len(val_theirs) == 6
    for (xa, ya), (xb, yb) in zip(val_ours, val_theirs, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and ya.dtype == yb.dtype == labels.dtype


def test_a_rank_gathers_its_own_shard_as_the_distributed_sampler_gives_it():
    cfg = fast_config(batch_size=3, seed=1)
    x, y = torch.arange(20.0).unsqueeze(1), torch.arange(20)
    shards = [make_train_loader(TensorDataset(x, y), cfg, CPU, DistContext(rank=r, world_size=2))
              for r in (0, 1)]
    seen = [torch.cat([b[1] for _, b in shard.epoch(1)]).tolist() for shard in shards]
    assert len(seen[0]) == len(seen[1]) == 10
    assert sorted(seen[0] + seen[1]) == list(range(20))


def test_a_run_trains_bitwise_the_same_with_or_without_the_loader_dropout_and_mixup_included():
    cfg = fast_config(epochs=2, batch_size=64, mixup_alpha=0.2)
    ours, theirs = RecordingReporter(), RecordingReporter()
    a = train(DigitsTask("cnn", dropout=0.2), cfg, ours)
    b = train(DigitsThroughLoader("cnn", dropout=0.2), cfg, theirs)
    assert a.steps_completed == b.steps_completed == 46
    assert _curves(ours) == _curves(theirs)


def test_the_finished_runs_confusion_matrix_and_onnx_check_see_the_loaders_validation_batches(tmp_path):
    """finalize_run gathers the validation set in memory too: the same matrix, and the ONNX check
    compares the same first 256 inputs (so the same largest difference)."""
    cfg = fast_config(epochs=1, batch_size=64, save_checkpoints=True, export_onnx=True)
    a = train(DigitsTask("cnn"), cfg, RecordingReporter(), tmp_path / "in_memory")
    b = train(DigitsThroughLoader("cnn"), cfg, RecordingReporter(), tmp_path / "loader")
    assert a.onnx is not None and b.onnx is not None and a.onnx.passed
    assert a.confusion_matrix == b.confusion_matrix and sum(map(sum, a.confusion_matrix)) == 360
    assert (a.onnx.n_inputs_checked, a.onnx.max_abs_diff) == (b.onnx.n_inputs_checked, b.onnx.max_abs_diff)
    assert a.onnx.n_inputs_checked == 256
    task = DigitsTask("cnn")
    assert isinstance(batches_in_order(task.datasets()[1], 64, task, CPU), InMemoryBatches)
    assert isinstance(batches_in_order(DigitsThroughLoader("cnn").datasets()[1], 64, task, CPU), DataLoader)


def test_an_in_memory_run_resumed_mid_epoch_gives_the_straight_runs_curves(tmp_path):
    task, cfg = DigitsTask("cnn", dropout=0.2), fast_config(epochs=2, batch_size=64, save_checkpoints=True)
    straight = RecordingReporter()
    train(task, cfg, straight, tmp_path / "straight")
    first = StopAt(step=30)  # mid-epoch 2 (23 steps an epoch)
    assert train(task, cfg, first, tmp_path / "split").status == "interrupted"
    second = RecordingReporter()
    assert train(task, cfg, second, tmp_path / "split", resume=True).status == "completed"
    assert second.resumed_steps + second.steps == straight.steps
    assert _curves(second)[1] == _curves(straight)[1][1:]
