"""The lock around "count the budget, then ask" that keeps parallel Optuna workers from
overshooting a study's total budget."""
from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy

from sweeps.backends import optuna_outage
from sweeps.backends.optuna_study import journal_file, sqlalchemy_url
from sweeps.spec.model import StudySpec
from sweeps.store_urls import redact_url


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
        engine = sqlalchemy.create_engine(sqlalchemy_url(url), poolclass=sqlalchemy.pool.NullPool)
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
