"""``train.profile``: torch.profiler over a few optimizer steps of a run.

The profiler follows ``torch.profiler.schedule(wait, warmup, active, repeat)`` counted in optimizer
steps (one ``step()`` after each; the data loading between steps is in the trace). Each recorded
cycle writes, under ``out/profile/``, a Chrome trace (``trace_<cycle>.json``: open it in
chrome://tracing or https://ui.perfetto.dev) and the top operators by self time
(``top_ops_<cycle>.txt``), each logged as an artifact of kind "profile". Once the schedule is
done the profiler is stopped, so the rest of the run pays nothing; with ``train.profile`` unset
no profiler exists at all.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from core.config import ProfileConfig
from core.reporting import Reporter

PROFILE_DIR = "profile"
TOP_OPS = 30  # rows of the operator table
# A line of Kineto's own log ("USDT:2026-01-01 10:00:00 123:123 SyncActivityProfilerHandler.cpp:39] ..."),
# e.g. "gpuGetDeviceCount failed with code 35" on a machine without a GPU.
KINETO_LINE = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\]")


@contextlib.contextmanager
def kineto_quiet() -> Iterator[None]:
    """Keep Kineto's log lines (the profiler's C++ side writes them to file descriptor 2 as it
    starts and stops a trace) out of the run's output; anything else written meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not KINETO_LINE.match(line)]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


class StepProfiler:
    """A ``torch.profiler.profile`` for the run: :meth:`start` before the first step, :meth:`step`
    after every optimizer step (it says whether to go on calling it), :meth:`close` when the run
    ends, however it ends."""

    def __init__(self, cfg: ProfileConfig, cuda: bool, out: Path, reporter: Reporter) -> None:
        self.out, self.reporter, self.cuda = out / PROFILE_DIR, reporter, cuda
        self.remaining = (cfg.wait + cfg.warmup + cfg.active) * cfg.repeat
        self.cycle = 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = profile(activities=activities,
                            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
                            on_trace_ready=self._ready, record_shapes=cfg.record_shapes,
                            profile_memory=cfg.profile_memory, with_stack=cfg.with_stack)
        self.running = False

    def start(self) -> None:
        """Called right before the first training step: set-up (data, model) is not profiled."""
        with kineto_quiet():
            self.prof.start()
        self.running = True

    def step(self) -> bool:
        """Called after each optimizer step; False once the schedule is done (the profiler stopped)."""
        with kineto_quiet():  # a cycle's trace starts and stops inside step()
            self.prof.step()
        self.remaining -= 1
        if self.remaining <= 0:
            self.close()
        return self.running

    def close(self) -> None:
        """Stop the profiler (a cycle cut short by the run's end is still written)."""
        if self.running:
            self.running = False
            with kineto_quiet():
                self.prof.stop()

    def _ready(self, prof: profile) -> None:
        """torch.profiler calls this at the end of each recorded cycle."""
        self.cycle += 1
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"trace_{self.cycle}.json"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages(group_by_input_shape=False).table(sort_by=sort_by, row_limit=TOP_OPS)
        ops = self.out / f"top_ops_{self.cycle}.txt"
        ops.write_text(table + "\n")
        self.reporter.log_artifact(trace, "profile")
        self.reporter.log_artifact(ops, "profile")


def start_profiler(cfg: ProfileConfig | None, device_setting: str, out: Path | None,
                   reporter: Reporter) -> StepProfiler | None:
    """The run's profiler (not started yet) when ``train.profile`` is set and the run has an output
    folder, else None."""
    if cfg is None or out is None:
        return None
    cuda = device_setting != "cpu" and torch.cuda.is_available()
    return StepProfiler(cfg, cuda, out, reporter)
