"""The signals that stop a sweeps process the resumable way, what a hangup leaves behind, and the
waits they end at once.

SIGTERM (``kill``, a scheduler), SIGINT (Ctrl-C) and SIGHUP (the terminal closed, an ssh session
dropped) all take one stop path: running trials checkpoint and are requeued, runs are closed,
the process exits 128 + the signal's number. Every handler of a driver or a worker installs
itself for :data:`STOP_SIGNALS`, so no stop signal ends a process the default way (SIGHUP's
default is to die at once, leaving trials and runs RUNNING).

A signal is recorded and honoured at the next safe point (a checkpoint, the end of a set-up step),
so nothing is left half-written. A wait on a network answer has nothing to save and can last a
timeout of tens of seconds (a tracking server that accepts the connection and never answers):
inside :func:`interrupted_by_signals` the signal raises instead, and the user's Ctrl-C works at once.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from sweeps.errors import StoppedBySignal

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


class _Signalled(BaseException):  # not an Exception: no library's `except Exception` swallows it
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interrupted_by_signals(waiting_for: str) -> Iterator[None]:
    """SIGINT, SIGTERM or SIGHUP inside the block raise :class:`StoppedBySignal` ("stopped by SIGINT while
    ``waiting_for``; no study, run or trial was created"); the handlers before it are put back. Only
    for code that writes nothing; a no-op outside the main thread (signals reach only it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame) -> None:
        raise _Signalled(signum)

    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    except _Signalled as exc:
        raise StoppedBySignal(f"stopped by {signal.Signals(exc.signum).name} while {waiting_for}; no study, run "
                              "or trial was created: run the same command again", exc.signum) from None
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
