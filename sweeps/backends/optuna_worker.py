"""One Optuna worker: takes trials from the shared study until its total budget is met.
(``sweeps run`` keeps the parent run's best-so-far current from the study: a worker writes
only its trials' runs.)

``sweeps run`` starts one per pool slot on this machine; ``sweeps worker SPEC`` starts one
on any machine that reaches a shared RDB storage. Both run this loop.
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import optuna

from core import faults
from sweeps.backends import optuna_adapter, optuna_attrs, optuna_pack, optuna_recovery, optuna_storage, optuna_study
from sweeps.backends.optuna_attrs import ATTR_OUT_DIR
from sweeps.backends.optuna_outage import StorageUnavailable
from sweeps.backends.optuna_storage import ask_lock
from sweeps.backends.optuna_study import check_tracking_before_trials, join_study
from sweeps.backends.trial_liveness import HeldTrials, StaleTrialMonitor, progress_beat
from sweeps.backends.worker_protocol import WorkerGo
from sweeps.errors import StoreGone, StudyStateError, SweepsError, TrackingError
from sweeps.parent_run import reader_for, tracker_for
from sweeps.spec import search_space as ss
from sweeps.spec.load import spec_from_text
from sweeps.spec.model import StudySpec
from sweeps.stop_signals import STOP_SIGNALS, after_hangup
from sweeps.store_urls import redact_url
from sweeps.tracking import layout
from sweeps.trial import TrialSpec, run_trial
from sweeps.trial_control import StopRequest, TrialControl, TrialInterrupted
from sweeps.worker_identity import worker_identity

log = logging.getLogger("sweeps")
EXIT_OK, EXIT_MAX_FAILURES = 0, 3  # `sweeps worker`'s exit codes (besides 128 + a signal's number)


class _Signals:
    """SIGTERM / SIGINT / SIGHUP (:data:`~sweeps.stop_signals.STOP_SIGNALS`) request a stop of the
    running trial (``event``, its :class:`~sweeps.trial_control.StopRequest`): it stops at its next
    optimizer step with a checkpoint, or aborts its set-up (:class:`TrialInterrupted`); the worker
    marks it FAIL and requeues it."""

    def __init__(self) -> None:
        self.event = StopRequest()
        self.signum: int | None = None
        self.storage_lost: StoreGone | None = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        after_hangup(signum)
        self.signum = signum
        self.event.request_from_signal(signum)

    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else EXIT_OK

    def storage_gone(self, exc: StoreGone) -> None:
        """A store (the Optuna storage, the MLflow tracking store) did not come back within its
        wait: the trial stops as on SIGTERM (it checkpoints at its next step), and the worker then
        exits with ``exc``."""
        self.storage_lost = self.storage_lost or exc
        self.signum = self.signum or signal.SIGTERM
        self.event.request(self.signum)


def trial_dir(spec: StudySpec, study_name: str, number: int) -> Path:
    journal = spec.journal_path()
    base = journal.parent if journal is not None else Path("runs")
    return base / study_name / f"trial-{number:04d}"


def run_worker(spec: StudySpec, worker_index: int = 0, go: WorkerGo | None = None, wait_s: float = 0.0) -> int:
    """The worker loop. Returns the process exit code.

    With ``go`` (a worker of ``sweeps run``): the study, parent run and budget window it says.
    Without (``sweeps worker``): it joins the study ``sweeps run`` created, waiting up to
    ``wait_s`` seconds for it to appear. Either way its trials write to MLflow from this process."""
    tracker = tracker_for(spec)
    try:
        return _worker_loop(spec, worker_index, go, wait_s, tracker)
    except TrialInterrupted as exc:  # a signal between trials: nothing to checkpoint
        return 128 + exc.signum
    finally:
        try:
            tracker.close()
        except TrackingError as exc:  # every run has ended by now: report what the store refused
            log.error("%s", exc)


def _worker_loop(spec: StudySpec, worker_index: int, go: WorkerGo | None, wait_s: float, tracker) -> int:
    signals = _Signals()
    if go is None:
        study = join_study(spec, wait_s, signals.event)
        if study is None:
            return signals.exit_code()
        check_tracking_before_trials(tracker, spec.experiment_name())
        # A `sweeps worker` on its own: nobody else on this machine fails dead workers' trials on
        # a timer (a worker of `sweeps run` or of `sweeps worker --devices` has its supervisor's).
        monitor = StaleTrialMonitor.start_for(spec, study)
        try:
            return _take_trials(spec, worker_index, go, study, tracker, signals)
        finally:
            if monitor is not None:
                monitor.stop()
    study = optuna_study.open_study(spec)
    return _take_trials(spec, worker_index, go, study, tracker, signals)


def _take_trials(spec: StudySpec, worker_index: int, go: WorkerGo | None, study: optuna.Study, tracker,
                 signals: _Signals) -> int:
    if go is not None:
        if study.user_attrs.get(optuna_attrs.ATTR_STUDY_UID) != go.study_uid:  # never work for another study
            raise StudyStateError(f"study {study.study_name!r} in {redact_url(spec.storage_url())} is not the one "
                                  f"`sweeps run` started (its identity changed); run `sweeps run {spec.path}` again")
    since = go.since if go is not None else time.time()
    deadline = go.deadline if go is not None else None
    beat_file = Path(go.beat_file) if go is not None else None
    # A worker of `sweeps run` is told the parent run whole: it starts without reading the store,
    # so one started during an MLflow outage spools its trials' runs like the others.
    parent = go.parent() if go is not None else reader_for(spec).handle(study.user_attrs[optuna_attrs.ATTR_PARENT_RUN])
    n_trials = spec.budget.n_trials

    held = HeldTrials(study)
    try:
        while not signals.event.is_set():
            if deadline is not None and time.time() >= deadline:
                break
            if optuna_study.failures_in_a_row(study, since) >= spec.budget.max_failures:
                log.error("stopping: %d trials failed in a row (budget.max_failures=%d); see the reasons with "
                          "sweeps status %s", spec.budget.max_failures, spec.budget.max_failures, spec.path)
                return EXIT_MAX_FAILURES
            trials, stay = next_trials(spec, study, held, n_trials, go.pool if go else 1)
            if not trials:
                if stay:
                    signals.event.wait(_poll_seconds(study))
                    continue
                break
            jobs = [prepare_trial(spec, study, t, held, tracker, parent, worker_index, signals, beat_file)
                    for t in trials]
            code = (optuna_pack.run_packed(spec, study, jobs, tracker, signals, _run_job, finish_trial)
                    if len(jobs) > 1 else _run_job(spec, study, jobs[0], tracker, signals))
            if code is not None:
                return code
    finally:
        held.stop()
    return signals.exit_code()


def next_trials(spec: StudySpec, study: optuna.Study, held: HeldTrials, n_trials: int,
                pool: int) -> tuple[list[optuna.Trial], bool]:
    """The trials this worker runs next, asked under the ask lock (more than one with
    resources.pack, to train as a population: optuna_pack); none once the budget is taken, with
    whether to stay. On RDB storage a trial still running on another machine may die and be
    requeued: the worker stays while one runs, so someone is there to retry it (and `sweeps run`
    summarises the study only once every trial has ended). The budget and the running trials are
    one read: a trial failed and requeued between two reads would be neither, and every worker
    could leave its retry WAITING."""
    rdb = optuna_adapter.heartbeat_enabled(study)
    if rdb:
        optuna_recovery.fail_stale_trials(study, lambda: ask_lock(spec))  # a dead worker's trial is requeued
    with ask_lock(spec):
        left, running = optuna_study.budget_and_running(study, n_trials)
        if left <= 0:
            return [], rdb and running
        trial = held.ask(worker_identity())
        return [trial, *optuna_pack.ask_more(spec, study, held, n_trials, pool)], True


def _poll_seconds(study: optuna.Study) -> float:
    """How often a worker that is out of trials to start checks for dead workers' trials."""
    return min(5.0, max(0.5, optuna_adapter.heartbeat_grace_seconds(study) / 4))


def _run_job(spec, study, job: TrialJob, tracker, signals) -> int | None:
    outcome = run_trial(spec, job.spec_trial, job.control, tracker)
    return finish_trial(spec, study, job, outcome, tracker, signals)


@dataclass
class TrialJob:
    """A trial taken from the study, ready to train (``sweeps.trial.run_trial``, or with others as a
    population: ``optuna_pack``), and what telling its outcome needs."""

    trial: optuna.Trial
    spec_trial: TrialSpec
    control: TrialControl
    overrides: dict
    beat: Callable[[], None]
    held: HeldTrials  # keeps the trial alive in the storage until its outcome is told


def prepare_trial(spec, study, trial, held, tracker, parent, worker_index, signals, beat_file) -> TrialJob:
    """The trial's parameters, folder, tags and control (its pruning asks the study)."""
    params = ss.suggest(trial, optuna_study.effective_search(spec, study))
    retry_of = optuna_adapter.stored_trial(study, trial).system_attrs.get("failed_trial")
    if retry_of is not None:
        # A retry inherits the failed attempt's user attributes (its folder, to resume from);
        # the attempt's own outcome is not this trial's.
        trial.set_user_attr(optuna_attrs.ATTR_REASON, "")
        trial.set_user_attr("interrupted", False)
    out_dir = Path(trial.user_attrs.get(ATTR_OUT_DIR) or trial_dir(spec, study.study_name, trial.number))
    overrides = dict(trial.user_attrs.get(optuna_attrs.ATTR_BATCH_OVERRIDES) or {})
    trial.set_user_attr(ATTR_OUT_DIR, str(out_dir))
    uid = study.user_attrs[optuna_attrs.ATTR_STUDY_UID]
    tags = {"sweeps.worker_slot": worker_index, "sweeps.optuna_trial_id": optuna_adapter.trial_id_of(trial),
            layout.TAG_STUDY_UID: uid}
    if retry_of is not None:
        tags["sweeps.retry_of_trial"] = retry_of
    beat = progress_beat(beat_file)
    if beat_file is None:  # on its own (`sweeps worker`): no supervisor watches the MLflow store for it
        beat = _watching_tracking(beat, tracker, signals)
    spec_trial, control = _trial_parts(parent, trial, params, out_dir, tags, overrides, uid, signals, beat)
    return TrialJob(trial, spec_trial, control, overrides, beat, held)


def finish_trial(spec, study, job: TrialJob, outcome, tracker, signals) -> int | None:
    """Tell the study the trial's outcome; the worker's exit code when it must stop, else None."""
    trial, overrides = job.trial, job.overrides
    job.held.release(trial)
    job.beat()
    try:
        if outcome.run is not None and tracker.store_run_id(outcome.run.run_id) != outcome.run.run_id:
            # Made during an MLflow outage and on the store since: the study names the store's run.
            trial.set_user_attr(optuna_attrs.ATTR_RUN_ID, tracker.store_run_id(outcome.run.run_id))
        exhausted = optuna_study.record_outcome(spec, study, trial, outcome, overrides)
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
        if not optuna_adapter.stored_trial(study, trial).state.is_finished():
            raise
        # This worker was silent past the grace period and another one failed the trial as
        # stale and requeued it: this attempt's result is dropped, the retry counts instead.
        log.warning("trial %d was failed as stale by another worker (no heartbeat for longer than %s=%d s); "
                    "this attempt's result is dropped and its retry counts instead", trial.number,
                    optuna_storage.ENV_GRACE, optuna_storage.heartbeat_settings()[1])
        exhausted = False
    if signals.storage_lost is not None:  # the trial is checkpointed (and requeued if the storage is back)
        raise signals.storage_lost
    if outcome.state == "INTERRUPTED":
        return signals.exit_code()
    if exhausted:
        log.warning("the grid of search values is exhausted; this worker stops")
        return EXIT_OK
    return None


def _watching_tracking(beat, tracker, signals: _Signals):
    """The trial's beat (at most once a second) that also asks the tracker whether the MLflow store
    has been away past its wait: the trial then stops as on SIGTERM. A worker of `sweeps run` or
    of `sweeps worker --devices` is stopped by its supervisor, which asks the same of its tracker."""

    def beat_and_check() -> None:
        beat()
        try:
            tracker.check_outage()
        except StoreGone as exc:
            signals.storage_gone(exc)

    return beat_and_check


def _trial_parts(parent, trial, params, out_dir, tags, overrides, uid, signals, beat):
    """The trial's TrialSpec and its TrialControl, with Optuna's pruning."""
    several = len(trial.study.directions) > 1

    def should_prune(epoch: int, value: float) -> bool:
        if several:  # Optuna keeps no intermediate values for several objectives; no pruner runs (spec)
            return False
        try:
            trial.report(value, epoch)
            # tests: a worker dead mid-trial, its first epoch's checkpoint and report made
            faults.stop_here(faults.Fault.TRIAL_EPOCH_REPORTED)
            control.hold_mid_trial()
            return trial.should_prune()
        except StorageUnavailable as exc:
            signals.storage_gone(exc)
            return False

    # The folder is this trial's (the study's identity and its original number): a retry (crash,
    # SIGTERM) resumes from the checkpoint there, and anything else found there is moved aside.
    owner = f"{uid}:{out_dir.name}"
    spec_trial = TrialSpec(trial.number, params, out_dir, parent, "optuna", tags=tags, overrides=overrides,
                           owner=owner)

    def on_start(run) -> None:
        try:
            trial.set_user_attr(optuna_attrs.ATTR_RUN_ID, run.run_id)
        except StorageUnavailable as exc:  # the trial stops before its first step; its run is closed
            signals.storage_gone(exc)
        beat()

    control = TrialControl(signals.event, should_prune, beat, on_start)
    return spec_trial, control


def spec_of(go: WorkerGo) -> StudySpec:
    """The spec a worker runs: the snapshot ``sweeps run`` (or ``sweeps worker``) read and
    validated, with the resources its flags override (``--devices``, ``--gpus-per-trial``), so a
    trial holding K GPUs runs DDP over them as the supervisor planned."""
    spec = spec_from_text(go.spec_text, go.spec_path)
    if go.resources:
        spec = spec.model_copy(update={"resources": spec.resources.model_copy(update=go.resources)})
    return spec


# What every trial imports (seconds of torch, MLflow and its SQL store), loaded before the go: by the
# fork server that ``sweeps run`` starts before it sets up the study (worker_forkserver), once for
# all its workers, or by a worker process of its own (``sweeps worker --devices``). torch._dynamo is
# one: building any torch.optim optimizer imports it (Optimizer.add_param_group is wrapped by
# torch._disable_dynamo). Nothing a trial may not use: torchmetrics (with the torchvision models and
# SciPy signal module it pulls in) loads in the trials of a task whose metrics need it, ONNX at a
# trial's export, after its training.
TRIAL_IMPORTS = ("torch", "torch._dynamo", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "core.train")


def _quiet_exit(signum, _frame) -> None:
    os._exit(128 + signum)  # before the go there is no trial to save, nor anything to say


def main(go_stream: IO[str] | None = None) -> int:
    """Entry point of a local worker (``supervisor.Supervisor``): it imports what trials use (a
    forked worker has them from the fork server), reads its go (:class:`WorkerGo`: the spec
    snapshot, the study, its slot) from ``go_stream`` (a forked worker's go pipe) or stdin, then
    runs the worker loop. EOF instead means stop."""
    # A Ctrl-C while `sweeps run` sets up is the driver's to report; this worker has nothing to
    # save yet and leaves without a traceback (as supervisor._WORKER_BOOT and the fork server set
    # it up before any import; again here for a worker started with -m). After the go, a signal
    # means what it always does.
    for signum in STOP_SIGNALS:
        signal.signal(signum, _quiet_exit)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    for module in TRIAL_IMPORTS:
        importlib.import_module(module)
    faults.pause_here(faults.Pause.WORKER_BEFORE_GO)
    line = (go_stream or sys.stdin).readline()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if not line.strip():
        return 0  # the orchestrator stopped before sending the go
    go = WorkerGo.from_line(line)
    spec = spec_of(go)
    size_thread_pools(go.threads)
    try:
        return run_worker(spec, go.slot, go=go)
    except SweepsError as exc:  # one line, as the CLI says it; `sweeps run` fails and requeues its trial
        if os.environ.get("SWEEPS_DEBUG"):
            raise
        log.error("worker %d: %s", go.slot, exc)
        return exc.exit_code


def size_thread_pools(threads: int) -> None:
    """The slot's thread count for every pool the process has loaded: OMP_NUM_THREADS in the
    environment is read only by libraries loaded after it was set, and a forked worker's torch and
    numpy (OpenBLAS) were loaded by the fork server."""
    import torch  # lazy, for start-up time: a worker imports torch once it has its go
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(limits=threads)


if __name__ == "__main__":
    from sweeps.fast_exit import exit_now

    exit_now(main())
