"""How a backend steers one trial that ``sweeps.trial.run_trial`` runs: the stop request, the
pruning question, the heartbeat, the hook told the trial's run, and the test holds.

A stop is asked by a signal handler (Optuna's worker), by Ray stopping the actor, by a deadline or
by a lost storage. Once the trial trains, it stops at its next optimizer step and checkpoints. While
it still sets up (the task's imports, datasets and model: nothing to checkpoint yet, and no step to
look at), a stop asked from a signal handler raises :class:`TrialInterrupted` where the set-up is,
so a hang there stops as well.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from core import faults
from sweeps.tracking.base import RunHandle

PruneFn = Callable[[int, float], bool]
ENV_HOLD_TRIAL = "SWEEPS_HOLD_TRIAL"  # tests: see TrialControl.hold_if_asked
ENV_HOLD_MID_TRIAL = "SWEEPS_HOLD_MID_TRIAL"  # tests: see TrialControl.hold_mid_trial


class TrialInterrupted(BaseException):
    """Raised by a signal handler while a trial is still setting up, where there is no step to stop
    at. A BaseException, so a user task's ``except Exception`` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopRequest(threading.Event):
    """Set once a stop is asked, with the signal that asked (``signum``; 0: a request without one).
    An Event, so whoever waits for a stop (a worker between trials, a test hold) waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.signum = 0
        self._setting_up = False

    def request(self, signum: int = 0) -> None:
        """Ask the trial to stop at its next step; never raises (any thread may ask)."""
        self.signum = self.signum or signum
        self.set()

    def request_from_signal(self, signum: int) -> None:
        """A signal handler's request: as :meth:`request`, and while the trial sets up, abort the
        set-up where it is (the handler runs in the thread that sets the trial up)."""
        self.request(signum)
        if self._setting_up:
            self._setting_up = False
            raise TrialInterrupted(signum)

    @contextlib.contextmanager
    def setting_up(self) -> Iterator[None]:
        """Around a trial's set-up and training: a signal aborts it until :meth:`stepping`."""
        self._setting_up = True
        try:
            if self.is_set():
                raise TrialInterrupted(self.signum)
            yield
        finally:
            self._setting_up = False

    def stepping(self) -> None:
        """The trial reached a step: from now on it stops there, with a checkpoint."""
        self._setting_up = False


def _never_prune(_epoch: int, _value: float) -> bool:
    return False


def _nothing(*_args: object) -> None:
    return None


@dataclass
class TrialControl:
    """What a backend gives ``run_trial`` besides the trial's description: ``stop`` (shared with
    whoever asks for the stop), ``should_prune(epoch, value)`` (Optuna's pruner, a Ray scheduler),
    ``heartbeat()`` (called at steps and epochs: the backend's liveness mark), ``on_start(run)``
    (the trial's tracking run, before training: the backend records its id so a crash recovery can
    close it)."""

    stop: StopRequest = field(default_factory=StopRequest)
    should_prune: PruneFn = _never_prune
    heartbeat: Callable[[], None] = _nothing
    on_start: Callable[[RunHandle], None] = _nothing

    def hold_if_asked(self) -> None:
        """For tests: with ``SWEEPS_HOLD_TRIAL=<file>``, the trial waits at its start, marking
        progress as a long step would, until that file exists (or a stop is asked). A test holds a
        worker busy this way for exactly as long as it needs, whatever the speed."""
        self._hold_until(os.environ.get(ENV_HOLD_TRIAL, ""))

    def hold_mid_trial(self) -> None:
        """Called by Optuna's workers after each epoch a single-objective trial reports (and has
        checkpointed); Ray's trials and multi-objective ones never wait here. A mid-trial driver
        fault waits here for the stop the driver's signal brings (``core.faults``), so it never
        races the trial's end. For tests, with ``SWEEPS_HOLD_MID_TRIAL=<file>`` the trial waits
        here (beating) until that file exists or a stop is asked: a signal from outside the study
        (a SLURM preemption) then always meets a trial mid-training, however fast it would end."""
        faults.hold_mid_trial(self.stop)
        self._hold_until(os.environ.get(ENV_HOLD_MID_TRIAL, ""))

    def _hold_until(self, gate: str) -> None:
        while gate and not os.path.exists(gate) and not self.stop.wait(0.5):
            self.heartbeat()
