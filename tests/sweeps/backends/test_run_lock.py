"""The study's run lock (sweeps/backends/driver.py), shared by both backends: a second
`sweeps run` of a study is refused at once, naming the first one's pid."""
from __future__ import annotations

import os

import pytest

from sweeps.backends import ray_records
from sweeps.backends.driver import run_lock, run_lock_held
from sweeps.backends.optuna_backend import OptunaBackend
from sweeps.errors import StudyStateError
from sweeps.spec.load import spec_from_dict


def _spec(storage: str | None = None):
    data = {"name": "locked", "task": {"name": "digits", "model": "mlp"},
            "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "tracking": {"uri": "sqlite:///unused.db"}}
    return spec_from_dict({**data, "storage": storage} if storage else data)


def test_a_second_holder_is_refused_at_once_with_the_first_ones_pid(tmp_path):
    path = tmp_path / "s.runlock"
    assert not run_lock_held(path)  # no file yet: nobody
    with run_lock(path, "s"):
        assert run_lock_held(path)
        assert path.read_text() == str(os.getpid())
        with pytest.raises(StudyStateError, match=rf"study 's' is already being run by another sweeps process "
                                                   rf"\(pid {os.getpid()}\); wait for it or stop it first"):
            with run_lock(path, "s"):
                pytest.fail("a second holder got the lock")
    assert not run_lock_held(path)
    with run_lock(path, "s"):  # released: the next run takes it
        pass


def test_an_error_inside_the_block_releases_the_lock(tmp_path):
    path = tmp_path / "s.runlock"
    with pytest.raises(RuntimeError):
        with run_lock(path, "s"):
            raise RuntimeError("the run failed")
    assert not run_lock_held(path)


def test_the_optuna_backend_locks_a_journal_study_beside_its_journal(in_tmp):
    spec = _spec()
    with OptunaBackend()._run_lock(spec):
        assert run_lock_held(in_tmp / "runs" / "locked.journal.runlock")
        with pytest.raises(StudyStateError, match="study 'locked' is already being run"):
            with OptunaBackend()._run_lock(spec):
                pass


def test_a_refused_run_starts_no_worker(in_tmp, monkeypatch):
    from sweeps.backends import supervisor

    started = []
    monkeypatch.setattr(supervisor, "spawn_worker", lambda slot: started.append(slot))  # recorded, never run
    monkeypatch.setattr(supervisor, "fork_worker", lambda slot: started.append(slot))
    spec = _spec()
    with OptunaBackend()._run_lock(spec):
        with pytest.raises(StudyStateError, match="study 'locked' is already being run"):
            OptunaBackend().run(spec)
    assert started == []


def test_the_optuna_backend_does_not_lock_an_rdb_study(in_tmp):
    spec = _spec(f"sqlite:///{in_tmp}/optuna.db")
    with OptunaBackend()._run_lock(spec), OptunaBackend()._run_lock(spec):  # many runs and workers may share it
        pass


def test_the_ray_backend_sees_its_driver_through_the_same_lock(in_tmp):
    path = ray_records.lock_path("locked")
    path.parent.mkdir(parents=True)
    assert not ray_records.driver_running("locked")
    with run_lock(path, "locked"):
        assert ray_records.driver_running("locked")
    assert not ray_records.driver_running("locked")
