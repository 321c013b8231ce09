"""A worker process of its own (``sweeps worker --devices``: supervisor.spawn_worker) imports what
trials use, then waits for its go on stdin: a signal before the go ends it without a traceback,
whether it is still importing or waiting. (``sweeps run``'s workers are forked from a fork server
that imported them: test_worker_forkserver.py.) Real worker processes; the pause point makes the
signal test deterministic (the worker stops itself once its handlers are set). And a signal as
``sweeps run``'s supervisor takes over from its driver stops the study."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sweeps.backends.supervisor import worker_command

WORKER = [sys.executable, "-m", "sweeps.backends.optuna_worker"]
pytestmark = pytest.mark.slow  # real worker processes, each importing torch and MLflow


@pytest.mark.parametrize("command, point", [
    (worker_command(), "worker_importing"),  # as spawn_worker starts it: before any import (packages' too)
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
    from core.faults import Fault
    from tests.sweeps.backends.conftest import study_runs
    from tests.sweeps.study_helpers import cli_in_process, run_cli, write_spec

    spec = write_spec(tmp_path, "handover", budget={"n_trials": 1})
    stopped = run_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT=Fault.DRIVER_SIGINT_AT_HANDOVER.value)
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "stopped by SIGINT" in stopped.stdout and "Traceback" not in stopped.stderr
    parents, children = study_runs(tmp_path, "handover")
    assert [p.info.status for p in parents] == ["KILLED"] and children == []
    done = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, children = study_runs(tmp_path, "handover")
    assert [c.data.tags["sweeps.state"] for c in children] == ["COMPLETE"]
