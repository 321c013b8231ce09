"""core.train with each step's numbers read one step late (lag 1, what one CUDA device uses so the
GPU never waits for Python) gives the same curves, weights, resume and divergence handling as
reading them at once (lag 0). Forced on CPU here, so no GPU is needed."""
from __future__ import annotations

import math

import pytest
import torch

from core import checkpoint as ckpt
from core import train as train_mod
from core.reporting import RecordingReporter
from core.step_stats import PendingStep, gradient_norm, read_lag
from core.tasks.digits import DigitsTask
from core.train import train
from tests.core.helpers import fast_config
from tests.core.test_train import _InterruptAtStep, _PoisonedTask


@pytest.fixture
def lag_one(monkeypatch):
    monkeypatch.setattr(train_mod, "read_lag", lambda device, distributed: 1)


def _weights(path):
    return ckpt.load_checkpoint(path)["model"]


def test_read_lag_by_device():
    assert read_lag(torch.device("cpu"), False) == 0
    assert read_lag(torch.device("cuda", 0), False) == 1
    assert read_lag(torch.device("cuda", 0), True) == 0  # DDP ranks act on the same step


def test_lag_one_reports_the_same_steps_and_trains_the_same_weights(tmp_path, monkeypatch):
    cfg = fast_config(epochs=2, scheduler="onecycle", lr=0.1, save_checkpoints=True, grad_accum_steps=2)
    now = train(DigitsTask("mlp"), cfg, reporter=(rec_now := RecordingReporter()), out_dir=tmp_path / "now")
    monkeypatch.setattr(train_mod, "read_lag", lambda device, distributed: 1)
    late = train(DigitsTask("mlp"), cfg, reporter=(rec_late := RecordingReporter()), out_dir=tmp_path / "late")
    assert rec_late.steps == rec_now.steps and len(rec_now.steps) == now.steps_completed
    a, b = _weights(tmp_path / "now" / "last.pt"), _weights(tmp_path / "late" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for h_now, h_late in zip(now.history, late.history, strict=True):
        assert {k: v for k, v in h_now.items() if k not in ("samples_per_s", "epoch_time_s", "peak_mem_mb")} == \
               {k: v for k, v in h_late.items() if k not in ("samples_per_s", "epoch_time_s", "peak_mem_mb")}


def test_lag_one_interrupt_lands_one_step_later_and_resumes_bitwise(tmp_path, lag_one):
    cfg = fast_config(epochs=2, scheduler="cosine", warmup_epochs=0.5, save_checkpoints=True)
    straight = train(DigitsTask("mlp"), cfg, reporter=(rec_straight := RecordingReporter()), out_dir=tmp_path / "a")
    first = train(DigitsTask("mlp"), cfg, out_dir=tmp_path / "b", reporter=(rec_first := _InterruptAtStep(30)))
    # Step 30's decision is read while step 31 is queued: step 31 finishes, then the checkpoint.
    assert first.status == "interrupted" and first.steps_completed == 31
    resumed = train(DigitsTask("mlp"), cfg, out_dir=tmp_path / "b", resume=True,
                    reporter=(rec_resumed := RecordingReporter()))
    assert resumed.steps_completed == straight.steps_completed
    # The checkpoint holds step 31 too (reported after the loop): the resumed run hands it on.
    assert rec_resumed.resumed_steps == rec_first.steps and rec_first.steps[-1][0] == 31
    assert rec_resumed.resumed_steps + rec_resumed.steps == rec_straight.steps
    a, b = _weights(tmp_path / "a" / "last.pt"), _weights(tmp_path / "b" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.history[-1]["val_loss"] == straight.history[-1]["val_loss"]


def test_lag_one_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, lag_one):
    train(DigitsTask("mlp"), fast_config(epochs=1, save_checkpoints=True), out_dir=tmp_path)
    good = _weights(tmp_path / "last.pt")
    result = train(_PoisonedTask(after_calls=5), fast_config(epochs=2, save_checkpoints=True), out_dir=tmp_path)
    assert result.status == "diverged" and "non-finite loss nan at step 6 (epoch 1)" in result.reason
    after = _weights(tmp_path / "last.pt")
    assert all(torch.equal(good[k], after[k]) for k in good)


def test_pending_step_reads_everything_in_one_go():
    rec = PendingStep(step=3, epoch=1)
    rec.add(torch.tensor(0.5), 4)
    rec.add(torch.tensor(float("inf")), 2)
    rec.grad_norm = torch.tensor(1.5)
    losses, norm = rec.read()
    assert losses == [0.5, float("inf")] and norm == 1.5
    assert rec.problem(check_loss=True, check_grad=True) == "non-finite loss inf at step 3 (epoch 1)"
    assert rec.problem(check_loss=False, check_grad=True) is None
    rec.loss_values, rec.norm_value = [0.5], float("nan")
    assert rec.problem(check_loss=True, check_grad=True).startswith("non-finite gradient norm nan")


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_gradient_norm_on_cpu_matches_torch_and_keeps_non_finite(poison):
    torch.manual_seed(0)
    grads = [torch.randn(16, 1, 3, 3), torch.randn(16), torch.randn(10, 512, dtype=torch.float64),
             torch.randn(3).to(torch.bfloat16)]
    if poison is not None:
        grads[1][3] = poison
    ours = gradient_norm(grads, torch.device("cpu"))
    reference = float(torch.nn.utils.get_total_norm([g.double() for g in grads]))
    assert isinstance(ours, float)
    if poison is None:
        assert ours == pytest.approx(reference, rel=1e-6)
    else:
        assert not math.isfinite(ours)
    assert float(gradient_norm([], torch.device("cpu"))) == 0.0


def test_pending_step_takes_a_host_gradient_norm():
    rec = PendingStep(step=1, epoch=1)
    rec.add(torch.tensor(0.25), 8)
    rec.grad_norm = 2.5  # what gradient_norm gives on CPU
    assert rec.read() == ([0.25], 2.5)
