"""One Optuna worker: takes trials from the shared study until its total budget is met.

``sweeps run`` starts one per pool slot on this machine; ``sweeps worker SPEC`` starts one
on any machine that reaches a shared RDB storage. Both run this loop.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from sweeps import search_space as ss
from sweeps.backends import optuna_study as os_
from sweeps.objective import TrialSpec, run_trial, worker_name
from sweeps.spec import StudySpec
from sweeps.study_run import tracker_for, update_parent_best
from sweeps.tracking.base import RunHandle

EXIT_OK, EXIT_MAX_FAILURES = 0, 3
log = logging.getLogger("sweeps")


class _Signals:
    """SIGTERM / SIGINT set an event the running trial polls at every optimizer step:
    it then saves a checkpoint and stops; the worker marks it FAIL and requeues it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signum = signum
        self.event.set()

    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else EXIT_OK


def trial_dir(spec: StudySpec, study_name: str, number: int) -> Path:
    base = spec.journal_path().parent if spec.journal_path() else Path("runs")
    return base / study_name / f"trial-{number:04d}"


def _failures_in_a_row(study: optuna.Study, since: datetime) -> int:
    """FAIL trials at the end of this invocation's finished trials (signals excluded)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                 TrialState.FAIL))
            if t.datetime_complete and t.datetime_complete >= since and not t.user_attrs.get("interrupted")]
    done.sort(key=lambda t: t.datetime_complete)
    n = 0
    for t in reversed(done):
        if t.state != TrialState.FAIL:
            break
        n += 1
    return n


def run_worker(spec: StudySpec, worker_index: int = 0, parent_run_id: str | None = None,
               deadline: float | None = None, since: float | None = None,
               beat_file: Path | None = None) -> int:
    """The worker loop. Returns the process exit code."""
    threads = os.environ.get("SWEEPS_WORKER_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    signals = _Signals()
    study = os_.open_study(spec, worker_index=worker_index)
    since_dt = datetime.fromtimestamp(since or time.time())
    tracker = tracker_for(spec)
    experiment_id = tracker.get_or_create_experiment(spec.experiment_name())
    parent_id = parent_run_id or study.user_attrs.get(os_.ATTR_PARENT_RUN)
    if parent_id is None:
        log.error("study %s has no MLflow parent run yet; start the study once with: sweeps run %s",
                  study.study_name, spec.path)
        return 2
    parent = RunHandle(parent_id, experiment_id, spec.name)
    n_trials = spec.budget.n_trials

    while not signals.event.is_set():
        if deadline is not None and time.time() >= deadline:
            break
        if _failures_in_a_row(study, since_dt) >= spec.budget.max_failures:
            log.error("stopping: %d trials failed in a row (budget.max_failures=%d); see the reasons with "
                      "sweeps status %s", spec.budget.max_failures, spec.budget.max_failures, spec.path)
            return EXIT_MAX_FAILURES
        if os_.is_rdb_heartbeat(study):
            optuna.storages.fail_stale_trials(study)  # a dead worker's trial is failed and requeued
        with os_.ask_lock(spec):
            if os_.budget_left(study, n_trials) <= 0:
                break
            trial = study.ask()
        code = _run_one(spec, study, trial, tracker, parent, worker_index, signals, beat_file)
        if code is not None:
            return code
    return signals.exit_code()


def _run_one(spec, study, trial, tracker, parent, worker_index, signals, beat_file) -> int | None:
    params = ss.suggest(trial, os_.effective_search(spec, study))
    retry_of = study._storage.get_trial(trial._trial_id).system_attrs.get("failed_trial")
    out_dir = Path(trial.user_attrs.get(os_.ATTR_OUT_DIR) or trial_dir(spec, study.study_name, trial.number))
    overrides = dict(trial.user_attrs.get(os_.ATTR_BATCH_OVERRIDES) or {})
    trial.set_user_attr(os_.ATTR_OUT_DIR, str(out_dir))
    trial.set_user_attr(os_.ATTR_WORKER, worker_name())
    tags = {"sweeps.worker_slot": worker_index, "sweeps.optuna_trial_id": trial._trial_id}
    if retry_of is not None:
        tags["sweeps.retry_of_trial"] = retry_of
    beat = _heartbeat(study, trial, beat_file)

    def should_prune(epoch: int, value: float) -> bool:
        trial.report(value, epoch)
        return trial.should_prune()

    # A retry (crash, SIGTERM) reuses the original's folder and resumes from its last checkpoint.
    resume = (out_dir / "last.pt").exists() or (out_dir / "last.prev.pt").exists()
    spec_trial = TrialSpec(trial.number, params, out_dir, resume=resume, tags=tags, overrides=overrides)
    outcome = run_trial(spec, tracker, parent, spec_trial, "optuna", should_prune, signals.event, beat,
                        on_start=lambda run: trial.set_user_attr(os_.ATTR_RUN_ID, run.run_id))
    if outcome.value is not None:
        trial.set_user_attr("best_value", outcome.value)
    if outcome.reason:
        trial.set_user_attr(os_.ATTR_REASON, outcome.reason)

    exhausted = False
    if outcome.state == "COMPLETE":
        exhausted = _tell(study, trial, values=outcome.value)
    elif outcome.state == "PRUNED":
        exhausted = _tell(study, trial, state=TrialState.PRUNED)
    else:
        if outcome.state == "INTERRUPTED":
            trial.set_user_attr("interrupted", True)
        exhausted = _tell(study, trial, state=TrialState.FAIL)
        frozen = study._storage.get_trial(trial._trial_id)
        if outcome.state == "INTERRUPTED":
            # Requeue the same parameters; the retry resumes from the checkpoint just saved.
            RetryHeartbeatStaleTrialCallback(max_retry=os_.MAX_RETRIES)(study, frozen)
        elif outcome.oom and spec.budget.oom_retry_smaller_batch and not overrides:
            os_.enqueue_smaller_batch(spec, study, frozen)
    update_parent_best(tracker, parent, os_.study_result(spec, study))
    if outcome.state == "INTERRUPTED":
        return signals.exit_code()
    if exhausted:
        log.warning("the grid of search values is exhausted; this worker stops")
        return EXIT_OK
    return None


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


def _heartbeat(study: optuna.Study, trial: optuna.Trial, beat_file: Path | None):
    """Called by the trial about once a second: touches the worker's beat file (the local
    orchestrator stops a trial with no progress for budget.trial_timeout) and, on RDB
    storage, records Optuna's heartbeat so other machines can tell this worker is alive."""
    storage = study._storage
    rdb = os_.is_rdb_heartbeat(study)

    def beat() -> None:
        if beat_file is not None:
            beat_file.touch()
        if rdb:
            storage.record_heartbeat(trial._trial_id)

    beat()
    return beat


def main(argv: list[str] | None = None) -> int:
    """Entry point of a local worker process started by ``sweeps run``."""
    import argparse

    from sweeps.spec import load_spec

    p = argparse.ArgumentParser(prog="sweeps-worker")
    p.add_argument("spec")
    p.add_argument("--slot", type=int, default=0)
    p.add_argument("--parent-run-id")
    p.add_argument("--deadline", type=float)
    p.add_argument("--since", type=float)
    p.add_argument("--beat-file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    spec = load_spec(a.spec)
    return run_worker(spec, a.slot, a.parent_run_id, a.deadline, a.since, Path(a.beat_file) if a.beat_file else None)


if __name__ == "__main__":
    sys.exit(main())
