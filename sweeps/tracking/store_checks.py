"""Whether this process can use the tracking store, said in words that name the cause and the fix.

The fail-fast check run before any training (:func:`check_store`: the server or database answers,
a SQLite file is usable), and what the store lets this process do: the credentials MLflow's client
sends, a server's Host-header check (``--allowed-hosts``), write permission on the study's
experiment, and a SQLite store held locked by another process. ``sweeps run``, a joining worker
and ``sweeps doctor`` use these, so a worker is refused before it claims a trial rather than
failing on its first run.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sweeps.errors import TrackingError, TrackingPathError, cause_chain
from sweeps.stop_signals import interrupted_by_signals
from sweeps.store_urls import sqlite_path
from sweeps.tracking.store_errors import disk_full_error, store_folder

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


# (connect, read): an unreachable server fails in seconds. A server that accepted the connection is
# up; its first answer (on a database store, after a cold start, on a loaded machine) took over 5 s here.
_CHECK_TIMEOUT_S = (3.0, 30.0)
# With credentials the server hashes the password (MLflow basic auth: PBKDF2, slow on purpose),
# which took 10-13 s per request on a busy 2-core test machine; a 5 s read timeout would call a
# live, authenticating server "unreachable". Connecting still fails in seconds.
_CHECK_TIMEOUT_AUTH_S = (3.0, 90.0)
_FIX = (
    "Start the tracking server or point the study's tracking.uri at one that runs "
    "(e.g. `mlflow server --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000`, "
    "then --tracking-uri http://127.0.0.1:5000)."
)


# By default MLflow's HTTP client retries several times, with exponential backoff and a long
# timeout per request: an unreachable server would stall a flush (and training) for minutes.
# The spool makes retrying later cheap, so fail fast instead.
_FAST_FAIL_HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}


def is_http_uri(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def apply_fast_fail_http_defaults() -> None:
    """Make MLflow's HTTP client give up in seconds. MLflow reads these variables on
    every request and has no per-client setting, so this is process-wide; setdefault
    keeps any value the user set explicitly."""
    for name, value in _FAST_FAIL_HTTP_ENV.items():
        os.environ.setdefault(name, value)


def check_store(tracking_uri: str, get_client: Callable[[], Any]) -> None:
    """Raise TrackingError naming ``tracking_uri`` and the fix unless the store answers.

    Called before any training starts and before a sync. For http(s) it asks the REST
    API directly with a timeout of seconds and no retries (MLflow's own client would
    retry for minutes); a database server gets one connection attempt with a timeout
    (MLflow's engine setup retries for over a minute); then one cheap query through the client.
    """
    if is_http_uri(tracking_uri):
        _check_http(tracking_uri)
        return
    check_sqlite_store(tracking_uri)
    scheme = tracking_uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in ("postgresql", "postgres", "mysql", "mssql"):
        _check_database(tracking_uri, scheme)
    try:
        get_client().search_experiments(max_results=1)
    except TrackingError as exc:
        locked = sqlite_locked_error(tracking_uri, sqlite_path(tracking_uri), exc)
        if locked is None:
            raise
        raise locked from exc
    except Exception as exc:  # any error here means the store is not usable: say so now
        raise (sqlite_locked_error(tracking_uri, sqlite_path(tracking_uri), exc)
               or disk_full_error(exc, f"opening {tracking_uri}", store_folder(tracking_uri, "."))
               or TrackingError(
            f"cannot use the MLflow tracking store {tracking_uri!r}: {exc}. Check the URI "
            f"(for sqlite, that its folder can be created and written). {_FIX}")) from exc


SQLITE_HEADER = b"SQLite format 3\x00"


def check_sqlite_store(uri: str) -> None:
    """TrackingPathError (exit 2) naming the file and the fix when the SQLite file of a tracking URI
    cannot work: its folder is blocked by a file or not writable, it is a folder, or it is
    damaged. MLflow would otherwise fail deep inside SQLAlchemy ("database disk image is
    malformed", "unable to open database file") with a traceback."""
    path = sqlite_path(uri)
    if path is None:
        return
    where = f"MLflow tracking store {uri!r}"
    blocker = next((p for p in path.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise TrackingPathError(f"{where}: {blocker} is a file, not a folder, so {path} cannot be created or "
                                "opened; move that file away, or point tracking.uri at another folder")
    folder = path.absolute().parent
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise TrackingPathError(f"{where}: the folder {folder} is not writable (SQLite writes its journal beside "
                                "the database); make it writable, or point tracking.uri at another folder")
    if path.is_dir():
        raise TrackingPathError(f"{where}: {path} is a folder; name the database file, e.g. {path / 'mlflow.db'}")
    damage = sqlite_damage(path) if path.is_file() else None
    if damage is not None:
        raise TrackingPathError(f"{where}: {path.absolute()} is damaged ({damage}), so MLflow cannot open it. "
                                f"Restore it from a backup, or move it aside (mv {path} {path}.damaged) to start an "
                                "empty store: the study's trials stay in its Optuna storage, but their MLflow runs "
                                "would be gone")


def sqlite_damage(path: Path) -> str | None:
    """Why ``path`` is not a usable SQLite database, from its 100-byte header (cheap at any size):
    not SQLite at all, or shorter than the pages its header counts (truncated). None when fine."""
    size = path.stat().st_size
    if size == 0:
        return None  # SQLite takes an empty file as a new database
    with open(path, "rb") as fh:
        header = fh.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_HEADER):
        return f"not an SQLite database: its {size} bytes do not start with the SQLite header"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The page count is valid only when the change counter matches "version valid for"; with a
    # write-ahead log, committed pages may still live in the -wal file.
    if header[24:28] != header[92:96] or pages == 0 or Path(f"{path}-wal").exists():
        return None
    if size < pages * page_size:
        return f"truncated: {size} bytes, its header counts {pages} pages of {page_size} bytes = {pages * page_size}"
    return None


def _check_database(uri: str, scheme: str) -> None:
    import sqlalchemy

    connect_args = {"connect_timeout": 5} if scheme in ("postgresql", "postgres", "mysql") else {}
    engine = sqlalchemy.create_engine(uri, connect_args=connect_args, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect():
            pass
    except Exception as exc:
        raise TrackingError(
            f"cannot connect to the database of the MLflow tracking store {uri!r}: "
            f"{str(exc).splitlines()[0]}. Start the database or fix the URI (host, port, "
            f"user, password, database name)."
        ) from exc
    finally:
        engine.dispose()


def _check_http(uri: str) -> None:
    import requests

    headers, auth, verify = http_credentials()
    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search"
    timeout = _CHECK_TIMEOUT_AUTH_S if (auth or headers) else _CHECK_TIMEOUT_S
    try:
        with interrupted_by_signals(f"waiting for the MLflow tracking server at {uri} to answer"):
            resp = requests.post(url, json={"max_results": 1}, headers=headers, auth=auth,
                                 verify=verify, timeout=timeout)
    except requests.exceptions.RequestException as exc:
        raise TrackingError(f"cannot reach the MLflow tracking server at {uri}: {exc}. {_FIX}") from exc
    refused = host_header_refusal(uri, resp.status_code, resp.text)
    if refused is not None:
        raise refused
    if resp.status_code in (401, 403):
        raise TrackingAuthError(_refusal(uri, resp.status_code, auth, bool(headers)))
    if resp.status_code != 200:
        raise TrackingError(
            f"{uri} does not answer like an MLflow tracking server (HTTP {resp.status_code} "
            f"from {url}: {resp.text[:200]!r}). {_FIX}"
        )


def _refusal(uri: str, status: int, auth: tuple[str, str] | None, token: bool) -> str:
    """Why the server said no, from what this process sent, and the fix; never the password."""
    if status == 403 and not (auth or token):
        return (f"the MLflow tracking server at {uri} refused access (HTTP 403) and no credentials were sent: "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_TOKEN are not set. Set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment of every `sweeps run` / "
                "`sweeps worker`.")
    if status == 403:
        who = f"user {auth[0]!r}" if auth else "the token in MLFLOW_TRACKING_TOKEN"
        return (f"the MLflow tracking server at {uri} refused access (HTTP 403): {who} is signed in but "
                "may not use it. Have an MLflow admin grant it permission (a study needs to create "
                "experiments and runs), or use other credentials.")
    if token:
        sent = "the token in MLFLOW_TRACKING_TOKEN was rejected"
    elif auth:
        sent = (f"user {auth[0]!r} and the password in MLFLOW_TRACKING_PASSWORD were rejected"
                + ("" if auth[1] else " (MLFLOW_TRACKING_PASSWORD is not set)"))
    else:
        sent = "no credentials were sent: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_TOKEN are not set"
    return (f"the MLflow tracking server at {uri} requires authentication (HTTP 401): {sent}. Set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (for the docker-compose stack: "
            "the MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD values in .env) in the environment of "
            "every `sweeps run` / `sweeps worker`, or MLFLOW_TRACKING_TOKEN for a token.")
