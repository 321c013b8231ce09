"""``sweeps run`` on Ray Tune: the same study as under Optuna, run by ``ray.tune.Tuner``.

The driver never trains. It checks MLflow, finds or creates the study's parent run,
starts Ray locally (this machine's CPUs and GPUs, no dashboard) or joins a cluster
(``resources.ray_address``), builds the Tuner (or restores the experiment a killed or
stopped driver left in ``runs/ray/<study>``), and after the fit reads every trial back
from the experiment state (:mod:`sweeps.backends.ray_records`), settles the MLflow runs
with the final Ray states, and writes the same summary as the Optuna backend.

Each trial runs :func:`sweeps.backends.ray_trainable.run_ray_trial`, which calls the
shared ``sweeps.objective.run_trial``: the MLflow layout is the Optuna backend's.

Budget: ``n_trials`` is Ray's ``num_samples``; ``max_failures`` is Ray's per-trial
``FailureConfig`` (a failing trial is retried that many times from its latest
checkpoint, then marked FAIL); ``timeout`` stops this invocation like Ctrl-C does:
Ray saves the experiment with the running trials' checkpoints, and the next
``sweeps run`` resumes them (Ray's ``time_budget_s`` would instead terminate them for
good and end the search). SIGTERM does the same, with exit code 143.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from sweeps import search_space as ss
from sweeps.backends import ray_records as rr
from sweeps.backends.base import StudyResult
from sweeps.backends.ray_cluster import Interrupts, init_ray, quiet_ray_noise
from sweeps.backends.ray_trainable import (
    TAG_RAY_TRIAL_ID,
    TrialContext,
    TrialNamer,
    ended_for_good,
    make_trainable,
    trial_dirname,
)
from sweeps.backends.run_lock import run_lock
from sweeps.errors import StudyStateError
from sweeps.spec import StudySpec
from sweeps.study_run import (
    find_or_create_parent,
    parent_status,
    reader_for,
    tracker_for,
    update_parent_best,
    write_summary,
)
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, RunStatus, Tracker
from sweeps.tracking.reader import TrackingReader

log = logging.getLogger("sweeps")
_LIVE: dict = {}  # the running driver's view, tracker and parent; read by _DriverCallback


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
    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False) -> StudyResult:
        from sweeps.live import LiveView

        tracker = tracker_for(spec)
        tracker.check_connection()  # before anything is created or trained
        study_name = self._study_name(spec, fresh)
        path = rr.lock_path(study_name)  # one driver per study (a second would restore the same experiment)
        path.parent.mkdir(parents=True, exist_ok=True)
        with run_lock(path, study_name):
            meta = self._checked_meta(spec, study_name)
            parent = find_or_create_parent(tracker, spec, study_name, self.name)
            rr.write_meta(study_name, {**meta, "parent_run_id": parent.run_id})
            view = LiveView(spec, study_name, quiet=quiet)
            try:
                stopped, code = "", 0
                if not _is_complete(spec, rr.load_result(spec, study_name, live=False)):
                    stopped, code = self._fit(spec, study_name, parent, tracker, view)
            finally:
                if view._live is not None:  # a failed fit must not leave the rich display running
                    view._live.stop()
                    view._live = None
            result = rr.load_result(spec, study_name, reader_for(spec), live=False)
            settle_runs(tracker, reader_for(spec), result)
            if not stopped and any(t.state in ("RUNNING", "WAITING") for t in result.trials):
                stopped, code = "stopped (interrupted); run the command again to resume the unfinished trials", 130
            result.stopped_reason = stopped
            write_summary(tracker, parent, result)
            tracker.end_run(parent, parent_status(result, code))  # reopened by the next invocation
            view.finish(result)
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
        if stored is None or not (rr.ray_root() / study_name).exists():
            return {**wanted, "spec_hash": spec.spec_hash(), "created": time.time()}
        changed = sorted(k for k in wanted if stored.get(k) != wanted[k])
        if changed:
            raise StudyStateError(
                f"study {study_name!r} was started on Ray with a different {', '.join(changed)} "
                f"(stored {[stored.get(k) for k in changed]}, spec {[wanted[k] for k in changed]}); a Ray "
                f"experiment keeps its search space, budget, sampler and pruner. Restore the spec, or start a "
                f"new study with: sweeps run {spec.path or '<spec>'} --fresh")
        return stored

    def _fit(self, spec: StudySpec, study_name: str, parent: RunHandle, tracker, view) -> tuple[str, int]:
        import ray
        from ray import tune
        from ray.tune.logger import JsonLoggerCallback

        from sweeps.backends.ray_search import make_scheduler, make_search, plan_resources

        # Trials run in the driver's working directory (relative paths in the spec mean the
        # same there); sweeps writes its own per-epoch JSON results, not Ray's CSV/TensorBoard.
        os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
        os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
        # The live view prints each trial's end (with the failure reason) and each retry;
        # Ray's own tables and tracebacks stay in its files (error.txt per trial).
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
        quiet_ray_noise()
        started_ray = init_ray(spec)
        try:
            res = plan_resources(spec, ray.cluster_resources())
            ctx = TrialContext(spec=spec, study_name=study_name, parent=parent,
                               trials_dir=str(trials_dir(study_name)), cwd=os.getcwd(), threads=res.threads,
                               gpus=res.gpus)
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
                        callbacks=[_DriverCallback(), JsonLoggerCallback()]))
            _LIVE.update(spec=spec, study=study_name, tracker=tracker, parent=parent, view=view, history={},
                         drawn=0.0)
            with Interrupts(spec.timeout_seconds()) as interrupts:
                tuner.fit()
        finally:
            _LIVE.clear()
            if started_ray:
                ray.shutdown()
        if interrupts.signum:
            name = signal.Signals(interrupts.signum).name
            return (f"stopped by {name}; running trials were checkpointed and resume on the next sweeps run",
                    128 + interrupts.signum)
        if interrupts.timed_out:
            return f"stopped: budget.timeout ({spec.budget.timeout}) reached; run the command again to continue", 0
        return "", 0


def _is_complete(spec: StudySpec, result: StudyResult) -> bool:
    """Every trial of the budget finished (COMPLETE or PRUNED): nothing for Ray to do.
    Failed trials are retried by the next run (``resume_errored``)."""
    total = ss.grid_size(spec.search) if spec.sampler.name == "grid" else spec.budget.n_trials
    return len(result.trials) >= total and all(t.state in ("COMPLETE", "PRUNED") for t in result.trials)


# ---- where ---------------------------------------------------------------------------------------
def trials_dir(study_name: str) -> Path:
    return (Path("runs") / study_name).resolve()


# ---- while the fit runs ---------------------------------------------------------------------------
try:
    from ray.tune import Callback as _Callback
except ImportError:  # pragma: no cover - ray is a dependency; keeps `import sweeps` light if absent
    _Callback = object  # type: ignore[misc,assignment]  # a plain base class without Ray


class _DriverCallback(_Callback):
    """Keeps the live view and the parent run's best trial current. It holds no state of
    its own (Ray pickles it into the experiment): it reads the running driver's ``_LIVE``."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if not _LIVE:
            return
        if result.get("epoch"):
            _LIVE["history"].setdefault(trial.trial_id, []).append(result)
        if time.monotonic() - _LIVE["drawn"] > 0.5:
            _LIVE["drawn"] = time.monotonic()
            _LIVE["view"].update_result(self._result(trials))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finished(trials, trial, "TERMINATED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finished(trials, trial, "ERROR")

    def on_trial_recover(self, iteration, trials, trial, **info):
        if _LIVE:
            number = rr.trial_number(trial)
            _LIVE["view"].console.print(f"trial {number} failed ({rr.error_reason(trial) or 'see its error.txt'}); "
                                        f"retry {trial.num_failures} of {_LIVE['spec'].budget.max_failures} "
                                        "from its last checkpoint", markup=False, highlight=False)

    def _finished(self, trials, trial, status) -> None:
        if not _LIVE:
            return
        result = self._result(trials, {trial.trial_id: status})
        try:
            update_parent_best(_LIVE["tracker"], _LIVE["parent"], result)
        except Exception as exc:  # noqa: BLE001 - the summary at the end writes it again
            log.warning("could not update the study's parent run: %s", exc)
        _LIVE["view"].update_result(result)

    @staticmethod
    def _result(trials, status: dict | None = None) -> StudyResult:
        spec = _LIVE["spec"]
        records = []
        for t in trials:
            rows = _LIVE["history"].get(t.trial_id, [])
            records.append(rr.record_of(_StatusView(t, (status or {}).get(t.trial_id)), spec, rows, live=True))
        return rr.study_result(spec, _LIVE["study"], records, _LIVE["parent"].run_id)


class _StatusView:
    """A live Ray trial with its status as the callback knows it (Ray sets it just after)."""

    def __init__(self, trial, status: str | None) -> None:
        self._trial, self.status = trial, status or trial.status

    def __getattr__(self, name):
        return getattr(self._trial, name)


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
            want, new_tags, drop = "KILLED", {layout.TAG_STATE: "PRUNED", layout.TAG_PRUNED: "true"}, ()
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
        else:
            continue  # COMPLETE: closed FINISHED by run_trial itself
        if status == want and all(tags.get(k) == str(v) for k, v in new_tags.items()) \
                and not any(k in tags for k in drop):
            continue
        tracker.log(handle, tags={**{k: None for k in drop if k in tags}, **new_tags})
        tracker.end_run(handle, want)


__all__ = ["RayBackend", "TAG_RAY_TRIAL_ID", "settle_runs"]
