"""Deterministic fault injection: stop a process at a named point of its own code.

Tests reproduce crashes (a SIGKILL mid-write, a full disk) by naming points in the
``SWEEPS_FAULT`` environment variable (comma-separated) rather than by timing a kill from
outside, which would race the code it means to interrupt. Production code marks a point with
:func:`stop_here` (the process SIGKILLs itself there: no ``finally``, no atexit, exactly
what the OOM killer or a power cut leaves) or asks :func:`armed` and raises its own error.

Points in use (``SWEEPS_PAUSE``: ``spec_read``, in ``sweeps run`` after it read the spec;
``worker_importing``, the fork server of ``sweeps run``'s workers, or a worker process of its own, with its
quiet signal handlers set, before it imports anything; ``worker_before_go``, a worker, its imports done,
before it reads its go):
``mid_checkpoint`` (core.checkpoint: part of a checkpoint is written, not yet
renamed); ``after_training`` (the end of ``core.train``, before the caller records anything);
``journal_mid_append`` (sweeps.backends.journal_file: a partial journal
record is on disk, Optuna's lock held); ``cli_unexpected_error`` (sweeps.cli.main raises a
RuntimeError no command handles, for the last-resort handler). Stdlib only: ``core`` does not import ``sweeps``
(``sweeps.faults`` re-exports this module).
"""
from __future__ import annotations

import os
import signal

ENV_FAULT = "SWEEPS_FAULT"


def armed(point: str) -> bool:
    """Whether ``SWEEPS_FAULT`` names ``point``."""
    names = os.environ.get(ENV_FAULT, "")
    return point in {n.strip() for n in names.split(",") if n.strip()}


def stop_here(point: str) -> None:
    """SIGKILL this process now if ``SWEEPS_FAULT`` names ``point``; otherwise do nothing."""
    if armed(point):
        os.kill(os.getpid(), signal.SIGKILL)


ENV_PAUSE = "SWEEPS_PAUSE"


def pause_here(point: str) -> None:
    """Stop this process with SIGSTOP if ``SWEEPS_PAUSE`` names ``point``: a test waits for the
    stop (``os.waitpid(pid, os.WUNTRACED)``), changes the world (edits a file), then sends
    SIGCONT. Deterministic where a sleep before the change would race the code."""
    names = os.environ.get(ENV_PAUSE, "")
    if point in {n.strip() for n in names.split(",") if n.strip()}:
        os.kill(os.getpid(), signal.SIGSTOP)
