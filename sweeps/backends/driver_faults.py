"""Fault points where a study's driver (``sweeps run``) hits itself, with the same names on both
backends, so that the shared contract suite (tests/sweeps/backends/test_backend_contract.py)
interrupts an Optuna study and a Ray study at the same moment without racing either.

The moment is the one a user's ``kill`` is most likely to hit: a trial has reported (and
checkpointed) an epoch and trains on. The driver then gets SIGINT or SIGTERM, as from
``kill`` to it alone (not to its process group), or SIGKILLs itself. Each point fires once per
process: the signal handlers' "second signal" path is not what these points test.
"""
from __future__ import annotations

import os
import signal
import threading

from sweeps.faults import armed

DRIVER_SIGINT_MID_TRIAL = "driver_sigint_mid_trial"
DRIVER_SIGTERM_MID_TRIAL = "driver_sigterm_mid_trial"
DRIVER_SIGHUP_MID_TRIAL = "driver_sighup_mid_trial"
DRIVER_KILL_MID_TRIAL = "driver_kill_mid_trial"
# A closed terminal: SIGHUP to the driver's whole process group (its local workers with it).
DRIVER_HANGUP_MID_TRIAL = "driver_hangup_mid_trial"
# While the driver starts (its study run made; on Ray right after ray.init, whose own SIGTERM
# handler is then in place), and while it ends (every trial done, before the summary and tags).
DRIVER_SIGTERM_AT_START = "driver_sigterm_at_start"
DRIVER_SIGTERM_AT_END = "driver_sigterm_at_end"
# The Optuna driver, between its last look for a signal while starting and its supervisor taking
# the signals over: a Ctrl-C there must stop the study as one mid-study does.
DRIVER_SIGINT_AT_HANDOVER = "driver_sigint_at_handover"
_SIGNAL_OF = {DRIVER_SIGINT_MID_TRIAL: signal.SIGINT, DRIVER_SIGTERM_MID_TRIAL: signal.SIGTERM,
              DRIVER_SIGHUP_MID_TRIAL: signal.SIGHUP, DRIVER_KILL_MID_TRIAL: signal.SIGKILL,
              DRIVER_HANGUP_MID_TRIAL: signal.SIGHUP}
_TO_GROUP = {DRIVER_HANGUP_MID_TRIAL}
_fired: set[str] = set()


def any_armed() -> bool:
    """Whether a driver fault is asked for (the driver skips the work of noticing the moment otherwise)."""
    return any(armed(point) for point in _SIGNAL_OF)


def starting() -> None:
    """Called by the driver while it starts, before any trial runs."""
    _sigterm_once(DRIVER_SIGTERM_AT_START)


def ending() -> None:
    """Called by the driver once its trials are done, before it writes the summary."""
    _sigterm_once(DRIVER_SIGTERM_AT_END)


def handing_over() -> None:
    """Called by the Optuna driver right before its supervisor takes SIGINT and SIGTERM."""
    _signal_once(DRIVER_SIGINT_AT_HANDOVER, signal.SIGINT)


def _sigterm_once(point: str) -> None:
    _signal_once(point, signal.SIGTERM)


def _signal_once(point: str, signum: int) -> None:
    if armed(point) and point not in _fired:
        _fired.add(point)
        os.kill(os.getpid(), signum)


def hold_mid_trial(stop: threading.Event) -> None:
    """Called by an Optuna worker once its trial has reported an epoch: with a mid-trial driver
    fault armed, the trial waits there for the stop the driver's signal brings (or dies with a
    SIGKILLed driver), so the fault never races the trial's end (a short trial could finish
    between the driver's look and its signal reaching the worker)."""
    if any_armed():
        stop.wait()


def trial_mid_way() -> None:
    """Called by the driver when it learns that a running trial reported an epoch."""
    for point, signum in _SIGNAL_OF.items():
        if armed(point) and point not in _fired:
            _fired.add(point)
            if point in _TO_GROUP:
                os.killpg(os.getpgrp(), signum)
            else:
                os.kill(os.getpid(), signum)
