"""The baseline of the trainer benchmarks: a minimal hand-written PyTorch loop, run whole or one
step at a time beside ``core.train()`` (lockstep).

Why lockstep. On these shared VMs the speed of a core drifts by 10 to 15% within seconds
(another tenant's load, frequency changes): two whole runs of the same loop, one after the
other, differ by that much, which is five times the 3% that benchmark 1 has to resolve. In
lockstep, ``core.train()`` drives and, from its per-step report, the hand loop takes one
optimizer step of its own, timed. So every core step is next to a hand step taken
milliseconds later, on the same machine state, and the drift cancels in the ratio of their
sums. The two models alternate in the caches; both sides pay that alike (each step follows one
of the other side's).
"""
from __future__ import annotations

import itertools
import statistics
import time


class HandStepper:
    """The hand loop, one optimizer step per call: a tutorial's loader (RandomSampler, in-process
    loading, no pinning) -> forward -> loss -> zero_grad -> backward -> SGD step, with core's
    optimizer settings. Run whole by :func:`hand_loop`, or beside core by :class:`Lockstep`.
    ``fused``: SGD's fused kernel, as core uses on CPU (core/optim.py), instead of the default
    a tutorial gets; the baseline for core's own overhead, with the same kernels on both sides."""

    def __init__(self, task, cfg, fused: bool = False) -> None:
        import torch
        from torch import nn
        from torch.utils.data import DataLoader

        torch.manual_seed(cfg.seed)
        self.model = task.build_model()
        self.model.train()
        train_ds, _ = task.datasets()
        self.loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0,
                                 pin_memory=False, drop_last=False,
                                 generator=torch.Generator().manual_seed(cfg.seed))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay, fused=fused or None)
        self.criterion = nn.CrossEntropyLoss()
        self._batches, self._left = iter(()), 0

    def start_epoch(self) -> None:
        self._batches, self._left = iter(self.loader), len(self.loader)

    def ready(self) -> None:
        """Untimed, in lockstep: start the next epoch when this one is spent (core's epoch start,
        where it does the same, is not timed either)."""
        if self._left == 0:
            self.start_epoch()

    def step(self) -> int:
        """One step: fetch a batch, forward, backward, update. Returns the batch's sample count."""
        x, y = next(self._batches)
        self._left -= 1
        loss = self.criterion(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return y.shape[0]


def hand_loop(task, cfg) -> dict:
    """The hand loop run whole, its epochs timed like core's (the loader's start included)."""
    hand = HandStepper(task, cfg)
    steps = len(hand.loader) if cfg.max_steps_per_epoch is None else min(len(hand.loader), cfg.max_steps_per_epoch)
    seen, train_time, intervals, cpu_intervals = 0, 0.0, [], []
    for _epoch in range(cfg.epochs):
        t0 = time.perf_counter()
        hand.start_epoch()
        last = last_cpu = None
        for _ in range(steps):
            seen += hand.step()
            now, now_cpu = time.perf_counter(), time.process_time()
            if last is not None:
                intervals.append(now - last)
                cpu_intervals.append(now_cpu - last_cpu)
            last, last_cpu = now, now_cpu
        train_time += time.perf_counter() - t0
    return {"samples_per_s": seen / train_time, "samples": seen, "train_time_s": train_time,
            "step_interval_s": statistics.median(intervals) if intervals else float("nan"),
            "step_cpu_s": statistics.median(cpu_intervals) if cpu_intervals else float("nan")}


class StepClock:
    """Wraps a reporter and timestamps every ``report_step`` call: consecutive stamps of one
    epoch are one full optimizer step of core's loop apart (data loading included)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.stamps: list[list[tuple[float, float]]] = [[]]  # (wall, process CPU) per step, per epoch

    def report_step(self, step, metrics):
        self.stamps[-1].append((time.perf_counter(), time.process_time()))
        return self.inner.report_step(step, metrics)

    def report_epoch(self, epoch, step, metrics):
        self.stamps.append([])
        return self.inner.report_epoch(epoch, step, metrics)

    def log_artifact(self, path, kind):
        return self.inner.log_artifact(path, kind)

    def intervals(self, which: int = 0) -> list[float]:
        return [b[which] - a[which] for epoch in self.stamps for a, b in itertools.pairwise(epoch)]


class Lockstep:
    """A reporter around core's reporter: after each of core's steps, one timed hand step.

    Core's step time is the interval from the end of one hand step to core's next report (its
    data loading, forward, backward, gradient norm, step read, report and optimizer step); the
    first step of each epoch has no interval and no hand step is counted against it."""

    def __init__(self, inner, hand: HandStepper) -> None:
        self.inner, self.hand = inner, hand
        self.core_s: list[float] = []
        self.hand_s: list[float] = []
        self.hand_samples = 0
        self._since: float | None = None

    def report_step(self, step, metrics):
        decision = self.inner.report_step(step, metrics)
        self.hand.ready()
        t0 = time.perf_counter()
        counted = self._since is not None
        if counted:
            self.core_s.append(t0 - self._since)
        n = self.hand.step()
        self._since = time.perf_counter()
        if counted:
            self.hand_s.append(self._since - t0)
            self.hand_samples += n
        return decision

    def report_epoch(self, epoch, step, metrics):
        self._since = None
        return self.inner.report_epoch(epoch, step, metrics)

    def log_artifact(self, path, kind):
        return self.inner.log_artifact(path, kind)

    def ratio(self) -> float:
        """Core's throughput over the hand loop's, both in samples per second of step time:
        the same batch size on both sides, so it is the hand's total step time over core's."""
        return sum(self.hand_s) / sum(self.core_s)
