"""The Optuna storage of a spec: opened, its errors told apart, and its ask lock.

Storage: a journal file under ``runs/`` by default (safe for parallel local workers, unlike a
shared SQLite file), or any RDB URL. On RDB storage, Optuna's heartbeat and stale-trial retry are
on, so a worker machine that dies has its trial failed and requeued
(:class:`~sweeps.backends.optuna_recovery.StaleTrialCallback`). A database that cannot be opened
is sorted by what the user does next: the server refused these credentials (bad input, exit 2,
as for the MLflow server), it does not answer (a worker's ``--wait`` waits for it as for the
study), or anything else.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import RDBStorage
from sqlalchemy.pool import NullPool

from sweeps.backends import optuna_adapter, optuna_outage
from sweeps.backends.journal_file import open_journal
from sweeps.backends.optuna_recovery import StaleTrialCallback
from sweeps.errors import BackendError, PathError, StudyStateError
from sweeps.spec.model import StudySpec
from sweeps.store_urls import redact_url

HEARTBEAT_S = 10  # RDB storage: how often a worker is expected to record a heartbeat, and...
GRACE_S = 40  # ...a RUNNING trial silent longer than this is failed and requeued by any other worker
ENV_HEARTBEAT, ENV_GRACE = "SWEEPS_HEARTBEAT_S", "SWEEPS_GRACE_S"  # override both (whole seconds)
_CREATE_TRIES = 3  # opening a new database: each try after the first follows another process's creation

optuna.logging.set_verbosity(optuna.logging.WARNING)
# The retry callback and its helpers are marked experimental since Optuna 2.8 but are stable
# in practice; the warning would otherwise print once per worker and per trial.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
# Workers ask/tell instead of Study.optimize and record the heartbeat themselves (optuna_worker).
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

# What libpq and PostgreSQL say (psycopg 2 and 3 alike) when the credentials are refused.
_REFUSED = ("password authentication failed", "no password supplied", "authentication failed",
            "pg_hba.conf", "permission denied for database")


class StorageAccessError(BackendError):
    """The database refused the credentials (user, password) in the storage URL and PGPASSWORD."""

    exit_code = 2


class StorageUnreachableError(BackendError):
    """No database answers at the storage URL's host and port (yet)."""


def open_storage(spec: StudySpec, create: bool = True, pooled: bool = True) -> optuna.storages.BaseStorage:
    """Open the spec's storage. ``create=False`` (read-only commands) refuses to create a
    journal file or database tables that are not there yet. ``pooled=False``: a database
    connection only while a call runs (a caller that calls every few seconds should not hold
    one of the server's connections between calls)."""
    url = spec.storage_url()
    if spec.is_rdb_storage():
        heartbeat_s, grace_s = heartbeat_settings()
        outage = optuna_outage.outage_wait(redact_url(url))  # waited out once this process has used it

        def rdb_storage() -> RDBStorage:
            return RDBStorage(
                sqlalchemy_url(url), engine_kwargs={"pool_pre_ping": True} if pooled else {"poolclass": NullPool},
                skip_table_creation=not create,
                heartbeat_interval=heartbeat_s, grace_period=grace_s,
                heartbeat_stale_trial_callback=StaleTrialCallback(spec.tracking_store_uri()),
            )

        try:
            rdb = outage.call(lambda: _created_by_one(rdb_storage))
            return optuna_adapter.outage_tolerant(rdb, outage)
        except optuna_outage.StorageUnavailable:
            raise
        except Exception as exc:  # sqlalchemy raises many types; all mean "cannot use this storage"
            raise storage_error(url, exc) from exc
    path = journal_file(spec)
    if not create and not path.exists():
        ran_in = _folder_it_ran_in(spec)
        if ran_in is not None:  # run from another folder: starting it here would start a second study
            raise StudyStateError(f"storage: {url} is not in this folder ({Path.cwd()}) but in {ran_in}: the "
                                  f"spec's paths are relative to the folder a command runs in; cd {ran_in} and "
                                  "run the command again")
        raise StudyStateError(f"storage: {url} does not exist, so study {spec.name!r} has not run yet; "
                              f"start it with: sweeps run {spec.path or '<spec>'}")
    if create:
        make_folder(path.parent, f"storage: {url}")
    return open_journal(path, create=create)


def _created_by_one(open_rdb: Callable[[], RDBStorage]) -> RDBStorage:
    """``open_rdb()``, again when another process created the same tables meanwhile: processes
    started together on a new database each create Optuna's tables (and stamp its schema
    version), and PostgreSQL answers the one that waited behind another's CREATE with a unique
    violation. The tables are there then, and the next try finds them."""
    for _ in range(_CREATE_TRIES - 1):
        with contextlib.suppress(sqlalchemy.exc.IntegrityError):
            return open_rdb()
    return open_rdb()


def _folder_it_ran_in(spec: StudySpec) -> Path | None:
    """The folder holding the spec's relative journal: the spec file's own folder or one above it
    (``studies/x.yaml`` run from the repository root), when it is not the working folder."""
    relative = Path(spec.storage_url())
    if spec.path is None or relative.is_absolute():
        return None
    for folder in Path(os.path.abspath(spec.path)).parents:
        if (folder / relative).is_file() and folder != Path.cwd():
            return folder
    return None


def journal_file(spec: StudySpec) -> Path:
    """The spec's journal file, absolute: Optuna's lock links to the path it is given, and a
    relative one dangles from the link's own folder (see journal_file.py)."""
    return Path(os.path.abspath(spec.storage_url()))


def make_folder(folder: Path, what: str) -> None:
    """mkdir -p, or a clear error naming the folder (a file in the way, no permission, a full disk)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))
    except OSError as exc:
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        why = (f"{blocker} is a file, not a folder" if blocker is not None
               else f"{exc.strerror or type(exc).__name__}")
        raise PathError(f"{what}: cannot create or write the folder {folder} ({why}); make it a "
                              "writable folder, or point the spec at another path") from exc


def heartbeat_settings() -> tuple[int, int]:
    """(heartbeat interval, grace period) in seconds for RDB storage: HEARTBEAT_S / GRACE_S,
    or the SWEEPS_HEARTBEAT_S / SWEEPS_GRACE_S environment variables (whole seconds >= 1).
    Every process of one study should use the same values."""
    values = []
    for name, default in ((ENV_HEARTBEAT, HEARTBEAT_S), (ENV_GRACE, GRACE_S)):
        text = os.environ.get(name, "").strip() or str(default)
        if not text.isdigit() or int(text) < 1:
            raise BackendError(f"{name}={text!r} is not a whole number of seconds >= 1; unset it to use "
                               f"the default {default}, or set e.g. {name}={default}")
        values.append(int(text))
    return values[0], values[1]


def sqlalchemy_url(url: str) -> str:
    """``postgresql://`` with an installed driver: SQLAlchemy 2.1 maps the bare scheme to
    psycopg 3, while the project installs psycopg2; an explicit ``+driver`` is kept as given."""
    if (url.startswith("postgresql://") and importlib.util.find_spec("psycopg") is None
            and importlib.util.find_spec("psycopg2") is not None):
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def storage_error(url: str, exc: BaseException) -> BackendError:
    """The error to raise for ``exc`` opening the storage ``url`` (password masked)."""
    cause, shown = optuna_outage.root_cause(exc), redact_url(url)
    text = cause.lower()
    if any(s in text for s in _REFUSED) or ("role" in text and "does not exist" in text):
        return StorageAccessError(f"storage: the database at {shown!r} refused these credentials ({cause}). Set "
                                  "PGPASSWORD to the password of the URL's user (the URL holds no password), or fix "
                                  "the user in storage")
    if optuna_outage.classify(exc) == optuna_outage.TRANSIENT:
        return StorageUnreachableError(f"storage: no database answers at {shown!r} ({cause}); start it, or fix "
                                       "the host and port in storage")
    return BackendError(f"storage: cannot open {shown!r} ({cause}); check the URL, the server and the credentials")


@contextlib.contextmanager
def ask_lock(spec: StudySpec) -> Iterator[None]:
    """Serialise "count the budget, then ask" across workers, so the total never overshoots.

    Journal storage: an flock next to the journal (all its workers share this machine).
    PostgreSQL: a session advisory lock, which holds across machines. Other RDBs: none
    (overshoot is then bounded by the trials already running)."""
    url = spec.storage_url()
    if not spec.is_rdb_storage():
        lock_path = Path(f"{journal_file(spec)}.asklock")  # not ".lock": Optuna's own journal lock uses that name
        with open(lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    if url.startswith("postgresql"):
        engine = sqlalchemy.create_engine(sqlalchemy_url(url), poolclass=NullPool)
        key = int.from_bytes(spec.name.encode()[:8].ljust(8, b"\0"), "big") & 0x7FFFFFFFFFFFFFFF
        outage = optuna_outage.outage_wait(redact_url(url))

        def locked() -> sqlalchemy.Connection:
            conn = engine.connect()
            try:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            except BaseException:
                conn.close()
                raise
            return conn

        conn = outage.call(locked)
        try:
            yield
        finally:
            try:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            except sqlalchemy.exc.DBAPIError as exc:  # the connection died: its session's lock went with it
                if optuna_outage.classify(exc) != optuna_outage.TRANSIENT:
                    raise
            finally:
                conn.close()
                engine.dispose()
        return
    yield
