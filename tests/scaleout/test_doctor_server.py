"""``sweeps doctor`` and the start-up checks against real servers: an ``mlflow server
--app-name basic-auth`` whose ``--allowed-hosts`` leaves out 127.0.0.1, a personal account with
the default READ permission, and PostgreSQL users without the privileges a worker needs.

A READ-only account passes the credentials check but may not create runs in an experiment
someone else made: ``sweeps worker`` refuses it with exit 2 before it claims a trial, and the
doctor says to grant EDIT. A Host header the server does not allow is named as such, not as a
permission problem."""
from __future__ import annotations

import socket
import uuid

import pytest

from sweeps.doctor import OK, PROBLEM, SKIP, run_checks
from sweeps.spec.load import load_spec
from tests.scaleout.scaleout_helpers import start_mlflow_server, stop_group
from tests.scaleout.test_mlflow_auth import AUTH_INI, PASSWORD, USER, call
from tests.sweeps.study_helpers import cli_in_process, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

READER, READER_PASSWORD = "alice", "Alice-Passw0rd-reads-only"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A basic-auth server (default permission READ) with the admin and a personal account, alice."""
    folder = tmp_path_factory.mktemp("doctor-server")
    ini = folder / "basic_auth.ini"
    ini.write_text(AUTH_INI.format(folder=folder, user=USER))
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key"}
    proc, base, _, _ = start_mlflow_server(folder, f"sqlite:///{folder}/mlflow.db", _free_port(),
                                           "--app-name", "basic-auth", env=env)
    try:
        status, _ = call(base, "/api/2.0/mlflow/users/create", {"username": READER, "password": READER_PASSWORD},
                         auth=(USER, PASSWORD))
        assert status == 200, status
        yield base
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def narrow_hosts_server(tmp_path_factory):
    """A server whose --allowed-hosts leaves out 127.0.0.1 (the address the tests use)."""
    folder = tmp_path_factory.mktemp("narrow-hosts")
    proc, base, _, _ = start_mlflow_server(folder, f"sqlite:///{folder}/mlflow.db", _free_port(),
                                           "--allowed-hosts", "mlflow-host:*,localhost:*")
    try:
        yield base
    finally:
        stop_group(proc)


def _checks(spec_path) -> dict[str, tuple[str, str]]:
    return {c.name: (c.verdict, c.message) for c in run_checks(load_spec(str(spec_path)))}


def test_an_allowed_hosts_without_this_address_is_named_not_called_a_permission(tmp_path, narrow_hosts_server):
    spec = write_spec(tmp_path, name="hosts", tracking={"uri": narrow_hosts_server})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "refused the Host header '127.0.0.1:" in out and "--allowed-hosts" in out, out
    assert "permission" not in out and "no credentials were sent" not in out and "Traceback" not in out, out
    proc = cli_in_process(tmp_path, "doctor", str(spec))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith(("ok", "PROB", "skip"))}
    assert sorted(lines) == sorted(["storage", "mlflow", "host", "access", "permission", "artifacts", "gpus",
                                    "versions"]), lines  # one line each (problems on stderr)
    assert lines["mlflow"].startswith("ok") and lines["host"].startswith("PROBLEM"), lines
    assert "--allowed-hosts" in lines["host"] and lines["permission"].startswith("skip"), lines


@pytest.mark.postgres
def test_a_read_only_account_is_refused_before_a_worker_claims_a_trial(tmp_path, auth_server, fresh_db):
    storage = fresh_db()
    spec = write_spec(tmp_path, name="readonly", storage=storage, tracking={"uri": auth_server},
                      budget={"n_trials": 1})
    admin = {"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", OMP_NUM_THREADS="1", **admin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reader = {"MLFLOW_TRACKING_USERNAME": READER, "MLFLOW_TRACKING_PASSWORD": READER_PASSWORD}
    proc = cli_in_process(tmp_path, "worker", str(spec), "--wait", "0", OMP_NUM_THREADS="1", **reader)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "user 'alice' may read but not write MLflow experiment 'readonly'" in out, out
    assert "EDIT" in out and "grant_user_permission" in out and "Traceback" not in out, out
    # The doctor says the same on its permission line, and passes once EDIT is granted.
    proc = cli_in_process(tmp_path, "doctor", str(spec), **reader)
    assert proc.returncode == 2 and "PROBLEM permission" in proc.stderr, proc.stdout + proc.stderr
    status, body = call(auth_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=readonly",
                        auth=(USER, PASSWORD))
    status, _ = call(auth_server, "/api/3.0/mlflow/users/permissions/grant",
                     {"username": READER, "resource_type": "experiment",
                      "resource_id": body["experiment"]["experiment_id"], "permission": "EDIT"}, auth=(USER, PASSWORD))
    assert status == 200, status
    proc = cli_in_process(tmp_path, "doctor", str(spec), **reader)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for name in ("storage", "mlflow", "host", "access", "permission", "artifacts", "versions"):
        assert f"ok      {name}" in out, out


def test_wrong_mlflow_credentials_fail_the_access_line(tmp_path, auth_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", READER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    found = _checks(write_spec(tmp_path, name="wrongpw", tracking={"uri": auth_server}))
    assert found["mlflow"][0] == OK and found["host"][0] == OK, found
    assert found["access"][0] == PROBLEM and "were rejected" in found["access"][1], found
    assert found["permission"][0] == SKIP, found


@pytest.mark.postgres
def test_a_postgres_user_without_privileges_is_a_storage_problem(tmp_path, pg_admin, fresh_db):
    conn, _ = pg_admin
    role = f"doctor_{uuid.uuid4().hex[:8]}"
    url = fresh_db()
    database = url.rsplit("/", 1)[1]
    with conn.cursor() as cur:
        cur.execute(f'CREATE ROLE "{role}" LOGIN')
        cur.execute(f'GRANT CONNECT ON DATABASE "{database}" TO "{role}"')
    try:
        spec = write_spec(tmp_path, name="nopriv", storage=url.replace("://postgres@", f"://{role}@")
                          .replace("://root@", f"://{role}@"))
        verdict, message = _checks(spec)["storage"]
        assert verdict == PROBLEM and f"connected as '{role}', who may not create Optuna's tables" in message, message
        missing = write_spec(tmp_path, name="nodb", storage=url + "_missing")
        verdict, message = _checks(missing)["storage"]
        assert verdict == PROBLEM and "cannot connect" in message and "does not exist" in message, message
        assert _checks(write_spec(tmp_path, name="owner", storage=url))["storage"][0] == OK
    finally:
        with conn.cursor() as cur:
            cur.execute(f'REVOKE ALL ON DATABASE "{database}" FROM "{role}"')
            cur.execute(f'DROP ROLE "{role}"')

