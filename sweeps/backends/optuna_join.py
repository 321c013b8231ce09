"""How a ``sweeps worker`` joins a study that ``sweeps run`` created: it waits for the study and
its MLflow parent run, and checks its MLflow store before its first trial."""
from __future__ import annotations

import logging
import threading
import time

import optuna

from sweeps.backends import optuna_adapter, optuna_storage, optuna_study
from sweeps.backends.optuna_attrs import ATTR_PARENT_RUN
from sweeps.backends.optuna_storage import StorageUnreachableError
from sweeps.errors import BackendError, StudyStateError, cause_chain
from sweeps.spec.model import StudySpec
from sweeps.store_urls import redact_url
from sweeps.tracking.store_checks import check_experiment_writable, is_http_uri

log = logging.getLogger("sweeps")


def check_tracking_before_trials(tracker, experiment: str) -> None:
    """A joining worker's check of its MLflow store, as ``sweeps run`` checks before training: a store
    that does not answer from here (wrong URI, server down, refused credentials, no permission to
    create runs in ``experiment``) is an error, not trials that train through an outage that was
    there from the start, nor a claimed trial whose run is refused. After the study is found:
    a worker refused for want of a study writes nothing (a new SQLite store's file included)."""
    tracker.check_connection()
    if is_http_uri(tracker.tracking_uri):
        check_experiment_writable(tracker.tracking_uri, experiment)


def join_study(spec: StudySpec, wait_s: float, stop: threading.Event | None = None) -> optuna.Study | None:
    """The study of ``spec`` once ``sweeps run`` has created it with its MLflow parent run.

    A worker started first waits (saying so once) up to ``wait_s`` seconds, then fails with
    the command to run. A worker never creates the study: ``sweeps run`` owns its parent run,
    the LR finder and the end-of-study summary. None if ``stop`` is set while waiting."""
    stop = stop or threading.Event()
    give_up = time.monotonic() + max(0.0, wait_s)
    where = redact_url(spec.storage_url())
    said = False
    while True:
        study, missing = _find_study(spec)
        if study is not None and study.user_attrs.get(ATTR_PARENT_RUN):
            if said:
                log.warning("study %r found; joining it", study.study_name)
            return study
        what = missing or f"study {spec.name!r} has no MLflow parent run yet"
        if time.monotonic() >= give_up:
            waited = f" after waiting {wait_s:.0f} s" if wait_s > 0 else ""
            raise StudyStateError(f"{what} in {where}{waited}. Workers join a study that `sweeps run` "
                                  f"created: run `sweeps run {spec.path}` (on any machine that reaches the "
                                  f"storage), or start the worker with a longer --wait")
        if not said:
            log.warning("%s in %s; waiting up to %.0f s for `sweeps run %s` to create it", what, where,
                        wait_s, spec.path)
            said = True
        if stop.wait(min(2.0, max(0.1, give_up - time.monotonic()))):
            return None


def _find_study(spec: StudySpec) -> tuple[optuna.Study | None, str]:
    """(study, "") when it exists; (None, what is missing) while the database does not answer,
    has no tables or no study of that name yet. Any other problem (credentials, a changed search
    space) raises."""
    try:
        storage = optuna_storage.open_storage(spec, create=False)
    except StorageUnreachableError as exc:
        return None, str(exc).removeprefix("storage: ")
    except BackendError as exc:
        if not _tables_missing(exc):
            raise
        return None, "the storage has no Optuna tables yet (no study was ever run on it)"
    try:
        if optuna_study.current_study_name(storage, spec.name) is None:
            return None, f"study {spec.name!r} does not exist yet"
    finally:
        rdb = optuna_adapter.rdb_of(storage)
        if rdb is not None:  # polled every 2 s: do not pile up connection pools
            rdb.engine.dispose()
    return optuna_study.open_study(spec, create=False), ""


def _tables_missing(exc: BaseException) -> bool:
    """Whether the database says it has no Optuna tables (PostgreSQL, SQLite, MySQL), a few causes down."""
    texts = (f"{type(link).__name__} {link}".lower() for link in cause_chain(exc))
    return any("undefinedtable" in text or "no such table" in text or ("relation" in text and "does not exist" in text)
               or ("table" in text and "doesn't exist" in text) for text in texts)
