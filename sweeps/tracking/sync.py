"""Reaching the tracking store: the fail-fast connection check run before any training,
and ``sync_spool``, which sends what a sweep spooled while the store was down
(``sweeps sync-tracking --uri URI --spool DIR``).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sweeps.durations import env_seconds
from sweeps.errors import TrackingError, TrackingPathError
from sweeps.interruptible import interrupted_by_signals
from sweeps.store_urls import RDB_DIALECTS, sqlite_path
from sweeps.tracking.local_runs import is_local
from sweeps.tracking.send import COUNT_KEYS, StoreRefusesEveryWrite, drain
from sweeps.tracking.spool import Spool, store_key
from sweeps.tracking.store_access import TrackingAuthError, host_header_refusal, http_credentials, sqlite_locked_error
from sweeps.tracking.store_errors import disk_full_error, is_transient, store_folder

log = logging.getLogger(__name__)


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


def is_database_uri(uri: str) -> bool:
    """A SQLAlchemy URL (``postgresql+psycopg2://...``), which MLflow opens with its SQL store."""
    return uri.split(":", 1)[0].split("+", 1)[0] in RDB_DIALECTS


def apply_fast_fail_http_defaults() -> None:
    """Make MLflow's HTTP client give up in seconds. MLflow reads these variables on
    every request and has no per-client setting, so this is process-wide; setdefault
    keeps any value the user set explicitly."""
    for name, value in _FAST_FAIL_HTTP_ENV.items():
        os.environ.setdefault(name, value)


ENV_RETRY_S = "SWEEPS_TRACKING_RETRY_S"
RETRY_S = 30.0  # after a failed write, how long a tracker spools without trying the store


def retry_seconds() -> float:
    """How long a tracker leaves an unreachable store alone (``SWEEPS_TRACKING_RETRY_S``, default 30)."""
    return env_seconds(ENV_RETRY_S, RETRY_S)


def sync_command(tracking_uri: str, spool_dir: str | Path) -> str:
    """The command that sends a spool later; quoted in warnings and errors."""
    return f"sweeps sync-tracking --uri {tracking_uri} --spool {spool_dir}"


def kept_until_fixed(tracking_uri: str, spool_dir: str | Path, exc: BaseException) -> TrackingError:
    """The one line for a store that refuses every write (``send.StoreRefusesEveryWrite``), whose
    writes wait in the spool ``spool_dir``."""
    return TrackingError(f"MLflow tracking store {tracking_uri} {exc}; the writes are kept in {spool_dir}: once "
                         f"it is fixed, send them with: {sync_command(tracking_uri, spool_dir)}")


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


def sync_spool(tracking_uri: str, spool_dir: str | Path, client: Any = None) -> dict:
    """Send every run's spooled writes to the store at ``tracking_uri``, oldest spool
    first, each run's writes in order; called by ``sweeps sync-tracking``.

    Raises TrackingError (before sending anything) when the store cannot be reached.
    Returns::

        {"runs": {run_id: {"metrics": n, "params": n, "tags": n, "artifacts": n, "inputs": n,
                           "models": n, "statuses": n, "drained": bool}},
         "totals": {"metrics": n, ...},
         "refused": [one line per write the store refused (dropped: it never would accept it)],
         "failed": {run_id: reason}   # run unknown to this store, or the store went
                                      # away mid-sync: the spool is kept, run again later
        }

    Safe to run again, and safe to interrupt: progress is committed per batch.
    """
    from mlflow.tracking import MlflowClient

    if is_http_uri(tracking_uri):
        apply_fast_fail_http_defaults()
    spool = Spool(spool_dir)
    if not spool.directory.is_dir():
        raise TrackingError(
            f"no spool folder at {str(spool.directory)!r}: nothing to send. Pass the folder the "
            f"sweep's warning named (the default is runs/.mlflow_spool)."
        )
    made: list[Any] = [client]

    def get_client() -> Any:
        if made[0] is None:
            made[0] = MlflowClient(tracking_uri=tracking_uri)
        return made[0]

    check_store(tracking_uri, get_client)
    client = get_client()
    totals = dict.fromkeys(COUNT_KEYS, 0)
    result: dict[str, Any] = {"runs": {}, "totals": totals, "refused": [], "failed": {}}
    for run_id in spool.run_ids():
        stamped = spool.store_of(run_id)
        if is_local(run_id) and stamped is not None and stamped != store_key(tracking_uri):
            # Not yet on any store: only the store it was made for can say it is the wrong one.
            result["failed"][run_id] = f"run {run_id} was made for the store {stamped}, not {store_key(tracking_uri)}"
            log.error("%s; its spool is kept (sync it with --uri set to that store)", result["failed"][run_id])
            continue
        try:
            # A run the store does not know means the wrong --uri: every write would be
            # refused and dropped, so keep the spool and say so instead. A run made during an
            # outage (a local id) is created by the drain, exactly once.
            if not is_local(run_id):
                client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - whatever the store answers, this run cannot be synced there
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            reason = f"run {run_id} not found at {tracking_uri} ({first}): is --uri the store the sweep used?"
            result["failed"][run_id] = reason
            log.error("%s; its spool is kept", reason)
            continue
        try:
            counts, refusals, drained = drain(spool, client, run_id)
        except StoreRefusesEveryWrite as exc:  # so would every other run's: one line, at once
            raise TrackingError(f"MLflow tracking store {tracking_uri} {exc}; nothing more was sent") from exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            result["failed"][run_id] = f"{type(exc).__name__}: {exc}"
            log.warning("sync of run %s stopped, the store failed (%s); run the sync again", run_id, exc)
            continue
        for key, n in counts.items():
            totals[key] += n
        result["runs"][run_id] = {**{k: counts.get(k, 0) for k in totals}, "drained": drained}
        result["refused"].extend(refusals)
        for line in refusals:
            log.error("%s", line)
    return result


def artifact_root_uri(root: str | Path | None) -> str | None:
    """Where experiments a tracker creates keep artifacts: a URI as given, a local folder absolute."""
    if root is None:
        return None
    text = str(root)
    if "://" in text or text.startswith(("mlflow-artifacts:", "file:")):
        return text.rstrip("/")
    return str(Path(text).resolve())  # a relative root would depend on the worker's cwd
