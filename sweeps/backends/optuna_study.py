"""The Optuna study of a spec: storage, sampler, pruner, versions, orphans, records.

Storage: a journal file under ``runs/`` by default (safe for parallel local workers,
unlike a shared SQLite file), or any RDB URL. On RDB storage, Optuna's heartbeat and
stale-trial retry are on, so a worker machine that dies has its trial failed and requeued.
"""
from __future__ import annotations

import copy
import errno
import importlib.util
import logging
import os
import re
import uuid
import warnings
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import cast

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.pool import NullPool

from sweeps.backends import optuna_adapter, optuna_outage
from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.backends.journal_file import open_journal
from sweeps.backends.optuna_attrs import (
    ATTR_BATCH_OVERRIDES,
    ATTR_JUDGED_BY,
    ATTR_N_TRIALS,
    ATTR_PARENT_RUN,
    ATTR_REASON,
    ATTR_RUN_ID,
    ATTR_SEARCH,
    ATTR_SPEC_HASH,
    ATTR_STUDY_UID,
    ATTR_WORKER,
    MAX_RETRIES,
)
from sweeps.backends.optuna_recovery import StaleTrialCallback
from sweeps.backends.storage_errors import storage_error
from sweeps.backends.trial_seeded_sampler import TrialSeededSampler
from sweeps.deploy_check import ATTR_FIGURES, ATTR_REJECTED
from sweeps.errors import BackendError, PathError, StudyStateError
from sweeps.spec import search_space as ss
from sweeps.spec.model import StudySpec
from sweeps.spec.objectives import judged_by, judged_by_changes
from sweeps.store_urls import redact_url

HEARTBEAT_S = 10  # RDB storage: how often a worker is expected to record a heartbeat, and...
GRACE_S = 40  # ...a RUNNING trial silent longer than this is failed and requeued by any other worker
ENV_HEARTBEAT, ENV_GRACE = "SWEEPS_HEARTBEAT_S", "SWEEPS_GRACE_S"  # override both (whole seconds)

optuna.logging.set_verbosity(optuna.logging.WARNING)
# The retry callback and its helpers are marked experimental since Optuna 2.8 but are stable
# in practice; the warning would otherwise print once per worker and per trial.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
# Workers ask/tell instead of Study.optimize and record the heartbeat themselves (optuna_worker).
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
log = logging.getLogger("sweeps")


# ---- storage -------------------------------------------------------------------------
def open_storage(spec: StudySpec, create: bool = True, pooled: bool = True) -> optuna.storages.BaseStorage:
    """Open the spec's storage. ``create=False`` (read-only commands) refuses to create a
    journal file or database tables that are not there yet. ``pooled=False``: a database
    connection only while a call runs (a caller that calls every few seconds should not hold
    one of the server's connections between calls)."""
    url = spec.storage_url()
    if spec.is_rdb_storage():
        heartbeat_s, grace_s = heartbeat_settings()
        outage = optuna_outage.outage_wait(redact_url(url))  # waited out once this process has used it
        try:
            rdb = outage.call(lambda: RDBStorage(
                sqlalchemy_url(url), engine_kwargs={"pool_pre_ping": True} if pooled else {"poolclass": NullPool},
                skip_table_creation=not create,
                heartbeat_interval=heartbeat_s, grace_period=grace_s,
                heartbeat_stale_trial_callback=StaleTrialCallback(spec.tracking_store_uri()),
            ))
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


# ---- sampler and pruner ------------------------------------------------------------------
def make_sampler(spec: StudySpec, worker_index: int = 0) -> optuna.samplers.BaseSampler:
    """The spec's sampler, the same in every process of the study: ``worker_index`` no longer
    changes it (the argument is kept for callers). A seeded sampler draws trial n's values from
    ``(sampler.seed, n)`` (:mod:`~sweeps.backends.trial_seeded_sampler`), so resuming, more
    budget and replacement or parallel workers never redraw a point already drawn, and the
    same spec run again from scratch draws the same points. ``seed: null`` stays unseeded."""
    seed, name = spec.sampler.seed, spec.sampler.name
    samplers = optuna.samplers
    if name == "grid":
        # Not wrapped: trial n takes grid point n (later ones a point no trial has visited, read
        # from the study), and the seed only shuffles the grid: the same shuffle in every
        # process, or one grid index would mean different points to different workers.
        return samplers.GridSampler(ss.grid_search_space(spec.search), seed=seed)
    factories = {
        # constant_liar: running trials count as bad guesses, so parallel workers spread out.
        "tpe": lambda s: samplers.TPESampler(seed=s, constant_liar=True, **spec.sampler.model_options()),
        "random": lambda s: samplers.RandomSampler(seed=s),
        "cmaes": lambda s: samplers.CmaEsSampler(seed=s),
        "gp": lambda s: samplers.GPSampler(seed=s, **spec.sampler.model_options()),
        # One sequence for the whole study (its position is counted in the study); only the
        # random first point, drawn before the search space is known, comes from the trial.
        "qmc": lambda s: samplers.QMCSampler(seed=seed, scramble=True,
                                             independent_sampler=samplers.RandomSampler(seed=s)),
    }
    if name not in factories:
        raise BackendError(f"sampler.name: {name!r} cannot run on the optuna backend")
    if seed is None:
        return factories[name](None)
    return TrialSeededSampler(factories[name], seed)


def make_pruner(spec: StudySpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    epochs = int(spec.resolved_train_config().epochs)
    if p.name == "none":
        return optuna.pruners.NopPruner()
    if p.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=p.warmup_epochs)
    if p.name == "percentile":
        return optuna.pruners.PercentilePruner(p.percentile, n_startup_trials=2, n_warmup_steps=p.warmup_epochs)
    if p.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_resource,
                                                      reduction_factor=p.reduction_factor)
    if p.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_resource, max_resource=epochs,
                                              reduction_factor=p.reduction_factor)
    raise BackendError(f"pruner.name: {p.name!r} cannot run on the optuna backend; use ray for pbt")


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


def open_study(spec: StudySpec, fresh: bool = False, worker_index: int = 0,
               create: bool = True) -> optuna.Study:
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
    sampler, pruner = make_sampler(spec, worker_index), make_pruner(spec)
    if create and not exists:
        study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True, directions=directions,
                                    sampler=sampler, pruner=pruner)
    else:  # it exists: create_study(load_if_exists) would append a create record to a journal, refused or not
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    _check_resumable(spec, study, directions)  # a refused resume writes nothing
    extended = study.user_attrs.get(ATTR_N_TRIALS)  # sweeps run --add-trials (optuna_warm_start.py)
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


def fail_stale_trials(study: optuna.Study) -> list[int]:
    """``optuna.storages.fail_stale_trials``, with the reason recorded on each trial first:
    RUNNING trials whose worker has been silent for longer than the grace period are failed
    (once, whichever worker gets there first), then StaleTrialCallback closes their MLflow
    runs and requeues them. Returns the numbers of the trials this call failed."""
    if not optuna_adapter.heartbeat_enabled(study):
        return []
    storage = optuna_adapter.storage_of(study)
    grace = optuna_adapter.heartbeat_grace_seconds(study)
    if isinstance(storage, optuna_adapter.OutageTolerantStorage) and storage.outage.quiet_for(grace):
        return []  # no heartbeat could be recorded during the outage: silence is no sign of a dead worker
    failed = []
    for trial_id in optuna_adapter.stale_trial_ids(study):
        worker = storage.get_trial(trial_id).user_attrs.get(ATTR_WORKER, "?")
        reason = (f"heartbeat lost: worker {worker} was silent for more than {grace} s (killed, crashed or cut "
                  f"off); failed as stale and requeued (at most {MAX_RETRIES} times) to resume from its last "
                  "checkpoint")
        try:
            storage.set_trial_user_attr(trial_id, ATTR_REASON, reason)
            storage.set_trial_user_attr(trial_id, "interrupted", True)  # not the trial's fault: not a failure in a row
            if storage.set_trial_state_values(trial_id, TrialState.FAIL):
                failed.append(trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first
    callback = optuna_adapter.stale_trial_callback(study)
    for trial_id in failed:
        if callback is not None:
            callback(study, copy.deepcopy(storage.get_trial(trial_id)))
    return [storage.get_trial(t).number for t in failed]


ATTR_LR_RANGE = "lr_finder_range"


def effective_search(spec: StudySpec, study: optuna.Study) -> dict:
    """The spec's search space, with ``lr`` narrowed by the study-level LR finder when it ran."""
    narrowed = study.user_attrs.get(ATTR_LR_RANGE)
    if not narrowed or "lr" not in spec.search:
        return spec.search
    lr = spec.search["lr"].model_copy(update={"low": narrowed[0], "high": narrowed[1]})
    return {**spec.search, "lr": lr}


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
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return n_trials - len(study.get_trials(deepcopy=False, states=states))
