"""A project folder moved (a real ``mv``) or copied after its study ran: every command run from
the new place reads and writes the artifacts there, never in the folder it came from; run from
another folder, commands say which path they expected and create nothing. The study runs in a
process of its own and the move happens after it has exited; the commands after each move run
in this process, which never opened the project at its old path."""
from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess

import pytest

from sweeps import cli
from tests.sweeps.study_helpers import cli_in_process, empty_mlflow_db, mlflow_runs, run_cli, write_spec


def _locations(folder) -> list[str]:
    """Every artifact location the store in ``folder`` records (experiments of sweeps, runs)."""
    with sqlite3.connect(folder / "runs" / "mlflow.db") as con:
        found = [r[0] for r in con.execute("SELECT artifact_location FROM experiments WHERE name != 'Default'")]
        return found + [r[0] for r in con.execute("SELECT artifact_uri FROM runs")]


@pytest.mark.slow
def test_a_moved_project_reads_and_writes_its_artifacts_where_they_are_now(tmp_path):
    first, moved, copy, elsewhere = (tmp_path / n for n in ("first", "moved", "copy", "elsewhere"))
    write_spec(first, "mv_study", budget={"n_trials": 2, "max_failures": 1})
    done = run_cli(first, "run", "mv_study.yaml", "--quiet")
    assert done.returncode == 0, done.stderr
    subprocess.run(["mv", str(first), str(moved)], check=True)

    report = cli_in_process(moved, "report", "mv_study.yaml")
    assert report.returncode == 0, report.stderr
    assert not first.exists()  # nothing written into the old absolute path
    assert (moved / "runs" / "mv_study" / "report.html").is_file()
    assert list((moved / "runs" / "mlartifacts" / "mv_study").glob("*/artifacts/report/report.html"))
    assert "was moved: its artifact locations named" in report.stderr  # it says what it changed
    assert all(str(moved) in loc for loc in _locations(moved))

    dry = cli_in_process(moved, "promote", "mv_study.yaml", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    [trial0] = [r for r in mlflow_runs(moved, "mv_study") if r.data.tags.get("sweeps.trial_number") == "0"]
    threads = re.match(r"cpu \((\d+) threads?\)", trial0.data.tags["sweeps.device"]).group(1)
    rerun = cli_in_process(moved, "rerun", "mv_study.yaml", "--trial", "0", "--threads", threads)
    assert rerun.returncode == 0, rerun.stderr
    assert "bitwise equal" in rerun.stdout  # the original's config and curves were found
    promote = cli_in_process(moved, "promote", "mv_study.yaml")
    assert promote.returncode == 0, promote.stderr + promote.stdout  # its checkpoint artifact was found
    status = cli_in_process(moved, "status", "mv_study.yaml")
    assert status.returncode == 0 and "COMPLETE" in status.stdout
    assert not first.exists()

    # A copy (the original still in place) uses its own artifacts, not the original's.
    shutil.copytree(moved, copy)
    again = cli_in_process(copy, "report", "mv_study.yaml")
    assert again.returncode == 0, again.stderr
    assert all(str(copy) in loc for loc in _locations(copy))
    assert all(str(moved) in loc for loc in _locations(moved))

    # From another folder: runs/ is relative to the working directory; the error names the path
    elsewhere.mkdir()
    spec = str(moved / "mv_study.yaml")
    for args in (("report", spec), ("status", spec), ("rerun", spec, "--trial", "0"), ("compare", spec, "0", "1"),
                 ("promote", spec, "--dry-run")):
        out = cli_in_process(elsewhere, *args)
        assert out.returncode == 2, (args, out.stderr)
        named = r"runs/(mlflow\.db|mv_study\.journal) (does not exist|is not in this folder)"
        assert re.search(named, out.stderr), (args, out.stderr)
        assert "Traceback" not in out.stderr
    assert list(elsewhere.iterdir()) == []

    # Moved again, then resumed with more budget: the new trial's run writes where the project is now.
    again_moved = tmp_path / "again"
    subprocess.run(["mv", str(moved), str(again_moved)], check=True)
    write_spec(again_moved, "mv_study", budget={"n_trials": 3, "max_failures": 1})
    # A process of its own, as a user resumes it: this process has opened the project at the path
    # it moved from, and a study driven from here writes its parent run's artifacts there.
    resumed = run_cli(again_moved, "run", "mv_study.yaml", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert not moved.exists() and not first.exists()
    assert all(str(again_moved) in loc for loc in _locations(again_moved))
    assert len([r for r in mlflow_runs(again_moved, "mv_study") if r.data.tags.get("sweeps.role") == "trial"]) == 3


def test_a_store_moved_without_its_artifacts_names_the_path_it_expected(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    (tmp_path / "runs").mkdir()
    db = tmp_path / "runs" / "mlflow.db"
    shutil.copyfile(empty_mlflow_db(), db)
    uri = f"sqlite:///{db}"
    gone = tmp_path / "old-place" / "runs" / "mlartifacts" / "lost"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("lost", artifact_location=str(gone))).info.run_id

    assert cli.main(["rerun", "--run-id", run_id, "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert f"its artifacts were recorded at {gone}, which does not exist" in err
    assert f"no mlartifacts folder beside the store ({tmp_path / 'runs' / 'mlartifacts'})" in err
    assert not gone.parent.exists()
