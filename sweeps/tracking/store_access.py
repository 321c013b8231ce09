"""What the tracking store lets this process do, said in words that name the cause: the
credentials MLflow's client sends, a server's Host-header check (``--allowed-hosts``), write
permission on the study's experiment, and a SQLite store held locked by another process.

The start-up check (``sync.check_store``), a joining worker and ``sweeps doctor`` use these, so
a worker is refused before it claims a trial rather than failing on its first run.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sweeps.errors import TrackingError, cause_chain

# Where MLflow's server says its Host-header check refused the request (mlflow.server.security_utils).
INVALID_HOST = "Invalid Host header"
# An experiment tag that every sweeps process may set: setting it needs the same permission as
# creating a run in the experiment (MLflow basic auth: "update" on the experiment, EDIT or MANAGE).
WRITE_CHECK_TAG = "sweeps.write_check"
GRANT_EDIT = ('from mlflow.server import get_app_client; get_app_client("basic-auth", tracking_uri="{uri}")'
              '.grant_user_permission("{user}", "experiment", "{experiment_id}", "EDIT")')


class TrackingAuthError(TrackingError):
    """The tracking server refused the credentials, their absence, their permission or the Host
    header: the user's settings are wrong, not the store, so it is bad input (exit 2) like a bad
    spec, and retrying cannot help."""

    exit_code = 2


def http_credentials() -> tuple[dict[str, str], tuple[str, str] | None, bool | str]:
    """(headers, basic auth, TLS verify) as MLflow's client sends them (its documented variables)."""
    headers: dict[str, str] = {}
    auth = None
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
        auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))
    verify: bool | str = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        verify = False
    return headers, auth, verify


def host_header_refusal(uri: str, status: int, body: str) -> TrackingAuthError | None:
    """The error for a server whose ``--allowed-hosts`` leaves out the address in ``uri``; None
    when the answer is not that refusal. MLflow answers it with 403 like a missing permission."""
    if status != 403 or INVALID_HOST not in body:
        return None
    host = urlsplit(uri).netloc.rsplit("@", 1)[-1]
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return TrackingAuthError(
        f"the MLflow tracking server at {uri} refused the Host header {host!r} (HTTP 403 '{INVALID_HOST}'): "
        f"its --allowed-hosts does not list the address this machine uses. Add it where the server starts "
        f"(e.g. --allowed-hosts '{name}:*,127.0.0.1:*,localhost:*', or MLFLOW_ALLOWED_HOSTS in the compose .env), "
        "or point tracking.uri at a name it lists. This is not a credentials problem.")


def check_experiment_writable(uri: str, experiment: str, session: Any = None) -> str | None:
    """Raise TrackingAuthError unless these credentials may create runs in ``experiment`` on the
    MLflow server at ``uri``. A missing experiment passes (its creator gets MANAGE on it). Returns
    the experiment's id, or None when it does not exist yet.

    The probe sets the tag ``sweeps.write_check``, which needs the permission a run's creation
    needs: a personal account whose default permission is READ fails here, before a worker
    claims a trial, rather than on the trial's first run."""
    import requests

    http = session or requests
    headers, auth, verify = http_credentials()
    api = uri.rstrip("/") + "/api/2.0/mlflow"
    kw: dict[str, Any] = {"headers": headers, "auth": auth, "verify": verify, "timeout": (3.0, 90.0)}
    try:
        got = http.get(f"{api}/experiments/get-by-name", params={"experiment_name": experiment}, **kw)
        if got.status_code == 404:
            return None
        refused = host_header_refusal(uri, got.status_code, got.text)
        if refused is not None:
            raise refused
        if got.status_code != 200:
            raise TrackingError(f"looking up MLflow experiment {experiment!r} at {uri} failed "
                                f"(HTTP {got.status_code}: {got.text[:200]!r})")
        experiment_id = got.json()["experiment"]["experiment_id"]
        put = http.post(f"{api}/experiments/set-experiment-tag",
                        json={"experiment_id": experiment_id, "key": WRITE_CHECK_TAG, "value": "ok"}, **kw)
    except requests.exceptions.RequestException as exc:
        raise TrackingError(f"cannot reach the MLflow tracking server at {uri}: {exc}") from exc
    if put.status_code == 403:
        user = auth[0] if auth else "<user>"
        who = f"user {auth[0]!r}" if auth else ("the token in MLFLOW_TRACKING_TOKEN" if headers else "this client")
        raise TrackingAuthError(
            f"{who} may read but not write MLflow experiment {experiment!r} (id {experiment_id}) at {uri} "
            "(HTTP 403 on a write): runs cannot be created there. Have an MLflow admin grant EDIT on it: "
            + GRANT_EDIT.format(uri=uri, experiment_id=experiment_id, user=user)
            + " (docs/SCALE_OUT.md, Credentials), or use the account that created the study.")
    if put.status_code != 200:
        raise TrackingError(f"MLflow experiment {experiment!r} at {uri} did not take a tag "
                            f"(HTTP {put.status_code}: {put.text[:200]!r})")
    return str(experiment_id)


def sqlite_locked_error(uri: str, path: Path | None, exc: BaseException) -> TrackingError | None:
    """The error for a SQLite store that another process holds locked, naming the process when
    this one may see it; None when ``exc`` (or its cause) is not SQLite's "database is locked"."""
    if path is None or not any("database is locked" in str(link) for link in cause_chain(exc)):
        return None
    holders = lock_holders(path)
    by = f" by {'; '.join(holders)}" if holders else " by another process (not one this user can see)"
    return TrackingError(
        f"the SQLite tracking store {uri!r} is locked{by}: SQLite gave up waiting for it. Let that process finish "
        "or stop it, then run the command again; for several processes writing at once, use an MLflow server "
        "(docs/SCALE_OUT.md) instead of one SQLite file.")


def lock_holders(path: Path) -> list[str]:
    """``pid N (command)`` for every other process that has the database (or its journal) open, as
    far as /proc shows this user; empty where there is no /proc."""
    target = str(path.absolute())
    wanted = {target, f"{target}-journal", f"{target}-wal", f"{target}-shm"}
    found = []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            opened = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
            if opened & wanted:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"pid {entry.name} ({command[:120]})")
        except OSError:  # gone meanwhile, or another user's
            continue
    return found
