"""The outage wait of the Optuna storage in-process, on a real SQLite RDB storage that another
connection holds locked: the call waits (one line saying so), answers once the lock goes (one line
saying so), and stale-trial checks find no trial stale for a grace period after the outage."""
from __future__ import annotations

import logging
import sqlite3
import threading

from sweeps.backends import optuna_adapter, optuna_recovery, optuna_study
from sweeps.backends.optuna_outage import ENV_STORAGE_WAIT
from tests.sweeps.study_helpers import sqlite_rdb_spec


class _Said(logging.Handler):
    def __init__(self, words: str) -> None:
        super().__init__()
        self.words, self.event, self.lines = words, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if self.words in record.getMessage():
            self.event.set()


def test_a_locked_storage_is_waited_for_and_used_once_it_answers(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_STORAGE_WAIT, "600")
    # SQLite's own busy timeout (5 s unless the URL says) passes before the storage says it waits.
    spec = sqlite_rdb_spec(tmp_path, "locked", storage_query="?timeout=0.2")
    study = optuna_study.open_study(spec)
    study.tell(study.ask(), 1.0)
    said = _Said("does not answer")
    logging.getLogger("sweeps").addHandler(said)
    holder = sqlite3.connect(tmp_path / "optuna.db", isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")  # another process's long write: every call is refused
        got: list = []
        asking = threading.Thread(target=lambda: got.append(study.ask().number))
        asking.start()
        assert said.event.wait(timeout=600), said.lines  # the wait began, and said so
        holder.execute("COMMIT")
        asking.join(timeout=600)
    finally:
        holder.close()
        logging.getLogger("sweeps").removeHandler(said)
    assert got == [1]
    waiting = [line for line in said.lines if "does not answer" in line]
    assert len(waiting) == 1 and "database is locked" in waiting[0], said.lines
    assert f"waiting up to 600 s ({ENV_STORAGE_WAIT})" in waiting[0]
    assert any("answers again after" in line for line in said.lines), said.lines
    storage = optuna_adapter.storage_of(study)
    assert isinstance(storage, optuna_adapter.OutageTolerantStorage)
    assert storage.outage.quiet_for(optuna_adapter.heartbeat_grace_seconds(study))
    # The database names trial 1 stale (its worker beat no heartbeat through the outage): within a
    # grace period of the outage's end that silence is no sign of a dead worker, past it it is.
    trial_id = optuna_adapter.trial_id_of(study.trials[1])
    monkeypatch.setattr(storage.cached, "_get_stale_trial_ids", lambda study_id: [trial_id])
    assert optuna_recovery.fail_stale_trials(study) == []
    monkeypatch.setattr(storage.outage, "quiet_for", lambda seconds: False)
    assert optuna_recovery.fail_stale_trials(study) == [1]
