"""A real `mlflow server --app-name basic-auth` on loopback: a study with the right credentials is
tracked; without them, or with a wrong password, `sweeps run` stops before any training with a
message naming the variables to set (exit 2); a client without credentials cannot write."""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from tests.scaleout.scaleout_helpers import start_mlflow_server, stop_group
from tests.sweeps.study_helpers import cli_in_process, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

USER, PASSWORD = "sweeps-admin", "Test-Passw0rd-for-auth"
# The auth store (users, permissions) apart from the tracking store, as in docker/mlflow-auth.ini.
# The cache keeps the (deliberately slow) password hash to once per worker and credential.
AUTH_INI = """[mlflow]
default_permission = READ
database_uri = sqlite:///{folder}/basic_auth.db
admin_username = {user}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 600
"""


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    import socket

    folder = tmp_path_factory.mktemp("auth-server")
    ini = folder / "basic_auth.ini"
    ini.write_text(AUTH_INI.format(folder=folder, user=USER))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key"}
    proc, base, _, _ = start_mlflow_server(folder, f"sqlite:///{folder}/mlflow.db", port,
                                           "--app-name", "basic-auth", env=env)
    try:
        yield base
    finally:
        stop_group(proc)


def call(base: str, path: str, body: dict | None = None, auth: tuple[str, str] | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body or {}) of a REST call, with basic auth when given."""
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def experiments(base: str) -> list[str]:
    status, body = call(base, "/api/2.0/mlflow/experiments/search", {"max_results": 100}, auth=(USER, PASSWORD))
    assert status == 200, status
    return [e["name"] for e in body.get("experiments", [])]


def test_a_client_without_credentials_cannot_write_or_read(auth_server, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(MlflowException) as err:
        MlflowClient(tracking_uri=auth_server).create_experiment("intruder")
    assert "401" in str(err.value) or "not authenticated" in str(err.value).lower(), str(err.value)
    assert call(auth_server, "/api/2.0/mlflow/experiments/search", {"max_results": 1})[0] == 401
    assert call(auth_server, "/api/2.0/mlflow/experiments/search", {"max_results": 1}, auth=(USER, "wrong"))[0] == 401
    assert "intruder" not in experiments(auth_server)


@pytest.mark.parametrize("creds, says", [
    ({}, "no credentials were sent"),
    ({"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": "wrong-password"}, "were rejected"),
])
def test_sweeps_run_without_valid_credentials_stops_before_training(tmp_path, auth_server, creds, says):
    spec = write_spec(tmp_path, name="noauth", tracking={"uri": auth_server}, budget={"n_trials": 1})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", OMP_NUM_THREADS="1", **creds)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "requires authentication (HTTP 401)" in out and says in out, out
    assert "MLFLOW_TRACKING_USERNAME" in out and "MLFLOW_TRACKING_PASSWORD" in out, out
    assert "Traceback" not in out and "wrong-password" not in out, out  # never echo the password
    assert not list(tmp_path.glob("runs/**/trial-*")), "a trial started although the store refused"
    assert "noauth" not in experiments(auth_server)


def test_a_study_with_the_right_credentials_is_tracked(tmp_path, auth_server):
    spec = write_spec(tmp_path, name="authed", tracking={"uri": auth_server}, budget={"n_trials": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", OMP_NUM_THREADS="1",
                          MLFLOW_TRACKING_USERNAME=USER, MLFLOW_TRACKING_PASSWORD=PASSWORD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status, body = call(auth_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=authed",
                        auth=(USER, PASSWORD))
    assert status == 200, status
    status, runs = call(auth_server, "/api/2.0/mlflow/runs/search",
                        {"experiment_ids": [body["experiment"]["experiment_id"]], "max_results": 50},
                        auth=(USER, PASSWORD))
    roles = sorted(t["value"] for r in runs["runs"] for t in r["data"].get("tags", []) if t["key"] == "sweeps.role")
    assert roles == ["study", "trial", "trial"], roles
    assert all(r["info"]["status"] == "FINISHED" for r in runs["runs"])
