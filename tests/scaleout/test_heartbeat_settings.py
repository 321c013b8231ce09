"""RDB-storage heartbeat settings and stale-trial handling, without a server (SQLite is an RDB URL too)."""
from __future__ import annotations

import pytest

from sweeps.backends import optuna_adapter, optuna_attrs, optuna_recovery, optuna_storage, optuna_study
from sweeps.errors import BackendError
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import silence_heartbeat


def _spec(storage: str):
    return spec_from_dict({"name": "hb", "task": {"name": "digits", "model": "mlp"},
                           "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
                           "tracking": {"uri": "sqlite:///unused.db"}, "storage": storage})


def test_defaults_and_environment_overrides(monkeypatch):
    monkeypatch.delenv("SWEEPS_HEARTBEAT_S", raising=False)
    monkeypatch.delenv("SWEEPS_GRACE_S", raising=False)
    assert optuna_storage.heartbeat_settings() == (optuna_storage.HEARTBEAT_S, optuna_storage.GRACE_S) == (10, 40)
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "2")
    monkeypatch.setenv("SWEEPS_GRACE_S", " 4 ")
    assert optuna_storage.heartbeat_settings() == (2, 4)


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "ten"])
def test_a_bad_value_names_the_variable_and_the_fix(monkeypatch, value):
    monkeypatch.setenv("SWEEPS_GRACE_S", value)
    with pytest.raises(BackendError, match=rf"SWEEPS_GRACE_S='{value}'.*whole number of seconds.*SWEEPS_GRACE_S=40"):
        optuna_storage.heartbeat_settings()


def test_open_storage_uses_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "3")
    monkeypatch.setenv("SWEEPS_GRACE_S", "7")
    rdb = optuna_adapter.rdb_of(optuna_storage.open_storage(_spec(f"sqlite:///{tmp_path}/optuna.db")))
    assert rdb is not None
    assert (rdb.heartbeat_interval, rdb.grace_period) == (3, 7)


def test_postgresql_urls_get_an_installed_driver():
    import importlib.util

    url = "postgresql://u@h:5432/db"
    expected = url if importlib.util.find_spec("psycopg") else "postgresql+psycopg2://u@h:5432/db"
    assert optuna_storage.sqlalchemy_url(url) == expected
    assert optuna_storage.sqlalchemy_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert optuna_storage.sqlalchemy_url("sqlite:///x.db") == "sqlite:///x.db"


def test_a_silent_trial_is_failed_with_the_reason_and_requeued(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPS_HEARTBEAT_S", "1")
    monkeypatch.setenv("SWEEPS_GRACE_S", "1")
    study = optuna_study.open_study(_spec(f"sqlite:///{tmp_path}/optuna.db"))
    trial = study.ask({"lr": __import__("optuna").distributions.FloatDistribution(0.01, 0.1)})
    trial.set_user_attr(optuna_attrs.ATTR_WORKER, "box:123")
    optuna_adapter.storage_of(study).record_heartbeat(optuna_adapter.trial_id_of(trial))
    assert optuna_recovery.fail_stale_trials(study) == []  # still within the grace period
    silence_heartbeat(study, optuna_adapter.trial_id_of(trial))
    assert optuna_recovery.fail_stale_trials(study) == [trial.number]
    assert optuna_recovery.fail_stale_trials(study) == []  # failed once
    dead = study.trials[trial.number]
    assert dead.state.name == "FAIL" and dead.user_attrs["interrupted"] is True
    assert "heartbeat lost: worker box:123" in dead.user_attrs[optuna_attrs.ATTR_REASON]
    [retry] = [t for t in study.trials if t.state.name == "WAITING"]
    assert retry.system_attrs["failed_trial"] == trial.number and retry.params == dead.params
