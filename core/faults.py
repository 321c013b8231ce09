"""Deterministic fault injection for tests: a process stops itself at a named point.

``SWEEPS_FAULT=point[,point...]`` in the environment makes :func:`stop_here` SIGKILL the
calling process when it reaches one of those points, as the OOM killer or a power cut would.
Unset (always, outside tests), it costs one dictionary lookup.
"""
from __future__ import annotations

import os
import signal


def stop_here(point: str) -> None:
    """SIGKILL this process if ``SWEEPS_FAULT`` names ``point``."""
    wanted = os.environ.get("SWEEPS_FAULT")
    if wanted and point in wanted.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
