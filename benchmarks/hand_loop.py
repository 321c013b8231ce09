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

import statistics
import time


def hand_parts(task, cfg):
    """Model, shuffling loader, optimizer and loss of the hand loop: SGD with core's settings,
    the loader the way a tutorial writes it (RandomSampler, in-process loading, no pinning)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(cfg.seed)
    model = task.build_model()
    train_ds, _ = task.datasets()
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0, pin_memory=False,
                        drop_last=False, generator=torch.Generator().manual_seed(cfg.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    return model, loader, optimizer, nn.CrossEntropyLoss()


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hand_loop(task, cfg, faults: bool = False) -> dict:
    """The minimal loop, whole: DataLoader(shuffle) -> forward -> loss -> zero_grad -> backward ->
    step. ``faults``: also count minor page faults per step (a getrusage call per step)."""
    model, loader, optimizer, criterion = hand_parts(task, cfg)
    steps = len(loader) if cfg.max_steps_per_epoch is None else min(len(loader), cfg.max_steps_per_epoch)
    seen, train_time, intervals, cpu_intervals, fault_counts = 0, 0.0, [], [], []
    for _epoch in range(cfg.epochs):
        model.train()
        t0 = time.perf_counter()
        last = last_cpu = last_faults = None
        for i, (x, y) in enumerate(loader):
            if i >= steps:
                break
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += y.shape[0]
            now, now_cpu = time.perf_counter(), time.process_time()
            now_faults = minor_faults() if faults else 0
            if last is not None:
                intervals.append(now - last)
                cpu_intervals.append(now_cpu - last_cpu)
                fault_counts.append(now_faults - last_faults)
            last, last_cpu, last_faults = now, now_cpu, now_faults
        train_time += time.perf_counter() - t0
    return {"samples_per_s": seen / train_time, "samples": seen, "train_time_s": train_time,
            "step_interval_s": statistics.median(intervals) if intervals else float("nan"),
            "step_cpu_s": statistics.median(cpu_intervals) if cpu_intervals else float("nan"),
            "step_faults": statistics.median(fault_counts) if faults and fault_counts else float("nan")}


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
        return [b[which] - a[which] for epoch in self.stamps for a, b in zip(epoch, epoch[1:])]


class HandStepper:
    """The hand loop one optimizer step per call, cycling through its epochs."""

    def __init__(self, task, cfg) -> None:
        self.model, self.loader, self.optimizer, self.criterion = hand_parts(task, cfg)
        self.model.train()
        self._batches, self._left = iter(()), 0

    def ready(self) -> None:
        """Untimed: start the next epoch's iterator when this one is spent (core's epoch start,
        where it does the same, is not timed either)."""
        if self._left == 0:
            self._batches, self._left = iter(self.loader), len(self.loader)

    def step(self) -> int:
        """One step: fetch a batch, forward, backward, update. Returns the batch's sample count."""
        x, y = next(self._batches)
        self._left -= 1
        loss = self.criterion(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return y.shape[0]


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
