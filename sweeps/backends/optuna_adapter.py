"""The one module of sweeps that touches Optuna's private API (names starting with ``_``).

Optuna may rename or drop a private name in any release, without a deprecation warning.
Keeping every such use here makes an upgrade a review of one short file: re-check each
function below against the new Optuna's source, then update :data:`OPTUNA_CHECKED`
(tests/sweeps/backends/test_optuna_adapter.py fails until then, and a static test there
fails if any other module of sweeps/ or dashboards/ reaches into Optuna's privates).

Each function says what it does and why Optuna's public API does not do it. Callers get
plain storage objects and ids back and use the public storage API (``BaseStorage``'s
methods) with them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, RDBStorage, _CachedStorage
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled
from optuna.storages._rdb import models
from optuna.storages.journal._file import LOCK_FILE_SUFFIX
from optuna.storages.journal._storage import JournalOperation
from optuna.trial import FrozenTrial

from sweeps.backends.optuna_outage import OutageWait, StorageUnavailable, classify, permanent_message
from sweeps.errors import BackendError

OPTUNA_CHECKED = "5.1.0"  # the Optuna version every function below was read against

# The suffix of the symlink lock Optuna's journal file backend (JournalFileSymlinkLock) puts
# next to the journal. sweeps takes and clears the same link (journal_file.JournalLock), so a
# plain Optuna process appending to a sweeps journal waits for sweeps; Optuna exports the
# lock class, not the name of its link.
JOURNAL_LOCK_SUFFIX: str = LOCK_FILE_SUFFIX
# The record kinds (``op_code``) this Optuna's journal reader replays; it stops on any other with
# a bare ``AssertionError``, so sweeps checks each record's kind before Optuna reads the file.
JOURNAL_OP_CODES: frozenset[int] = frozenset(int(op) for op in JournalOperation)

AnyTrial = optuna.Trial | FrozenTrial


def storage_of(study: optuna.Study) -> BaseStorage:
    """The storage a study reads and writes (for RDB, Optuna's caching wrapper around it).

    ``Study`` has no public accessor for it (only a live ``Trial`` has ``trial.storage``), yet
    failing another process's trial, recording a heartbeat and reading a trial's latest stored
    state are storage calls. Reopening the storage from the spec instead would mean a second
    connection pool (RDB) or a second in-memory replay of the journal per call."""
    return study._storage


def trial_id_of(trial: AnyTrial) -> int:
    """The storage's id of a trial (a ``Trial`` or a ``FrozenTrial``), which every
    ``BaseStorage`` trial method takes; ``trial.number`` counts within the study only.

    The public route, ``storage.get_trial_id_from_study_id_trial_number(
    storage.get_study_id_from_name(name), number)``, costs two storage round trips, and a
    worker needs the id for the heartbeat it records every second."""
    return trial._trial_id


def stored_trial(study: optuna.Study, trial: AnyTrial) -> FrozenTrial:
    """The trial as the storage has it now. A ``Trial`` caches its frozen copy and a
    ``FrozenTrial`` is a snapshot; after another process may have written to the trial (failed
    it as stale, say), only the storage knows its state."""
    return storage_of(study).get_trial(trial_id_of(trial))


def heartbeat_enabled(study: optuna.Study) -> bool:
    """Whether the study's storage records heartbeats (RDB storage opened with a heartbeat
    interval). Optuna's own check (``is_heartbeat_enabled``) lives in a private module; using it
    keeps our answer the one Optuna acts on (``study.ask`` warns, ``fail_stale_trials`` runs)."""
    return is_heartbeat_enabled(storage_of(study))


def heartbeat_grace_seconds(study: optuna.Study) -> int:
    """Silence after which a RUNNING trial of a heartbeat-enabled study counts as stale.

    The caches in front of an ``RDBStorage`` (Optuna's ``_CachedStorage``, sweeps'
    :class:`OutageTolerantStorage`) forward the heartbeat interval but not the grace period; the
    ``RDBStorage`` they wrap has both as public attributes. ``None`` as grace period means twice
    the interval (RDBStorage's rule)."""
    rdb = rdb_of(storage_of(study))
    assert rdb is not None and rdb.heartbeat_interval is not None, "the study's storage records no heartbeats"
    return rdb.grace_period or 2 * rdb.heartbeat_interval


def stale_trial_ids(study: optuna.Study) -> list[int]:
    """Storage ids of the study's RUNNING trials whose heartbeat is older than the grace period.

    The public ``optuna.storages.fail_stale_trials`` fails them and runs the stale-trial
    callback in one go, and returns nothing: sweeps must record why each trial failed (and that
    it was not the trial's fault) before the callback copies the trial into its retry, and must
    know which trials this process failed. Only heartbeat-enabled storages answer."""
    return _heartbeat_storage(study)._get_stale_trial_ids(study._study_id)


def never_beaten_trial_ids(study: optuna.Study) -> list[int]:
    """Storage ids of the study's RUNNING trials that have never recorded a heartbeat.

    Optuna's stale check skips them, so a worker that dies between asking for a trial and its
    first beat (a storage outage there stops it) leaves the trial RUNNING for good and the study
    one trial short. The heartbeat table is not in Optuna's public API."""
    storage, rdb = storage_of(study), rdb_of(storage_of(study))
    if rdb is None or rdb.heartbeat_interval is None:
        return []
    if isinstance(storage, OutageTolerantStorage):
        return storage.never_beaten_trial_ids(study._study_id)
    return _never_beaten(rdb, study._study_id)


def _never_beaten(rdb: RDBStorage, study_id: int) -> list[int]:
    trial, beat = models.TrialModel, models.TrialHeartbeatModel
    query = (sqlalchemy.select(trial.trial_id)
             .outerjoin(beat, beat.trial_id == trial.trial_id)
             .where(trial.study_id == study_id, trial.state == optuna.trial.TrialState.RUNNING,
                    beat.trial_heartbeat_id.is_(None)))
    with rdb.engine.connect() as conn:
        return [row[0] for row in conn.execute(query)]


def stale_trial_callback(study: optuna.Study) -> Callable[[optuna.Study, FrozenTrial], None] | None:
    """The callback a heartbeat-enabled study's storage runs for each trial it fails as stale."""
    return _heartbeat_storage(study).get_heartbeat_stale_trial_callback()


def heartbeat_interval_seconds(study: optuna.Study) -> int:
    """How often a heartbeat-enabled study's trials are to beat."""
    return _heartbeat_storage(study).get_heartbeat_interval() or 1


def record_heartbeat(study: optuna.Study, trial_id: int) -> None:
    """Records that ``trial_id`` is alive, as ``Study.optimize`` does for its own trials; a
    worker that runs trials through ask/tell must do it itself."""
    _heartbeat_storage(study).record_heartbeat(trial_id)


def _heartbeat_storage(study: optuna.Study) -> BaseHeartbeat:
    """The storage of a heartbeat-enabled study (``RDBStorage`` or the cache around it), as
    Optuna's heartbeat interface."""
    return cast(BaseHeartbeat, storage_of(study))


# ---- an RDB storage that waits out an outage -----------------------------------------------------
def outage_tolerant(rdb: RDBStorage, outage: OutageWait) -> BaseStorage:
    """``rdb`` behind Optuna's own cache (what ``optuna.create_study`` would put in front of it),
    every call of both interfaces (``BaseStorage``, ``BaseHeartbeat``) through ``outage``: a study
    opened on it waits out a database restart instead of raising ``StorageInternalError``."""
    return OutageTolerantStorage(_CachedStorage(rdb), rdb, outage)


def rdb_of(storage: BaseStorage) -> RDBStorage | None:
    """The ``RDBStorage`` under a storage sweeps opened (None for a journal): its engine to
    dispose of, its grace period to read."""
    if isinstance(storage, OutageTolerantStorage):
        return storage.rdb
    if isinstance(storage, _CachedStorage):
        return storage._backend
    return storage if isinstance(storage, RDBStorage) else None


def _forwarded(name: str) -> Callable[..., Any]:
    def call(self: OutageTolerantStorage, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    call.__name__ = name
    return call


class OutageTolerantStorage(BaseStorage, BaseHeartbeat):
    """Forwards each storage call to Optuna's cached RDB storage through an :class:`OutageWait`.
    A permanent database error becomes one clear :class:`BackendError`."""

    def __init__(self, cached: BaseStorage, rdb: RDBStorage, outage: OutageWait) -> None:
        self.cached, self.rdb, self.outage = cached, rdb, outage

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(getattr(self.cached, name), *args, **kwargs)

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return self.outage.call(fn, *args, **kwargs)
        except StorageUnavailable:
            raise
        except Exception as exc:
            if classify(exc) is None:
                raise  # Optuna's own answer (no such study, a finished trial): the caller's to handle
            raise BackendError(permanent_message(self.outage.where, exc)) from exc

    # Every call of BaseStorage and BaseHeartbeat that reaches the database.
    create_new_study = _forwarded("create_new_study")
    delete_study = _forwarded("delete_study")
    set_study_user_attr = _forwarded("set_study_user_attr")
    set_study_system_attr = _forwarded("set_study_system_attr")
    get_study_id_from_name = _forwarded("get_study_id_from_name")
    get_study_name_from_id = _forwarded("get_study_name_from_id")
    get_study_directions = _forwarded("get_study_directions")
    get_study_user_attrs = _forwarded("get_study_user_attrs")
    get_study_system_attrs = _forwarded("get_study_system_attrs")
    get_all_studies = _forwarded("get_all_studies")
    create_new_trial = _forwarded("create_new_trial")
    set_trial_param = _forwarded("set_trial_param")
    get_trial_id_from_study_id_trial_number = _forwarded("get_trial_id_from_study_id_trial_number")
    get_trial_number_from_id = _forwarded("get_trial_number_from_id")
    get_trial_param = _forwarded("get_trial_param")
    set_trial_state_values = _forwarded("set_trial_state_values")
    set_trial_intermediate_value = _forwarded("set_trial_intermediate_value")
    set_trial_user_attr = _forwarded("set_trial_user_attr")
    set_trial_system_attr = _forwarded("set_trial_system_attr")
    get_trial = _forwarded("get_trial")
    get_all_trials = _forwarded("get_all_trials")
    get_n_trials = _forwarded("get_n_trials")
    get_best_trial = _forwarded("get_best_trial")
    get_trial_params = _forwarded("get_trial_params")
    get_trial_user_attrs = _forwarded("get_trial_user_attrs")
    get_trial_system_attrs = _forwarded("get_trial_system_attrs")
    check_trial_is_updatable = _forwarded("check_trial_is_updatable")
    record_heartbeat = _forwarded("record_heartbeat")

    def _beats_missed_lately(self) -> bool:
        """No heartbeat could be recorded during an outage or just after it: silence then is no
        sign of a dead worker, so no trial counts as stale (or never beaten) until a grace period
        has passed."""
        return self.outage.quiet_for(self.rdb.grace_period or 2 * (self.rdb.heartbeat_interval or 1))

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        return [] if self._beats_missed_lately() else self._call("_get_stale_trial_ids", study_id)

    def never_beaten_trial_ids(self, study_id: int) -> list[int]:
        return [] if self._beats_missed_lately() else self._guarded(_never_beaten, self.rdb, study_id)

    def remove_session(self) -> None:
        self.cached.remove_session()

    def get_heartbeat_interval(self) -> int | None:
        return self.rdb.get_heartbeat_interval()

    def get_heartbeat_stale_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        return self.rdb.get_heartbeat_stale_trial_callback()

    def get_failed_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        return self.rdb.get_failed_trial_callback()
