"""Plain ``postgresql://`` URLs work in the project's environment for every program that opens
one: SQLAlchemy 2.1 maps the bare scheme to psycopg 3 (not psycopg2), so psycopg 3 must be
installed, and then Optuna and ``mlflow server`` take the spec's own URL as is (optuna-dashboard,
not a project dependency, opens it through the same SQLAlchemy)."""
from __future__ import annotations

import importlib.util

import pytest
import sqlalchemy

from tests.scaleout.scaleout_helpers import rest, start_mlflow_server, stop_group

pytestmark = [pytest.mark.postgres]


def test_sqlalchemy_opens_a_bare_postgresql_url_with_psycopg3():
    dialect = sqlalchemy.engine.make_url("postgresql://u@h/db").get_dialect()
    assert dialect.driver == "psycopg", dialect.driver  # what SQLAlchemy 2.1 picks by itself
    assert importlib.util.find_spec("psycopg") is not None, (
        "psycopg 3 is not installed: it is a dependency in pyproject.toml, which `make install` installs")


def test_optuna_creates_and_loads_a_study_on_a_plain_postgresql_url(fresh_db):
    import optuna

    url = fresh_db()
    assert url.startswith("postgresql://")  # no +driver: exactly what a spec's storage key holds
    study = optuna.create_study(study_name="plain-url", storage=url, direction="maximize")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    loaded = optuna.load_study(study_name="plain-url", storage=url)
    assert len(loaded.trials) == 2 and loaded.best_value == study.best_value
    # The storage really went through psycopg 3 (psycopg2 would also work, but is not what runs).
    assert sqlalchemy.engine.make_url(url).get_dialect().driver == "psycopg"


@pytest.mark.slow
def test_mlflow_server_starts_on_a_plain_postgresql_backend_store(tmp_path, fresh_db, free_port):
    store = fresh_db()
    proc, base, _, _ = start_mlflow_server(tmp_path, store, free_port)
    try:
        made = rest(base, "/api/2.0/mlflow/experiments/create", {"name": "plain-url"})
        got = rest(base, f"/api/2.0/mlflow/experiments/get?experiment_id={made['experiment_id']}")
        assert got["experiment"]["name"] == "plain-url"
    finally:
        stop_group(proc)

