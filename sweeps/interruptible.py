"""Waits that a Ctrl-C or SIGTERM ends at once.

Elsewhere a signal is recorded and honoured at the next safe point (a checkpoint, the end of a
set-up step), so nothing is left half-written. A wait on a network answer has nothing to save
and can last a timeout of tens of seconds (a tracking server that accepts the connection and
never answers): inside :func:`interrupted_by_signals` the signal raises instead, and the user's
Ctrl-C works at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from sweeps.errors import StoppedBySignal
from sweeps.stop_signals import STOP_SIGNALS


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
