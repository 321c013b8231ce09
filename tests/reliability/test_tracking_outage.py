"""The MLflow tracking server stays away longer than ``SWEEPS_STORAGE_WAIT_S`` under ``sweeps run``:
the study stops as on SIGTERM (its trial checkpoints mid-epoch and is requeued, exit 143, one
line saying what was waited for and where the writes are kept), and the same command, once the
server is back, sends every kept write and finishes the study from the checkpoint.

The outage starts at a known point: the trial waits after its first step (fault_tasks.py,
``StopWaitingTask``) until its worker gets SIGTERM; the test kills the server once it waits. The
trial's system metrics are then kept in the spool, where the driver finds them, tries them, and
with a wait of 0 stops at its first failed try."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.sweeps.study_helpers import ROOT, cli_in_process, load_study, start_cli, write_spec
from tests.sweeps.tracking.conftest import MlflowServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HERE = Path(__file__).resolve().parent
PYTHONPATH = f"{HERE}:{ROOT}"


def test_past_the_wait_sweeps_run_stops_as_on_sigterm_and_the_next_run_sends_what_was_kept(tmp_path, monkeypatch):
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        spec = write_spec(tmp_path, name="away", tracking={"uri": server.uri}, budget={"n_trials": 1},
                          task={"name": None, "target": "fault_tasks:make_stop_waiting_task", "model": "mlp",
                                "args": {}})
        held = tmp_path / "held"
        driver = start_cli(tmp_path, "run", str(spec), "--quiet", PYTHONPATH=PYTHONPATH, STOP_AT=str(held),
                           SWEEPS_STORAGE_WAIT_S="0", SWEEPS_TRACKING_RETRY_S="0",
                           MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1")
        try:
            while not held.exists():  # the task's barrier: the trial has stepped once and waits
                assert driver.poll() is None, driver.stdout.read() if driver.stdout else driver.returncode
                time.sleep(0.2)
            server.stop()
            out, _ = driver.communicate(timeout=600)
        finally:
            if driver.poll() is None:
                driver.kill()
        assert driver.returncode == 143, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
        assert f"MLflow tracking store {server.uri} is unreachable" in out, out[-4000:]
        said = " ".join(out.split())  # the live view wraps long lines at spaces
        assert said.count("did not answer for") == 1, out[-4000:]
        stop = said[said.index(f"stopped: the MLflow tracking store {server.uri} did not answer for"):]
        assert "(SWEEPS_STORAGE_WAIT_S=0; last error:" in stop and "running trials were checkpointed" in stop, stop
        assert f"sweeps sync-tracking --uri {server.uri} --spool runs/.mlflow_spool" in stop, stop
        trials = load_study(tmp_path, "away").trials
        assert [t.state.name for t in trials] == ["FAIL", "WAITING"], trials  # requeued, not failed for good
        assert trials[0].user_attrs["interrupted"] and trials[1].system_attrs["failed_trial"] == 0
        assert (tmp_path / "runs" / "away" / "trial-0000" / "last.pt").exists()  # checkpointed mid-epoch
        assert list((tmp_path / "runs" / ".mlflow_spool").glob("*.jsonl"))  # kept, not lost

        server.start()
        monkeypatch.syspath_prepend(str(HERE))  # the task's module, as PYTHONPATH gives it to the driver above
        done = cli_in_process(tmp_path, "run", str(spec), "--quiet")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert [t.state.name for t in load_study(tmp_path, "away").trials] == ["FAIL", "COMPLETE"]
        assert not list((tmp_path / "runs" / ".mlflow_spool").glob("*.jsonl"))  # everything kept was sent
        client = MlflowClient(server.uri)
        runs = client.search_runs([client.get_experiment_by_name("away").experiment_id])
        by_role = {r.info.run_id: r for r in runs}
        [parent] = [r for r in by_role.values() if r.data.tags.get("sweeps.role") == "study"]
        stopped, retry = sorted((r for r in by_role.values() if r.data.tags.get("sweeps.role") == "trial"),
                                key=lambda r: r.info.start_time)
        assert parent.info.status == "FINISHED"
        assert stopped.info.status == "KILLED" and retry.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(stopped.info.run_id, "step/train_loss")][:1] == [1]
        assert int(retry.data.tags["sweeps.resumed_from_step"]) >= 1  # from the checkpoint
    finally:
        server.stop()
