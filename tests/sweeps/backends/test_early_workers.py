"""``sweeps run`` starts its workers before it sets up the study (supervisor.EarlyWorkers): they
import what trials use while the driver opens its store, and wait for their go. Those the
supervisor never takes are killed; a signal before the go ends a worker without a traceback;
EOF instead of a go is a clean stop. Real worker processes; the pause point makes the signal
test deterministic (the worker stops itself once its handlers are set)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sweeps.backends.supervisor import EarlyWorkers, worker_command
from sweeps.pool import WorkerSlot

WORKER = [sys.executable, "-m", "sweeps.backends.optuna_worker"]
pytestmark = pytest.mark.slow  # real worker processes, each importing torch and MLflow


def _slot(index: int) -> WorkerSlot:
    return WorkerSlot(index=index, devices=(), threads=1)


def test_workers_the_supervisor_does_not_take_are_killed_and_a_taken_one_stops_at_eof():
    with EarlyWorkers([_slot(0), _slot(1)]) as early:
        taken = early.take(_slot(0))
        assert taken is not None and early.take(_slot(0)) is None  # one process per slot, taken once
        untaken = early.procs[1]
        assert taken.poll() is None and untaken.poll() is None  # both waiting for their go
    assert untaken.returncode == -signal.SIGKILL  # killed on leaving: it had only imported
    assert taken.poll() is None  # the supervisor's now
    assert taken.stdin is not None
    taken.stdin.close()  # EOF instead of a go: the driver stopped before sending it
    assert taken.wait(timeout=600) == 0


@pytest.mark.parametrize("command, point", [
    (worker_command(), "worker_importing"),  # as sweeps run starts it: before any import (packages' too)
    (WORKER, "worker_before_go"),  # however started: imports done, waiting for the go
])
def test_a_ctrl_c_before_the_go_ends_the_worker_quietly(tmp_path, command, point):
    env = {**os.environ, "SWEEPS_PAUSE": point}
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # stopped itself at the point, its handlers set
    assert os.WIFSTOPPED(status)
    proc.send_signal(signal.SIGINT)  # pending until it runs again, as a terminal's Ctrl-C would be
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGINT
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out == ""


def test_a_ctrl_c_as_the_supervisor_takes_over_from_the_driver_stops_the_study(tmp_path):
    """SIGINT after the driver's last look for a signal while starting, before its supervisor's
    handlers are in place (the driver's own records it): obeyed as mid-study, exit 130 with the
    study run KILLED and no trial run; the same command then finishes the study. Before, the
    supervisor started its workers and ran the whole study, and only the exit code said 130."""
    from sweeps.backends.driver_faults import DRIVER_SIGINT_AT_HANDOVER
    from tests.sweeps.backends.conftest import study_runs
    from tests.sweeps.study_helpers import cli_in_process, run_cli, write_spec

    spec = write_spec(tmp_path, "handover", budget={"n_trials": 1})
    stopped = run_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT=DRIVER_SIGINT_AT_HANDOVER)
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "stopped by SIGINT" in stopped.stdout and "Traceback" not in stopped.stderr
    parents, children = study_runs(tmp_path, "handover")
    assert [p.info.status for p in parents] == ["KILLED"] and children == []
    done = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, children = study_runs(tmp_path, "handover")
    assert [c.data.tags["sweeps.state"] for c in children] == ["COMPLETE"]
