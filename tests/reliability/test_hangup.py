"""A closed terminal (SIGHUP to `sweeps run`'s whole process group: the driver and its local
workers) takes the stop path SIGTERM takes: the running trial checkpoints and is requeued, every
run is closed, the driver exits 129 saying so; the same command then finishes the study with no
step logged twice. (SIGHUP to the driver alone, on both backends: the shared contract suite,
tests/sweeps/backends/test_backend_contract.py.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from core.faults import Fault
from tests.sweeps.backends.conftest import mlflow_client, study_runs
from tests.sweeps.study_helpers import cli_in_process, sweeps_env, write_spec

pytestmark = pytest.mark.slow


def test_a_closed_terminal_stops_the_study_the_resumable_way(tmp_path):
    spec = write_spec(tmp_path, name="hangup", train={"epochs": 3, "batch_size": 16}, budget={"n_trials": 2})
    # Its own session, as a login shell's job: the hangup reaches its group, never pytest.
    hung = subprocess.run([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--quiet"], cwd=tmp_path,
                          env=sweeps_env(SWEEPS_FAULT=Fault.DRIVER_HANGUP_MID_TRIAL.value), capture_output=True,
                          text=True, timeout=600, start_new_session=True)
    out = hung.stdout + hung.stderr
    assert hung.returncode == 129, out[-4000:]
    assert "stopped by SIGHUP; running trials were checkpointed and requeued" in hung.stdout, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    parents, children = study_runs(tmp_path, "hangup")
    assert [p.info.status for p in parents] == ["KILLED"]
    assert [c.info.status for c in children] == ["KILLED"]
    # The trial checkpointed mid-way and was requeued (FAIL in the study, not the trial's fault).
    assert children[0].data.tags["sweeps.error"].startswith("interrupted at step"), children[0].data.tags

    done = cli_in_process(tmp_path, "run", str(spec), "--quiet")  # the resume: its process is not the point
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, children = study_runs(tmp_path, "hangup")
    client = mlflow_client(tmp_path)
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert len(finished) == 2 and not [c for c in children if c.info.status == "RUNNING"]
    for child in finished:  # the requeued trial resumed from its checkpoint: every epoch once
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [1, 2, 3]
