"""``sweeps run`` on Ray Tune: the same study as under Optuna, run by ``ray.tune.Tuner``.

The driver never trains. It checks MLflow, finds or creates the study's parent run,
starts Ray locally (this machine's CPUs and GPUs, no dashboard) or joins a cluster
(``resources.ray_address``), builds the Tuner (or restores the experiment a killed or
stopped driver left in ``runs/ray/<study>``), and after the fit reads every trial back
from the experiment state (:mod:`sweeps.backends.ray_records`), settles the MLflow runs
with the final Ray states, and writes the same summary as the Optuna backend.

Each trial runs :func:`sweeps.backends.ray_trainable.run_ray_trial`, which calls the
shared ``sweeps.trial.run_trial``: the MLflow layout is the Optuna backend's.

Budget: ``n_trials`` is Ray's ``num_samples``; ``max_failures`` is Ray's per-trial
``FailureConfig`` (a failing trial is retried that many times from its latest
checkpoint, then marked FAIL) and, as under Optuna, that many failed trials in a row stop
the study (exit 1, :mod:`sweeps.backends.driver`); ``timeout`` stops this
invocation the resumable way: Ray saves the experiment with the running trials'
checkpoints, and the next ``sweeps run`` resumes them (Ray's ``time_budget_s`` would
instead terminate them for good and end the search). SIGTERM and SIGINT do the same,
with exit code 143 and 130. A fit that ends with trials failed exits 1.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from core import faults
from sweeps.backends import ray_records as rr
from sweeps.backends.base import StudyResult
from sweeps.backends.driver import DriverSignals, max_failures_stop, run_lock, stopped_by, unfinished_stop
from sweeps.backends.ray_cluster import Interrupts, init_ray, quiet_ray_noise, shutdown_ray
from sweeps.backends.ray_live import LIVE, DriverCallback
from sweeps.backends.ray_search import make_scheduler, make_search, plan_resources
from sweeps.backends.ray_trainable import (
    TAG_RAY_TRIAL_ID,
    TrialContext,
    TrialNamer,
    ended_for_good,
    make_trainable,
    trial_dirname,
)
from sweeps.errors import StudyStateError
from sweeps.live import LiveView
from sweeps.parent_run import (
    find_or_create_parent,
    parent_status,
    reader_for,
    tracker_for,
    write_summary,
)
from sweeps.spec import search_space as ss
from sweeps.spec.model import StudySpec
from sweeps.spec.objectives import judged_by, judged_by_changes
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, RunStatus, Tracker
from sweeps.tracking.reader import TrackingReader

log = logging.getLogger("sweeps")


class RayBackend:
    name = "ray"

    # ---- read-only -------------------------------------------------------------------------------
    def load(self, spec: StudySpec) -> StudyResult:
        study_name = rr.current_study_name(spec)
        if study_name is None:
            raise StudyStateError(f"study {spec.name!r} has not run on Ray yet (nothing in {rr.ray_root()}); "
                                  f"start it with: sweeps run {spec.path or '<spec>'}")
        return rr.load_result(spec, study_name, reader_for(spec))

    # ---- run -------------------------------------------------------------------------------------
    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False,
            on_locked: Callable[[], None] | None = None) -> StudyResult:
        with DriverSignals() as early:
            return self._run(spec, fresh, quiet, early, on_locked or (lambda: None))

    def _run(self, spec: StudySpec, fresh: bool, quiet: bool, early: DriverSignals,
             on_locked: Callable[[], None]) -> StudyResult:
        tracker = tracker_for(spec)
        tracker.check_connection()  # before anything is created or trained
        study_name = self._study_name(spec, fresh)
        path = rr.lock_path(study_name)  # one driver per study (a second would restore the same experiment)
        path.parent.mkdir(parents=True, exist_ok=True)
        with run_lock(path, study_name):
            on_locked()
            meta = self._checked_meta(spec, study_name)
            parent = find_or_create_parent(tracker, spec, study_name, self.name, study_uid=meta.get("study_uid"))
            rr.write_meta(study_name, {**meta, "parent_run_id": parent.run_id})
            view = LiveView(spec, study_name, quiet=quiet)
            try:
                stopped, code = "", 0
                if not _is_complete(spec, rr.load_result(spec, study_name, live=False)):
                    try:
                        stopped, code = self._fit(spec, study_name, parent, tracker, view, meta.get("study_uid"),
                                                  early)
                    except Exception:  # e.g. the cluster refused this driver: the parent must not stay RUNNING
                        with contextlib.suppress(Exception):
                            tracker.end_run(parent, "FAILED")
                        raise
            finally:
                if view._live is not None:  # a failed fit must not leave the rich display running
                    view._live.stop()
                    view._live = None
            result = rr.load_result(spec, study_name, reader_for(spec), live=False)
            settle_runs(tracker, reader_for(spec), result)
            if early.signum and not stopped:  # while it started, or before it ended
                stopped, code = _stopped_by(early.signum)
            if not stopped and any(t.state in ("RUNNING", "WAITING") for t in result.trials):
                stopped, code = "stopped (interrupted); run the command again to resume the unfinished trials", 130
            elif not stopped and not _is_complete(spec, result):
                done, failed = len(result.finished()), result.counts().get("FAIL", 0)
                stopped, code = unfinished_stop(done, _budget_size(spec), failed, spec.path)
            result.stopped_reason = stopped
            faults.signal_here(faults.Fault.DRIVER_SIGTERM_AT_END)
            write_summary(tracker, parent, result)
            if early.signum and code < 128:  # while it ended: the summary above is complete
                stopped, code = _stopped_by(early.signum)
                result.stopped_reason = stopped
            tracker.end_run(parent, parent_status(result, code))  # reopened by the next invocation
            view.finish(result)
        if code < 128:  # not after a stop: the writes kept in an outage are sent now, or said to be kept
            tracker.send_spooled()
        result.exit_code = code
        return result

    def _study_name(self, spec: StudySpec, fresh: bool) -> str:
        found = rr.versions(spec)
        if not found:
            return spec.name
        if fresh:
            return f"{spec.name}-v{found[-1][0] + 1}"
        return found[-1][1]

    def _checked_meta(self, spec: StudySpec, study_name: str) -> dict:
        """What the study was started with; a resumed study must not change it."""
        wanted = {"search": ss.signature(spec.search), "n_trials": spec.budget.n_trials,
                  "sampler": spec.sampler.model_dump(), "pruner": spec.pruner.model_dump(),
                  "direction": spec.objective.direction, "metric": spec.objective.metric}
        stored = rr.read_meta(study_name)
        if (stored is not None and stored.get("joined") is False and all(stored.get(k) == wanted[k] for k in wanted)
                and stored.get("judged_by") == judged_by(spec)):
            # The last driver never joined Ray (a missing token, a wrong ray_address) or was
            # stopped as it did: no trial ran, so this is the same study, with the same parent run.
            return {**stored, "spec_hash": spec.spec_hash()}
        if stored is None or not (rr.ray_root() / study_name).exists():
            # A new identity, also for a name reused after runs/ray/<study> was deleted: its parent
            # run and trial folders are its own, never the old study's (sweeps.trial_folder).
            return {**wanted, "spec_hash": spec.spec_hash(), "created": time.time(), "study_uid": uuid.uuid4().hex,
                    "judged_by": judged_by(spec), "joined": False}
        judged, stored_judged = judged_by(spec), stored.get("judged_by", {})
        if message := judged_by_changes(stored_judged, judged, study_name, spec.path):
            raise StudyStateError(message)
        stored = {**stored, "judged_by": {**judged, **stored_judged}}  # a part stored from now on
        changed = sorted(k for k in wanted if stored.get(k) != wanted[k])
        if changed:
            raise StudyStateError(
                f"study {study_name!r} was started on Ray with a different {', '.join(changed)} "
                f"(stored {[stored.get(k) for k in changed]}, spec {[wanted[k] for k in changed]}); a Ray "
                f"experiment keeps its search space, budget, sampler and pruner. Restore the spec, or start a "
                f"new study with: sweeps run {spec.path or '<spec>'} --fresh")
        return stored

    def _fit(self, spec: StudySpec, study_name: str, parent: RunHandle, tracker, view,
             study_uid: str | None, early: DriverSignals) -> tuple[str, int]:
        import ray
        from ray import tune
        from ray.tune.logger import JsonLoggerCallback

        # Trials run in the driver's working directory (relative paths in the spec mean the
        # same there); sweeps writes its own per-epoch JSON results, not Ray's CSV/TensorBoard.
        os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
        os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
        # The live view prints each trial's end (with the failure reason) and each retry;
        # Ray's own tables and tracebacks stay in its files (error.txt per trial).
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
        # SIGINT is handled as SIGTERM is (ray_cluster.Interrupts): Ray's own handler would end
        # the fit without telling this driver, which then could not say it was interrupted.
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
        quiet_ray_noise()
        if early.signum:
            return _stopped_by(early.signum)
        started_ray = False
        with early.around_ray_init():
            started_ray = init_ray(spec)
            faults.signal_here(faults.Fault.DRIVER_SIGTERM_AT_START)
        try:
            if early.signum:  # stopped before a trial could run: the next driver is the same study
                return _stopped_by(early.signum)
            if (meta := rr.read_meta(study_name) or {}).get("joined") is False:  # from now on trials may run
                rr.write_meta(study_name, {**meta, "joined": True})
            res = plan_resources(spec, ray.cluster_resources())
            ctx = TrialContext(spec=spec, study_name=study_name, parent=parent,
                               trials_dir=str(trials_dir(study_name)), cwd=os.getcwd(), threads=res.threads,
                               gpus=res.gpus, study_uid=study_uid)
            trainable = tune.with_resources(make_trainable(ctx), {"cpu": res.cpus, "gpu": res.gpus})
            path = rr.ray_root() / study_name
            if tune.Tuner.can_restore(str(path)):
                tuner = tune.Tuner.restore(str(path), trainable=trainable, resume_errored=True)
            else:
                search_alg, space, num_samples, first = make_search(spec, res.workers)
                tuner = tune.Tuner(
                    trainable, param_space=space,
                    tune_config=tune.TuneConfig(
                        search_alg=search_alg, scheduler=make_scheduler(spec), num_samples=num_samples,
                        reuse_actors=True,
                        trial_name_creator=TrialNamer(first), trial_dirname_creator=trial_dirname),
                    run_config=tune.RunConfig(
                        name=study_name, storage_path=str(rr.ray_root()), verbose=0,
                        failure_config=tune.FailureConfig(max_failures=spec.budget.max_failures),
                        # PBT exploits other trials' checkpoints of any age: keep them all;
                        # otherwise the latest two are enough to resume or retry a trial.
                        checkpoint_config=tune.CheckpointConfig(
                            num_to_keep=None if spec.pruner.name == "pbt" else 2),
                        callbacks=[DriverCallback(), JsonLoggerCallback()]))
            with Interrupts(spec.timeout_seconds(), early) as interrupts:
                LIVE.update(spec=spec, study=study_name, tracker=tracker, parent=parent, view=view, history={},
                            drawn=0.0, ended=[], interrupts=interrupts)
                tuner.fit()
        finally:
            LIVE.clear()
            if started_ray:
                shutdown_ray()
                early.reinstall()  # ray.shutdown resets SIGTERM: the end of the study must not die on one
        if interrupts.lost is not None:
            return str(interrupts.lost), interrupts.lost.exit_code
        if interrupts.signum:
            return _stopped_by(interrupts.signum)
        if interrupts.stop_reason == "max_failures":
            return max_failures_stop(spec.budget.max_failures)
        if interrupts.timed_out:
            return f"stopped: budget.timeout ({spec.budget.timeout}) reached; run the command again to continue", 0
        return "", 0


def _stopped_by(signum: int) -> tuple[str, int]:
    return stopped_by(signum, "running trials were checkpointed and resume on the next sweeps run")


def _is_complete(spec: StudySpec, result: StudyResult) -> bool:
    """Every trial of the budget finished (COMPLETE or PRUNED): nothing for Ray to do.
    Failed trials are retried by the next run (``resume_errored``)."""
    return len(result.trials) >= _budget_size(spec) and all(t.state in ("COMPLETE", "PRUNED") for t in result.trials)


def _budget_size(spec: StudySpec) -> int:
    return ss.grid_size(spec.search) if spec.sampler.name == "grid" else spec.budget.n_trials


# ---- where ---------------------------------------------------------------------------------------
def trials_dir(study_name: str) -> Path:
    return (Path("runs") / study_name).resolve()


# ---- while the fit runs ---------------------------------------------------------------------------
# Experiments started before the callback moved to ray_live pickled it under this name.
_DriverCallback = DriverCallback


# ---- after the fit: MLflow runs follow the final Ray states ------------------------------------------
def settle_runs(tracker: Tracker, reader: TrackingReader, result: StudyResult) -> None:
    """Make each trial's MLflow run say what Ray decided. A trial thread that Ray stopped
    closes its run as pruned, but Ray may have paused it (it resumes and reopens the run),
    or the whole fit may have been interrupted (the trial resumes on the next run); an
    actor that died never closed its run at all."""
    if not result.parent_run_id:
        return
    try:
        runs = rr.trial_runs(reader, result.parent_run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow down: the spool and the next run settle it
        log.warning("could not read the trial runs back from MLflow: %s", exc)
        return
    for t in result.trials:
        ray_id: str | None = getattr(t, "ray_trial_id", None)  # set by ray_records.load_result
        run = runs.get(ray_id) if ray_id is not None else None
        if run is None:
            continue
        if ended_for_good(run):
            continue  # finished in MLflow even if Ray had not recorded it yet (a driver crash)
        tags, status = run.data.tags, run.info.status
        handle = RunHandle(run.info.run_id, run.info.experiment_id, run.info.run_name or "")
        want: RunStatus
        drop: tuple[str, ...]  # tags to remove
        if t.state == "PRUNED":
            want, new_tags, drop = "FINISHED", {layout.TAG_STATE: "PRUNED", layout.TAG_PRUNED: "true"}, ()
            if t.reason and "sweeps.reason" not in tags:
                new_tags["sweeps.reason"] = t.reason
        elif t.state == "FAIL":
            reason = tags.get(layout.TAG_ERROR) or t.reason or "the trial's actor died (see the Ray error file)"
            want, new_tags, drop = "FAILED", {layout.TAG_STATE: "FAIL", layout.TAG_ERROR: reason}, (layout.TAG_PRUNED,)
        elif t.state in ("RUNNING", "WAITING"):
            want = "KILLED"
            new_tags = {layout.TAG_STATE: "WAITING",
                        "sweeps.reason": "interrupted; resumes from its last checkpoint on the next sweeps run"}
            drop = (layout.TAG_PRUNED,)
        elif status == "RUNNING":  # COMPLETE, but its actor died before the end reached MLflow
            want, new_tags, drop = "FINISHED", {layout.TAG_STATE: "COMPLETE"}, (layout.TAG_PRUNED,)
        else:
            continue  # COMPLETE: closed FINISHED by run_trial itself
        if status == want and all(tags.get(k) == str(v) for k, v in new_tags.items()) \
                and not any(k in tags for k in drop):
            continue
        tracker.log(handle, tags={**{k: None for k in drop if k in tags}, **new_tags})
        tracker.end_run(handle, want)
    known = {getattr(t, "ray_trial_id", None) for t in result.trials}
    for ray_id, run in runs.items():
        if ray_id not in known and run.info.status == "RUNNING":
            # Its driver was killed before Ray recorded the trial, and no trial of the restored
            # experiment took its number (sweeps.backends.ray_continuing_run.adopt_lost_run).
            handle = RunHandle(run.info.run_id, run.info.experiment_id, run.info.run_name or "")
            tracker.log(handle, tags={layout.TAG_STATE: "FAIL", layout.TAG_ERROR: (
                "lost: its driver was killed before Ray recorded the trial, and no trial took it up again")})
            tracker.end_run(handle, "FAILED")


__all__ = ["RayBackend", "TAG_RAY_TRIAL_ID", "settle_runs"]
