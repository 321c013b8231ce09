"""Each schedule's learning-rate sequence, with gradient accumulation, against torch's reference."""
from __future__ import annotations

import math

import pytest
import torch
from torch.optim import lr_scheduler

from core.reporting import RecordingReporter
from core.tasks.synthetic import SyntheticTask
from core.train import train
from tests.core.helpers import fast_config

N_TRAIN, BATCH, ACCUM, EPOCHS = 200, 8, 3, 3
MICRO = math.ceil(N_TRAIN / BATCH)  # 25 micro-batches -> 9 optimizer steps per epoch (last one smaller)
STEPS = math.ceil(MICRO / ACCUM)


def _lrs(**overrides) -> list[float]:
    rec = RecordingReporter()
    task = SyntheticTask("mlp", shape=(8,), n_train=N_TRAIN, n_val=16)
    train(task, fast_config(epochs=EPOCHS, batch_size=BATCH, grad_accum_steps=ACCUM, lr=0.1, **overrides),
          reporter=rec)
    return [m["lr"] for _, m in rec.steps]


def _reference(make, per_step: bool) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    sched = make(opt)
    out = []
    for _epoch in range(EPOCHS):
        for _ in range(STEPS):
            opt.step()
            if per_step:
                sched.step()
            out.append(opt.param_groups[0]["lr"])
        if not per_step:
            sched.step()
    return out


def test_onecycle_counts_optimizer_steps_after_accumulation():
    got = _lrs(scheduler="onecycle")
    want = _reference(lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=EPOCHS * STEPS, pct_start=0.3,
                                                        div_factor=25.0, final_div_factor=1e4), per_step=True)
    assert len(got) == EPOCHS * STEPS
    assert got == pytest.approx(want, rel=1e-12)


def test_cosine_with_linear_warmup():
    got = _lrs(scheduler="cosine", warmup_epochs=1)
    warm = STEPS

    def make(o):
        ramp = lr_scheduler.LinearLR(o, start_factor=1 / (warm + 1), end_factor=1.0, total_iters=warm)
        cos = lr_scheduler.CosineAnnealingLR(o, T_max=EPOCHS * STEPS - warm, eta_min=0.0)
        return lr_scheduler.SequentialLR(o, [ramp, cos], milestones=[warm])

    assert got == pytest.approx(_reference(make, per_step=True), rel=1e-12)
    assert max(got) == pytest.approx(0.1, rel=1e-3)


def test_step_schedule_per_epoch():
    got = _lrs(scheduler="step", step_size_epochs=1, step_gamma=0.5)
    want = _reference(lambda o: lr_scheduler.StepLR(o, step_size=1, gamma=0.5), per_step=False)
    assert got == pytest.approx(want, rel=1e-12)


def test_constant_schedule():
    assert set(_lrs(scheduler="constant")) == {0.1}


def test_plateau_lowers_lr_when_the_monitored_metric_stalls():
    rec = RecordingReporter()
    task = SyntheticTask("mlp", shape=(8,), n_train=64, n_val=16)
    # A tiny lr keeps val_acc from improving enough; patience 0 reduces after each non-improving epoch.
    train(task, fast_config(epochs=4, lr=1e-6, scheduler="plateau", plateau_patience=0, plateau_factor=0.5,
                            monitor="val_acc", monitor_mode="max"), reporter=rec)
    lrs = [m["lr"] for _, m in rec.epochs]
    # The epoch metric records the rate the epoch trained with; cuts show from epoch 3 on.
    assert lrs[0] == pytest.approx(1e-6) and lrs[-1] == pytest.approx(1e-6 * 0.5 ** 2)
