"""A dead machine's trial on PostgreSQL is retried, not left WAITING: a worker out of budget stays
while another machine's trial runs, and a retry requeued while it looks at the study is asked on
its next round; no worker asks for a trial between a stale trial's FAIL and its retry's enqueue
(it would take a new trial in the retry's place)."""
from __future__ import annotations

import threading
import time

import optuna
import pytest
import sqlalchemy

from sweeps.backends import optuna_adapter, optuna_study
from sweeps.backends import optuna_recovery as recovery
from sweeps.backends.optuna_storage import ask_lock, sqlalchemy_url
from sweeps.backends.optuna_worker import next_trials
from sweeps.backends.trial_liveness import HeldTrials, StaleTrialMonitor
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import migrated_store, tiny_spec

pytestmark = pytest.mark.postgres


class _RequeuedAfterTheFirstRead:
    """The study, as a worker reads it while another machine's stale-trial check fails ``dead``
    and requeues it: right after the worker's first read of its trials."""

    def __init__(self, study: optuna.Study, dead: optuna.Trial, tracking_uri: str) -> None:
        self._study, self._dead, self._tracking_uri, self._read = study, dead, tracking_uri, False

    def __getattr__(self, name: str):
        return getattr(self._study, name)

    def get_trials(self, *args, **kwargs):
        trials = self._study.get_trials(*args, **kwargs)
        if not self._read:
            self._read = True
            recovery.fail_trial(self._study, optuna_adapter.stored_trial(self._study, self._dead), "heartbeat lost",
                                requeue=True, tracking_uri=self._tracking_uri, interrupted=True)
        return trials


def _one_trial_study(tmp_path, url: str, name: str):
    spec = spec_from_dict(tiny_spec(name, storage=url, tracking={"uri": migrated_store(tmp_path)},
                                    budget={"n_trials": 1}))
    study = optuna_study.open_study(spec)
    other = study.ask()  # another machine's trial: the whole budget
    optuna_adapter.record_heartbeat(study, optuna_adapter.trial_id_of(other))
    return spec, study, other


def test_a_worker_out_of_budget_stays_for_a_trial_requeued_while_it_looks(tmp_path, fresh_db):
    spec, study, other = _one_trial_study(tmp_path, fresh_db(), "stays")
    looking = _RequeuedAfterTheFirstRead(study, other, spec.tracking_store_uri())
    held = HeldTrials(study)
    try:
        assert next_trials(spec, looking, held, 1, 1) == ([], True)  # the budget is taken and a trial runs: it stays
        assert looking._read  # the trial was failed and requeued while the worker looked
        [retry], _ = next_trials(spec, study, held, 1, 1)  # its next round
    finally:
        held.stop()
    assert optuna_adapter.stored_trial(study, retry).system_attrs["failed_trial"] == other.number


_WAITING_FOR_A_LOCK = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                       "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")


@pytest.mark.parametrize("who", ["worker", "monitor"])
def test_no_trial_is_asked_between_a_stale_trials_fail_and_its_requeue(tmp_path, fresh_db, who):
    """A stale trial is failed and requeued under the ask lock. The test holds the lock (a worker
    asking); the worker's or the stale-trial monitor's check waits for it before failing the trial."""
    url = fresh_db()
    spec, study, dead = _one_trial_study(tmp_path, url, "stale")
    db = sqlalchemy.create_engine(sqlalchemy_url(url))
    with db.begin() as conn:  # its machine died an hour ago
        conn.execute(sqlalchemy.text("UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '1 hour'"))
    monitor = StaleTrialMonitor(spec, study.study_name)
    taken: list = []
    held = HeldTrials(study)
    check = {"worker": lambda: taken.append(next_trials(spec, study, held, 1, 1)), "monitor": monitor.check_now}[who]
    checking = threading.Thread(target=check, daemon=True)

    def state(sql: str):
        with db.connect() as conn:
            return conn.execute(sqlalchemy.text(sql)).scalar()

    try:
        with ask_lock(spec):
            checking.start()
            # Until the check has finished or waits for the lock, whichever it does (both last).
            while checking.is_alive() and not state(_WAITING_FOR_A_LOCK):
                time.sleep(0.01)
            assert state(f"SELECT state FROM trials WHERE number = {dead.number}") == "RUNNING"
        checking.join()
    finally:
        monitor.stop()
        held.stop()
        db.dispose()
    trials = optuna_study.open_study(spec, create=False).trials
    assert trials[dead.number].state.name == "FAIL"
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.state.name == ("RUNNING" if who == "worker" else "WAITING")  # the worker asked it
    if who == "worker":
        assert [t.number for t in taken[0][0]] == [retry.number]


def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_failed_and_requeued(tmp_path, fresh_db,
                                                                                     monkeypatch):
    """A worker that asked for a trial and died before its first beat (a storage outage stopped it
    there) leaves a RUNNING trial with no heartbeat, which Optuna's stale check never takes: it is
    failed and requeued once this process has seen it without a beat for a grace period, by its own
    clock. One whose asker beats late, within that period, and one a worker holds stay RUNNING."""
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "1")
    monkeypatch.setenv("SWEEPS_GRACE_S", "3")
    spec = spec_from_dict(tiny_spec("unbeaten", storage=fresh_db(), tracking={"uri": migrated_store(tmp_path)},
                                    budget={"n_trials": 3}))
    study = optuna_study.open_study(spec)
    dead, late = study.ask(), study.ask()  # neither records a heartbeat yet
    held = HeldTrials(study)
    try:
        alive = held.ask("another machine")
        check = lambda: recovery.fail_stale_trials(study, lambda: ask_lock(spec))  # noqa: E731
        assert check() == []  # seen without a beat: not for a grace period yet
        time.sleep(optuna_adapter.heartbeat_grace_seconds(study))  # a lower bound: any longer wait is the same
        optuna_adapter.record_heartbeat(study, optuna_adapter.trial_id_of(late))  # its asker beat, late
        assert check() == [dead.number]
    finally:
        held.stop()
    trials = optuna_study.open_study(spec, create=False).trials
    assert [trials[t.number].state.name for t in (dead, late, alive)] == ["FAIL", "RUNNING", "RUNNING"]
    assert "recorded no heartbeat for the trial in more than 3 s" in trials[dead.number].user_attrs["fail_reason"]
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.state.name == "WAITING"
