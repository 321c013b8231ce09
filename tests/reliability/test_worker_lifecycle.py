"""Whatever ends a worker, its trial fails with the true cause, is requeued, and the study goes
on; signals and the timeout stop a trial in every phase (trust issue, defects 6, 8, 12). Where a
worker dies or hangs, the driver runs in this process (its workers are processes all the same);
where the driver is signalled, in a process of its own."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sweeps.backends import supervisor
from tests.sweeps.study_helpers import cli_in_process, load_study, mlflow_runs, save_spec, start_cli, tiny_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DYING = "tests.reliability.dying_tasks:make_dying_task"


def _spec(tmp_path: Path, name: str = "die", **overrides) -> Path:
    spec = tiny_spec(name, **overrides)
    spec["task"] = {"target": DYING, "model": "mlp", "args": {"width": 32}}
    return save_spec(tmp_path, spec)


def _env(tmp_path: Path, how: str, **extra) -> dict:
    return {"DIE_HOW": how, "DIE_MARKER": str(tmp_path / "died.marker"), **extra}


def _trials(tmp_path: Path, name: str = "die"):
    return load_study(tmp_path, name).trials


def _assert_nothing_running(tmp_path: Path, name: str = "die") -> None:
    assert not [t.number for t in _trials(tmp_path, name) if t.state.name == "RUNNING"]
    assert not [r.info.run_name for r in mlflow_runs(tmp_path, name) if r.info.status == "RUNNING"]


# End to end, a real exit code and a real signal reaching the supervisor from a forked worker; what
# it does about every other exit code, and about workers dying in every trial or before their
# first, is test_supervisor_bookkeeping's (its workers in that test's process).
@pytest.mark.parametrize("how, cause", [
    ("os_exit_3", "exited with code 3 in the middle of the trial"),
    ("sigkill", "killed by SIGKILL"),
])
def test_a_worker_that_dies_in_a_trial_fails_it_with_the_true_cause_and_the_study_finishes(tmp_path, how, cause):
    spec = _spec(tmp_path, budget={"n_trials": 2, "max_failures": 3})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", **_env(tmp_path, how))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = _trials(tmp_path)
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert len(failed) == 1 and cause in failed[0].user_attrs["fail_reason"]
    assert "failed in a row" not in proc.stdout + proc.stderr  # os._exit(3) is not "max failures"
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2
    # The dead trial's parameters were requeued: its retry trained the same point.
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == failed[0]._trial_id]
    assert len(retry) == 1 and retry[0].params == failed[0].params and retry[0].state.name == "COMPLETE"
    runs = {r.info.run_id: r for r in mlflow_runs(tmp_path, "die")}
    dead_run = runs[failed[0].user_attrs["mlflow_run_id"]]
    assert dead_run.info.status == "FAILED" and cause in dead_run.data.tags["sweeps.error"]
    _assert_nothing_running(tmp_path)


def test_sys_exit_in_a_task_fails_the_trial_naming_it_and_the_worker_goes_on(tmp_path):
    spec = _spec(tmp_path, budget={"n_trials": 2, "max_failures": 3})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", **_env(tmp_path, "sys_exit"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failed = [t for t in _trials(tmp_path) if t.state.name == "FAIL"]
    assert [t.user_attrs["fail_reason"] for t in failed] == ["the task called sys.exit(0)"]
    assert sum(t.state.name == "COMPLETE" for t in _trials(tmp_path)) == 2
    _assert_nothing_running(tmp_path)


def _start_and_wait_for_the_hang(tmp_path: Path, spec: Path, how: str, **env) -> subprocess.Popen:
    proc = start_cli(tmp_path, "run", str(spec), "--quiet", **_env(tmp_path, how, **env))
    marker = tmp_path / "died.marker"
    while not marker.exists():  # the task writes it, then hangs in datasets() for good
        assert proc.poll() is None, proc.stdout.read()
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_trial_hanging_in_its_set_up_and_the_next_run_resumes(tmp_path, signum):
    spec = _spec(tmp_path, budget={"n_trials": 1, "max_failures": 3})
    proc = _start_and_wait_for_the_hang(tmp_path, spec, "hang")
    proc.send_signal(signum)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signum, out
    (failed,) = _trials(tmp_path)[:1]
    assert failed.state.name == "FAIL" and f"stopped by {signum.name}" in failed.user_attrs["fail_reason"]
    assert [t.state.name for t in _trials(tmp_path)] == ["FAIL", "WAITING"]  # requeued
    _assert_nothing_running(tmp_path)
    again = cli_in_process(tmp_path, "run", str(spec), "--quiet")  # the marker exists: no hang this time
    assert again.returncode == 0, again.stdout + again.stderr
    assert [t.state.name for t in _trials(tmp_path)] == ["FAIL", "COMPLETE"]


def test_budget_timeout_stops_a_trial_hanging_in_its_set_up(tmp_path, monkeypatch):
    # The supervisor's clock reaches budget.timeout once the trial hangs (its task wrote the
    # marker, then sleeps for good), not 120 s of waiting later: the deadline passes with the
    # trial in its set-up on any machine, however slow. Without the fix the run would hang until
    # the test's own timeout.
    marker = tmp_path / "died.marker"
    monkeypatch.setattr(supervisor, "time", SimpleNamespace(
        monotonic=time.monotonic, time=lambda: time.time() + (120 if marker.exists() else 0)))
    spec = _spec(tmp_path, budget={"n_trials": 1, "max_failures": 3, "timeout": "120s"})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", **_env(tmp_path, "hang"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists(), "the trial never reached its set-up within budget.timeout"
    assert "budget.timeout (120s) reached" in proc.stdout + proc.stderr
    assert [t.state.name for t in _trials(tmp_path)] == ["FAIL", "WAITING"]
    _assert_nothing_running(tmp_path)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    spec = _spec(tmp_path, budget={"n_trials": 1, "max_failures": 3})
    proc = _start_and_wait_for_the_hang(tmp_path, spec, "hang_ignoring_sigterm", SWEEPS_STOP_GRACE_S="1")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out
    failed = _trials(tmp_path)[0]
    assert failed.state.name == "FAIL" and "did not stop within 1 s" in failed.user_attrs["fail_reason"]
    assert [t.state.name for t in _trials(tmp_path)] == ["FAIL", "WAITING"]
    _assert_nothing_running(tmp_path)

