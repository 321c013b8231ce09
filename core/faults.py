"""Deterministic fault injection: stop a process at a named point of its own code.

Tests reproduce crashes (a SIGKILL mid-write, a full disk, a signal at a given moment) by naming
points in the ``SWEEPS_FAULT`` environment variable (comma-separated) rather than by timing a kill
from outside, which would race the code it means to interrupt; ``SWEEPS_PAUSE`` names points where
the process stops itself (SIGSTOP) for the test to change the world and resume it.

Every point is declared once, in :class:`Fault` or :class:`Pause`, with its one-line meaning; code
marks a point by its declared name. A name in either variable that is not declared is refused
(:class:`UnknownFaultPoint`), never silently ignored: a misspelt point would otherwise leave a test
passing without its fault. Stdlib only: ``core`` imports no outer layer, and ``sweeps`` calls this
module directly.
"""
from __future__ import annotations

import os
import signal
import threading
from enum import StrEnum
from typing import TypeVar

ENV_FAULT = "SWEEPS_FAULT"
ENV_PAUSE = "SWEEPS_PAUSE"


class _Point(StrEnum):
    """A declared point: its value is the name a test writes, ``meaning`` says where it fires."""

    meaning: str

    def __new__(cls, name: str, meaning: str) -> _Point:
        point = str.__new__(cls, name)
        point._value_ = name
        point.meaning = meaning
        return point


class Fault(_Point):
    """The points ``SWEEPS_FAULT`` may name."""

    MID_CHECKPOINT = ("mid_checkpoint",
                      "core.checkpoint: SIGKILL with part of a checkpoint written, not yet renamed into place")
    AFTER_TRAINING = ("after_training", "core.train: SIGKILL once training ended, before the caller records anything")
    JOURNAL_MID_APPEND = ("journal_mid_append",
                          "sweeps.backends.journal_file: half a journal record on disk, then SIGKILL, the lock held")
    TRIAL_RUN_MADE = ("trial_run_made",
                      "sweeps.trial: SIGKILL once the trial's MLflow run is made, before the study records its id")
    TRIAL_EPOCH_REPORTED = ("trial_epoch_reported",
                            "sweeps.backends.optuna_worker: SIGKILL a worker once its trial's first epoch is "
                            "checkpointed and reported to the study")
    CLI_UNEXPECTED_ERROR = ("cli_unexpected_error",
                            "sweeps.cli.main: raise a RuntimeError no command handles (the last-resort handler)")
    # A study's driver (``sweeps run``) hits itself, at the same moment on both backends: a trial has
    # reported (and checkpointed) an epoch and trains on. Each fires once per process.
    DRIVER_SIGINT_MID_TRIAL = ("driver_sigint_mid_trial", "the driver sends itself SIGINT mid-trial")
    DRIVER_SIGTERM_MID_TRIAL = ("driver_sigterm_mid_trial", "the driver sends itself SIGTERM mid-trial")
    DRIVER_SIGHUP_MID_TRIAL = ("driver_sighup_mid_trial", "the driver sends itself SIGHUP mid-trial")
    DRIVER_KILL_MID_TRIAL = ("driver_kill_mid_trial", "the driver SIGKILLs itself mid-trial")
    DRIVER_HANGUP_MID_TRIAL = ("driver_hangup_mid_trial",
                               "a closed terminal: SIGHUP to the driver's process group (its workers too) mid-trial")
    DRIVER_SIGTERM_AT_START = ("driver_sigterm_at_start",
                               "the driver sends itself SIGTERM once its study run is made, before any trial")
    DRIVER_SIGTERM_AT_END = ("driver_sigterm_at_end",
                             "the driver sends itself SIGTERM once every trial is done, before the summary")
    DRIVER_SIGINT_AT_HANDOVER = ("driver_sigint_at_handover",
                                 "the Optuna driver sends itself SIGINT right before its supervisor takes the signals")
    DRIVER_KILL_AFTER_TRIAL = ("driver_kill_after_trial",
                               "the Ray driver SIGKILLs itself as Ray tells it a trial completed, before Ray's "
                               "experiment snapshot may hold it")


class Pause(_Point):
    """The points ``SWEEPS_PAUSE`` may name."""

    SPEC_READ = ("spec_read", "sweeps run, right after it read the spec file")
    WORKER_IMPORTING = ("worker_importing",
                        "the fork server of sweeps run's workers (or a worker process of its own), its quiet "
                        "signal handlers set, before it imports anything")
    WORKER_BEFORE_GO = ("worker_before_go", "a local worker of sweeps run, its imports done, before it reads its go")


# What each driver point sends, once per process; a closed terminal's SIGHUP goes to the process group.
_SIGNAL_OF: dict[Fault, int] = {
    Fault.DRIVER_SIGINT_MID_TRIAL: signal.SIGINT, Fault.DRIVER_SIGTERM_MID_TRIAL: signal.SIGTERM,
    Fault.DRIVER_SIGHUP_MID_TRIAL: signal.SIGHUP, Fault.DRIVER_KILL_MID_TRIAL: signal.SIGKILL,
    Fault.DRIVER_HANGUP_MID_TRIAL: signal.SIGHUP, Fault.DRIVER_SIGTERM_AT_START: signal.SIGTERM,
    Fault.DRIVER_SIGTERM_AT_END: signal.SIGTERM, Fault.DRIVER_SIGINT_AT_HANDOVER: signal.SIGINT,
    Fault.DRIVER_KILL_AFTER_TRIAL: signal.SIGKILL}
MID_TRIAL = frozenset({Fault.DRIVER_SIGINT_MID_TRIAL, Fault.DRIVER_SIGTERM_MID_TRIAL, Fault.DRIVER_SIGHUP_MID_TRIAL,
                       Fault.DRIVER_KILL_MID_TRIAL, Fault.DRIVER_HANGUP_MID_TRIAL})
_TO_GROUP = frozenset({Fault.DRIVER_HANGUP_MID_TRIAL})
_fired: set[Fault] = set()
_fired_lock = threading.Lock()
P = TypeVar("P", bound=_Point)


class UnknownFaultPoint(ValueError):
    """``SWEEPS_FAULT`` or ``SWEEPS_PAUSE`` names a point that is not declared."""


def _named(env: str, kind: type[P]) -> set[P]:
    names = [n.strip() for n in os.environ.get(env, "").split(",") if n.strip()]
    known = {p.value: p for p in kind}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnknownFaultPoint(
            f"{env}={os.environ[env]!r} names {', '.join(map(repr, unknown))}, which is not a fault point; "
            f"the points are: {', '.join(known)} (core/faults.py); fix the name or unset {env}")
    return {known[n] for n in names}


def _declared(point: str, kind: type[P]) -> P:
    """``point`` as its declared member (a worker's boot line names its pause as plain text)."""
    for member in kind:
        if member.value == point:
            return member
    raise ValueError(f"{point!r} is not a declared {kind.__name__} point (core/faults.py)")


def check_environment() -> None:
    """Raise :class:`UnknownFaultPoint` if either variable names an undeclared point."""
    _named(ENV_FAULT, Fault)
    _named(ENV_PAUSE, Pause)


def armed(point: Fault) -> bool:
    """Whether ``SWEEPS_FAULT`` names ``point``."""
    return _declared(point, Fault) in _named(ENV_FAULT, Fault)


def stop_here(point: Fault) -> None:
    """SIGKILL this process now if ``SWEEPS_FAULT`` names ``point``; otherwise do nothing."""
    if armed(point):
        os.kill(os.getpid(), signal.SIGKILL)


def signal_here(point: Fault) -> None:
    """A driver point: send its signal if ``SWEEPS_FAULT`` names ``point`` and it has not fired in
    this process yet (the signal handlers' "second signal" path is not what these points test)."""
    if not armed(point):
        return
    with _fired_lock:
        if point in _fired:
            return
        _fired.add(point)
    if point in _TO_GROUP:
        os.killpg(os.getpgrp(), _SIGNAL_OF[point])
    else:
        os.kill(os.getpid(), _SIGNAL_OF[point])


def mid_trial_armed() -> bool:
    """Whether a mid-trial driver point is named (the driver skips noticing the moment otherwise)."""
    return bool(_named(ENV_FAULT, Fault) & MID_TRIAL)


def trial_mid_way() -> None:
    """Called by a driver when it learns that a running trial reported an epoch."""
    for point in sorted(_named(ENV_FAULT, Fault) & MID_TRIAL):
        signal_here(point)


def hold_mid_trial(stop: threading.Event) -> None:
    """Called by a worker once its trial has reported an epoch: with a mid-trial driver point
    named, the trial waits there for the stop the driver's signal brings (or dies with a SIGKILLed
    driver), so the fault never races the trial's end (a short trial could finish between the
    driver's look and its signal reaching the worker)."""
    if mid_trial_armed():
        stop.wait()


def pause_here(point: Pause) -> None:
    """Stop this process with SIGSTOP if ``SWEEPS_PAUSE`` names ``point``: a test waits for the
    stop (``os.waitpid(pid, os.WUNTRACED)``), changes the world (edits a file), then sends
    SIGCONT. Deterministic where a sleep before the change would race the code."""
    if _declared(point, Pause) in _named(ENV_PAUSE, Pause):
        os.kill(os.getpid(), signal.SIGSTOP)
