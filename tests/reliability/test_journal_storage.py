"""The Optuna journal through the real CLI: stale and held locks, a kill mid-append, corrupt
records, and a storage: path that is not a journal at all."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.sweeps.study_helpers import cli_in_process, load_study, sweeps_env, write_spec

# A process holding the journal lock the way a live sweeps writer does, until its stdin closes.
HOLD_LOCK = """
import sys
from sweeps.backends.journal_file import JournalLock
lock = JournalLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""

# A writer of the study appending one record (a study attribute) through sweeps' journal backend.
APPEND_ONE = """
import sys
import optuna
from sweeps.backends.journal_file import open_journal
optuna.load_study(study_name="midappend", storage=open_journal(sys.argv[1], create=True)).set_user_attr("x", 1)
"""


def _quiet(proc: subprocess.CompletedProcess) -> str:
    """stderr, checked to be a message and not a traceback."""
    assert "Traceback" not in proc.stderr and "JSONDecodeError" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stale_relative_lock_link_spins_neither_status_nor_run(tmp_path):
    spec = write_spec(tmp_path, name="stale", budget={"n_trials": 1})
    assert cli_in_process(tmp_path, "run", str(spec), "--quiet").returncode == 0
    # What Optuna's own lock leaves when its process is SIGKILLed mid-append and was handed the
    # relative journal path: a link to "runs/stale.journal", dangling from runs/ where it lies.
    # Optuna's acquire() then looped without sleeping, forever.
    lock = tmp_path / "runs" / "stale.journal.lock"
    os.symlink("runs/stale.journal", lock)
    assert lock.is_symlink() and not lock.exists()

    status = cli_in_process(tmp_path, "status", str(spec))
    assert status.returncode == 0, status.stdout + status.stderr
    assert "1 complete" in status.stdout  # readers never take the lock

    spec = write_spec(tmp_path, name="stale", budget={"n_trials": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"removing the stale journal lock {lock}" in proc.stderr
    assert not lock.is_symlink()
    assert [t.state.name for t in load_study(tmp_path, "stale").trials] == ["COMPLETE", "COMPLETE"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lock_held_by_a_live_process_ends_in_a_clear_error_naming_it(tmp_path):
    spec = write_spec(tmp_path, name="held", budget={"n_trials": 1})
    journal = tmp_path / "runs" / "held.journal"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(journal)], env=sweeps_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # The bound is an environment variable so the test waits half a second, not two minutes.
        proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", SWEEPS_JOURNAL_LOCK_WAIT_S="0.5")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = _quiet(proc)
    assert f"journal lock {journal}.appendlock" in err and f"held by pid {holder.pid}" in err
    assert f"kill {holder.pid}" in err and f"rm -f {journal}.appendlock {journal}.lock" in err
    assert "SWEEPS_JOURNAL_LOCK_WAIT_S" in err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_mid_append_the_next_run_cuts_the_partial_record_and_finishes(tmp_path):
    spec = write_spec(tmp_path, name="midappend", budget={"n_trials": 1})
    assert cli_in_process(tmp_path, "run", str(spec), "--quiet").returncode == 0
    journal = tmp_path / "runs" / "midappend.journal"
    intact = journal.read_bytes()

    spec = write_spec(tmp_path, name="midappend", budget={"n_trials": 2})
    # A writer of the study (here one setting a study attribute) is killed in the middle of its append.
    killed = subprocess.run([sys.executable, "-c", APPEND_ONE, str(journal)], capture_output=True, text=True,
                            env=sweeps_env(SWEEPS_FAULT="journal_mid_append"), timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    torn = journal.read_bytes()
    assert torn.startswith(intact) and len(torn) > len(intact) and not torn.endswith(b"\n")  # half a record
    assert (tmp_path / "runs" / "midappend.journal.lock").is_symlink()  # Optuna's lock, left held

    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "removing the stale journal lock" in proc.stderr and "torn last record" in proc.stderr
    saved = list(journal.parent.glob("midappend.journal.torn-*"))
    assert len(saved) == 1 and saved[0].read_bytes() == torn[len(intact):]  # the cut bytes are kept
    assert [t.state.name for t in load_study(tmp_path, "midappend").trials] == ["COMPLETE", "COMPLETE"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_corrupt_record_inside_the_journal_gives_the_repair_command_to_every_command(tmp_path):
    spec = write_spec(tmp_path, name="corrupt", budget={"n_trials": 1})
    assert cli_in_process(tmp_path, "run", str(spec), "--quiet").returncode == 0
    journal = tmp_path / "runs" / "corrupt.journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"op_code": 5, "worker_id": GARBAGE\n'
    journal.write_bytes(b"".join(lines))
    damaged = journal.read_bytes()

    for command in ("run", "status", "report", "promote"):
        proc = cli_in_process(tmp_path, command, str(spec))
        assert proc.returncode == 2, (command, proc.stdout + proc.stderr)
        err = _quiet(proc)
        assert re.search(rf"{re.escape(str(journal))}: line 3: record 3 is corrupt and {len(lines) - 3} more "
                         rf"lines follow it.*run: sweeps repair-journal {re.escape(str(journal))}$", err.strip()), err
        assert len(err.strip().splitlines()) == 1, err
        assert journal.read_bytes() == damaged, command  # refused before anything was written

    repaired = cli_in_process(tmp_path, "repair-journal", str(journal))
    assert repaired.returncode == 0 and "kept 2 intact records" in repaired.stdout, repaired.stdout + repaired.stderr
    assert cli_in_process(tmp_path, "status", str(spec)).returncode == 0


@pytest.mark.slow
def test_a_storage_file_that_is_not_a_journal_is_refused_and_left_as_it_was(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes about this study\n")
    spec = write_spec(tmp_path, name="notes", storage="notes.txt", budget={"n_trials": 1})
    for command in ("run", "status"):
        proc = cli_in_process(tmp_path, command, str(spec))
        assert proc.returncode == 2, (command, proc.stdout + proc.stderr)
        assert f"{notes} is not an Optuna journal" in _quiet(proc) and "nothing was changed" in proc.stderr
        assert notes.read_text() == "my notes about this study\n"


def test_repair_journal_names_a_missing_path_or_a_folder(tmp_path):
    (tmp_path / "runs").mkdir()
    missing = cli_in_process(tmp_path, "repair-journal", "runs/nope.journal")
    assert missing.returncode == 2 and "runs/nope.journal does not exist" in _quiet(missing)
    folder = cli_in_process(tmp_path, "repair-journal", "runs")
    assert folder.returncode == 2 and "runs is a folder, not an Optuna journal file" in _quiet(folder)
