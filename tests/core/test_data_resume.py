"""Exact resume of the data (issue #24): with random augmentation (torch, numpy and python's
``random`` in ``__getitem__``, or in a stream) and 0 or 2 loader workers, a run stopped at an
epoch's end or mid-epoch and resumed ends with the straight run's weights, and its reporter's
curves (with what ``Reporter.resumed`` handed over) are the straight run's, bit for bit on CPU.
Also: iterable datasets, the epoch length of a stream, a task's collate_fn, and their errors."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from core import checkpoint as ckpt
from core.data import make_train_loader
from core.distributed import DistContext
from core.reporting import RecordingReporter
from core.tasks.base import TaskError
from core.train import train
from tests.core.data_tasks import N_TRAIN, AugmentedImages, AugmentedTask, PaddedSequencesTask
from tests.core.helpers import StopAt, fast_config

TIMINGS = ("samples_per_s", "epoch_time_s", "peak_mem_mb")  # measure the machine: differ between runs
STEPS_PER_EPOCH = N_TRAIN // 16  # 12 micro-batches of 16
STREAM_STEPS = 10  # a stream's epoch: max_steps_per_epoch


def _cfg(workers: int, **overrides):
    # Dropout and mixup draw from the training's RNG stream, which data loading must not move.
    base = dict(epochs=2, batch_size=16, num_workers=workers, mixup_alpha=0.2, device="cpu", save_checkpoints=True)
    return fast_config(**{**base, **overrides})


def _stream_cfg(workers: int, **overrides):
    return _cfg(workers, max_steps_per_epoch=STREAM_STEPS, **overrides)


def _without_timings(epochs):
    return [(e, {k: v for k, v in m.items() if k not in TIMINGS}) for e, m in epochs]


def _weights(folder):
    return ckpt.load_checkpoint(folder / ckpt.LAST)["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The straight run of (stream, workers): its reporter and final weights, trained once per module."""
    runs: dict[tuple[bool, int], tuple[RecordingReporter, dict]] = {}

    def run(stream: bool, workers: int):
        if (stream, workers) not in runs:
            out = tmp_path_factory.mktemp(f"straight-{'stream' if stream else 'map'}-{workers}")
            rec = RecordingReporter()
            cfg = _stream_cfg(workers) if stream else _cfg(workers)
            assert train(AugmentedTask(stream), cfg, rec, out).status == "completed"
            runs[stream, workers] = rec, _weights(out)
        return runs[stream, workers]

    return run


def _assert_resumes_exactly(straight, tmp_path, stream: bool, workers: int, stop: dict) -> None:
    rec, weights = straight(stream, workers)
    task, cfg = AugmentedTask(stream), _stream_cfg(workers) if stream else _cfg(workers)
    first = StopAt(**stop)
    assert train(task, cfg, first, tmp_path).status == "interrupted"
    second = RecordingReporter()
    assert train(task, cfg, second, tmp_path, resume=True).status == "completed"

    resumed = _weights(tmp_path)
    assert resumed.keys() == weights.keys()
    assert all(torch.equal(resumed[k], weights[k]) for k in weights), "weights differ from the straight run's"
    assert second.resumed_steps == first.steps and second.resumed_steps + second.steps == rec.steps
    assert _without_timings(second.resumed_epochs) == _without_timings(first.epochs)
    assert _without_timings(second.resumed_epochs + second.epochs) == _without_timings(rec.epochs)


def test_an_augmented_two_worker_run_stopped_mid_epoch_resumes_bitwise_like_the_straight_run(straight, tmp_path):
    rec, _ = straight(False, 2)
    assert len(rec.steps) == 2 * STEPS_PER_EPOCH
    # Stopped after micro-batch 5 of epoch 1: the rest of epoch 1, then epoch 2, in a new run.
    _assert_resumes_exactly(straight, tmp_path, stream=False, workers=2, stop={"step": 5})


@pytest.mark.parametrize("workers, stop", [
    (0, {"step": 5}), (0, {"step": STEPS_PER_EPOCH + 5}), (0, {"epoch": 1}),
    (2, {"step": STEPS_PER_EPOCH + 5}), (2, {"epoch": 1}),
    (0, {"step": STEPS_PER_EPOCH}),  # after the epoch's last step, before its validation
])
def test_an_augmented_run_resumes_bitwise_like_the_straight_run(straight, tmp_path, workers, stop):
    _assert_resumes_exactly(straight, tmp_path, stream=False, workers=workers, stop=stop)


def test_loader_workers_do_not_change_the_results(straight):
    (rec0, w0), (rec2, w2) = straight(False, 0), straight(False, 2)
    assert all(torch.equal(w0[k], w2[k]) for k in w0)
    assert rec0.steps == rec2.steps and _without_timings(rec0.epochs) == _without_timings(rec2.epochs)


def test_a_mid_epoch_resume_fetches_only_the_batches_after_the_interrupt():
    fetched: list[int] = []

    class Recorded(AugmentedImages):
        def __getitem__(self, i):
            fetched.append(i)
            return super().__getitem__(i)

    def loader():
        return make_train_loader(Recorded(N_TRAIN, 0, True), _cfg(0), torch.device("cpu"), DistContext())

    whole = [(i, x) for i, (x, _) in loader().epoch(2)]
    order, fetched[:] = list(fetched), []
    rest = [(i, x) for i, (x, _) in loader().epoch(2, start=4)]
    assert fetched == order[4 * 16:]  # nothing of micro-batches 0-3
    assert [i for i, _ in rest] == list(range(4, STEPS_PER_EPOCH))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(whole[4:], rest, strict=True))


# ---- iterable datasets ------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_an_augmented_stream_trains_and_resumes_mid_epoch_bitwise(straight, tmp_path, workers):
    rec, _ = straight(True, workers)
    assert [s for s, _ in rec.steps] == list(range(1, 2 * STREAM_STEPS + 1))  # max_steps_per_epoch each
    _assert_resumes_exactly(straight, tmp_path, stream=True, workers=workers, stop={"step": STREAM_STEPS + 3})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_ends_before_max_steps_per_epoch_ends_the_epoch(workers):
    result = train(AugmentedTask(stream=True), _cfg(workers, max_steps_per_epoch=100, save_checkpoints=False))
    assert result.status == "completed" and result.epochs_completed == 2
    assert result.steps_completed == 2 * STEPS_PER_EPOCH  # all 192 samples, in batches of 16, each epoch


def test_a_stream_without_an_epoch_length_is_refused_before_any_step(tmp_path):
    rec = RecordingReporter()
    with pytest.raises(TaskError) as info:
        train(AugmentedTask(stream=True), _cfg(0), rec, tmp_path)
    assert "'augmented'" in str(info.value) and "train.max_steps_per_epoch" in str(info.value)
    assert rec.steps == [] and not (tmp_path / ckpt.LAST).exists()


def test_a_streamed_validation_set_is_read_to_its_end_and_exported(tmp_path):
    result = train(AugmentedTask(stream=True), _stream_cfg(2, epochs=1, export_onnx=True), out_dir=tmp_path)
    assert result.status == "completed"
    assert sum(sum(row) for row in result.confusion_matrix) == 64  # every validation sample
    assert result.onnx is not None and result.onnx.passed


def test_a_dataset_with_neither_a_length_nor_iteration_is_refused():
    class NoLength(Dataset):
        def __getitem__(self, i):
            return torch.zeros(1, 8, 8), 0

    class Task_(AugmentedTask):
        def datasets(self):
            return NoLength(), AugmentedImages(8, 0, False)

    with pytest.raises(TaskError, match=r"task 'augmented' .* train dataset \(NoLength\) with no __len__"):
        train(Task_(), _cfg(0, save_checkpoints=False))


# ---- collate_fn -------------------------------------------------------------------------------
def test_a_tasks_collate_fn_batches_both_loaders_and_the_evaluation(tmp_path):
    task = PaddedSequencesTask()  # sequences of 3 to 8 values: torch's default collate cannot stack them
    result = train(task, fast_config(epochs=1, batch_size=16, num_workers=0), out_dir=tmp_path)
    assert result.status == "completed" and result.steps_completed == STEPS_PER_EPOCH
    assert task.collated == STEPS_PER_EPOCH + 4 + 1  # train, validation (64 in 16s), evaluation (one batch)
    assert sum(sum(row) for row in result.confusion_matrix) == 64


def test_a_collate_fn_that_is_not_callable_is_refused():
    task = PaddedSequencesTask()
    task.collate_fn = "pad"  # type: ignore[assignment]
    with pytest.raises(TaskError, match=r"task 'padded' .*collate_fn is 'pad', not a callable"):
        train(task, fast_config(epochs=1))
