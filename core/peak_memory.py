"""A run's own peak memory, reported each epoch as ``peak_mem_mb`` (MiB).

A sweep worker trains many runs in one process, and the counters a process keeps for its whole
life (``ru_maxrss``, CUDA's ``max_memory_allocated``) would give trial N the largest peak of
trials 1..N. ``peak_mem_mb`` may be a study's objective or constraint, so each run starts its own
measure when it is set up (before its model and data are built):

* CUDA: the peak of memory allocated to tensors on the run's device since the run started
  (``torch.cuda.reset_peak_memory_stats``, then ``max_memory_allocated``); what the caching
  allocator reserves beyond it, and the CUDA context, are not counted.
* CPU on Linux: the peak resident set size of the process since the run started: the kernel's
  high-water mark (``VmHWM``) is reset to the current size (``/proc/self/clear_refs``, "5") and
  read back. It includes what the process already held when the run started (the interpreter,
  torch, data an earlier trial left cached), as that memory is resident while the run trains.
* Elsewhere (or where ``clear_refs`` cannot be written): NaN, since no per-run peak can be had;
  a study whose objective or constraint is ``peak_mem_mb`` needs Linux or a GPU.

The mark is per process: runs trained at the same time in one process share it.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class PeakMemory:
    """The peak memory of the run started when this is made, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.per_run = True
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        try:
            _CLEAR_REFS.write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
        except OSError:  # not Linux, or /proc read-only: no per-run peak here
            self.per_run = False

    def mb(self) -> float:
        """The peak since the run started, in MiB (NaN where it cannot be measured per run)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if not self.per_run:
            return math.nan
        return _status_kib("VmHWM") / 1024


def _status_kib(field: str) -> float:
    """A ``kB`` field of /proc/self/status (NaN when it is missing)."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return math.nan
