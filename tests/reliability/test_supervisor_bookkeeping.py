"""The supervisor's bookkeeping, whatever ends a worker (trust issue, defects 6, 8, 12): the trial it
left RUNNING is failed with the true cause and its MLflow run closed, its parameters are requeued,
a fresh worker takes the slot and the study finishes; workers dying in every trial, or before
their first, stop the study with a non-zero exit; one that ignores SIGTERM is killed after the
grace period. Its workers live in this process (tests/reliability/scripted_workers.py): what is
tested is what the supervisor does about their exit codes, not how a process gets one (that is
test_worker_lifecycle's, end to end)."""
from __future__ import annotations

import contextlib
import os
import signal

import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from sweeps.backends import optuna_storage
from sweeps.backends.optuna_attrs import ATTR_REASON, ATTR_RUN_ID
from sweeps.backends.supervisor import CRASH_LOOP
from tests.reliability.scripted_workers import COMPLETE, HANG, LEAVES_A_RETRY, ONE_SLOT, Dies, supervised


def _runs(spec) -> dict:
    client = MlflowClient(spec.tracking_store_uri())
    exp = client.get_experiment_by_name(spec.name)
    return {r.info.run_id: r for r in client.search_runs([exp.experiment_id])} if exp else {}


def _assert_nothing_running(supervisor) -> None:
    assert not [t.number for t in supervisor.study.trials if t.state.name == "RUNNING"]
    assert not [r.info.run_name for r in _runs(supervisor.spec).values() if r.info.status == "RUNNING"]


@pytest.mark.parametrize("code, cause", [
    (0, "its worker process exited with code 0 in the middle of the trial (the task, or a library it calls, "
        "ended the process, e.g. with os._exit)"),
    (3, "its worker process exited with code 3 in the middle of the trial"),
    (-signal.SIGKILL, "its worker was killed by SIGKILL (the kernel's out-of-memory killer, a kill -9, or a crash)"),
    (-signal.SIGSEGV, "its worker was killed by SIGSEGV"),
])
def test_a_worker_that_dies_in_a_trial_fails_it_with_the_true_cause_and_the_study_finishes(tmp_path, code, cause):
    supervisor, workers = supervised(tmp_path, [Dies(code)], budget={"n_trials": 2, "max_failures": 3})
    assert supervisor.run(ONE_SLOT) == ("", 0)
    trials = supervisor.study.trials
    [failed] = [t for t in trials if t.state.name == "FAIL"]
    assert failed.user_attrs[ATTR_REASON] == cause
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2
    # The dead trial's parameters were requeued: its retry trained the same point.
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == failed._trial_id]
    assert len(retry) == 1 and retry[0].params == failed.params and retry[0].state.name == "COMPLETE"
    dead_run = _runs(supervisor.spec)[failed.user_attrs[ATTR_RUN_ID]]
    assert dead_run.info.status == "FAILED" and dead_run.data.tags["sweeps.error"] == cause
    assert len(workers.started) == 2  # a fresh worker took the slot
    _assert_nothing_running(supervisor)


def test_a_dead_workers_trial_is_failed_and_requeued_under_the_ask_lock(tmp_path, monkeypatch):
    """No worker can count the budget between the dead trial's FAIL and its retry's enqueue (it
    would take a new trial in the retry's place and leave the retry WAITING): both happen while
    the supervisor holds the study's ask lock, the one workers ask under."""
    supervisor, _ = supervised(tmp_path, [Dies(-signal.SIGKILL)], budget={"n_trials": 2, "max_failures": 3})
    real_lock, seen = optuna_storage.ask_lock, []

    @contextlib.contextmanager
    def watched(spec):
        with real_lock(spec):
            seen.append(("taken", sorted(t.state.name for t in supervisor.study.trials)))
            yield
            seen.append(("released", sorted(t.state.name for t in supervisor.study.trials)))

    monkeypatch.setattr(optuna_storage, "ask_lock", watched)
    assert supervisor.run(ONE_SLOT) == ("", 0)
    assert seen == [("taken", ["RUNNING"]), ("released", ["FAIL", "WAITING"])]


def test_a_worker_that_exits_between_the_supervisors_looks_is_handled_and_replaced(tmp_path):
    """The last live worker exits after the supervisor's look for exits found it running and
    before its look for a worker still alive: its exit is still handled (the true cause, the
    requeue) and a fresh worker finishes the study, instead of the loop ending with the trial
    failed as if its worker had died before it began."""
    supervisor, workers = supervised(tmp_path, [Dies(3, between_looks=True)], budget={"n_trials": 2, "max_failures": 3})
    assert supervisor.run(ONE_SLOT) == ("", 0)
    [failed] = [t for t in supervisor.study.trials if t.state.name == "FAIL"]
    assert failed.user_attrs[ATTR_REASON] == "its worker process exited with code 3 in the middle of the trial"
    assert sum(t.state.name == "COMPLETE" for t in supervisor.study.trials) == 2
    assert len(workers.started) == 2
    _assert_nothing_running(supervisor)


def test_a_worker_that_exits_cleanly_with_a_retry_waiting_is_replaced_and_the_retry_runs(tmp_path):
    """A worker exits 0 while a requeued trial waits and the budget has room for it (it looked for
    trials between the dead trial's FAIL and its retry's enqueue, as every worker may have): its
    slot gets a fresh worker, which runs the retry, instead of the study ending short of its budget."""
    supervisor, workers = supervised(tmp_path, [LEAVES_A_RETRY], budget={"n_trials": 1, "max_failures": 3})
    assert supervisor.run(ONE_SLOT) == ("", 0)
    assert len(workers.started) == 2
    [failed, retry] = supervisor.study.trials
    assert failed.state.name == "FAIL" and retry.state.name == "COMPLETE"
    assert retry.system_attrs["failed_trial"] == failed.number and retry.params == failed.params
    _assert_nothing_running(supervisor)


def test_workers_that_die_in_every_trial_stop_the_study_with_a_non_zero_exit(tmp_path):
    supervisor, workers = supervised(tmp_path, [Dies(0)] * 5, budget={"n_trials": 3, "max_failures": 2})
    stopped, code = supervisor.run(ONE_SLOT)
    assert code == 1 and "2 trials failed in a row" in stopped, stopped
    assert len(workers.started) == 2  # no third worker once the failures in a row reached the budget
    assert not [t for t in supervisor.study.trials if t.state.name == "COMPLETE"]
    _assert_nothing_running(supervisor)


def test_workers_that_die_before_their_first_trial_stop_the_study_naming_the_last_cause(tmp_path):
    supervisor, workers = supervised(tmp_path, [Dies(1, before_a_trial=True)] * 5)
    stopped, code = supervisor.run(ONE_SLOT)
    assert code == 1, stopped
    assert stopped == (f"stopped: {CRASH_LOOP} workers in a row exited before their first trial (last: its worker "
                       "process exited with code 1 in the middle of the trial); see the messages above")
    assert len(workers.started) == CRASH_LOOP and supervisor.study.trials == []


def test_a_worker_between_two_early_deaths_that_began_a_trial_resets_the_count(tmp_path):
    early = Dies(1, before_a_trial=True)
    supervisor, workers = supervised(tmp_path, [early, early, Dies(-signal.SIGKILL), early, early, COMPLETE],
                                     budget={"n_trials": 2, "max_failures": 3})
    assert supervisor.run(ONE_SLOT) == ("", 0)
    assert len(workers.started) == 6
    assert sorted(t.state.name for t in supervisor.study.trials) == ["COMPLETE", "COMPLETE", "FAIL"]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period_and_its_trial_requeued(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPS_STOP_GRACE_S", "1")
    supervisor, workers = supervised(tmp_path, [HANG], budget={"n_trials": 1, "max_failures": 3})
    sent: list[int] = []

    def signal_once_it_hangs() -> None:  # the driver gets SIGTERM while its worker hangs in a trial
        if not sent and supervisor.study.get_trials(states=(TrialState.RUNNING,)):
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's handler takes it, in this thread

    supervisor.on_progress = signal_once_it_hangs
    stopped, code = supervisor.run(ONE_SLOT)
    assert code == 143 and stopped.startswith("stopped by SIGTERM"), stopped
    [worker] = workers.started
    assert worker.signals == [signal.SIGTERM] and worker.returncode == -signal.SIGKILL
    [failed, waiting] = supervisor.study.trials
    assert failed.state.name == "FAIL" and waiting.state.name == "WAITING"
    assert failed.user_attrs[ATTR_REASON] == ("stopped by SIGTERM; it did not stop within 1 s (SWEEPS_STOP_GRACE_S), "
                                              "so it was killed")
    assert failed.user_attrs["interrupted"] is True  # not the trial's fault: no failure in a row
    _assert_nothing_running(supervisor)
