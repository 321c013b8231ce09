"""The contract every backend keeps: the same study through `sweeps run` gives the same
MLflow layout, the same status mapping, and a `Backend.load` / `sweeps status` view that
matches MLflow, whichever backend ran it; and the same guarantees when every trial fails,
a trial hangs, or the driver is interrupted or killed mid-trial (issue 30).

One tiny digits study per backend: a grid over three learning rates, one of which
diverges (non-finite loss: PRUNED, MLflow KILLED + sweeps.pruned), two epochs, ONNX export.
"""
from __future__ import annotations

import math
import os
import select
import signal
from pathlib import Path

import pytest

from tests.reliability.hang_clock import clock_ahead_while_hung
from tests.sweeps.backends.conftest import (
    ONE_THREAD,
    _pids_using,
    artifact_paths,
    mlflow_client,
    run_cli,
    study_runs,
    write_spec,
)
from tests.sweeps.study_helpers import cli_in_process

pytestmark = pytest.mark.slow

LRS = [0.05, 0.3, 1.0e6]  # the last one diverges in its first epoch


def _sweeps(backend: str):
    """`sweeps` for a case whose subject is not the driver's process: an Optuna driver runs in
    this process (its workers are processes all the same); a Ray driver in a process of its own,
    Ray's state and signal handlers with it."""
    if backend == "optuna":
        return lambda cwd, *args, **env: cli_in_process(cwd, *args, **{**ONE_THREAD, **env})
    return run_cli


def _spec(tmp_path, backend):
    return write_spec(
        tmp_path, name=f"contract_{backend}", backend=backend,
        train={"export_onnx": True},
        search={"lr": {"type": "categorical", "choices": LRS}},
        sampler={"name": "grid", "seed": 0},
        budget={"n_trials": 3, "max_failures": 1},
        resources={"devices": "cpu", "workers": 2 if backend == "ray" else 1},
    )


@pytest.fixture(params=["optuna", pytest.param("ray", marks=pytest.mark.ray)])
def finished_study(request, tmp_path, monkeypatch):
    backend = request.param
    if backend == "ray":
        request.getfixturevalue("ray_tmp")
    spec_path = _spec(tmp_path, backend)
    proc = _sweeps(backend)(tmp_path, "run", str(spec_path), "--quiet")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    monkeypatch.chdir(tmp_path)  # the spec's paths (runs/...) are relative to the working directory
    return backend, spec_path, proc


def test_same_mlflow_layout_status_mapping_and_load(finished_study, tmp_path):
    from sweeps.backends.by_name import get_backend
    from sweeps.spec.load import load_spec

    backend, spec_path, proc = finished_study
    name = f"contract_{backend}"
    assert "promote it:" in proc.stdout  # the end-of-run summary

    parents, children = study_runs(tmp_path, name)
    assert len(parents) == 1 and len(children) == len(LRS)
    parent = parents[0]
    assert parent.data.tags["sweeps.backend"] == backend
    assert parent.info.status == "FINISHED"  # closed at the end of the invocation
    client = mlflow_client(tmp_path)
    assert "summary/summary.json" in artifact_paths(client, parent.info.run_id)

    by_lr = {}
    for child in children:
        tags, params = child.data.tags, child.data.params
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["sweeps.backend"] == backend
        assert set(params) == {"task", "model", "epochs", "optimizer", "scheduler", "seed", "lr"}  # searched + headline
        assert client.get_metric_history(child.info.run_id, "step/train_loss"), "per-step curve"
        arts = artifact_paths(client, child.info.run_id)
        assert "config/resolved_config.json" in arts
        by_lr[float(params["lr"])] = (child, arts)
    assert sorted(by_lr) == sorted(LRS)

    for lr in LRS[:2]:  # trained normally
        child, arts = by_lr[lr]
        assert child.info.status == "FINISHED" and child.data.tags["sweeps.state"] == "COMPLETE"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [1, 2]
        assert {"checkpoints/best.pt", "onnx/model.onnx"} <= arts
    child, _ = by_lr[LRS[2]]  # diverged: pruned, not failed
    assert child.info.status == "FINISHED" and child.data.tags["sweeps.pruned"] == "true"
    assert child.data.tags["sweeps.state"] == "PRUNED"

    # Backend.load: the same trials, states and values as MLflow
    result = get_backend(backend).load(load_spec(spec_path))
    assert result.backend == backend and result.parent_run_id == parent.info.run_id
    mlflow_view = {int(c.data.tags["sweeps.trial_number"]): c for c in children}
    assert sorted(t.number for t in result.trials) == sorted(mlflow_view)
    for t in result.trials:
        run = mlflow_view[t.number]
        assert t.run_id == run.info.run_id
        assert t.state == run.data.tags["sweeps.state"]
        assert t.params == {"lr": float(run.data.params["lr"])}
        objective = run.data.metrics.get("objective")
        if t.state == "COMPLETE":
            assert t.value is not None and math.isclose(t.value, objective, rel_tol=1e-9)
            assert sorted(t.intermediate) == [1, 2]
            assert math.isclose(t.intermediate[2], run.data.metrics["val_acc"], rel_tol=1e-9)
    best = result.best()
    assert best is not None and parent.data.tags.get("sweeps.best_trial") == str(best.number)

    # `sweeps status` lists every trial, whichever backend ran the study
    status = cli_in_process(tmp_path, "status", str(spec_path))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"({backend})" in status.stdout
    lines = status.stdout.splitlines()
    for t in result.trials:
        assert any(f" {t.number} " in line and t.state in line for line in lines), status.stdout


# ---- trust: the same guarantees when trials fail, hang, or the driver is hit (issue 30) ----------
TRUST_TASK = "tests.sweeps.backends.ray_trust_tasks:make_task"
HANG_TASK = "tests.reliability.fault_tasks:make_hang_task"


@pytest.fixture(params=["optuna", pytest.param("ray", marks=pytest.mark.ray)])
def backend(request):
    """Each trust case once per backend; a Ray study gets a private Ray temp folder."""
    if request.param == "ray":
        request.getfixturevalue("ray_tmp")
    return request.param


def _trust_spec(tmp_path, backend, name, **overrides):
    return write_spec(tmp_path, name=f"{name}_{backend}", backend=backend, **overrides)


def _processes_left(backend: str, tmp_path) -> list[int]:
    """Live processes the study started: Ray's (found by the test's private RAY_TMPDIR) or
    the Optuna workers' fork server and the workers (their command line, working in the study's
    folder)."""
    if backend == "ray":
        return _pids_using(os.environ["RAY_TMPDIR"])
    return [pid for marker in ("sweeps.backends.optuna_worker", "sweeps.backends.worker_forkserver")
            for pid in _pids_using(marker) if os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(tmp_path)]


def _wait_until_gone(pids: list[int]) -> None:
    """Wait for each process to exit (a pidfd turns readable): an event, not a time."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, ProcessLookupError):
            continue  # already gone
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)


def _after_a_driver_kill(backend: str, tmp_path) -> None:
    """What a SIGKILLed driver leaves dies on its own (Optuna workers by their parent-death
    signal; Ray's processes by the driver's guardian, which exits once they are killed)."""
    if backend == "ray":
        ray_tmp = os.environ["RAY_TMPDIR"]
        _wait_until_gone([p for p in _pids_using(ray_tmp)
                          if b"sweeps.backends.ray_guardian" in Path(f"/proc/{p}/cmdline").read_bytes()])
    else:
        _wait_until_gone(_processes_left(backend, tmp_path))


def _repeated_steps(client, run) -> dict[str, list[int]]:
    out = {}
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        if len(steps) != len(set(steps)):
            out[key] = sorted(steps)
    return out


def _no_run_running_and_no_step_twice(tmp_path, name) -> list:
    """The trial runs of a finished study: none RUNNING, no metric with a step twice."""
    parents, children = study_runs(tmp_path, name)
    assert all(p.info.status != "RUNNING" for p in parents)
    assert [c.info.status for c in children if c.info.status == "RUNNING"] == []
    client = mlflow_client(tmp_path)
    for child in children:
        assert not _repeated_steps(client, child), child.data.tags["sweeps.trial_number"]
    return children


@pytest.mark.slow
def test_a_study_whose_trials_all_fail_exits_non_zero_naming_each_cause(tmp_path, backend):
    """Every trial fails (one task raises, one calls sys.exit(0)): budget.max_failures in a
    row stop the study with one message and exit 1; the reasons name the exception and the
    SystemExit; failed trials show the time they took."""
    from tests.sweeps.backends.ray_trust_tasks import EXIT_WIDTH, RAISE_WIDTH

    name = f"allfail_{backend}"
    spec_path = _trust_spec(tmp_path, backend, "allfail",
                            task={"name": None, "target": TRUST_TASK, "model": "mlp", "args": {}},
                            search={"task.width": {"type": "categorical", "choices": [EXIT_WIDTH, RAISE_WIDTH]}},
                            sampler={"name": "grid"}, budget={"n_trials": 2, "max_failures": 2},
                            resources={"devices": "cpu", "workers": 2 if backend == "ray" else 1})
    proc = _sweeps(backend)(tmp_path, "run", str(spec_path), "--quiet")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "stopped: 2 trials failed in a row (budget.max_failures)" in out, out[-4000:]
    assert "in 0.0s" not in out and "Should not have reached here" not in out, out[-4000:]
    parents, children = study_runs(tmp_path, name)
    assert parents[0].info.status == "FAILED"
    errors = {int(c.data.params["task.width"]): (c.info.status, c.data.tags.get("sweeps.error", ""))
              for c in children}
    assert errors[EXIT_WIDTH] == ("FAILED", "the task called sys.exit(0)"), errors
    assert errors[RAISE_WIDTH][0] == "FAILED" and "always fails" in errors[RAISE_WIDTH][1], errors
    status = cli_in_process(tmp_path, "status", str(spec_path))
    assert "sys.exit(0)" in status.stdout and "always fails" in status.stdout, status.stdout + status.stderr


@pytest.mark.slow
def test_signals_and_a_sigkill_to_the_driver_alone_stop_it_and_the_study_resumes(tmp_path, backend):
    """One study takes every stop of its driver (not of its process group), each in a run of the
    same command, each a driver start (seconds of CPU, more so on Ray):

    * SIGTERM as the driver starts (its study run made; Ray just initialised, with its own exit-15
      handler): exit 143 saying so, no trial begun, the study run KILLED, never left RUNNING;
    * `kill -INT`, `kill -TERM` and `kill -HUP` while a trial trains: exit 130, 143 or 129 with
      the budget unmet, no run RUNNING, no process left; each run resumes the study;
    * SIGKILL once a trial has reported (and checkpointed) an epoch: what it started dies with it;
    * SIGTERM as it ends (every trial done, before the summary and the tags): exit 143, the study
      run KILLED with its summary written;

    then the same command finishes: no run RUNNING, no metric with a repeated step, every completed
    run FINISHED with all its epochs. (A SIGKILL in a study's first start:
    tests/reliability/test_process_faults.py and test_ray_backend.py.)"""
    from core.faults import Fault

    name = f"signal_{backend}"
    spec_path = _trust_spec(tmp_path, backend, "signal", train={"epochs": 3, "batch_size": 16},
                            budget={"n_trials": 2}, resources={"devices": "cpu", "workers": 1})

    def stopped_by(signum: int, fault: Fault) -> list:
        stopped = run_cli(tmp_path, "run", str(spec_path), "--quiet", SWEEPS_FAULT=fault.value)
        assert stopped.returncode == 128 + signum, stopped.stdout[-3000:] + stopped.stderr[-3000:]
        assert f"stopped by {signal.Signals(signum).name}" in stopped.stdout, fault
        assert not _processes_left(backend, tmp_path), f"a driver stopped at {fault.value} left processes behind"
        parents, children = study_runs(tmp_path, name)
        # One study run, reopened by each invocation: KILLED, not left RUNNING.
        assert [p.info.status for p in parents] == ["KILLED"], fault
        assert not [c for c in children if c.info.status == "RUNNING"], fault
        return children

    assert stopped_by(signal.SIGTERM, Fault.DRIVER_SIGTERM_AT_START) == []
    for signum, fault in ((signal.SIGINT, Fault.DRIVER_SIGINT_MID_TRIAL),
                          (signal.SIGTERM, Fault.DRIVER_SIGTERM_MID_TRIAL),
                          (signal.SIGHUP, Fault.DRIVER_SIGHUP_MID_TRIAL)):
        children = stopped_by(signum, fault)
        assert len([c for c in children if c.data.tags.get("sweeps.state") == "COMPLETE"]) < 2

    killed = run_cli(tmp_path, "run", str(spec_path), "--quiet", SWEEPS_FAULT=Fault.DRIVER_KILL_MID_TRIAL.value)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    _after_a_driver_kill(backend, tmp_path)
    assert not _processes_left(backend, tmp_path), "a killed driver left processes behind"

    children = stopped_by(signal.SIGTERM, Fault.DRIVER_SIGTERM_AT_END)
    # The budget met, one run per completed trial; what else is there is a stopped attempt (on
    # Optuna a stopped trial is failed, then requeued as a new trial).
    numbers = [c.data.tags["sweeps.trial_number"] for c in children if c.data.tags["sweeps.state"] == "COMPLETE"]
    assert len(numbers) == len(set(numbers)) == 2, numbers
    assert {c.data.tags["sweeps.state"] for c in children} <= {"COMPLETE", "FAIL"}
    parents, _ = study_runs(tmp_path, name)
    # The summary was written before the study run was closed.
    assert "summary/summary.json" in artifact_paths(mlflow_client(tmp_path), parents[0].info.run_id)

    done = _sweeps(backend)(tmp_path, "run", str(spec_path), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parents, _ = study_runs(tmp_path, name)
    assert [p.info.status for p in parents] == ["FINISHED"]
    children = _no_run_running_and_no_step_twice(tmp_path, name)
    complete = [c for c in children if c.data.tags["sweeps.state"] == "COMPLETE"]
    assert len(complete) == 2 and all(c.info.status == "FINISHED" for c in complete)
    assert {c.data.tags["sweeps.state"] for c in children} <= {"COMPLETE", "FAIL"}
    client = mlflow_client(tmp_path)
    for child in complete:
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [1, 2, 3]


# A hung trial fails; what the budget does next is each backend's meaning of n_trials: Optuna
# counts finished trials (a third trial replaces the failed one), Ray Tune draws n_trials samples.
HANG_EXIT = {"optuna": 0, "ray": 1}


@pytest.mark.slow
def test_a_hung_trial_is_failed_by_trial_timeout_with_the_reason_and_not_resumed_into_the_hang(tmp_path, backend,
                                                                                                monkeypatch):
    """The first trial hangs mid-epoch (tests/reliability/fault_tasks.py): budget.trial_timeout
    stops it and fails it with the reason; the other trials complete; the next run of the
    same command does not retry the hung trial into its hang."""
    name = f"hang_{backend}"
    hang_task = {"name": None, "target": HANG_TASK, "model": "mlp", "args": {}}
    spec_path = _trust_spec(tmp_path, backend, "hang", task=hang_task,
                            budget={"n_trials": 2, "max_failures": 2, "trial_timeout": "30s"},
                            resources={"devices": "cpu", "workers": 1})
    # 30 s pass at once while the trial hangs: on the clock of the Optuna backend's supervisor,
    # which runs here, or of the Ray trial's watchdog, in the trial's process.
    env = {"HANG_MARKER": str(tmp_path / "hung-once"), "HANG_CLOCK_AHEAD_S": "30"}
    if backend == "optuna":
        clock_ahead_while_hung(monkeypatch, tmp_path, name, tmp_path / "hung-once", 30)
    proc = _sweeps(backend)(tmp_path, "run", str(spec_path), "--quiet", **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == HANG_EXIT[backend], out[-4000:]
    children = _no_run_running_and_no_step_twice(tmp_path, name)
    [failed] = [c for c in children if c.data.tags["sweeps.state"] == "FAIL"]
    assert failed.info.status == "FAILED"
    assert failed.data.tags["sweeps.error"].startswith("hung: no progress for"), failed.data.tags
    assert "budget.trial_timeout=30s" in failed.data.tags["sweeps.error"]
    assert (tmp_path / "hung-once").exists()
    # What the user reads says why, on both: not Ray's "actor died" with a promise of a retry from
    # its checkpoint (Ray's retry fails at once with the recorded reason).
    assert "trial 0 failed: hung: no progress for" in out, out[-4000:]
    assert "retry 1 of" not in out, out[-4000:]

    again = _sweeps(backend)(tmp_path, "run", str(spec_path), "--quiet", **env)
    assert again.returncode == HANG_EXIT[backend], again.stdout[-3000:] + again.stderr[-3000:]
    _, after = study_runs(tmp_path, name)
    [still] = [c for c in after if c.info.run_id == failed.info.run_id]
    assert still.info.status == "FAILED" and still.data.tags["sweeps.state"] == "FAIL"
