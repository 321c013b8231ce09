"""``sweeps run`` on Optuna: set up the study, recover what a crash left, run workers, summarise.

The orchestrator never trains. It starts one worker process per pool slot (each pinned
to its devices and CPU threads), watches them, forwards SIGTERM/Ctrl-C, stops a trial
that hangs, and draws the live view from the study storage.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import optuna
from optuna.trial import TrialState

from sweeps.backends import optuna_recovery as recovery
from sweeps.backends import optuna_study as os_
from sweeps.backends.base import StudyResult
from sweeps.backends.early_worker import EXIT_MAX_FAILURES, adopt_early_worker, spawn_worker
from sweeps.errors import StudyStateError
from sweeps.pool import WorkerSlot, cpu_threads_available, discover_devices, plan_workers
from sweeps.spec import StudySpec
from sweeps.study_run import find_or_create_parent, parent_status, tracker_for, update_parent_best, write_summary
from sweeps.tracking.mlflow_tracker import MlflowTracker
from sweeps.tracking.writer import serve_in_thread

log = logging.getLogger("sweeps")
@dataclass
class _Worker:
    slot: WorkerSlot
    proc: subprocess.Popen
    beat_file: Path
    tracking_ends: tuple[Connection, Connection]  # this process's ends of the pipe serving its MLflow writes
    started: bool = False  # sent its go
    writer: threading.Thread | None = None  # the thread serving its writes (from the go on)


@dataclass(frozen=True)
class _Go:
    """What every worker's go says (the parent run, the budget window), and the tracker whose
    store this process serves the writes of workers that have no writer process of their own."""
    parent_id: str
    started: float
    deadline: float | None
    tracker: MlflowTracker


def _close_stdin(w: _Worker) -> None:
    if w.proc.stdin is not None and not w.proc.stdin.closed:
        try:
            w.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass


def _wait_any(workers: list[_Worker], timeout: float) -> None:
    """Sleep up to ``timeout`` seconds, less if the first live worker exits meanwhile."""
    alive = [w for w in workers if w.proc.poll() is None]
    if not alive:
        return
    try:
        alive[0].proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _beat_dir(spec: StudySpec) -> Path:
    """Heartbeat files of local workers (their mtime is their last sign of progress)."""
    if spec.is_rdb_storage():
        return Path("runs") / spec.name / ".workers"
    return Path(spec.storage_url()).parent / spec.name / ".workers"


class OptunaBackend:
    name = "optuna"

    # ---- read-only -------------------------------------------------------------------------
    def load(self, spec: StudySpec) -> StudyResult:
        study = os_.open_study(spec, create=False)
        return os_.study_result(spec, study)

    # ---- run ---------------------------------------------------------------------------------
    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False) -> StudyResult:
        slots = self._plan(spec)
        # Workers start first and import while this process opens the store, the study and
        # the parent run; they train only once _supervise sends them the go.
        workers = [self._spawn(spec, s) for s in slots]
        try:
            return self._run(spec, workers, fresh, quiet)
        finally:
            for w in workers:
                if not w.started:  # no go was sent (an error above): it holds nothing yet,
                    _close_stdin(w)  # so it is stopped at once rather than waited for
                    w.proc.kill()
                    w.proc.wait()
                    for conn in w.tracking_ends:
                        conn.close()

    def _run(self, spec: StudySpec, workers: list[_Worker], fresh: bool, quiet: bool) -> StudyResult:
        from sweeps.live import LiveView

        tracker = tracker_for(spec)
        tracker.check_connection()  # before anything is created or trained
        with self._run_lock(spec):
            study = os_.open_study(spec, fresh=fresh)
            parent = find_or_create_parent(tracker, spec, study.study_name, self.name)
            if study.user_attrs.get(os_.ATTR_PARENT_RUN) != parent.run_id:
                study.set_user_attr(os_.ATTR_PARENT_RUN, parent.run_id)
            recovered = self._recover_orphans(spec, study, tracker)
            if spec.lr_finder.enabled:
                from sweeps.study_lr_finder import run_study_lr_finder

                run_study_lr_finder(spec, study, tracker, parent)
            started = time.time()
            deadline = started + spec.timeout_seconds() if spec.timeout_seconds() else None
            view = LiveView(spec, study.study_name, quiet=quiet, recovered=recovered)
            if os_.budget_left(study, spec.budget.n_trials) <= 0 and not study.get_trials(
                    deepcopy=False, states=(TrialState.RUNNING,)):
                # The whole budget has run: the workers get no go (they are stopped unstarted).
                stopped, code = (f"nothing to run: all {spec.budget.n_trials} trials of budget.n_trials have run; "
                                 "raise it to run more"), 0
            else:
                stopped, code, replaced = self._supervise(spec, study, workers, parent, started, deadline, view,
                                                          tracker)
                self._wait_for_writes(workers + replaced)
            result = os_.study_result(spec, optuna.load_study(study_name=study.study_name,
                                                              storage=os_.open_storage(spec)))
            result.stopped_reason = stopped
            write_summary(tracker, parent, result)
            tracker.end_run(parent, parent_status(result, code))
            view.finish(result)
        result.exit_code = code
        return result

    def _plan(self, spec: StudySpec) -> list[WorkerSlot]:
        devices = [] if spec.resources.devices == "cpu" else discover_devices(spec.resources.devices)
        slots = plan_workers(devices, spec.resources.gpus_per_trial, spec.resources.workers,
                             cpu_threads_available())
        if len(slots) > 1 and spec.storage_url().startswith("sqlite"):
            raise StudyStateError(
                f"storage: {spec.storage_url()!r} is SQLite, which parallel workers would lock "
                f"('database is locked'); with resources.workers={len(slots)} use the default journal file "
                f"(remove the storage key) or postgresql://...")
        return slots

    def _run_lock(self, spec: StudySpec):
        """One ``sweeps run`` per journal study at a time: a second one would race the first
        for orphaned trials. RDB studies may have many (plus ``sweeps worker``s)."""
        import contextlib

        if spec.is_rdb_storage():
            return contextlib.nullcontext()
        path = Path(f"{os_.journal_file(spec)}.runlock")  # absolute, like every journal path (journal_file.py)
        os_.make_folder(path.parent, f"storage: {spec.storage_url()}")  # a clear error if runs/ is a file

        @contextlib.contextmanager
        def held():
            with open(path, "a+") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fh.seek(0)
                    raise StudyStateError(f"study {spec.name!r} is already being run by another sweeps process "
                                          f"(pid {fh.read().strip() or '?'}); wait for it or stop it first")
                fh.seek(0)
                fh.truncate()
                fh.write(str(os.getpid()))
                fh.flush()
                yield

        return held()

    def _recover_orphans(self, spec: StudySpec, study: optuna.Study, tracker) -> list[int]:
        """Journal storage with the run lock held: every RUNNING trial belongs to a process
        that died (SIGKILL, OOM killer, power). Each is failed with the reason, its MLflow
        run closed as FAILED, and its parameters requeued to resume from its checkpoint."""
        if spec.is_rdb_storage():
            return []  # RDB: Optuna's heartbeat fails stale trials (see optuna_study.open_storage)
        from sweeps.backends.journal_repair import check_journal

        check_journal(spec.storage_url())
        stale_lock = Path(spec.storage_url() + ".lock")
        if stale_lock.is_symlink():
            stale_lock.unlink()  # Optuna's journal lock, left by a process killed mid-append
        recovered = []
        callback = recovery.StaleTrialCallback(spec.tracking_store_uri(), tracker)
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            reason = (f"orphaned: worker {t.user_attrs.get(os_.ATTR_WORKER, '?')} died while running it "
                      f"(killed or crashed); requeued to resume from its last checkpoint")
            study._storage.set_trial_user_attr(t._trial_id, os_.ATTR_REASON, reason)
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            callback(study, study._storage.get_trial(t._trial_id))
            recovered.append(t.number)
        recovery.close_orphan_runs(tracker, study)
        return recovered

    def _supervise(self, spec, study, workers, parent, started, deadline, view,
                   tracker) -> tuple[str, int, list[_Worker]]:
        """Send the go, then watch until every worker has exited: the live view and the parent
        run's best-so-far (from the study, so every worker's trials count, in order, and no
        worker waits on the store for it between trials), hung trials, signals. Returns why it
        stopped, the exit code, and the hung workers it killed and replaced (their writes are
        still to be waited for)."""
        go = _Go(parent.run_id, started, deadline, tracker)
        replaced: list[_Worker] = []
        for w in workers:
            self._go(w, go)
        got_signal: list[int] = []

        def forward(signum, _frame):
            got_signal.append(signum)
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        trial_timeout = spec.trial_timeout_seconds()
        stopped, code = "", 0
        try:
            finished = None
            while any(w.proc.poll() is None for w in workers):
                result = os_.study_result(spec, study)
                view.update_result(result)
                if len(result.finished()) != finished:
                    finished = len(result.finished())
                    update_parent_best(tracker, parent, result)
                if trial_timeout:
                    replaced += self._stop_hung(spec, study, workers, trial_timeout, go)
                _wait_any(workers, 0.5)  # returns as soon as a worker exits: no idle tail at the end
            codes = [w.proc.returncode for w in workers]
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        view.update(study)
        if got_signal:
            signum = got_signal[0]
            stopped = f"stopped by {signal.Signals(signum).name}; running trials were checkpointed and requeued"
            code = 128 + signum
        elif EXIT_MAX_FAILURES in codes:
            stopped = f"stopped: {spec.budget.max_failures} trials failed in a row (budget.max_failures)"
            code = 1
        elif deadline and time.time() >= deadline and os_.budget_left(study, spec.budget.n_trials) > 0:
            stopped = f"stopped: budget.timeout ({spec.budget.timeout}) reached; run the command again to continue"
        elif any(c not in (0, None) for c in codes):
            stopped = f"workers exited with codes {codes}"
            code = 1
        return stopped, code, replaced

    def _spawn(self, spec: StudySpec, slot: WorkerSlot) -> _Worker:
        """Start a worker that warms up, then waits on its stdin for :meth:`_go`, or adopt one
        ``sweeps run`` started before validating the spec (early_worker.py) for a CPU slot.
        Nothing is written yet: if the set-up fails, the worker is killed and leaves no trace."""
        beat = _beat_dir(spec) / f"worker-{slot.index}.beat"
        local = adopt_early_worker(spec.path) if not slot.devices and spec.path is not None else None
        if local is None:
            local = spawn_worker(spec.path, slot.env())
        return _Worker(slot, local.proc, beat, local.tracking_ends)

    def _go(self, w: _Worker, go: _Go) -> None:
        """Tell a waiting worker which parent run and budget window it works for."""
        w.beat_file.parent.mkdir(parents=True, exist_ok=True)
        # The worker creates the file at its trial's first beat: the hang watchdog counts from
        # there. Start-up (imports, opening the study) is not a trial; counting it made a fresh
        # worker slower to start than budget.trial_timeout be killed again and again.
        w.beat_file.unlink(missing_ok=True)
        try:
            w.proc.stdin.write(json.dumps({"parent_run_id": go.parent_id, "since": go.started, "deadline": go.deadline,
                                           "slot": w.slot.index, "beat_file": str(w.beat_file),
                                           "env": w.slot.env()}) + "\n")
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died while warming up: _supervise sees its exit code
        w.started = True
        _close_stdin(w)
        if not w.slot.writer_process:
            # This process writes for it: MLflow is imported and the store open here already, so
            # the worker saves their seconds of start-up (sweeps.tracking.writer).
            tracker = go.tracker
            w.writer = serve_in_thread(w.tracking_ends, lambda: MlflowTracker(
                tracker.tracking_uri, spool_dir=tracker.spool.directory, artifact_root=tracker.artifact_root,
                client=tracker.client), name=f"worker-{w.slot.index}")
        else:  # it starts a writer process of its own and closes its end: nothing to serve
            for conn in w.tracking_ends:
                conn.close()

    @staticmethod
    def _wait_for_writes(workers: list[_Worker]) -> None:
        """Every worker has exited: let the threads serving their writes write what they hold
        (each ends when its worker's pipe closes) before the summary is written."""
        for w in workers:
            if w.writer is not None:
                w.writer.join(timeout=120)
                if w.writer.is_alive():
                    log.warning("the MLflow writes of worker %d are still being written after 120 s; "
                                "the summary is written without waiting for them", w.slot.index)

    def _stop_hung(self, spec, study, workers, trial_timeout, go: _Go) -> list[_Worker]:
        """A worker whose trial made no progress for budget.trial_timeout is killed; its trial
        is failed with the reason (not requeued: it would likely hang again) and the slot,
        with its devices, gets a fresh worker. A worker that has not begun a trial since its
        go is left alone. Returns the killed workers."""
        killed = []
        for i, w in enumerate(workers):
            if w.proc.poll() is not None:
                continue
            try:
                idle = time.time() - w.beat_file.stat().st_mtime
            except FileNotFoundError:
                continue  # still starting: no trial yet
            if idle < trial_timeout:
                continue
            w.proc.kill()
            w.proc.wait()
            worker_id = f"{os.uname().nodename}:{w.proc.pid}"
            reason = f"hung: no progress for {idle:.0f} s (budget.trial_timeout={spec.budget.trial_timeout})"
            hung = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if t.user_attrs.get(os_.ATTR_WORKER) == worker_id]
            for t in hung:
                recovery.fail_trial(study, t, reason, requeue=False, tracking_uri=spec.tracking_store_uri())
            log.warning("%s, %s: its worker was killed and a fresh one takes slot %d",
                        ", ".join(f"trial {t.number} failed" for t in hung) or "no trial", reason, w.slot.index)
            killed.append(w)
            workers[i] = self._spawn(spec, w.slot)
            self._go(workers[i], go)
        return killed
