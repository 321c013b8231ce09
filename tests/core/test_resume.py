"""A resumed run: its reporter gets what the checkpoint recorded (the straight run's curves),
and it refuses another run's checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core import checkpoint as ckpt
from core.reporting import Decision, RecordingReporter
from core.results import STEP_METRICS
from core.tasks.digits import DigitsTask
from core.tasks.synthetic import SyntheticTask
from core.train import train
from tests.core.helpers import StopAt, fast_config

TIMINGS = ("samples_per_s", "epoch_time_s", "peak_mem_mb")  # measure the machine: differ between runs


def _without_timings(epochs):
    return [(e, {k: v for k, v in m.items() if k not in TIMINGS}) for e, m in epochs]


def test_a_resumed_reporter_gets_the_straight_runs_curves_after_a_mid_epoch_and_an_epoch_end_interrupt(tmp_path):
    task = SyntheticTask("mlp", shape=(16,), n_train=320, n_val=64)  # 10 steps an epoch
    cfg = fast_config(epochs=3, scheduler="cosine", lr=0.1, save_checkpoints=True)
    straight = RecordingReporter()
    train(task, cfg, straight, tmp_path / "straight")
    assert len(straight.steps) == 30

    first = StopAt(step=14)  # mid-epoch 2
    assert train(task, cfg, first, tmp_path / "split").status == "interrupted"
    second = StopAt(epoch=2)  # at the end of epoch 2
    assert train(task, cfg, second, tmp_path / "split", resume=True).status == "interrupted"
    third = RecordingReporter()
    result = train(task, cfg, third, tmp_path / "split", resume=True)
    assert result.status == "completed" and result.steps_completed == 30

    # Each resumed run heard, once, exactly what the runs before it reported ...
    assert first.resumed_calls == 0 and second.resumed_calls == third.resumed_calls == 1
    assert second.resumed_steps == first.steps and second.resumed_epochs == first.epochs
    assert third.resumed_steps == first.steps + second.steps
    assert third.resumed_epochs == first.epochs + second.epochs
    # ... so together they are the straight run's curves, bit for bit (timings aside).
    assert [s for s, _ in third.resumed_steps] == list(range(1, 21))
    assert third.resumed_steps + third.steps == straight.steps
    assert set(third.steps[0][1]) == set(STEP_METRICS)
    assert _without_timings(third.resumed_epochs + third.epochs) == _without_timings(straight.epochs)
    assert [e for e, _ in third.resumed_epochs] == [1, 2] and [e for e, _ in third.epochs] == [3]


def test_a_run_resumed_from_its_final_checkpoint_reports_every_epoch_through_resumed(tmp_path):
    task = DigitsTask("mlp")
    cfg = fast_config(epochs=2, save_checkpoints=True)
    straight = RecordingReporter()
    done = train(task, cfg, straight, tmp_path)

    again = RecordingReporter()
    result = train(task, cfg, again, tmp_path, resume=True)  # nothing left to train
    assert result.status == "completed" and result.epochs_completed == 2
    assert again.steps == [] and again.epochs == [] and again.resumed_calls == 1
    assert again.resumed_epochs == straight.epochs  # the same run's numbers: timings included
    assert again.resumed_steps == straight.steps and len(again.resumed_steps) == done.steps_completed
    assert result.metrics == straight.epochs[-1][1]  # the last epoch's metrics, not {}
    assert result.best_metric == done.best_metric


def test_steps_in_a_checkpoint_are_tensors_that_load_with_weights_only(tmp_path):
    train(DigitsTask("mlp"), fast_config(epochs=1, save_checkpoints=True, max_steps_per_epoch=5), out_dir=tmp_path)
    steps = ckpt.load_checkpoint(tmp_path / ckpt.LAST)["steps"]  # load_checkpoint uses weights_only=True
    assert steps["step"].tolist() == [1, 2, 3, 4, 5]
    assert {k: v.dtype for k, v in steps.items()} == {"step": torch.int64, **{k: torch.float64 for k in STEP_METRICS}}


# ---- ownership -------------------------------------------------------------------------------
def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_resume_with_the_checkpoints_owner_continues(tmp_path):
    task, owner = DigitsTask("mlp"), "5f0c:trial-0003"
    train(task, fast_config(epochs=1, save_checkpoints=True), out_dir=tmp_path, owner=owner)
    assert ckpt.load_checkpoint(tmp_path / ckpt.LAST)["owner"] == owner
    rec = RecordingReporter()
    result = train(task, fast_config(epochs=2, save_checkpoints=True), rec, tmp_path, resume=True, owner=owner)
    assert result.epochs_completed == 2 and [e for e, _ in rec.epochs] == [2]  # continued, not restarted


@pytest.mark.parametrize("written_by, message", [
    ("other-study:trial-0003", "belongs to 'other-study:trial-0003'"),
    (None, "records no owner"),
])
def test_a_checkpoint_of_another_owner_is_never_trained_on(tmp_path, written_by, message):
    task = DigitsTask("mlp")
    train(task, fast_config(epochs=1, save_checkpoints=True), out_dir=tmp_path, owner=written_by)
    train(task, fast_config(epochs=2, save_checkpoints=True), out_dir=tmp_path, resume=True, owner=written_by)
    before = _files(tmp_path)
    assert {ckpt.LAST, ckpt.PREV, ckpt.BEST} <= set(before)

    with pytest.raises(ckpt.CheckpointError) as info:
        train(task, fast_config(epochs=4, save_checkpoints=True), out_dir=tmp_path, resume=True,
              owner="this-study:trial-0003")
    text = str(info.value)
    assert str(tmp_path / ckpt.LAST) in text and message in text and "'this-study:trial-0003'" in text
    assert _files(tmp_path) == before  # no weights, config or checkpoint touched


# ---- checkpoints every few epochs (train.checkpoint_every) -------------------------------------------
class _Died(Exception):
    """The process died as this epoch was reported: after its checkpoint, if one was due."""


def _dies_before(folder: Path, death: int, calls: list[str]):
    """``os.link``, ``os.replace`` and ``os.unlink`` as they are, except that from the ``death``-th
    call on a checkpoint name (``*.pt*``) in ``folder`` on, each raises :class:`_Died` instead of
    running: a killed process cleans nothing up."""
    def wrap(real):
        def call(*args, **kwargs):
            path = Path(args[-1] if real is not os.unlink else args[0])
            if path.parent == folder and ".pt" in path.name:
                calls.append(f"{real.__name__} {path.name}")
                if len(calls) >= death:
                    raise _Died(0)
            return real(*args, **kwargs)
        return call
    return {name: wrap(getattr(os, name)) for name in ("link", "replace", "unlink")}


@pytest.mark.parametrize("death", range(1, 9))
def test_a_kill_anywhere_in_a_new_bests_save_leaves_best_pt_as_last_pt_records_it(tmp_path, monkeypatch, death):
    """Epoch 2 sets a new best; its save (best.pt, then last.pt, with best.prev.pt between) dies
    before its ``death``-th link, rename or unlink. Resumed and stopped at once, without training
    epoch 2 again where last.pt says it is still to come, the folder's best.pt holds the weights of
    the epoch last.pt records as the best; resumed to the end, those of a straight run."""
    task = SyntheticTask("mlp", shape=(16,), n_train=320, n_val=64)  # 10 steps an epoch
    cfg = fast_config(epochs=2, lr=0.1, save_checkpoints=True)
    straight = train(task, cfg, RecordingReporter(), tmp_path / "straight")
    assert straight.best_epoch == 2
    epoch_weights = {1: _weights(tmp_path / "straight" / ckpt.PREV), 2: _weights(tmp_path / "straight" / ckpt.LAST)}
    folder, calls = tmp_path / "killed", []

    class DiesInEpoch2Save(RecordingReporter):
        def report_epoch(self, epoch, step, metrics):
            if epoch == 1:  # epoch 1's save is done; count from epoch 2's
                for name, wrapped in _dies_before(folder, death, calls).items():
                    monkeypatch.setattr(os, name, wrapped)
            return super().report_epoch(epoch, step, metrics)

    with pytest.raises(_Died):
        train(task, cfg, DiesInEpoch2Save(), folder)
    monkeypatch.undo()
    assert len(calls) >= death, calls

    train(task, cfg, StopAt(step=11), folder, resume=True)  # epoch 2's first step, if it is to come
    recorded = ckpt.load_checkpoint(folder / ckpt.LAST)["best_epoch"]
    best = ckpt.load_checkpoint(folder / ckpt.BEST)
    assert best["best_epoch"] == recorded and _same(best["model"], epoch_weights[recorded]), calls
    result = train(task, cfg, RecordingReporter(), folder, resume=True)
    assert result.status == "completed" and result.checkpoint_best == folder / ckpt.BEST
    assert _same(_weights(folder / ckpt.BEST), epoch_weights[2])
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or "prev" in p.name) == [ckpt.PREV]


class DiesAt(RecordingReporter):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def report_epoch(self, epoch, step, metrics):
        if epoch == self.epoch:
            raise _Died(epoch)
        return super().report_epoch(epoch, step, metrics)


def _weights(path):
    return ckpt.load_checkpoint(path)["model"]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoints_every_few_epochs_resume_a_killed_run_from_the_last_one_bitwise(tmp_path):
    """Every 3 of 7 epochs: a run that dies at epoch 5 resumes from epoch 3, trains 4 to 7 again and
    ends with the weights, best weights and curves of a run that checkpoints every epoch."""
    task = SyntheticTask("mlp", shape=(16,), n_train=320, n_val=64)
    every_epoch = fast_config(epochs=7, scheduler="cosine", lr=0.1, save_checkpoints=True)
    every_third = fast_config(epochs=7, scheduler="cosine", lr=0.1, save_checkpoints=True, checkpoint_every=3)
    straight = RecordingReporter()
    done = train(task, every_epoch, straight, tmp_path / "straight")

    with pytest.raises(_Died):
        train(task, every_third, DiesAt(epoch=5), tmp_path / "killed")
    assert ckpt.load_checkpoint(tmp_path / "killed" / ckpt.LAST)["epoch"] == 3  # none written at 4 or 5
    again = RecordingReporter()
    result = train(task, every_third, again, tmp_path / "killed", resume=True)
    assert result.status == "completed" and result.best_metric == done.best_metric
    assert [e for e, _ in again.resumed_epochs] == [1, 2, 3] and [e for e, _ in again.epochs] == [4, 5, 6, 7]
    assert _without_timings(again.resumed_epochs + again.epochs) == _without_timings(straight.epochs)
    assert again.resumed_steps + again.steps == straight.steps
    for name in (ckpt.LAST, ckpt.BEST):
        assert _same(_weights(tmp_path / "killed" / name), _weights(tmp_path / "straight" / name)), name


def test_a_stop_between_checkpoints_writes_one_with_that_epochs_best_weights(tmp_path):
    """Interrupted after epoch 5 of a run that checkpoints every 3: the stop writes last.pt at epoch 5,
    and best.pt holds the weights of the best epoch it records (kept in memory since that epoch)."""
    task = SyntheticTask("mlp", shape=(16,), n_train=320, n_val=64)
    cfg = fast_config(epochs=7, scheduler="cosine", lr=0.1, save_checkpoints=True, checkpoint_every=3)
    every_epoch = fast_config(epochs=7, scheduler="cosine", lr=0.1, save_checkpoints=True)
    assert train(task, cfg, StopAt(epoch=5), tmp_path / "third").status == "interrupted"
    assert train(task, every_epoch, StopAt(epoch=5), tmp_path / "each").status == "interrupted"
    last = ckpt.load_checkpoint(tmp_path / "third" / ckpt.LAST)
    assert last["epoch"] == 5 and last["best_epoch"] not in (3, 6)  # a best between checkpoints
    assert _same(_weights(tmp_path / "third" / ckpt.BEST), _weights(tmp_path / "each" / ckpt.BEST))
    kept = ckpt.load_checkpoint(tmp_path / "third" / ckpt.BEST)
    assert kept["epoch"] == kept["best_epoch"] == last["best_epoch"] and kept["best"] == last["best"]


def test_a_run_pruned_between_checkpoints_keeps_its_best_weights(tmp_path):
    """Pruned after epoch 5 of a run that checkpoints every 3: the prune writes one, so best.pt holds
    the weights of the best epoch last.pt records (kept since that epoch), as in a run that
    checkpoints every epoch; a run resumed from it (a worker killed before the study recorded the
    prune) finds the two agreeing."""
    task = SyntheticTask("mlp", shape=(16,), n_train=320, n_val=64)
    cfg = fast_config(epochs=7, scheduler="cosine", lr=0.1, save_checkpoints=True, checkpoint_every=3)
    every_epoch = fast_config(epochs=7, scheduler="cosine", lr=0.1, save_checkpoints=True)
    pruned = train(task, cfg, StopAt(epoch=5, at_epoch=Decision.PRUNE), tmp_path / "third")
    assert pruned.status == "pruned" and pruned.best_epoch not in (3, 6)
    assert train(task, every_epoch, StopAt(epoch=5, at_epoch=Decision.PRUNE), tmp_path / "each").status == "pruned"
    last = ckpt.load_checkpoint(tmp_path / "third" / ckpt.LAST)
    assert last["epoch"] == 5 and last["best_epoch"] == pruned.best_epoch
    assert ckpt.load_checkpoint(tmp_path / "third" / ckpt.BEST)["best_epoch"] == pruned.best_epoch
    assert _same(_weights(tmp_path / "third" / ckpt.BEST), _weights(tmp_path / "each" / ckpt.BEST))
