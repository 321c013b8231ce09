"""``sweeps run`` on Optuna: set up the study, recover what a crash left, run workers, summarise.

The orchestrator never trains. It validates the spec once (its text is the study's snapshot),
opens the study and its MLflow run, then hands the workers to :class:`Supervisor`, which
owns their lifecycles, signals, hung trials and the timeout, and draws the live view.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
from optuna.trial import TrialState

from core import faults
from sweeps.backends import optuna_attrs, optuna_storage, optuna_study, worker_forkserver
from sweeps.backends import optuna_recovery as recovery
from sweeps.backends.base import StudyResult
from sweeps.backends.driver import DriverSignals, run_lock, stopped_by
from sweeps.backends.journal_file import LINK_SUFFIX, check_journal
from sweeps.backends.optuna_outage import StorageUnavailable
from sweeps.backends.optuna_study import enqueue_warm_start
from sweeps.backends.supervisor import Supervisor
from sweeps.backends.worker_protocol import WorkerGo
from sweeps.errors import StudyStateError
from sweeps.live import LiveView
from sweeps.parent_run import find_or_create_parent, parent_status, tracker_for, update_parent_best, write_summary
from sweeps.slot_plan import WorkerSlot, cpu_threads_available, discover_devices, plan_workers, threads_setting
from sweeps.spec.model import StudySpec

log = logging.getLogger("sweeps")


def workers_beat_dir(spec: StudySpec) -> Path:
    """Heartbeat files of local workers (their mtime is their last sign of progress)."""
    if spec.is_rdb_storage():
        return Path("runs").resolve() / spec.name / ".workers"
    return Path(spec.storage_url()).resolve().parent / spec.name / ".workers"


def plan_local_workers(spec: StudySpec) -> list[WorkerSlot]:
    """This machine's worker slots for the spec's ``resources`` (``sweeps run``, and
    ``sweeps worker --devices``, which hands its flags in as the spec's resources)."""
    devices = [] if spec.resources.devices == "cpu" else discover_devices(spec.resources.devices)
    workers = spec.resources.workers
    if workers == "auto" and spec.storage_url().startswith("sqlite"):
        workers = 1  # what fits: parallel workers would lock SQLite; an explicit count > 1 is refused below
        log.info("storage is SQLite: one worker (parallel workers would lock it); the default journal file or "
                 "postgresql://... runs one per core")
    slots = plan_workers(devices, spec.resources.gpus_per_trial, workers, cpu_threads_available())
    if len(slots) > spec.budget.n_trials:  # a worker with no trial to run would only cost memory
        slots = plan_workers(devices, spec.resources.gpus_per_trial, spec.budget.n_trials, cpu_threads_available())
    # OMP_NUM_THREADS, where the user sets it, caps each worker's threads as it caps torch's in a
    # plain script: a shared machine, or processes that share the cores. Said, since one exported for
    # other jobs (OMP_NUM_THREADS=1) slows every trial. (On Ray a trial trains on the CPUs it reserves.)
    cap = threads_setting()
    if cap is not None and cap < slots[0].threads:
        log.info("OMP_NUM_THREADS=%s: each worker trains on %d CPU thread(s), not its share of %d",
                 os.environ["OMP_NUM_THREADS"], cap, slots[0].threads)
        slots = [dataclasses.replace(slot, threads=cap) for slot in slots]
    if len(slots) > 1 and spec.storage_url().startswith("sqlite"):
        raise StudyStateError(
            f"storage: {spec.storage_url()!r} is SQLite, which parallel workers would lock "
            f"('database is locked'); with resources.workers={len(slots)} use the default journal file "
            f"(remove the storage key) or postgresql://...")
    return slots


@contextlib.contextmanager
def _killed_if_storage_lost(tracker, parent) -> Iterator[None]:
    """The Optuna storage stayed away past its wait (optuna_outage), or the workers' fork server is
    gone: no summary can be read, so the study run is closed KILLED, as on SIGTERM, and the error
    (its message and exit code) goes on."""
    try:
        yield
    except (StorageUnavailable, worker_forkserver.ServerGone):
        tracker.end_run(parent, "KILLED")
        raise


def _stopped_while(signum: int, when: str) -> tuple[str, int]:
    return stopped_by(signum, f"it came while {when}; run the same command to go on")


class OptunaBackend:
    name = "optuna"

    # ---- read-only -------------------------------------------------------------------------
    def load(self, spec: StudySpec) -> StudyResult:
        study = optuna_study.open_study(spec, create=False)
        return optuna_study.study_result(spec, study)

    # ---- run ---------------------------------------------------------------------------------
    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False,
            on_locked: Callable[[], None] | None = None) -> StudyResult:
        with DriverSignals() as signals:  # outside the supervisor: while the study starts and ends
            return self._run(spec, fresh, quiet, signals, on_locked or (lambda: None))

    def _run(self, spec: StudySpec, fresh: bool, quiet: bool, signals: DriverSignals,
             on_locked: Callable[[], None]) -> StudyResult:
        slots = self._plan(spec)
        tracker = tracker_for(spec)
        # The workers' fork server before the set-up (`sweeps run` has started it already, as soon
        # as it read the spec): its imports take seconds, on the cores this set-up leaves idle.
        # Workers are forked from it once the study is ready; it ends with the run. After the run
        # lock: a run refused because another holds the study starts nothing here.
        with self._run_lock(spec), worker_forkserver.running():
            on_locked()
            tracker.check_connection()  # before anything is created or trained
            study = optuna_study.open_study(spec, fresh=fresh)
            warm = (enqueue_warm_start(spec, study) if spec.warm_start is not None
                    and not study.get_trials(deepcopy=False) else "")
            uid = study.user_attrs[optuna_attrs.ATTR_STUDY_UID]
            parent = find_or_create_parent(tracker, spec, study.study_name, self.name, study_uid=uid)
            if study.user_attrs.get(optuna_attrs.ATTR_PARENT_RUN) != parent.run_id:
                study.set_user_attr(optuna_attrs.ATTR_PARENT_RUN, parent.run_id)
            with _killed_if_storage_lost(tracker, parent):
                faults.signal_here(faults.Fault.DRIVER_SIGTERM_AT_START)
                recovered = self._recover_orphans(spec, study, tracker)
                if spec.lr_finder.enabled:
                    from sweeps.study_lr_finder import run_study_lr_finder  # lazy: torch, only when used

                    run_study_lr_finder(spec, study, tracker, parent)
                started = time.time()
                timeout = spec.timeout_seconds()
                deadline = started + timeout if timeout else None
                view = LiveView(spec, study.study_name, quiet=quiet, recovered=recovered, note=warm)
                if optuna_study.budget_left(study, spec.budget.n_trials) <= 0 and not study.get_trials(
                        deepcopy=False, states=(TrialState.RUNNING,)):
                    stopped, code = (f"nothing to run: all {spec.budget.n_trials} trials of budget.n_trials have run; "
                                     "raise it to run more"), 0
                elif signals.signum:  # while it started: no worker is started
                    stopped, code = _stopped_while(signals.signum, "the study started")
                else:
                    faults.signal_here(faults.Fault.DRIVER_SIGINT_AT_HANDOVER)
                    stopped, code = self._supervise(spec, study, slots, parent, started, deadline, view, tracker,
                                                    signals)
                result = optuna_study.study_result(spec, optuna.load_study(
                    study_name=study.study_name, storage=optuna_storage.open_storage(spec)))
                result.stopped_reason = stopped
                faults.signal_here(faults.Fault.DRIVER_SIGTERM_AT_END)
                write_summary(tracker, parent, result)
                if signals.signum and code < 128:  # while it ended: the summary above is complete
                    stopped, code = _stopped_while(signals.signum, "the study ended")
                    result.stopped_reason = stopped
                tracker.end_run(parent, parent_status(result, code))
                view.finish(result)
        if code < 128:  # not after a stop: the writes kept in an outage are sent now, or said to be kept
            tracker.send_spooled()
        result.exit_code = code
        return result

    def _supervise(self, spec, study, slots, parent, started, deadline, view, tracker,
                   signals: DriverSignals) -> tuple[str, int]:
        """Run the workers under a :class:`Supervisor`; the live view and the parent run's
        best-so-far are kept current from the study (every worker's trials, in order)."""
        uid = study.user_attrs[optuna_attrs.ATTR_STUDY_UID]
        finished: list[int] = [-1]

        def go_for(slot: WorkerSlot, beat: Path) -> WorkerGo:
            return WorkerGo(spec_text=spec.text or "", spec_path=str(spec.path), study_name=study.study_name,
                            study_uid=uid, parent_run_id=parent.run_id, parent_experiment_id=parent.experiment_id,
                            parent_run_name=parent.name, since=started, deadline=deadline,
                            slot=slot.index, threads=slot.threads, beat_file=str(beat), pool=len(slots))

        def on_progress() -> None:
            tracker.check_outage()  # the MLflow store away past its wait: the supervisor stops as on SIGTERM
            if faults.mid_trial_armed() and any(
                    t.intermediate_values for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
                faults.trial_mid_way()
            result = optuna_study.study_result(spec, study)
            view.update_result(result)
            if len(result.finished()) != finished[0]:
                finished[0] = len(result.finished())
                update_parent_best(tracker, parent, result)

        tracker.log(parent, tags={"sweeps.workers": len(slots)})  # this invocation's local workers
        supervisor = Supervisor(spec, study, go_for, workers_beat_dir(spec), started, deadline, on_progress,
                                forked=True, driver_signals=signals)
        stopped, code = supervisor.run(slots)
        view.update_result(optuna_study.study_result(spec, study))
        return stopped, code

    def _plan(self, spec: StudySpec) -> list[WorkerSlot]:
        return plan_local_workers(spec)

    def _run_lock(self, spec: StudySpec):
        """One ``sweeps run`` per journal study at a time: a second one would race the first
        for orphaned trials. RDB studies may have many (plus ``sweeps worker``s)."""
        if spec.is_rdb_storage():
            return contextlib.nullcontext()
        path = Path(f"{optuna_storage.journal_file(spec)}.runlock")  # absolute, like every journal path
        optuna_storage.make_folder(path.parent, f"storage: {spec.storage_url()}")  # a clear error if runs/ is a file
        return run_lock(path, spec.name)

    def _recover_orphans(self, spec: StudySpec, study: optuna.Study, tracker) -> list[int]:
        """Journal storage with the run lock held: every RUNNING trial belongs to a process
        that died (SIGKILL, OOM killer, power). Each is failed with the reason, its MLflow
        run closed as FAILED, and its parameters requeued to resume from its checkpoint."""
        if spec.is_rdb_storage():
            return []  # RDB: Optuna's heartbeat fails stale trials (see optuna_storage.open_storage)
        check_journal(spec.storage_url())
        stale_lock = Path(spec.storage_url() + LINK_SUFFIX)
        if stale_lock.is_symlink():
            stale_lock.unlink()  # Optuna's journal lock, left by a process killed mid-append
        recovered = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            reason = (f"orphaned: worker {t.user_attrs.get(optuna_attrs.ATTR_WORKER, '?')} died while running it "
                      f"(killed or crashed); requeued to resume from its last checkpoint")
            recovery.fail_trial(study, t, reason, requeue=True, tracker=tracker, tracking_uri=spec.tracking_store_uri())
            recovered.append(t.number)
        recovery.close_orphan_runs(tracker, study)
        return recovered
