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

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from core.config import ProfileConfig
from core.reporting import Reporter

PROFILE_DIR = "profile"
TOP_OPS = 30  # rows of the operator table


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
        self.prof.start()
        self.running = True

    def step(self) -> bool:
        """Called after each optimizer step; False once the schedule is done (the profiler stopped)."""
        self.prof.step()
        self.remaining -= 1
        if self.remaining <= 0:
            self.close()
        return self.running

    def close(self) -> None:
        """Stop the profiler (a cycle cut short by the run's end is still written)."""
        if self.running:
            self.running = False
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
