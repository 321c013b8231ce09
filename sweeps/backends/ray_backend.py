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

import contextlib
import fcntl
import importlib.util
import logging
import os
import signal
import threading
import time
from pathlib import Path

from sweeps import search_space as ss
from sweeps.backends import ray_records as rr
from sweeps.backends.base import StudyResult
from sweeps.backends.ray_trainable import TAG_RAY_TRIAL_ID, TrialContext, TrialNamer, make_trainable, trial_dirname
from sweeps.errors import BackendError, StudyStateError
from sweeps.spec import StudySpec
from sweeps.study_run import find_or_create_parent, tracker_for, update_parent_best, write_summary
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle

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
        return rr.load_result(spec, study_name, tracker_for(spec))

    # ---- run -------------------------------------------------------------------------------------
    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False) -> StudyResult:
        from sweeps.live import LiveView

        tracker = tracker_for(spec)
        tracker.check_connection()  # before anything is created or trained
        study_name = self._study_name(spec, fresh)
        with _run_lock(study_name):
            meta = self._checked_meta(spec, study_name)
            parent = find_or_create_parent(tracker, spec, study_name, self.name)
            rr.write_meta(study_name, {**meta, "parent_run_id": parent.run_id})
            view = LiveView(spec, study_name, quiet=quiet)
            try:
                stopped, code = self._fit(spec, study_name, parent, tracker, view)
            finally:
                if view._live is not None:
                    view._live.stop()
                    view._live = None
            result = rr.load_result(spec, study_name, tracker, live=False)
            settle_runs(tracker, result)
            if not stopped and any(t.state in ("RUNNING", "WAITING") for t in result.trials):
                stopped, code = "stopped (interrupted); run the command again to resume the unfinished trials", 130
            result.stopped_reason = stopped
            write_summary(tracker, parent, result)
            tracker.flush()
            view.finish(result)
        result.exit_code = code  # type: ignore[attr-defined]
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
        _quiet_stale_checkpoint_errors()
        started_ray = init_ray(spec)
        try:
            res = plan_resources(spec, ray.cluster_resources())
            ctx = TrialContext(spec=spec, study_name=study_name, parent=parent,
                               trials_dir=str(trials_dir(study_name)), cwd=os.getcwd(), threads=res.threads)
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
                        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                        callbacks=[_DriverCallback(), JsonLoggerCallback()]))
            _LIVE.update(spec=spec, tracker=tracker, parent=parent, view=view, history={}, drawn=0.0)
            with _Interrupts(spec.timeout_seconds()) as interrupts:
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


# ---- Ray itself ----------------------------------------------------------------------------------
def init_ray(spec: StudySpec) -> bool:
    """Start Ray locally (this machine's CPUs and GPUs, no dashboard) or join
    ``resources.ray_address``. Returns whether this call connected (and must shut down)."""
    import ray

    if ray.is_initialized():
        return False  # the caller (a notebook, a test) owns the connection
    from sweeps.pool import cpu_threads_available

    kwargs = {"logging_level": logging.WARNING, "log_to_driver": False}
    env_vars = _worker_pythonpath(spec)
    if env_vars:
        kwargs["runtime_env"] = {"env_vars": env_vars}
    address = spec.resources.ray_address
    try:
        if address:
            ray.init(address=address, **kwargs)
            return True
        devices = spec.resources.devices
        num_gpus = 0 if devices == "cpu" else (len(devices) if isinstance(devices, list) else None)
        with _visible_devices(devices):
            ray.init(num_cpus=cpu_threads_available(), num_gpus=num_gpus, include_dashboard=False,
                     object_store_memory=256 * 2**20, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        raise BackendError(f"cannot start or join {where}: {exc}. Check resources.ray_address "
                           "(auto, or host:port of a running head node: `ray start --head`)") from exc
    return True


class _StaleCheckpointFilter(logging.Filter):
    """After a driver crash, Ray's last experiment snapshot may still list a checkpoint it
    had already deleted (``CheckpointConfig(num_to_keep)``); deleting it again on restore
    fails with FileNotFoundError, after the new checkpoint was registered. Harmless: hide it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, FileNotFoundError) and "Error handling checkpoint" in str(record.msg))


def _quiet_stale_checkpoint_errors() -> None:
    logger = logging.getLogger("ray.tune.execution.tune_controller")
    if not any(isinstance(f, _StaleCheckpointFilter) for f in logger.filters):
        logger.addFilter(_StaleCheckpointFilter())


@contextlib.contextmanager
def _visible_devices(devices):
    """A device list limits the GPUs the local Ray instance sees (Ray then assigns them)."""
    if not isinstance(devices, list):
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _worker_pythonpath(spec: StudySpec) -> dict[str, str]:
    """A user task (``task.target``) must import in the trial actors as it does here: its
    package's folder goes onto their PYTHONPATH (Ray adds only the working directory)."""
    if not spec.task.target:
        return {}
    top = spec.task.target.partition(":")[0].split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None:
        return {}
    if found.submodule_search_locations:
        root = Path(list(found.submodule_search_locations)[0]).parent
    elif found.origin:
        root = Path(found.origin).parent
    else:
        return {}
    paths = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def trials_dir(study_name: str) -> Path:
    return (Path("runs") / study_name).resolve()


@contextlib.contextmanager
def _run_lock(study_name: str):
    """One driver per study at a time (a second would restore the same experiment)."""
    path = rr.lock_path(study_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise StudyStateError(f"study {study_name!r} is already being run by another sweeps process "
                                  f"(pid {fh.read().strip() or '?'}); wait for it or stop it first") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _Interrupts:
    """SIGTERM and ``budget.timeout`` stop the fit the way Ctrl-C does: Ray's handler for
    SIGUSR1 (installed while ``fit`` runs) saves the experiment with the running trials,
    which resume on the next run. The signal is repeated until ``fit`` has seen it, since
    the handler is only there once the fit has started."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s, self.signum, self.timed_out = timeout_s, None, False
        self._done = threading.Event()
        self._poking = threading.Event()
        self._old: dict = {}
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals need the main thread; a timeout is then not enforced
        self._old = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, lambda *_: None),
                     signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_term)}
        if self.timeout_s:
            self._start(self._deadline)
        return self

    def _on_term(self, signum, _frame) -> None:
        self.signum = signum
        self._start(self._poke)

    def _deadline(self) -> None:
        if not self._done.wait(self.timeout_s):
            self.timed_out = True
            self._poke()

    def _poke(self) -> None:
        if self._poking.is_set():
            return
        self._poking.set()
        while not self._done.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            self._done.wait(1.0)

    def _start(self, target) -> None:
        thread = threading.Thread(target=target, daemon=True, name="sweeps-interrupt")
        self._threads.append(thread)
        thread.start()

    def __exit__(self, *exc) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


# ---- while the fit runs ---------------------------------------------------------------------------
try:
    from ray.tune import Callback as _Callback
except ImportError:  # pragma: no cover - ray is a dependency; keeps `import sweeps` light if absent
    _Callback = object


class _DriverCallback(_Callback):
    """Keeps the live view and the parent run's best trial current. It holds no state of
    its own (Ray pickles it into the experiment): it reads the running driver's ``_LIVE``."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if not _LIVE:
            return
        metric = _LIVE["spec"].objective.metric
        if result.get("epoch") and metric in result:
            _LIVE["history"].setdefault(trial.trial_id, {})[int(result["epoch"])] = result[metric]
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
        spec, metric = _LIVE["spec"], _LIVE["spec"].objective.metric
        records = []
        for t in trials:
            rows = [{"epoch": e, metric: v} for e, v in sorted(_LIVE["history"].get(t.trial_id, {}).items())]
            records.append(rr.record_of(_StatusView(t, (status or {}).get(t.trial_id)), spec, rows, live=True))
        return rr.study_result(spec, _LIVE["parent"].name, records, _LIVE["parent"].run_id)


class _StatusView:
    """A live Ray trial with its status as the callback knows it (Ray sets it just after)."""

    def __init__(self, trial, status: str | None) -> None:
        self._trial, self.status = trial, status or trial.status

    def __getattr__(self, name):
        return getattr(self._trial, name)


# ---- after the fit: MLflow runs follow the final Ray states ------------------------------------------
def settle_runs(tracker, result: StudyResult) -> None:
    """Make each trial's MLflow run say what Ray decided. A trial thread that Ray stopped
    closes its run as pruned, but Ray may have paused it (it resumes and reopens the run),
    or the whole fit may have been interrupted (the trial resumes on the next run); an
    actor that died never closed its run at all."""
    if not result.parent_run_id:
        return
    try:
        runs = rr.trial_runs(tracker, result.parent_run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow down: the spool and the next run settle it
        log.warning("could not read the trial runs back from MLflow: %s", exc)
        return
    client = tracker.client
    for t in result.trials:
        run = runs.get(getattr(t, "ray_trial_id", None))
        if run is None:
            continue
        tags, status = run.data.tags, run.info.status
        handle = RunHandle(run.info.run_id, run.info.experiment_id, run.info.run_name or "")
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
        for key in drop:
            if key in tags:
                client.delete_tag(handle.run_id, key)
        tracker.set_tags(handle, new_tags)
        tracker.end_run(handle, want)


__all__ = ["RayBackend", "TAG_RAY_TRIAL_ID", "init_ray", "settle_runs"]
