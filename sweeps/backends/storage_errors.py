"""Why a database-backed Optuna storage cannot be opened, sorted by what the user does next: the
server refused these credentials (bad input, exit 2, as for the MLflow server), or it does not
answer (a worker's ``--wait`` waits for it as for the study), or anything else."""
from __future__ import annotations

from sweeps.errors import BackendError
from sweeps.store_urls import redact_url

# What libpq and PostgreSQL say (psycopg 2 and 3 alike) when the credentials are refused.
_REFUSED = ("password authentication failed", "no password supplied", "authentication failed",
            "pg_hba.conf", "permission denied for database")
_UNREACHABLE = ("connection refused", "could not translate host name", "name or service not known",
                "timeout expired", "could not connect", "no route to host", "network is unreachable",
                "server closed the connection unexpectedly", "the database system is starting up",
                "the database system is shutting down")


class StorageAccessError(BackendError):
    """The database refused the credentials (user, password) in the storage URL and PGPASSWORD."""

    exit_code = 2


class StorageUnreachableError(BackendError):
    """No database answers at the storage URL's host and port (yet)."""


def storage_error(url: str, exc: BaseException) -> BackendError:
    """The error to raise for ``exc`` opening the storage ``url`` (password masked)."""
    root: BaseException = exc
    while root.__cause__ is not None:  # Optuna wraps the database's own message
        root = root.__cause__
    detail = (str(root).strip() or type(root).__name__).splitlines()[0]
    shown = redact_url(url)
    text = f"{type(root).__name__}: {detail}".lower()
    if any(s in text for s in _REFUSED) or ("role" in text and "does not exist" in text):
        return StorageAccessError(f"storage: the database at {shown!r} refused these credentials ({detail}). Set "
                                  "PGPASSWORD to the password of the URL's user (the URL holds no password), or fix "
                                  "the user in storage")
    if any(s in text for s in _UNREACHABLE):
        return StorageUnreachableError(f"storage: no database answers at {shown!r} ({detail}); start it, or fix "
                                       "the host and port in storage")
    return BackendError(f"storage: cannot open {shown!r} ({type(root).__name__}: {detail}); "
                        "check the URL, the server and the credentials")
