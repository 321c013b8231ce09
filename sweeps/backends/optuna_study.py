"""The Optuna study of a spec: its versions, the checks before a resume, its records and budget,
a study that starts from an earlier one or goes on past its budget, and a ``sweeps worker``
joining the study ``sweeps run`` created (it waits for the study and its MLflow parent run, and
checks its MLflow store before its first trial).

``warm_start: {from: STUDY, top: K}`` (sweeps/spec/model.py): a new study's first trials are the K
best completed configurations of the earlier study, enqueued with Optuna's ``enqueue_trial``;
parameters the new search space lacks are dropped and those it adds are left to the sampler (a
partial enqueued trial has its other parameters drawn).

``sweeps run SPEC --add-trials N`` raises the budget of a study that ran by N without editing the
spec: the raised budget is a user attribute of the study, which every process opening the study
(the driver, its workers, status and report) takes over ``budget.n_trials``.
"""
from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from sweeps.backends import optuna_adapter, optuna_recovery
from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.backends.optuna_attrs import (
    ATTR_JUDGED_BY,
    ATTR_N_TRIALS,
    ATTR_PACK,
    ATTR_PARENT_RUN,
    ATTR_REASON,
    ATTR_RUN_ID,
    ATTR_SEARCH,
    ATTR_SPEC_HASH,
    ATTR_STUDY_UID,
    MAX_RETRIES,
)
from sweeps.backends.optuna_sampler import make_pruner, make_sampler
from sweeps.backends.optuna_storage import StorageUnreachableError, open_storage
from sweeps.deploy_check import ATTR_FIGURES, ATTR_REJECTED, constraint_values
from sweeps.errors import BackendError, StudyStateError, cause_chain
from sweeps.spec import search_space as ss
from sweeps.spec.model import StudySpec
from sweeps.spec.objectives import judged_by, judged_by_changes
from sweeps.spec.search_space import CategoricalParam
from sweeps.store_urls import redact_url
from sweeps.tracking.store_checks import check_experiment_writable, is_http_uri

log = logging.getLogger("sweeps")
ATTR_WARM_START = "warm_start_of"  # on an enqueued trial: "<earlier study>#<its trial number>"


# ---- study versions (--fresh) -------------------------------------------------------------
def _versions(storage, name: str) -> list[tuple[int, str]]:
    found = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if s.study_name == name:
            found.append((1, s.study_name))
        m = re.fullmatch(re.escape(name) + r"-v(\d+)", s.study_name)
        if m:
            found.append((int(m.group(1)), s.study_name))
    return sorted(found)


def current_study_name(storage, name: str) -> str | None:
    """The newest version of the study: ``name``, then ``name-v2``, ... after each --fresh."""
    versions = _versions(storage, name)
    return versions[-1][1] if versions else None


def open_study(spec: StudySpec, fresh: bool = False, create: bool = True) -> optuna.Study:
    """Create or load the spec's study (``fresh`` starts a new version and keeps the old).

    A study resumed under the same name with a different search space is refused, naming
    the changed parameters: its trials would not be comparable."""
    storage = open_storage(spec, create=create)
    name = current_study_name(storage, spec.name)
    exists = name is not None and not fresh
    if name is None and not create:
        raise StudyStateError(f"study {spec.name!r} is not in {spec.storage_url()}; run: sweeps run {spec.path}")
    if fresh and name is not None:
        version = _versions(storage, spec.name)[-1][0] + 1
        name = f"{spec.name}-v{version}"
    name = name or spec.name
    directions = spec.directions()
    sampler, pruner = make_sampler(spec), make_pruner(spec)
    if create and not exists:
        study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True, directions=directions,
                                    sampler=sampler, pruner=pruner)
    else:  # it exists: create_study(load_if_exists) would append a create record to a journal, refused or not
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    _check_resumable(spec, study, directions)  # a refused resume writes nothing
    extended = study.user_attrs.get(ATTR_N_TRIALS)  # sweeps run --add-trials (extend_budget)
    if isinstance(extended, int) and extended > spec.budget.n_trials:
        spec.budget.n_trials = extended
    if create:
        _store_identity(spec, study)
    return study


def _check_resumable(spec: StudySpec, study: optuna.Study, directions: Sequence[str]) -> None:
    """Refuse a study resumed under its name with a changed search space, training, objectives
    or constraints (naming what changed): its trials would not be comparable. Reads only."""
    name = study.study_name
    stored = study.user_attrs.get(ATTR_SEARCH)
    wanted = ss.signature(spec.search)
    if stored is not None and stored != wanted:
        changed = sorted(k for k in set(stored) | set(wanted) if stored.get(k) != wanted.get(k))
        raise StudyStateError(
            f"search space of study {name!r} changed since it started: {', '.join(changed)} differ "
            f"(stored {[stored.get(k) for k in changed]}, spec {[wanted.get(k) for k in changed]}). "
            f"Its trials would not be comparable: restore the search section, or start a new study "
            f"with: sweeps run {spec.path} --fresh")
    if message := judged_by_changes(study.user_attrs.get(ATTR_JUDGED_BY, {}), judged_by(spec), name, spec.path):
        raise StudyStateError(message)
    stored_dirs = [d.name.lower() for d in study.directions]
    if stored_dirs != list(directions):
        field = "objective.direction" if len(directions) == 1 == len(stored_dirs) else "objectives"
        raise StudyStateError(f"{field}: study {name!r} was created to {', '.join(stored_dirs)}, the spec says "
                              f"{', '.join(directions)}; use --fresh")


def _store_identity(spec: StudySpec, study: optuna.Study) -> None:
    """Once the study is accepted: what a new study (or one made before a part was stored) lacks,
    its identity, search space and what judges its trials, for later resumes to compare."""
    if ATTR_STUDY_UID not in study.user_attrs:
        study.set_user_attr(ATTR_STUDY_UID, uuid.uuid4().hex)
    if ATTR_SEARCH not in study.user_attrs:
        study.set_user_attr(ATTR_SEARCH, ss.signature(spec.search))
        study.set_user_attr(ATTR_SPEC_HASH, spec.spec_hash())
    judged, stored_judged = judged_by(spec), study.user_attrs.get(ATTR_JUDGED_BY, {})
    if set(judged) - set(stored_judged):
        study.set_user_attr(ATTR_JUDGED_BY, {**judged, **stored_judged})


# ---- records -------------------------------------------------------------------------------
ATTR_BEST_VALUE = "best_value"  # set by the worker: the objective at the trial's best epoch


def record_of(t: FrozenTrial, direction: str = "maximize") -> TrialRecord:
    duration = None
    if t.datetime_start and t.datetime_complete:
        duration = (t.datetime_complete - t.datetime_start).total_seconds()
    intermediate = {int(k): float(v) for k, v in t.intermediate_values.items()}
    return TrialRecord(
        number=t.number, state=t.state.name, params=dict(t.params),
        value=trial_value(t, intermediate, direction),
        duration_s=duration, run_id=t.user_attrs.get(ATTR_RUN_ID),
        intermediate=intermediate,
        reason=str(t.user_attrs.get(ATTR_REASON, "")),
        started=t.datetime_start.timestamp() if t.datetime_start else None,
        retry_of=t.system_attrs.get("failed_trial"),
        values=list(t.values) if t.state == TrialState.COMPLETE and t.values else None,
        figures=dict(t.user_attrs.get(ATTR_FIGURES) or {}), rejected=bool(t.user_attrs.get(ATTR_REJECTED)),
        pack=str(t.user_attrs.get(ATTR_PACK, "")),
    )


def trial_value(t: FrozenTrial, intermediate: dict[int, float], direction: str) -> float | None:
    """A trial's value in every view (status, report, MLflow ``objective``, promote): the objective
    at its best epoch, whose checkpoint promote registers, for completed and pruned trials alike.
    Optuna's value of a PRUNED trial is its LAST intermediate value, so the worker's user attribute
    comes first; without it (another tool stored the trial), the best intermediate value."""
    best = t.user_attrs.get(ATTR_BEST_VALUE)
    if best is not None:
        return float(best)
    if t.state == TrialState.PRUNED and intermediate:
        finite = [v for v in intermediate.values() if v == v]  # NaN compares unequal to itself
        if finite:
            return max(finite) if direction == "maximize" else min(finite)
    return t.values[0] if t.values else None  # t.value raises on a trial of several objectives


ATTR_LR_RANGE = "lr_finder_range"


def effective_search(spec: StudySpec, study: optuna.Study) -> dict:
    """The spec's search space, with ``lr`` narrowed by the study-level LR finder when it ran."""
    narrowed = study.user_attrs.get(ATTR_LR_RANGE)
    if not narrowed or "lr" not in spec.search:
        return spec.search
    lr = spec.search["lr"].model_copy(update={"low": narrowed[0], "high": narrowed[1]})
    return {**spec.search, "lr": lr}


def study_result(spec: StudySpec, study: optuna.Study) -> StudyResult:
    trials = [record_of(t, spec.objective.direction) for t in study.get_trials(deepcopy=False)]
    return StudyResult(name=study.study_name, backend="optuna", direction=spec.objective.direction,
                       metric=spec.objective.metric, trials=trials,
                       parent_run_id=study.user_attrs.get(ATTR_PARENT_RUN),
                       metrics=[o.metric for o in spec.objective_list()], directions=list(spec.directions()))


def failures_in_a_row(study: optuna.Study, since: float) -> int:
    """FAIL trials at the end of the trials finished since ``since`` (a time.time() instant);
    trials stopped by a signal or the timeout are not the trials' fault and are skipped."""
    since_dt = datetime.fromtimestamp(since)
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                 TrialState.FAIL))
            if t.datetime_complete and t.datetime_complete >= since_dt and not t.user_attrs.get("interrupted")]
    done.sort(key=lambda t: cast(datetime, t.datetime_complete))  # all set: filtered above
    n = 0
    for t in reversed(done):
        if t.state != TrialState.FAIL:
            break
        n += 1
    return n


def budget_left(study: optuna.Study, n_trials: int) -> int:
    """Trials still to start: the total counts finished (COMPLETE, PRUNED) and running ones;
    FAIL does not count (its parameters are retried or replaced)."""
    return budget_and_running(study, n_trials)[0]


def budget_and_running(study: optuna.Study, n_trials: int) -> tuple[int, bool]:
    """:func:`budget_left`, and whether a trial is RUNNING, from one read of the study: a running
    trial failed and requeued between two reads would be counted in neither."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    counted = study.get_trials(deepcopy=False, states=states)
    return n_trials - len(counted), any(t.state == TrialState.RUNNING for t in counted)


# ---- warm start and more budget ---------------------------------------------------------
def _fits(p: Any, value: Any) -> bool:
    """Whether ``value`` can be drawn from search parameter ``p`` (a choice, or within the range)."""
    if isinstance(p, CategoricalParam):
        return value in p.choices
    return isinstance(value, (int, float)) and not isinstance(value, bool) and p.low <= value <= p.high


def enqueue_warm_start(spec: StudySpec, study: optuna.Study) -> str:
    """Enqueue the best ``warm_start.top`` configurations of the earlier study into ``study`` (a new
    one, with no trials yet); returns the sentence saying what was carried over."""
    ws = spec.warm_start
    assert ws is not None  # the caller checks it
    source = spec.model_copy(update={"name": ws.study, "warm_start": None})
    where = f"{source.storage_url()}"
    missing = StudyStateError(f"warm_start.from: study {ws.study!r} is not in {where}; run it first, or fix the "
                              f"name in {spec.path or 'the spec'}")
    try:
        storage = open_storage(source, create=False)
    except StudyStateError:
        raise missing from None
    name = current_study_name(storage, ws.study)
    if name is None:
        raise missing
    earlier = optuna.load_study(study_name=name, storage=storage)
    if len(earlier.directions) > 1:
        raise StudyStateError(f"warm_start.from: study {name!r} has several objectives, so no single best "
                              "configurations to start from; name a study of one objective")
    done = [(t.value, t) for t in earlier.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None]
    if not done:
        raise StudyStateError(f"warm_start.from: study {name!r} has no completed trial to start from")
    maximize = earlier.direction == optuna.study.StudyDirection.MAXIMIZE
    best = [t for _, t in sorted(done, key=lambda vt: vt[0], reverse=maximize)]
    carried: set[str] = set()
    for t in best[:ws.top]:
        params = {k: v for k, v in t.params.items() if k in spec.search and _fits(spec.search[k], v)}
        carried |= set(params)
        study.enqueue_trial(params, user_attrs={ATTR_WARM_START: f"{name}#{t.number}"}, skip_if_exists=True)
    drawn = sorted(set(spec.search) - carried)
    return (f"warm start: the first {min(ws.top, len(best))} trials are the best of study {name!r} (trials "
            f"{', '.join(str(t.number) for t in best[:ws.top])}); carried over: {', '.join(sorted(carried)) or 'none'}"
            + (f"; drawn: {', '.join(drawn)}" if drawn else ""))


def extend_budget(spec: StudySpec, add: int) -> int:
    """Raise the budget of the spec's study (which must have run) by ``add``; the new budget."""
    study = open_study(spec, create=False)
    budget = spec.budget.n_trials  # open_study applied an earlier extension
    study.set_user_attr(ATTR_N_TRIALS, budget + add)
    return budget + add


# ---- a worker joining the study ----------------------------------------------------------
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
        storage = open_storage(spec, create=False)
    except StorageUnreachableError as exc:
        return None, str(exc).removeprefix("storage: ")
    except BackendError as exc:
        if not _tables_missing(exc):
            raise
        return None, "the storage has no Optuna tables yet (no study was ever run on it)"
    try:
        if current_study_name(storage, spec.name) is None:
            return None, f"study {spec.name!r} does not exist yet"
    finally:
        rdb = optuna_adapter.rdb_of(storage)
        if rdb is not None:  # polled every 2 s: do not pile up connection pools
            rdb.engine.dispose()
    return open_study(spec, create=False), ""


def _tables_missing(exc: BaseException) -> bool:
    """Whether the database says it has no Optuna tables (PostgreSQL, SQLite, MySQL), a few causes down."""
    texts = (f"{type(link).__name__} {link}".lower() for link in cause_chain(exc))
    return any("undefinedtable" in text or "no such table" in text or ("relation" in text and "does not exist" in text)
               or ("table" in text and "doesn't exist" in text) for text in texts)


def record_outcome(spec: StudySpec, study: optuna.Study, trial: optuna.Trial, outcome, overrides: dict) -> bool:
    """Store the outcome in the study (and requeue what should be retried). Returns whether
    the grid of search values is exhausted."""
    if outcome.value is not None:
        trial.set_user_attr("best_value", outcome.value)
    if outcome.figures:
        trial.set_user_attr(ATTR_FIGURES, outcome.figures)
    # Before tell: tpe and gp read a finished trial's constraints (rejected ones are told PRUNED).
    for key, value in constraint_values(spec.constraints, outcome.figures).items():
        trial.set_constraint(key, value)
    if outcome.rejected:
        trial.set_user_attr(ATTR_REJECTED, True)
    several = len(study.directions) > 1
    if outcome.state == "COMPLETE" and several and outcome.values is None:
        outcome.state, outcome.reason = "FAIL", "an objective has no value (NaN or not reported at the best epoch)"
    if outcome.reason:
        trial.set_user_attr(ATTR_REASON, outcome.reason)
    if outcome.state == "COMPLETE":  # one path for one objective or several
        return _tell(study, trial, values=outcome.values if several else outcome.value)
    if outcome.state == "PRUNED":
        return _tell(study, trial, state=TrialState.PRUNED)
    if outcome.state == "INTERRUPTED":
        trial.set_user_attr("interrupted", True)
    exhausted = _tell(study, trial, state=TrialState.FAIL)
    frozen = optuna_adapter.stored_trial(study, trial)
    if outcome.state == "INTERRUPTED":
        # Requeue the same parameters; the retry resumes from the checkpoint just saved.
        RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)(study, frozen)
    elif outcome.oom and spec.budget.oom_retry_smaller_batch and not overrides:
        optuna_recovery.enqueue_smaller_batch(spec, study, frozen)
    return exhausted


def _tell(study: optuna.Study, trial: optuna.Trial, **kwargs) -> bool:
    """``study.tell``; True when the sampler says the search space is exhausted.

    GridSampler calls ``study.stop()`` after the last grid point, which Optuna only allows
    inside ``optimize``; the trial's state is stored before that (in a ``finally``)."""
    try:
        study.tell(trial, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
        return True
    return False
