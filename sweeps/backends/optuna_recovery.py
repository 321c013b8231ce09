"""Recovery of trials whose process died: close their MLflow runs, fail and requeue them; and of
trials that ran out of memory: retried at half the batch.

Used by the orchestrator for orphans on journal storage (``sweeps run`` holds the run lock,
so every RUNNING trial is an orphan) and by Optuna's heartbeat on RDB storage
(:func:`fail_stale_trials`, which every worker and the stale-trial monitor call).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import optuna
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from sweeps.backends import optuna_adapter
from sweeps.backends.optuna_attrs import (
    ATTR_BATCH_OVERRIDES,
    ATTR_PARENT_RUN,
    ATTR_REASON,
    ATTR_RUN_ID,
    ATTR_WORKER,
    MAX_RETRIES,
)
from sweeps.parent_run import running_children
from sweeps.spec.model import StudySpec
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle
from sweeps.tracking.mlflow_tracker import MlflowTracker
from sweeps.tracking.reader import TrackingReader

log = logging.getLogger("sweeps")


class StaleTrialCallback:
    """Called for a trial whose worker died: closes its MLflow run as FAILED with the
    reason, then requeues its parameters (Optuna's retry callback, which keeps the user
    attributes, so the retry finds the original's checkpoint folder and resumes)."""

    def __init__(self, tracking_uri: str, tracker=None) -> None:
        self.tracking_uri, self._tracker = tracking_uri, tracker
        self._retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.close_runs(study, trial)
        self.requeue(study, trial)

    def close_runs(self, study: optuna.Study, trial: FrozenTrial) -> None:
        reason = trial.user_attrs.get(ATTR_REASON) or "worker heartbeat lost (the worker died); requeued"
        close_trial_runs(self._get_tracker(), study, trial, reason)

    def requeue(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._retry(study, trial)

    def _get_tracker(self):
        if self._tracker is None:
            self._tracker = MlflowTracker(self.tracking_uri)
        return self._tracker


def _close_run(tracker, run_id: str, reason: str) -> None:
    run = RunHandle(run_id, "", "")
    tracker.log(run, tags={layout.TAG_STATE: "FAIL", layout.TAG_ERROR: reason})
    tracker.end_run(run, "FAILED")


def close_trial_runs(tracker, study: optuna.Study, trial: FrozenTrial, reason: str) -> None:
    """Close as FAILED the MLflow runs of a trial whose process died: the run the trial records,
    and any other RUNNING run under the study's run tagged with its number. A process killed
    after making the run but before the study recorded its id leaves one that only the tag names
    (the trial's number is its own: no other process makes a run under it)."""
    run_id = trial.user_attrs.get(ATTR_RUN_ID)
    if run_id:
        _close_run(tracker, run_id, reason)
    parent = study.user_attrs.get(ATTR_PARENT_RUN)
    if not parent:
        return
    try:
        unnamed = running_children(TrackingReader(tracker.tracking_uri), parent, trial.number)
    except Exception as exc:  # noqa: BLE001 - the store is away: the run the trial names is closed (spooled)
        log.warning("trial %d: cannot look for its other runs (%s); a run it made may stay RUNNING",
                    trial.number, exc)
        return
    for found, client_id in unnamed:
        if run_id not in (found, client_id):
            _close_run(tracker, found, reason)


def close_orphan_runs(tracker, study: optuna.Study) -> None:
    """Trial runs still RUNNING in MLflow whose trial is not running (killed between the
    MLflow write and the study write): closed as FAILED, so no run stays RUNNING forever."""
    parent = study.user_attrs.get(ATTR_PARENT_RUN)
    if not parent:
        return
    running_ids = {t.user_attrs.get(ATTR_RUN_ID)
                   for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))} - {None}
    for run_id, client_id in running_children(TrackingReader(tracker.tracking_uri), parent):
        if run_id not in running_ids and client_id not in running_ids:
            _close_run(tracker, run_id, "orphaned: the process running this trial died")


def _set_failed(storage: BaseStorage, trial_id: int, reason: str, interrupted: bool) -> bool:
    """Record why, and whether it was not the trial's fault (``interrupted``: it then does not
    count toward budget.max_failures), then FAIL the trial; False when it had already finished."""
    try:
        storage.set_trial_user_attr(trial_id, ATTR_REASON, reason)
        if interrupted:
            storage.set_trial_user_attr(trial_id, "interrupted", True)
        return storage.set_trial_state_values(trial_id, TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False


def fail_trial(study: optuna.Study, t: FrozenTrial, reason: str, requeue: bool, tracker=None,
               tracking_uri: str | None = None, interrupted: bool = False,
               lock: Callable[[], AbstractContextManager] = nullcontext) -> bool:
    """Fail another process's RUNNING trial with a reason, close its MLflow run, and
    optionally requeue its parameters. ``interrupted``: stopped by the user or the timeout,
    not the trial's fault (it does not count toward budget.max_failures). Returns False,
    doing nothing, when the trial has already finished: on RDB storage a stale-trial check
    (this process's monitor, or another machine's) may have failed and requeued it first.

    ``lock`` is the study's ask lock (``optuna_storage.ask_lock``), held from the FAIL to the
    requeue, as :func:`fail_stale_trials` holds it: a worker that counted the budget in between
    would take a new trial in the retry's place. The MLflow run is closed after it."""
    # Through the storage: the trial is another process's, so there is no Trial object to set it on.
    storage, trial_id = optuna_adapter.storage_of(study), optuna_adapter.trial_id_of(t)
    callback = StaleTrialCallback(tracking_uri or "", tracker)
    with lock():
        if not _set_failed(storage, trial_id, reason, interrupted):
            return False
        frozen = storage.get_trial(trial_id)
        if requeue:
            callback.requeue(study, frozen)
    if requeue:
        callback.close_runs(study, frozen)
    elif tracker is not None or tracking_uri:
        close_trial_runs(tracker or callback._get_tracker(), study, frozen, reason)
    return True


# RUNNING trials without a heartbeat, by (storage URL, study name, trial id): when this process first
# saw each so. A worker records a trial's first beat right after asking for it, so one still without
# a beat a whole grace period later, by this process's clock, lost its worker in between; whatever
# the machines' clocks say, and whether or not the storage has an ask lock (PostgreSQL's only).
_NEVER_BEATEN_SINCE: dict[tuple[str, str, int], float] = {}
_NEVER_BEATEN_LOCK = threading.Lock()


def _never_beaten_for(study: optuna.Study, grace: float) -> list[int]:
    """The study's trials that have had no heartbeat for as long as this process has looked, and it
    has looked for at least ``grace`` seconds."""
    found = optuna_adapter.never_beaten_trial_ids(study)
    rdb = optuna_adapter.rdb_of(optuna_adapter.storage_of(study))
    where = (rdb.url if rdb is not None else "", study.study_name)
    now = time.monotonic()
    with _NEVER_BEATEN_LOCK:
        for key in [k for k in _NEVER_BEATEN_SINCE if k[:2] == where and k[2] not in found]:
            del _NEVER_BEATEN_SINCE[key]  # it beat, or it ended
        since = [_NEVER_BEATEN_SINCE.setdefault((*where, trial_id), now) for trial_id in found]
    return [trial_id for trial_id, first in zip(found, since, strict=True) if now - first >= grace]


def fail_stale_trials(study: optuna.Study, lock: Callable[[], AbstractContextManager] = nullcontext) -> list[int]:
    """``optuna.storages.fail_stale_trials``, with the reason recorded on each trial first:
    RUNNING trials whose worker has been silent for longer than the grace period are failed
    (once, whichever worker gets there first), then StaleTrialCallback closes their MLflow
    runs and requeues them. Returns the numbers of the trials this call failed. So are trials
    that have never beaten while this process looked for a grace period (their worker died
    between the ask and the first beat: :func:`_never_beaten_for`), read again under the lock.

    ``lock`` is the study's ask lock (``optuna_storage.ask_lock``), held from the FAILs to the
    requeues: a worker that counted the budget in between would find a trial owed, take a new one
    in the retry's place, and leave the retry WAITING past the budget."""
    if not optuna_adapter.heartbeat_enabled(study):
        return []
    grace = optuna_adapter.heartbeat_grace_seconds(study)
    stale, unbeaten = optuna_adapter.stale_trial_ids(study), _never_beaten_for(study, grace)
    if not stale and not unbeaten:
        return []
    storage = optuna_adapter.storage_of(study)
    callback = optuna_adapter.stale_trial_callback(study)
    failed = []
    with lock():
        if unbeaten:
            unbeaten = [i for i in _never_beaten_for(study, grace) if i in unbeaten and i not in stale]
        for trial_id in stale + unbeaten:
            worker = storage.get_trial(trial_id).user_attrs.get(ATTR_WORKER, "?")
            silence = (f"was silent for more than {grace} s" if trial_id in stale
                       else f"recorded no heartbeat for the trial in more than {grace} s")
            reason = (f"heartbeat lost: worker {worker} {silence} (killed, crashed or cut off); failed as stale "
                      f"and requeued (at most {MAX_RETRIES} times) to resume from its last checkpoint")
            if _set_failed(storage, trial_id, reason, interrupted=True):  # False: another worker failed it first
                failed.append(copy.deepcopy(storage.get_trial(trial_id)))
        if isinstance(callback, StaleTrialCallback):
            for trial in failed:
                callback.requeue(study, trial)
    for trial in failed:  # the MLflow store (away, perhaps) is not waited for with the lock held
        if isinstance(callback, StaleTrialCallback):
            callback.close_runs(study, trial)
        elif callback is not None:
            callback(study, trial)
    return [t.number for t in failed]


def enqueue_smaller_batch(spec: StudySpec, study: optuna.Study, failed: FrozenTrial) -> None:
    """Out of memory: retry once at half the batch size with twice the accumulation,
    so the effective batch (and so the learning-rate meaning) stays the same."""
    cfg = spec.resolved_train_config(failed.params)
    if cfg.batch_size < 2:
        return
    overrides = {"batch_size": cfg.batch_size // 2, "grad_accum_steps": cfg.grad_accum_steps * 2}
    if "batch_size" in failed.params:
        log.warning("trial %d ran out of memory with a searched batch_size; retry keeps the sampled value "
                    "in params but trains at %d x %d", failed.number, overrides["batch_size"],
                    overrides["grad_accum_steps"])
    study.enqueue_trial(failed.params, user_attrs={ATTR_BATCH_OVERRIDES: overrides, "oom_retry_of": failed.number},
                        skip_if_exists=False)
