"""Errors reach the user as one message through the real CLI, never as a traceback: the
last-resort handler, unusable paths (runs/ a file, -o a folder, a truncated MLflow store),
and a full disk (a real one: a small tmpfs, filled)."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from sweeps import cli
from tests.sweeps.study_helpers import cli_in_process, empty_mlflow_db, write_spec


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.strip()]


def _saved(line: str) -> Path:
    """The traceback file named by the handler's second line."""
    return Path(line.split("the full traceback is in ", 1)[1].split(" (SWEEPS_DEBUG=1")[0])


# ---- the last-resort handler ------------------------------------------------------------------
def test_an_unexpected_exception_prints_one_line_and_where_its_traceback_is(tmp_path):
    spec = write_spec(tmp_path, name="oops")
    proc = cli_in_process(tmp_path, "status", str(spec), SWEEPS_FAULT="cli_unexpected_error")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    first, where = _lines(proc)
    assert first == "error: RuntimeError: injected by SWEEPS_FAULT=cli_unexpected_error"
    saved = _saved(where)
    assert saved.parent == tmp_path / "runs" / ".errors"
    assert "Traceback" in saved.read_text() and "RuntimeError: injected" in saved.read_text()

    with pytest.raises(RuntimeError, match="injected by SWEEPS_FAULT"):  # SWEEPS_DEBUG=1 still raises
        cli_in_process(tmp_path, "status", str(spec), SWEEPS_FAULT="cli_unexpected_error", SWEEPS_DEBUG="1")


def test_a_fault_point_that_does_not_exist_is_refused_before_the_command_runs(tmp_path):
    spec = write_spec(tmp_path, name="oops")
    proc = cli_in_process(tmp_path, "status", str(spec), SWEEPS_FAULT="cli_unexpected_eror")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = _lines(proc)
    assert line.startswith("error: SWEEPS_FAULT='cli_unexpected_eror' names 'cli_unexpected_eror', which is not")
    assert "cli_unexpected_error" in line and "core/faults.py" in line


def test_the_traceback_goes_to_the_temp_folder_when_runs_cannot_hold_it(tmp_path):
    spec = write_spec(tmp_path, name="oops", seed_store=False)
    (tmp_path / "runs").write_text("not a folder\n")  # runs/.errors cannot be created
    proc = cli_in_process(tmp_path, "status", str(spec), SWEEPS_FAULT="cli_unexpected_error")
    assert proc.returncode == 1
    saved = _saved(_lines(proc)[1])
    try:
        assert saved.parent == Path(tempfile.gettempdir()) / "sweeps-errors" and "Traceback" in saved.read_text()
    finally:
        saved.unlink()


# ---- paths that cannot be used ------------------------------------------------------------------
@pytest.mark.slow
def test_run_with_runs_a_file_names_it_and_exits_2(tmp_path):
    # A read-only runs/ by chmod does not stop root (the tests run as root), so runs/ is made
    # a regular file: no one, root included, can create anything under it.
    spec = write_spec(tmp_path, name="ro", seed_store=False)
    (tmp_path / "runs").write_text("")
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = _lines(proc)
    assert f"{tmp_path / 'runs'} is a file, not a folder" in line  # the MLflow store in runs/ is checked first

    spec = write_spec(tmp_path, name="ro2", seed_store=False, tracking={"uri": "sqlite:///mlflow.db"})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = _lines(proc)
    assert "storage: runs/ro2.journal: cannot create or write the folder" in line
    assert f"{tmp_path / 'runs'} is a file, not a folder" in line


def test_report_to_a_folder_names_it_and_exits_2(tmp_path):
    spec = write_spec(tmp_path, name="rep")
    (tmp_path / "out").mkdir()
    proc = cli_in_process(tmp_path, "report", str(spec), "-o", "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _lines(proc) == ["error: report -o out: out is a folder; name the page file, e.g. -o out/report.html"]


def test_promote_on_a_truncated_mlflow_store_names_the_file_and_exits_2(in_tmp, capsys):
    """The store is checked before the study is read, so a migrated MLflow store cut in half
    stands for one a study wrote (no study needs to run); the CLI runs in this process."""
    spec = write_spec(in_tmp, name="trunc", budget={"n_trials": 1})
    db = in_tmp / "runs" / "mlflow.db"
    os.truncate(db, db.stat().st_size // 2)
    assert cli.main(["promote", str(spec)]) == 2
    err = capsys.readouterr().err  # MLflow's own INFO lines too, when this process made its first store
    assert "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert f"{db} is damaged (truncated:" in line and f"mv {db} {db}.damaged" in line


# ---- a full disk ---------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs. Needs root in a container that allows mounts (CI has both); elsewhere the test
    fails saying so rather than skipping, so a run without it never counts as a pass."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a 4 MB tmpfs for the full-disk test: {mounted.stderr.strip()}. Run the suite "
                    "as root where mounts are allowed (as .ci/run does in CI), or run `make test-fast`, which "
                    "leaves this test out", pytrace=False)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> None:
    """Write zeros until the disk is full: every later write that needs a block fails with ENOSPC."""
    with open(folder / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(bytes(1 << 16))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    assert shutil.disk_usage(folder).free == 0


@pytest.mark.slow
def test_a_full_disk_under_the_study_says_disk_full_in_one_line(small_disk):
    spec = write_spec(small_disk, name="full")
    _fill(small_disk)
    proc = cli_in_process(small_disk, "run", str(spec), "--quiet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    first, *rest = _lines(proc)
    assert first.startswith(f"error: disk full: {small_disk}") and "has 0.0 MB free" in first
    assert len(rest) <= 1  # and where the traceback was saved: the temp folder, runs/ being full
    for line in rest:
        _saved(line).unlink(missing_ok=True)


@pytest.mark.slow
def test_a_full_disk_under_the_mlflow_store_says_disk_full_in_one_line(tmp_path, small_disk):
    shutil.copyfile(empty_mlflow_db(), small_disk / "mlflow.db")
    spec = write_spec(tmp_path, name="fullstore", seed_store=False,
                      tracking={"uri": f"sqlite:///{small_disk}/mlflow.db"})
    _fill(small_disk)
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = _lines(proc)
    assert f"disk full: {small_disk} has 0.0 MB free" in line and "Free space there" in line
