"""DDP trials on CPU: 2 gloo processes started by core.ddp_launch, reporter in the test process.

What must hold: a DDP run follows the same loss curve as one process with the same global batch;
gradient all-reduce runs once per optimizer step, not per accumulation micro-step; pruning stops
every rank; a failing or dying rank fails the trial with its rank and error and leaves no process
behind; a checkpoint from 2 processes resumes on 1.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core import checkpoint as ckpt
from core.config import DistributedConfig
from core.ddp_launch import RankFailedError, TaskSpec, train_distributed
from core.reporting import Decision, RecordingReporter
from core.train import train
from tests.core.ddp_tasks import DdpTestTask
from tests.core.helpers import fast_config
from tests.memory_tracker import MemoryTracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Measured on CPU (torch 2.14, gloo, synthetic MLP, 2 ranks x 16 vs 1 rank x 32, SGD without momentum):
# largest gaps 3.6e-7 (step train loss), 6e-8 (grad norm), 2.4e-7 (epoch metrics), 3.7e-8 (weights)
# after 16 steps, 8.9e-8 (weights) after 64. Only the order of the float32 sums differs.
CURVE_TOL = 1e-5


def _cfg(nproc: int, **overrides):
    base = dict(device="cpu", momentum=0.0, lr=0.1, distributed=DistributedConfig(nproc=nproc, backend="gloo"))
    base.update(overrides)
    return fast_config(**base)


def _rank_pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie: the launcher waited for it


def test_ddp_loss_curve_matches_one_process_with_the_same_global_batch(tmp_path):
    task = DdpTestTask(str(tmp_path / "pids"))
    one, two = RecordingReporter(), RecordingReporter()
    single = train(task, _cfg(1, batch_size=32, save_checkpoints=True), one, tmp_path / "one")
    ddp = train_distributed(task, _cfg(2, batch_size=16, save_checkpoints=True), two, tmp_path / "two")

    assert ddp.status == single.status == "completed"
    assert ddp.global_batch_size == single.global_batch_size == 32
    assert [s for s, _ in two.steps] == [s for s, _ in one.steps] and len(one.steps) == 16
    for (_, a), (_, b) in zip(one.steps, two.steps, strict=True):  # the step loss is over the global batch
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=CURVE_TOL)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=CURVE_TOL)
    for (_, a), (_, b) in zip(one.epochs, two.epochs, strict=True):
        for key in ("train_loss", "val_loss", "val_acc"):
            assert a[key] == pytest.approx(b[key], abs=CURVE_TOL), key
    w1 = ckpt.load_checkpoint(tmp_path / "one" / "last.pt")["model"]
    w2 = ckpt.load_checkpoint(tmp_path / "two" / "last.pt")["model"]
    assert w1.keys() == w2.keys()  # saved from the unwrapped model: no "module." prefix
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < CURVE_TOL
    _assert_gone(_rank_pids(tmp_path / "pids"))


def test_distributed_sampler_permutation_is_shared_by_1_and_2_ranks():
    # Why the curves above can match: rank r takes positions r::2 of the 1-rank permutation.
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(64))
    for epoch in (1, 2):
        samplers = [DistributedSampler(data, num_replicas=n, rank=r, shuffle=True, seed=0)
                    for n, r in ((1, 0), (2, 0), (2, 1))]
        for s in samplers:
            s.set_epoch(epoch)
        whole, r0, r1 = (list(s) for s in samplers)
        assert r0 == whole[0::2] and r1 == whole[1::2]


def test_no_sync_skips_the_all_reduce_on_non_final_accumulation_micro_steps(tmp_path):
    counts = {}
    for accum in (4, 1):
        logs = tmp_path / f"comm{accum}"
        logs.mkdir()
        task = DdpTestTask(str(tmp_path / "pids"), comm_log=str(logs), n_train=128)
        cfg = _cfg(2, batch_size=8, grad_accum_steps=accum, epochs=1, max_steps_per_epoch=8)
        result = train_distributed(task, cfg)
        assert result.steps_completed == 8 // accum
        assert result.global_batch_size == 8 * 2 * accum
        counts[accum] = {p.stem: p.read_text().split() for p in logs.glob("rank*.log")}
    for accum, per_rank in counts.items():
        assert set(per_rank) == {"rank0", "rank1"}
        for buckets in per_rank.values():
            n_buckets = len(set(buckets))
            # one all-reduce round per bucket per optimizer step: 8 micro-batches / accum
            assert len(buckets) == n_buckets * (8 // accum), (accum, buckets)


def test_pruning_a_two_process_trial_stops_both_ranks(tmp_path):
    rec = RecordingReporter(prune_after_epoch=1)
    result = train_distributed(DdpTestTask(str(tmp_path / "pids")), _cfg(2, batch_size=16, epochs=5), rec)
    assert result.status == "pruned" and result.epochs_completed == 1
    assert [e for e, _ in rec.epochs] == [1]
    assert len(rec.steps) == result.steps_completed == 8  # 256 samples / global batch 32
    pids = _rank_pids(tmp_path / "pids")
    assert len(pids) == 2
    _assert_gone(pids)


@pytest.mark.parametrize("mode, expected", [
    ("raise", "rank 1 failed: RuntimeError: boom on rank 1 at micro-step 3"),
    ("exit", "rank 1 failed: process exited with code 3"),
])
def test_a_failing_rank_fails_the_trial_with_its_rank_and_error(tmp_path, mode, expected):
    task = DdpTestTask(str(tmp_path / "pids"), fail_rank=1, fail_at=3, fail_mode=mode)
    rec = RecordingReporter()
    with pytest.raises(RankFailedError) as info:
        train_distributed(task, _cfg(2, batch_size=16, epochs=3), rec, tmp_path / "out")
    assert str(info.value).startswith(expected), str(info.value)
    assert info.value.rank == 1
    assert len(rec.steps) <= 3  # rank 0 got no further than the step where rank 1 went away
    pids = _rank_pids(tmp_path / "pids")
    assert len(pids) == 2
    _assert_gone(pids)


class _InterruptAtStep(RecordingReporter):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.at = step

    def report_step(self, step, metrics):
        super().report_step(step, metrics)
        return Decision.INTERRUPT if step == self.at else Decision.CONTINUE


def test_interrupt_mid_epoch_then_resume_on_two_processes_matches_a_straight_run(tmp_path):
    task = DdpTestTask(str(tmp_path / "pids"))
    cfg = _cfg(2, batch_size=16, epochs=2, save_checkpoints=True)
    straight = train_distributed(task, cfg, (rec_straight := RecordingReporter()), tmp_path / "straight")
    first = train_distributed(task, cfg, (rec_first := _InterruptAtStep(5)), tmp_path / "split")
    assert first.status == "interrupted" and first.steps_completed == 5
    rec = RecordingReporter()
    resumed = train_distributed(task, cfg, rec, tmp_path / "split", resume=True)
    assert resumed.status == "completed" and resumed.steps_completed == straight.steps_completed
    # Rank 0 handed the checkpoint's steps to the reporter in this process, once, before its own.
    assert rec.resumed_calls == 1 and rec.resumed_steps == rec_first.steps
    assert rec.resumed_steps + rec.steps == rec_straight.steps
    a = ckpt.load_checkpoint(tmp_path / "straight" / "last.pt")["model"]
    b = ckpt.load_checkpoint(tmp_path / "split" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The partial epoch's sums of both ranks went into the checkpoint: the epoch metric is whole.
    assert resumed.history[0]["train_loss"] == pytest.approx(straight.history[0]["train_loss"], rel=1e-12)


def test_every_rank_refuses_a_checkpoint_of_another_owner(tmp_path):
    task = DdpTestTask(str(tmp_path / "pids"))
    cfg = _cfg(2, batch_size=16, epochs=1, save_checkpoints=True)
    train_distributed(task, cfg, out_dir=tmp_path / "out", owner="study-a:trial-0000")
    before = (tmp_path / "out" / "last.pt").read_bytes()
    with pytest.raises(RankFailedError, match="CheckpointError: checkpoint .*last.pt belongs to "
                                              "'study-a:trial-0000', but the run resuming from it is "
                                              "'study-b:trial-0000'") as info:
        train_distributed(task, _cfg(2, batch_size=16, epochs=2, save_checkpoints=True), out_dir=tmp_path / "out",
                          resume=True, owner="study-b:trial-0000")
    assert set(info.value.failures) <= {0, 1} and all("CheckpointError" in e for e in info.value.failures.values())
    assert (tmp_path / "out" / "last.pt").read_bytes() == before
    _assert_gone(_rank_pids(tmp_path / "pids"))


def test_a_two_process_checkpoint_resumes_on_one_process(tmp_path):
    spec = TaskSpec("synthetic", model="mlp", args={"shape": [16], "n_train": 256, "n_val": 64})
    first = train_distributed(spec, _cfg(2, batch_size=16, epochs=2, save_checkpoints=True), out_dir=tmp_path)
    assert first.status == "completed" and first.epochs_completed == 2
    rec = RecordingReporter()
    resumed = train_distributed(spec, _cfg(1, batch_size=16, epochs=4, save_checkpoints=True), rec, tmp_path,
                                resume=True)
    assert [e for e, _ in rec.epochs] == [3, 4]  # continued, not restarted
    assert resumed.status == "completed" and resumed.epochs_completed == 4
    assert resumed.steps_completed == first.steps_completed + 2 * 16  # 1 rank x batch 16: 16 steps/epoch
    losses = [h["val_loss"] for h in resumed.history]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("fail_rank", [None, 1])
def test_a_sweep_trial_with_nproc_2_runs_ddp_and_a_failing_rank_is_a_fail(tmp_path, fail_rank):
    from sweeps.spec.load import spec_from_dict
    from sweeps.tracking.base import RunHandle
    from sweeps.trial import TrialSpec, run_trial
    from sweeps.trial_control import TrialControl

    spec = spec_from_dict({
        "name": "ddp", "description": "DDP trial through run_trial",
        "task": {"target": "tests.core.ddp_tasks:make_ddp_test_task",
                 "args": {"pid_dir": str(tmp_path / "pids"), "fail_rank": fail_rank}},
        "train": {"epochs": 2, "batch_size": 16, "num_workers": 0, "device": "cpu", "momentum": 0.0,
                  "distributed": {"nproc": 2, "backend": "gloo", "lr_scale_rule": "linear"}},
        "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
        "objective": {"metric": "val_loss", "direction": "minimize"},
        "resources": {"devices": "cpu", "workers": 1},
    })
    tracker = MemoryTracker()
    trial = TrialSpec(0, {"lr": 0.05}, tmp_path / "t0", RunHandle("study", "0", "study"), "optuna")
    outcome = run_trial(spec, trial, TrialControl(), tracker)
    assert tracker.params["global_batch_size"] == 32
    assert tracker.params["scaled_lr"] == pytest.approx(0.1)  # 0.05 x 2 processes (linear rule)
    if fail_rank is None:
        assert outcome.state == "COMPLETE" and tracker.status == "FINISHED"
        assert outcome.result.global_batch_size == 32
        step_lrs = [m["step/lr"] for _, m in tracker.metrics if "step/lr" in m]
        assert len(step_lrs) == 16 and step_lrs == [pytest.approx(0.1)] * 16
    else:
        assert outcome.state == "FAIL" and tracker.status == "FAILED"
        assert "rank 1 failed: RuntimeError: boom on rank 1" in outcome.reason
    _assert_gone(_rank_pids(tmp_path / "pids"))


def test_settings_a_ddp_run_cannot_honour_are_errors_before_any_rank_starts(tmp_path):
    from core.config import ConfigError

    task = DdpTestTask(str(tmp_path / "pids"))
    with pytest.raises(ConfigError, match="'nccl' needs CUDA"):
        train_distributed(task, _cfg(2, distributed=DistributedConfig(nproc=2, backend="nccl")))
    with pytest.raises(ConfigError, match="all 2 ranks on one GPU"):
        train_distributed(task, _cfg(2, device="cuda:1"))
    task.unpicklable = lambda: None
    with pytest.raises(ConfigError, match="pass a core.ddp_launch.TaskSpec"):
        train_distributed(task, _cfg(2))
    assert not (tmp_path / "pids").exists()  # no rank was started
