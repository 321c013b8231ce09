"""The signals that stop a sweeps process the resumable way, and what a hangup leaves behind.

SIGTERM (``kill``, a scheduler), SIGINT (Ctrl-C) and SIGHUP (the terminal closed, an ssh session
dropped) all take one stop path: running trials checkpoint and are requeued, runs are closed,
the process exits 128 + the signal's number. Every handler of a driver or a worker installs
itself for :data:`STOP_SIGNALS`, so no stop signal ends a process the default way (SIGHUP's
default is to die at once, leaving trials and runs RUNNING).
"""
from __future__ import annotations

import os
import signal

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def after_hangup(signum: int) -> None:
    """Called by a stop handler: after SIGHUP the terminal is gone, and a write to it fails
    (EIO) in the middle of the stop; standard output and error that were that terminal write to
    /dev/null from then on. Any other signal, or output to a file or a pipe, is left alone."""
    if signum != signal.SIGHUP:
        return
    devnull = None
    for fd in (1, 2):
        try:
            if not os.isatty(fd):
                continue
        except OSError:
            continue
        if devnull is None:
            devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
    if devnull is not None:
        os.close(devnull)
