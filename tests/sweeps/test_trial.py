"""sweeps.trial.trial_config: the TrainConfig a trial runs with, including DDP over the
GPUs of its lease (resources.gpus_per_trial). The visible GPU count is faked: the rule is
decided before any rank starts, so no GPU is needed to test it."""
from __future__ import annotations

import pytest

from sweeps import trial
from sweeps.spec.load import spec_from_dict
from sweeps.trial_control import TrialControl

BASE = {
    "name": "t",
    "task": {"name": "digits", "model": "mlp"},
    "train": {"epochs": 1, "batch_size": 64},
    "search": {"lr": {"type": "float", "low": 1e-3, "high": 1.0, "log": True}},
}


def spec_with(resources: dict, train: dict | None = None):
    return spec_from_dict({**BASE, "resources": resources, "train": {**BASE["train"], **(train or {})}})


@pytest.mark.parametrize("visible, expected", [(2, 2), (1, 1), (0, 1)])
def test_a_two_gpu_trial_runs_two_ddp_ranks(monkeypatch, visible, expected):
    monkeypatch.setattr(trial, "visible_gpu_count", lambda: visible)
    cfg = trial.trial_config(spec_with({"gpus_per_trial": 2}), {"lr": 0.1})
    assert cfg.distributed.nproc == expected
    assert cfg.lr == 0.1 and cfg.batch_size == 64  # per process: the global batch is 64 * nproc


def test_an_explicit_nproc_is_kept(monkeypatch):
    monkeypatch.setattr(trial, "visible_gpu_count", lambda: 4)
    spec = spec_with({"gpus_per_trial": 4}, {"distributed": {"nproc": 2}})
    assert trial.trial_config(spec, {"lr": 0.1}).distributed.nproc == 2


def test_cpu_devices_and_gpu_shares_stay_single_process(monkeypatch):
    monkeypatch.setattr(trial, "visible_gpu_count", lambda: 4)
    assert trial.trial_config(spec_with({"devices": "cpu"}), {"lr": 0.1}).distributed.nproc == 1
    assert trial.trial_config(spec_with({"gpus_per_trial": 0.5}), {"lr": 0.1}).distributed.nproc == 1
    assert trial.trial_config(spec_with({"gpus_per_trial": 1}), {"lr": 0.1}).distributed.nproc == 1


@pytest.mark.parametrize("continued", [False, True])
def test_a_resumed_run_logs_the_checkpoints_curves_only_into_a_fresh_run(tmp_path, continued, store,
                                                                        make_tracker):
    """A retry in a new run gets the checkpoint's points; a run that continues (a Ray trial
    started again, a PBT exploit of another trial's checkpoint) already holds its own points
    and must not get them again, nor a donor's. Either way the pruner is not asked again."""
    from sweeps.tracking import TrackingReader

    tracker = make_tracker()
    run = tracker.start_run("trial-0000", experiment=store.experiment_name())
    asked: list[int] = []
    control = TrialControl(should_prune=lambda epoch, value: asked.append(epoch) or False)
    reporter = trial.TrialReporter(tracker, run, "val_acc", control, logged_up_to={} if continued else None)
    reporter.resumed([(1, 10, {"val_acc": 0.5}), (2, 20, {"val_acc": 0.6})], [(10, {"loss": 1.0}), (20, {"loss": 0.9})])
    reporter.report_epoch(3, 30, {"val_acc": 0.7})
    tracker.end_run(run)
    reader = TrackingReader(tracker.tracking_uri)
    history = reader.metric_history(run.run_id, "val_acc")
    assert sorted(m.step for m in history) == ([3] if continued else [1, 2, 3])
    assert asked == [3] and reporter.intermediate == {1: 0.5, 2: 0.6, 3: 0.7}
    assert reader.get_run(run.run_id).data.tags["sweeps.resumed_from_epoch"] == "2"
