"""sweeps.objective.trial_config: the TrainConfig a trial runs with, including DDP over the
GPUs of its lease (resources.gpus_per_trial). The visible GPU count is faked: the rule is
decided before any rank starts, so no GPU is needed to test it."""
from __future__ import annotations

import pytest

from sweeps import objective
from sweeps.spec import spec_from_dict

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
    monkeypatch.setattr(objective, "visible_gpu_count", lambda: visible)
    cfg = objective.trial_config(spec_with({"gpus_per_trial": 2}), {"lr": 0.1})
    assert cfg.distributed.nproc == expected
    assert cfg.lr == 0.1 and cfg.batch_size == 64  # per process: the global batch is 64 * nproc


def test_an_explicit_nproc_is_kept(monkeypatch):
    monkeypatch.setattr(objective, "visible_gpu_count", lambda: 4)
    spec = spec_with({"gpus_per_trial": 4}, {"distributed": {"nproc": 2}})
    assert objective.trial_config(spec, {"lr": 0.1}).distributed.nproc == 2


def test_cpu_devices_and_gpu_shares_stay_single_process(monkeypatch):
    monkeypatch.setattr(objective, "visible_gpu_count", lambda: 4)
    assert objective.trial_config(spec_with({"devices": "cpu"}), {"lr": 0.1}).distributed.nproc == 1
    assert objective.trial_config(spec_with({"gpus_per_trial": 0.5}), {"lr": 0.1}).distributed.nproc == 1
    assert objective.trial_config(spec_with({"gpus_per_trial": 1}), {"lr": 0.1}).distributed.nproc == 1
