"""The signals a study's driver records outside its backend's own handling (see
:class:`DriverSignals`); shared by the Optuna and the Ray backend."""
from __future__ import annotations

import contextlib
import signal
import threading

from sweeps.stop_signals import STOP_SIGNALS, after_hangup


class DriverSignals:
    """SIGINT, SIGTERM and SIGHUP (:data:`~sweeps.stop_signals.STOP_SIGNALS`) that reach a driver
    (``sweeps run``) outside the part where its backend takes them (the Optuna supervisor, Ray's
    fit): while it starts (the store, the parent run, ``ray.init``: seconds) and while it ends
    (the summary, the Pareto tags, closing the study run). They are recorded, not fatal: the
    driver skips what is left to run, closes the study run KILLED and exits 128+n, as a signal
    mid-study does, instead of dying with the study run RUNNING. ``ray.init`` installs Ray's own
    SIGTERM handler (``sys.exit(15)``): :meth:`around_ray_init` puts this one back and turns
    that exit into the recorded signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> DriverSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def _record(self, signum, _frame) -> None:
        after_hangup(signum)
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def around_ray_init(self):
        try:
            yield
        except SystemExit as exc:
            if exc.code != signal.SIGTERM:
                raise
            self.signum = self.signum or signal.SIGTERM  # Ray's handler took a SIGTERM during ray.init
        finally:
            self.reinstall()

    def reinstall(self) -> None:
        """Take the stop signals back from a library that set its own (``ray.init``) or reset
        them (``ray.shutdown``)."""
        if self._old:
            for s in STOP_SIGNALS:
                signal.signal(s, self._record)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


def stopped_by(signum: int, then: str) -> tuple[str, int]:
    """The verdict of a driver stopped by ``signum`` (both backends): its words and exit code 128+n."""
    return f"stopped by {signal.Signals(signum).name}; {then}", 128 + signum
