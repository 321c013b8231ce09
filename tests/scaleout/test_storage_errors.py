"""The Optuna storage's database errors sorted by what the user does next: refused credentials are
bad input (exit 2, as for the MLflow server), and a worker's ``--wait`` waits for a database that
does not answer yet as it waits for the study, instead of failing at once."""
from __future__ import annotations

import optuna
import pytest

from sweeps.backends.optuna_storage import StorageAccessError, open_storage
from sweeps.backends.optuna_worker import join_study
from sweeps.errors import StudyStateError
from sweeps.spec.load import load_spec
from tests.sweeps.study_helpers import cli_in_process, write_spec


def test_a_worker_waits_for_a_database_that_does_not_answer(tmp_path, free_port, caplog):
    spec = load_spec(str(write_spec(tmp_path, name="nodb", storage=f"postgresql://sweeps@127.0.0.1:{free_port}/x")))
    with pytest.raises(StudyStateError) as err:
        join_study(spec, wait_s=1.0)
    message = str(err.value)
    assert "no database answers at 'postgresql://sweeps@127.0.0.1" in message and "after waiting 1 s" in message
    assert any("waiting up to 1 s" in r.getMessage() and "no database answers" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.mark.postgres
def test_refused_database_credentials_exit_2(tmp_path, pg_admin):
    url = "postgresql://no_such_sweeps_user@127.0.0.1:5432/test"
    spec = write_spec(tmp_path, name="badrole", storage=url)
    with pytest.raises(StorageAccessError) as err:
        open_storage(load_spec(str(spec)))
    assert err.value.exit_code == 2 and "refused these credentials" in str(err.value) and "PGPASSWORD" in str(err.value)
    proc = cli_in_process(tmp_path, "worker", str(spec), "--wait", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'role "no_such_sweeps_user" does not exist' in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.postgres
def test_a_process_opening_a_new_database_while_another_creates_its_tables_opens_it(tmp_path, fresh_db):
    """Workers started together on a new database each create Optuna's tables: PostgreSQL lets one
    CREATE TABLE through and answers the other, blocked behind it, with a unique violation on its
    catalog. The loser finds the tables made and opens the storage. The race is set up exactly:
    another transaction holds the new tables uncommitted until this process waits behind it."""
    import threading

    import sqlalchemy
    from optuna.storages._rdb import models

    url = fresh_db()
    spec = load_spec(str(write_spec(tmp_path, name="race", storage=url)))
    engine = sqlalchemy.create_engine(url)
    opened: list[object] = []
    with engine.connect() as other:
        with other.begin():
            models.BaseModel.metadata.create_all(other)
            pid = other.execute(sqlalchemy.text("SELECT pg_backend_pid()")).scalar_one()
            opener = threading.Thread(target=lambda: opened.append(_open_or_error(spec)))
            opener.start()
            with engine.connect() as watch:  # until this process's CREATE TABLE waits for the transaction
                query = sqlalchemy.text("SELECT count(*) FROM pg_locks l JOIN pg_locks h ON h.pid = :pid AND "
                                        "h.granted AND NOT l.granted AND l.transactionid = h.transactionid")
                while not watch.execute(query, {"pid": pid}).scalar_one():
                    watch.rollback()
                    opener.join(0.05)
                    assert opener.is_alive(), opened
        opener.join()
    engine.dispose()
    storage = opened[0]
    assert not isinstance(storage, Exception), storage
    study_id = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "race")
    assert storage.get_study_name_from_id(study_id) == "race"


def _open_or_error(spec):
    try:
        return open_storage(spec)
    except Exception as exc:  # noqa: BLE001 - the test reads what the opener got
        return exc
