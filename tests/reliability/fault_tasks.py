"""User tasks (loaded through `task.target`) that misbehave on purpose."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from torch import nn

from core.tasks import task
from core.tasks.digits import DigitsTask


class _OomWhenBatchOver(nn.Module):
    """Raises CUDA's out-of-memory error when a batch is larger than ``limit``, as a GPU would."""

    def __init__(self, inner: nn.Module, limit: int) -> None:
        super().__init__()
        self.inner, self.limit = inner, limit

    def forward(self, x):
        if self.training and x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} samples")
        return self.inner(x)


class OomTask(DigitsTask):
    def build_model(self):
        return _OomWhenBatchOver(super().build_model(), limit=int(os.environ.get("OOM_LIMIT", "32")))


@task
def make_oom_task(model: str = "mlp") -> OomTask:
    return OomTask(model)


class _HangAfter(nn.Module):
    """Hangs forever (a deadlocked data pipeline, a stuck collective) after ``calls`` forwards,
    the first time only: the marker file records that it hung."""

    def __init__(self, inner: nn.Module, calls: int, marker: str) -> None:
        super().__init__()
        self.inner, self.calls, self.seen, self.marker = inner, calls, 0, marker

    def forward(self, x):
        self.seen += 1
        if self.training and self.seen > self.calls and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            _watchdog_clock_ahead()
            while True:
                time.sleep(1)
        return self.inner(x)


def _watchdog_clock_ahead() -> None:
    """On Ray, budget.trial_timeout is counted in the trial's own process, by the watchdog of
    sweeps.backends.ray_hang: ``HANG_CLOCK_AHEAD_S`` moves that watchdog's clock this far ahead
    once the task hangs, so that the timeout passes at once on any machine while the trial is hung
    (tests/reliability/hang_clock.py does the same to the Optuna backend's supervisor)."""
    ahead = float(os.environ.get("HANG_CLOCK_AHEAD_S", "0"))
    watchdog = sys.modules.get("sweeps.backends.ray_hang")
    if ahead and watchdog is not None:
        watchdog.time = _ClockAhead(ahead)


class _ClockAhead:
    """The :mod:`time` module with ``monotonic`` read ``ahead`` seconds later."""

    def __init__(self, ahead: float) -> None:
        self.ahead = ahead

    def __getattr__(self, name: str):
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


class HangTask(DigitsTask):
    def build_model(self):
        return _HangAfter(super().build_model(), calls=15, marker=os.environ["HANG_MARKER"])


@task
def make_hang_task(model: str = "mlp") -> HangTask:
    return HangTask(model)


class _WaitAfter(nn.Module):
    """Training forwards after the first ``calls`` wait until the file ``gate`` exists: the trial
    stays RUNNING, with the checkpoint of its earlier epochs on disk, until the test opens the gate.
    Each process counts from zero, so a retry that resumes past ``calls`` steps never waits."""

    def __init__(self, inner: nn.Module, calls: int, gate: str | None) -> None:
        super().__init__()
        self.inner, self.calls, self.seen, self.gate = inner, calls, 0, gate

    def forward(self, x):
        if self.training and self.gate:
            self.seen += 1
            while self.seen > self.calls and not os.path.exists(self.gate):
                time.sleep(0.05)
        return self.inner(x)


class GatedTask(DigitsTask):
    """``GATE_AFTER`` training forwards (an epoch's worth), then wait for the file ``GATE_OPEN``."""

    def build_model(self):
        return _WaitAfter(super().build_model(), calls=int(os.environ.get("GATE_AFTER", "0")),
                          gate=os.environ.get("GATE_OPEN"))


@task
def make_gated_task(model: str = "mlp") -> GatedTask:
    return GatedTask(model)


class _WaitForSigterm(nn.Module):
    """After ``calls`` training forwards, touches the file ``at`` and waits until this process gets
    SIGTERM (its own handler, the worker's, runs first): the trial is stopped mid-epoch at a known
    point, whoever sends the signal and whenever. Each process counts from zero, so a retry that
    resumes past ``calls`` steps never waits."""

    def __init__(self, inner: nn.Module, calls: int, at: str | None) -> None:
        super().__init__()
        self.inner, self.calls, self.seen, self.at = inner, calls, 0, at

    def forward(self, x):
        if self.training and self.at:
            self.seen += 1
            if self.seen == self.calls + 1:
                got = threading.Event()
                worker_handler = signal.getsignal(signal.SIGTERM)

                def chained(signum, frame):
                    if callable(worker_handler):
                        worker_handler(signum, frame)  # the trial stops at its next step
                    got.set()

                signal.signal(signal.SIGTERM, chained)
                open(self.at, "w").close()
                while not got.wait(0.05):
                    pass
        return self.inner(x)


class StopWaitingTask(DigitsTask):
    """``STOP_AFTER`` training forwards (default 1), then wait for SIGTERM; only with ``STOP_AT`` set."""

    def build_model(self):
        return _WaitForSigterm(super().build_model(), calls=int(os.environ.get("STOP_AFTER", "1")),
                               at=os.environ.get("STOP_AT"))


@task
def make_stop_waiting_task(model: str = "mlp") -> StopWaitingTask:
    return StopWaitingTask(model)
