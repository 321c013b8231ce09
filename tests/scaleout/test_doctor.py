"""``sweeps doctor SPEC`` on local stores, in-process: each check's failure is one PROBLEM line
naming the cause and the command exits 2; a machine that can run a worker gets ok lines and exit 0.
The server's checks (reachable, Host header, credentials, write permission, PostgreSQL
privileges) are in test_doctor_server.py."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from sweeps.cli import main
from sweeps.doctor import OK, PROBLEM, SKIP, run_checks
from sweeps.spec.load import load_spec
from sweeps.tracking.store_checks import lock_holders
from tests.sweeps.study_helpers import run_cli, write_spec


def verdicts(spec_path: Path, expect_gpus: int | None = None) -> dict[str, tuple[str, str]]:
    return {c.name: (c.verdict, c.message) for c in run_checks(load_spec(str(spec_path)), expect_gpus)}


def test_a_machine_that_can_run_a_worker_passes(in_tmp, capsys):
    spec = write_spec(in_tmp, name="fine")
    assert main(["doctor", str(spec)]) == 0
    out = capsys.readouterr().out
    for name in ("storage", "mlflow", "artifacts", "gpus"):
        assert any(line.startswith(f"ok      {name}") for line in out.splitlines()), out
    assert "a worker can run here" in out


def test_a_blocked_journal_folder_is_a_storage_problem(in_tmp, capsys):
    (in_tmp / "blocker").write_text("a file where the journal's folder must be")
    spec = write_spec(in_tmp, name="blocked", storage="blocker/sub/blocked.journal")
    found = verdicts(spec)
    assert found["storage"][0] == PROBLEM and "blocker is not a writable folder" in found["storage"][1], found
    assert main(["doctor", str(spec)]) == 2
    assert "1 problem" in capsys.readouterr().err


def test_an_unwritable_artifact_location_is_an_artifacts_problem(in_tmp):
    from mlflow.tracking import MlflowClient

    spec = write_spec(in_tmp, name="arts")
    (in_tmp / "taken").write_text("a file where the artifact folder must be")
    client = MlflowClient(f"sqlite:///{in_tmp}/runs/mlflow.db")
    client.create_experiment("arts", artifact_location=str(in_tmp / "taken" / "x"))
    verdict, message = verdicts(spec)["artifacts"]
    assert verdict == PROBLEM and "taken is not a writable folder" in message, message


def test_versions_other_than_the_studys_are_a_problem(in_tmp):
    from mlflow.tracking import MlflowClient

    from sweeps.parent_run import package_versions
    from sweeps.tracking import layout

    spec = write_spec(in_tmp, name="vers")
    client = MlflowClient(f"sqlite:///{in_tmp}/runs/mlflow.db")
    exp = client.create_experiment("vers")
    run = client.create_run(exp, tags={layout.TAG_ROLE: layout.ROLE_STUDY}, run_name="vers")
    here = package_versions(("torch", "optuna"))
    client.log_param(run.info.run_id, "version.torch", "1.0.0")
    client.log_param(run.info.run_id, "version.optuna", here["optuna"])
    verdict, message = verdicts(spec)["versions"]
    assert verdict == PROBLEM, message
    assert f"torch {here['torch']} here, 1.0.0 in the study" in message and "optuna" not in message, message
    client.log_param(client.create_run(exp, tags={layout.TAG_ROLE: layout.ROLE_STUDY}).info.run_id,
                     "version.torch", here["torch"])  # the newest study run is the one compared
    assert verdicts(spec)["versions"][0] == OK


@pytest.mark.slow  # two sweeps processes, each importing torch
def test_gpus_the_spec_names_but_this_machine_lacks_are_a_problem(tmp_path):
    # A process of its own: CUDA_VISIBLE_DEVICES is read when CUDA starts, once per process.
    spec = write_spec(tmp_path, name="gpus", resources={"devices": [0, 1], "workers": 1})
    proc = run_cli(tmp_path, "doctor", str(spec), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "PROBLEM gpus" in proc.stderr and "resources.devices [0, 1] needs 2 GPU(s), 0 visible" in proc.stderr
    proc = run_cli(tmp_path, "doctor", str(write_spec(tmp_path, name="cpu")), "--expect-gpus", "1",
                   CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2 and "--expect-gpus 1 needs 1 GPU(s), 0 visible" in proc.stderr, proc.stderr


def test_an_unreachable_server_fails_its_line_and_skips_what_needs_it(in_tmp, free_port):
    spec = write_spec(in_tmp, name="down", tracking={"uri": f"http://127.0.0.1:{free_port}"})
    found = verdicts(spec)
    assert found["mlflow"][0] == PROBLEM and "no answer" in found["mlflow"][1], found
    assert [found[n][0] for n in ("host", "access", "permission", "artifacts", "versions")] == [SKIP] * 5, found


@pytest.fixture
def locked_store(in_tmp):
    """A SQLite store held locked (BEGIN EXCLUSIVE) by another process, which says when it holds it."""
    spec = write_spec(in_tmp, name="locked")
    db = in_tmp / "runs" / "mlflow.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
         "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); sys.stdin.read()", str(db)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield spec, db, holder
    holder.stdin.close()
    holder.wait(timeout=30)


@pytest.mark.slow  # waits out SQLite's busy timeout on the held lock: about 10 s of real time
def test_a_locked_sqlite_store_says_locked_and_by_whom(locked_store):
    from sweeps.errors import TrackingError
    from sweeps.tracking.mlflow_tracker import MlflowTracker

    spec, db, holder = locked_store
    assert any(f"pid {holder.pid} " in h for h in lock_holders(db))
    with pytest.raises(TrackingError) as err:
        MlflowTracker(f"sqlite:///{db}", spool_dir=db.parent / "spool").check_connection()
    message = str(err.value)
    assert "is locked by pid" in message and f"pid {holder.pid} (" in message and "sqlite3.connect" in message, message
    assert "Check the URI" not in message
    verdict, text = verdicts(spec)["mlflow"]
    assert verdict == PROBLEM and f"pid {holder.pid}" in text, text
    sqlite3.connect(db).close()  # the holder's lock, not a damaged file: a plain open works
