"""TrialControl: how a backend steers run_trial. A stop asked from a signal handler aborts a trial
still setting up (where there is no step to stop at) and never one that trains; a stop from any
other thread never raises; the test hold waits for its gate, beating, and gives way to a stop."""
from __future__ import annotations

import signal
import threading

import pytest

from sweeps.spec.load import spec_from_dict
from sweeps.tracking.base import RunHandle, Tracker
from sweeps.trial import TrialSpec, run_trial
from sweeps.trial_control import ENV_HOLD_MID_TRIAL, ENV_HOLD_TRIAL, StopRequest, TrialControl, TrialInterrupted
from tests.memory_tracker import MemoryTracker


def test_a_signal_aborts_the_set_up_and_after_the_first_step_only_asks_for_a_stop():
    stop = StopRequest()
    with pytest.raises(TrialInterrupted) as err, stop.setting_up():
        stop.request_from_signal(signal.SIGTERM)  # as the handler does, in the thread setting up
    assert err.value.signum == signal.SIGTERM and stop.is_set() and stop.signum == signal.SIGTERM

    stop = StopRequest()
    with stop.setting_up():
        stop.stepping()  # the first optimizer step
        stop.request_from_signal(signal.SIGINT)  # no raise: the trial stops at its next step
    assert stop.is_set() and stop.signum == signal.SIGINT
    stop.request_from_signal(signal.SIGTERM)  # between trials: no raise either; the first signal is kept
    assert stop.signum == signal.SIGINT


def test_a_stop_from_another_thread_never_raises_and_a_stopped_trial_does_not_set_up():
    stop = StopRequest()
    with stop.setting_up():
        asker = threading.Thread(target=stop.request)  # Ray stopping the actor, a deadline
        asker.start()
        asker.join()
    assert stop.is_set() and stop.signum == 0
    with pytest.raises(TrialInterrupted) as err, stop.setting_up():
        pass
    assert err.value.signum == 0


@pytest.mark.parametrize("where", ["start", "mid_trial"])
def test_the_hold_waits_for_its_gate_beating_and_gives_way_to_a_stop(tmp_path, monkeypatch, where):
    gate = tmp_path / "gate"
    beats: list[int] = []

    def beat() -> None:  # the test opens the gate on the first beat
        beats.append(1)
        gate.touch()

    env, hold = {"start": (ENV_HOLD_TRIAL, TrialControl.hold_if_asked),
                 "mid_trial": (ENV_HOLD_MID_TRIAL, TrialControl.hold_mid_trial)}[where]
    monkeypatch.setenv(env, str(gate))
    hold(TrialControl(heartbeat=beat))
    assert beats == [1]
    gate.unlink()
    stopped = TrialControl(heartbeat=lambda: beats.append(2))
    stopped.stop.request()
    hold(stopped)  # the gate is closed, but a stop is asked: no wait, no beat
    assert beats == [1]


def test_a_trial_asked_to_stop_before_it_set_up_is_interrupted_naming_the_signal(tmp_path):
    spec = spec_from_dict({"name": "t", "task": {"name": "digits", "model": "mlp"}, "train": {"epochs": 1},
                           "search": {"lr": {"type": "float", "low": 1e-3, "high": 1.0, "log": True}}})
    runs = MemoryTracker()
    assert isinstance(runs, Tracker)
    control = TrialControl(on_start=lambda run: control.stop.request(signal.SIGTERM))  # a signal as it starts
    trial = TrialSpec(0, {"lr": 0.1}, tmp_path / "trial-0000", RunHandle("study", "0", "study"), "optuna")
    outcome = run_trial(spec, trial, control, runs)
    assert outcome.state == "INTERRUPTED"
    assert outcome.reason.startswith("stopped by SIGTERM while the trial was setting up")
    assert runs.status == "KILLED" and runs.tags["sweeps.backend"] == "optuna"
    assert not (trial.out_dir / "last.pt").exists()  # nothing was trained
