"""The owner of ``sweeps run``'s local Optuna workers, from their start to their exit.

One worker process per pool slot. Whatever ends a worker (a clean exit, an exit code, a
signal such as the OOM killer's SIGKILL), the trial it was running is failed with the true
cause, its MLflow run closed, its parameters requeued to resume from their checkpoint, and
the slot gets a fresh worker while the budget has trials left. Signals and the study's
timeout stop every worker in every phase of a trial: each is asked to checkpoint and stop
(SIGTERM), and one that has not stopped after a grace period is killed and its trial
requeued the same way. The exit code says whether the budget finished.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import TrialState

from sweeps.backends import optuna_attrs, optuna_storage, optuna_study, worker_forkserver
from sweeps.backends import optuna_recovery as recovery
from sweeps.backends.driver import DriverSignals, max_failures_stop
from sweeps.backends.trial_liveness import StaleTrialMonitor
from sweeps.backends.worker_forkserver import WORKER_MODULE, WorkerProcess, die_with_parent
from sweeps.backends.worker_protocol import WorkerGo
from sweeps.durations import ENV_STOP_GRACE, stop_grace_seconds
from sweeps.errors import StoreGone
from sweeps.slot_plan import WorkerSlot
from sweeps.spec.model import StudySpec
from sweeps.stop_signals import STOP_SIGNALS, after_hangup
from sweeps.worker_identity import boot_id, worker_identity

log = logging.getLogger("sweeps")
CRASH_LOOP = 3  # workers in a row that die before their first trial stop the study


def describe_exit(returncode: int) -> str:
    """Why a worker process ended, in a user's words."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        if sig is signal.SIGKILL:
            return "its worker was killed by SIGKILL (the kernel's out-of-memory killer, a kill -9, or a crash)"
        return f"its worker was killed by {sig.name}"
    if returncode == 0:
        return ("its worker process exited with code 0 in the middle of the trial (the task, or a library it "
                "calls, ended the process, e.g. with os._exit)")
    return f"its worker process exited with code {returncode} in the middle of the trial"


# A worker process's first lines: SIGINT, SIGTERM and SIGHUP end it quietly (128 + n) before anything is
# imported, so a Ctrl-C while its supervisor starts (its workers still importing, the packages' __init__s
# included) prints no traceback; the worker sets its own handlers once it has its go. The module
# is its own argument, so `ps` shows which process this is.
_WORKER_BOOT = ("import os, runpy, signal, sys\n"
                "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
                "    signal.signal(s, lambda n, _f: os._exit(128 + n))\n"
                "from core.faults import pause_here\n"  # stdlib only: cheap
                "pause_here('worker_importing')\n"
                "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)")


def worker_command() -> list[str]:
    return [sys.executable, "-c", _WORKER_BOOT, WORKER_MODULE]


def spawn_worker(slot: WorkerSlot) -> WorkerProcess:
    """A worker process of its own for ``slot`` (``sweeps worker --devices``): it imports what
    trials use, then waits for its go on stdin. If the supervisor dies, even by SIGKILL, so does
    it, and the next ``sweeps run`` finds its trial orphaned and requeues it."""
    boot_id()  # settled first: the worker then names itself as LocalWorker.name does
    return subprocess.Popen(worker_command(), env={**os.environ, **slot.env()}, stdin=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)


def fork_worker(slot: WorkerSlot) -> WorkerProcess:
    """A worker for ``slot`` forked from the fork server (``sweeps run``: worker_forkserver), which
    imported what trials use while the driver set up; it waits for its go on ``stdin``."""
    boot_id()  # settled first: the worker then names itself as LocalWorker.name does
    return worker_forkserver.fork_worker({**os.environ, **slot.env()}, slot.index)


@dataclass
class LocalWorker:
    slot: WorkerSlot
    proc: WorkerProcess
    beat_file: Path
    kill_reason: str = ""  # set when the supervisor kills it (hung trial, stop grace over)
    requeue_on_kill: bool = True
    handled: bool = False

    @property
    def name(self) -> str:
        """How its trials name it (``worker_identity()`` in the worker: same host, same boot)."""
        return worker_identity(self.proc.pid)

    def began_a_trial(self) -> bool:
        return self.beat_file.exists()


@dataclass
class Supervisor:
    spec: StudySpec
    study: optuna.Study
    go_for: Callable[[WorkerSlot, Path], WorkerGo]  # a slot's go message
    beat_dir: Path
    since: float
    deadline: float | None
    # Live view, parent run and the MLflow store's outage check, about twice a second.
    on_progress: Callable[[], None]
    workers: list[LocalWorker] = field(default_factory=list)
    stopping: str = ""  # why the workers were told to stop ("" while they run)
    signum: int | None = None
    stop_at: float = 0.0
    early_deaths: int = 0
    max_failures_code: int = 1  # the exit code for budget.max_failures (`sweeps worker` says 3)
    forked: bool = False  # workers forked from the fork server (sweeps run), else processes of their own
    driver_signals: DriverSignals | None = None  # what took the signals before this (sweeps run's driver)
    storage_lost: StoreGone | None = None  # the Optuna storage or the MLflow store stayed away past its wait
    # How a slot's worker starts; None: fork_worker or spawn_worker, as ``forked`` says. The
    # bookkeeping above does not depend on it: its tests give workers that live in their process.
    spawner: Callable[[WorkerSlot], WorkerProcess] | None = None

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, slots: list[WorkerSlot]) -> tuple[str, int]:
        """Start a worker per slot and watch them until all have exited and none is to be
        replaced. Returns why it stopped ("" when the budget finished) and the exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        monitor: StaleTrialMonitor | None = None
        try:
            # Dead workers' trials (another machine's, or one of ours that the heartbeat finds
            # first) are failed on a timer, also while every worker here is busy in a long trial.
            monitor = StaleTrialMonitor.start_for(self.spec, self.study)
            if self.driver_signals is not None and self.driver_signals.signum:
                # It came after the driver's last look and before the handlers above took over.
                self._on_signal(self.driver_signals.signum, None)
            for slot in slots:
                if self.stopping:  # a signal while the workers start: no more of them
                    break
                self._start(slot)
            while True:
                try:
                    for w in list(self.workers):
                        if w.proc.poll() is not None and not w.handled:
                            self._handle_exit(w)
                    # Only handled ones: a worker that exits after the look above is handled (and
                    # replaced) on the next round, not left with its trial when the loop ends.
                    if all(w.handled for w in self.workers):
                        break
                    self.on_progress()
                except StoreGone as exc:  # waited for as long as allowed: stop as on SIGTERM
                    self.storage_lost = self.storage_lost or exc
                    self._stop(str(exc))
                self._check_hung()
                self._check_deadline()
                self._check_stop_grace()
                self._wait_any(0.5)
        finally:
            if monitor is not None:
                monitor.stop()
            for s, handler in old.items():
                signal.signal(s, handler)
            for w in self.workers:  # an error above: nobody may be left behind
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait()
        self._fail_orphans()
        return self._verdict()

    def _on_signal(self, signum, _frame) -> None:
        after_hangup(signum)
        if self.signum is not None:  # a second Ctrl-C / SIGTERM: stop now, not at the next checkpoint
            for w in self.workers:
                self._kill(w, f"stopped by a second {signal.Signals(signum).name} before it checkpointed")
            return
        self.signum = signum
        self._stop(f"stopped by {signal.Signals(signum).name}", signum)

    def _stop(self, why: str, signum: int = signal.SIGTERM) -> None:
        """Ask every worker to checkpoint its trial and exit (their trials are requeued)."""
        if self.stopping:
            return
        self.stopping, self.stop_at = why, time.monotonic()
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signum)

    def _check_deadline(self) -> None:
        if self.deadline is not None and not self.stopping and time.time() >= self.deadline:
            self._stop(f"budget.timeout ({self.spec.budget.timeout}) reached")

    def _check_stop_grace(self) -> None:
        if self.stopping and time.monotonic() - self.stop_at > stop_grace_seconds():
            for w in self.workers:
                self._kill(w, f"{self.stopping}; it did not stop within {stop_grace_seconds():.0f} s "
                              f"({ENV_STOP_GRACE}), so it was killed")

    def _check_hung(self) -> None:
        """A trial with no progress for budget.trial_timeout: its worker is killed and the trial
        failed with the reason, not requeued (it would likely hang again)."""
        limit = self.spec.trial_timeout_seconds()
        if not limit or self.stopping:
            return
        for w in self.workers:
            try:
                idle = time.time() - w.beat_file.stat().st_mtime
            except FileNotFoundError:
                continue  # still starting: no trial yet
            if idle >= limit and w.proc.poll() is None:
                self._kill(w, f"hung: no progress for {idle:.0f} s (budget.trial_timeout="
                              f"{self.spec.budget.trial_timeout})", requeue=False)

    def _kill(self, w: LocalWorker, reason: str, requeue: bool = True) -> None:
        if w.proc.poll() is None:
            w.kill_reason, w.requeue_on_kill = reason, requeue
            w.proc.kill()
            w.proc.wait()

    # ---- a worker ended ----------------------------------------------------------------------
    def _handle_exit(self, w: LocalWorker) -> None:
        """Fail and requeue the trial it left RUNNING (with the true cause), then replace it
        while the budget has trials left."""
        w.handled = True
        code = w.proc.wait()  # it has exited: its code at once
        orphans = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if t.user_attrs.get(optuna_attrs.ATTR_WORKER) == w.name]
        cause = w.kill_reason or describe_exit(code)
        for t in orphans:
            interrupted = bool(self.stopping)  # stopped by the user or the timeout: not the trial's fault
            if not recovery.fail_trial(self.study, t, cause, requeue=w.requeue_on_kill,
                                       tracking_uri=self.spec.tracking_store_uri(), interrupted=interrupted,
                                       lock=lambda: optuna_storage.ask_lock(self.spec)):
                continue  # the stale-trial check failed and requeued it first
            log.warning("trial %d failed: %s%s", t.number, cause,
                        "; requeued to resume from its last checkpoint" if w.requeue_on_kill else "")
        if self.stopping:
            return
        if not orphans and code == 0 and not self._retry_waiting():
            return  # a clean end: the budget is taken, or the grid exhausted
        if not w.began_a_trial():
            self.early_deaths += 1
            if self.early_deaths >= CRASH_LOOP:
                self.stopping = (f"stopped: {CRASH_LOOP} workers in a row exited before their first trial "
                                 f"(last: {describe_exit(code)}); see the messages above")
                return
        else:
            self.early_deaths = 0
        if optuna_study.failures_in_a_row(self.study, self.since) >= self.spec.budget.max_failures:
            return  # the other workers see it too and stop; _verdict says why
        if optuna_study.budget_left(self.study, self.spec.budget.n_trials) > 0:
            log.warning("a fresh worker takes slot %d", w.slot.index)
            self._start(w.slot)

    def _retry_waiting(self) -> bool:
        """A requeued trial WAITING that the budget has room for: a worker that left cleanly may
        have looked between a dead trial's FAIL and its retry's enqueue (Optuna's stale-trial
        check writes them one after the other), as may every other worker; its slot gets a
        fresh worker, so the retry runs."""
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) and (
            optuna_study.budget_left(self.study, self.spec.budget.n_trials) > 0)

    def _fail_orphans(self) -> None:
        """Every worker has exited: on a journal study (this process holds its run lock) a trial
        still RUNNING belongs to none of them (a worker died between asking for it and naming
        itself on it); it is failed and requeued so that no trial stays RUNNING."""
        if self.spec.is_rdb_storage():
            return
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            recovery.fail_trial(self.study, t, "its worker died before the trial began",
                                requeue=True, tracking_uri=self.spec.tracking_store_uri(),
                                interrupted=bool(self.stopping))

    def _verdict(self) -> tuple[str, int]:
        study, spec = self.study, self.spec
        if self.storage_lost is not None:
            return str(self.storage_lost), self.storage_lost.exit_code
        if self.signum is not None:
            return f"{self.stopping}; running trials were checkpointed and requeued", 128 + self.signum
        if optuna_study.failures_in_a_row(study, self.since) >= spec.budget.max_failures:
            message, _ = max_failures_stop(spec.budget.max_failures)  # the same words on Ray
            return message, self.max_failures_code
        if self.stopping.startswith("budget.timeout"):
            return f"stopped: {self.stopping}; run the command again to continue", 0
        if self.stopping:
            return self.stopping, 1
        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        if done >= spec.budget.n_trials:
            return "", 0
        if spec.sampler.name == "grid" and optuna_study.budget_left(study, spec.budget.n_trials) > 0:
            return f"stopped: the grid of search values is exhausted after {done} trials", 0
        return (f"stopped with {done} of {spec.budget.n_trials} trials finished: the workers exited; see the "
                "messages above and `sweeps status`", 1)

    # ---- starting ----------------------------------------------------------------------------
    def _start(self, slot: WorkerSlot) -> None:
        """A worker for ``slot``: it reads its go (the spec snapshot, the study, its slot) from
        its stdin or go pipe. A trial's beat file is made at its first beat: the hang watchdog counts from there."""
        # The supervisor's pid in the name: a `sweeps run` and a `sweeps worker` on one machine share the folder.
        beat = self.beat_dir / f"worker-{os.getpid()}-{slot.index}-{len(self.workers)}.beat"
        beat.parent.mkdir(parents=True, exist_ok=True)
        beat.unlink(missing_ok=True)
        try:
            proc = self.spawner(slot) if self.spawner else fork_worker(slot) if self.forked else spawn_worker(slot)
        except worker_forkserver.ServerGone:
            if self.stopping:
                return  # a signal ended the server as it imported (the driver has it): nothing to start
            proc = fork_worker(slot)  # it was killed: a fresh one imports again; a second failure is the error
        assert proc.stdin is not None  # its go pipe
        try:
            if not self.stopping:  # a signal while it was forked (the server still importing): EOF, a clean stop
                proc.stdin.write(self.go_for(slot, beat).to_line())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it died at once: the loop sees its exit code
        self.workers.append(LocalWorker(slot, proc, beat))

    def _wait_any(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, less if the first live worker exits meanwhile."""
        alive = [w for w in self.workers if w.proc.poll() is None]
        if alive:
            try:
                alive[0].proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

