"""Fixtures for the scale-out tests: a fresh PostgreSQL database per use, an MLflow server.

Tests that need PostgreSQL fail (with the reason and how to start it) when no server answers on
127.0.0.1:5432 (trust authentication, as user postgres or root). Every database made here is dropped at
teardown, so tests never see each other's studies.
"""
from __future__ import annotations

import subprocess
import uuid

import pytest

from tests.scaleout.scaleout_helpers import start_mlflow_server, stop_group

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_USERS = ("postgres", "root")


def _admin_connection():
    """An autocommit connection to the server, or the reason there is none."""
    try:
        import psycopg2
    except ImportError as exc:
        return None, f"psycopg2 is not installed ({exc})"
    problems = []
    for user in PG_USERS:
        try:
            conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=user, dbname="postgres", connect_timeout=3)
        except psycopg2.OperationalError as exc:
            problems.append(f"{user}: {str(exc).strip().splitlines()[0]}")
            continue
        conn.autocommit = True
        return conn, user
    return None, "; ".join(problems)


@pytest.fixture(scope="session")
def pg_admin():
    conn, user_or_reason = _admin_connection()
    if conn is None:
        pytest.fail(f"needs PostgreSQL on {PG_HOST}:{PG_PORT} with trust authentication for user postgres or "
                    f"root: {user_or_reason}. Start it (.ci/run does: see its PostgreSQL step), or run "
                    "`make test-fast`, which leaves the scale-out tests out", pytrace=False)
    yield conn, user_or_reason
    conn.close()


@pytest.fixture
def fresh_db(pg_admin):
    """``fresh_db()`` -> the URL of a new, empty database (dropped at teardown)."""
    conn, user = pg_admin
    made = []

    def make() -> str:
        name = f"sweeps_test_{uuid.uuid4().hex[:12]}"
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        made.append(name)
        return f"postgresql://{user}@{PG_HOST}:{PG_PORT}/{name}"

    yield make
    with conn.cursor() as cur:
        for name in made:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---- MLflow tracking server -------------------------------------------------------------------
@pytest.fixture
def mlflow_server(tmp_path, fresh_db, free_port):
    """An ``mlflow server`` on a fresh PostgreSQL backend store (a plain ``postgresql://`` URL:
    SQLAlchemy 2.1 opens it with psycopg 3, a project dependency) and a free local port, artifacts
    proxied into ``tmp_path/mlartifacts``. Yields (base URL, artifacts folder). Killed at teardown."""
    proc, base, artifacts, _ = start_mlflow_server(tmp_path, fresh_db(), free_port)
    try:
        yield base, artifacts
    finally:
        stop_group(proc)


@pytest.fixture
def spawned():
    """A list to put started processes in; any still running at teardown is killed (by its pid)."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


# The compose file and .env.example, read once per module, for test_compose and test_compose_security.
@pytest.fixture(scope="module")
def compose() -> dict:
    from tests.scaleout.compose_helpers import load_compose

    return load_compose()


@pytest.fixture(scope="module")
def env_defaults() -> dict[str, str]:
    from tests.scaleout.compose_helpers import env_example

    return env_example()
