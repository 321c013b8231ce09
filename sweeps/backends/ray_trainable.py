"""The Ray Tune trainable: one Ray trial = one ``sweeps.trial.run_trial`` call.

Runs inside a Ray actor. The MLflow layout, params, artifacts and status mapping are
``run_trial``'s, exactly as under Optuna; this module only adds what Ray needs:

- the trial's number: Ray names each trial ``trial-<N>`` (:class:`TrialNamer`, creation order);
- pruning: ``should_prune`` calls ``tune.report`` with the epoch's objective and a checkpoint.
  When Ray takes the trial off its actor (a scheduler STOP or PAUSE, the end of the
  experiment), ``tune.report`` raises ``SystemExit`` in this thread: the trial stops as
  "pruned" and its MLflow run is closed FINISHED + ``sweeps.pruned``. The driver reads the
  final Ray states after the fit and corrects the few runs that were not really pruned
  (paused ones resume and reopen their run; interrupted ones are marked so);
- the last epoch is reported *after* ``run_trial`` returned (with ``sweeps_done``), so a
  scheduler decision at ``max_t`` can never cut the end-of-run evaluation and ONNX export;
- checkpoints (:mod:`sweeps.backends.ray_checkpoints`): each epoch's ``last.pt`` and
  ``best.pt`` go to Ray (``tune.Checkpoint``); a retried, restored, resumed or PBT-exploiting
  trial gets them back into its folder and resumes with ``resume=True``; a trial that
  MLflow shows as finished (the driver died before Ray recorded it) is never run again;
- one MLflow run per Ray trial: a trial that starts again (retry, pause, driver restart)
  continues its own run (``TrialSpec.continues``) instead of opening a second one;
- PBT: the exploit copies the better trial's checkpoint; the new ``lr`` (and ``momentum``)
  are applied by rescaling the optimizer and scheduler state in ``last.pt`` before resuming,
  so the schedule keeps its shape at the new scale (a constant schedule trains at exactly
  the new ``lr``). MLflow keeps the params the trial started with; each exploit is recorded
  in the tags ``sweeps.pbt_params`` and ``sweeps.pbt_from``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps import trial_folder
from sweeps.backends.ray_adapter import running_trial_thread
from sweeps.backends.ray_checkpoints import (
    clear_checkpoints,
    existing_checkpoint,
    report_with_checkpoint,
    restore_checkpoint,
)
from sweeps.backends.ray_continuing_run import TAG_RAY_TRIAL_ID, adopt_lost_run, logged_up_to
from sweeps.backends.ray_hang import TAG_HUNG, HangWatchdog, recorded_hang
from sweeps.durations import stop_grace_seconds
from sweeps.parent_run import reader_for, tracker_for
from sweeps.spec.model import StudySpec
from sweeps.spec.objectives import DEPLOY_METRICS, is_deploy_metric
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle
from sweeps.trial_control import StopRequest, TrialControl

if TYPE_CHECKING:
    from sweeps.tracking.reader import TrackingReader

TAG_RAY_NODE = "sweeps.ray_node"


def find_trial_run(reader: TrackingReader, parent: RunHandle, trial_id: str) -> RunHandle | None:
    """The MLflow run of Ray trial ``trial_id`` under the study run ``parent`` (None before its first start)."""
    return reader.find_run(parent.experiment_id, {layout.PARENT_TAG: parent.run_id, TAG_RAY_TRIAL_ID: trial_id})
# Result keys the trainable adds to Ray's results (the driver and `load` read them back).
R_NUMBER, R_RUN_ID, R_DONE, R_STATE, R_VALUE, R_REASON = (
    "sweeps_number", "sweeps_run_id", "sweeps_done", "sweeps_state", "sweeps_value", "sweeps_reason")
R_OBJECTIVE = "sweeps_objective"  # best objective so far: what the searcher (TPE) learns from
R_FIGURE_PREFIX = "sweeps_figure__"  # final report: each deployment figure (sweeps.deploy_check)


def r_objective(i: int) -> str:
    """Final report of a study of several objectives: objective ``i``'s value (OptunaSearch's metric list)."""
    return f"{R_OBJECTIVE}_{i}"


def stop_wait_seconds() -> float:
    """How long an actor being stopped waits for its trial to stop at a step and close its MLflow
    run: the Optuna backend's grace for a worker (SWEEPS_STOP_GRACE_S, default 60)."""
    return stop_grace_seconds()


class TrialNamer:
    """``trial_name_creator``: ``trial-<N>``, N counting trials in creation order from 0.

    Ray numbers each experiment's trials in ``experiment_tag`` (from 0 under
    BasicVariantGenerator, from 1 under a Searcher such as OptunaSearch) and keeps the
    counter in its experiment state, so numbers stay unique when the study is restored."""

    def __init__(self, first: int) -> None:
        self.first = first

    def __call__(self, trial) -> str:
        return f"trial-{int(str(trial.experiment_tag).split('_')[0]) - self.first}"


def trial_dirname(trial) -> str:
    """``trial_dirname_creator``: short folder names (Ray's default embeds every param)."""
    return f"{trial.custom_trial_name or 'trial'}-{trial.trial_id}"


def number_of(trial_name: str) -> int:
    return int(trial_name.rsplit("-", 1)[-1])


@dataclass
class TrialContext:
    """What every trial needs from the driver; pickled into the trainable."""

    spec: StudySpec  # with an absolute tracking URI (actors may run elsewhere)
    study_name: str
    parent: RunHandle
    trials_dir: str  # absolute runs/<study>/: trial-NNNN folders, as under Optuna
    cwd: str  # the driver's working directory: relative paths in the spec mean the same
    threads: int  # torch threads per trial (the trial's CPU share)
    gpus: float = 0.0  # GPUs per trial; Ray sets CUDA_VISIBLE_DEVICES for trials that have some
    study_uid: str | None = None  # the study's identity (None: started before studies had one on Ray)


class TrialActorMixin:
    """Mixin for Ray's function-trainable actor (``__mixins__``).

    - When Ray stops or reuses the actor, wait for the trial thread to finish (it closes
      its MLflow run after ``tune.report`` raised ``SystemExit``) instead of letting the
      actor exit under it.
    - Restoring from a checkpoint Ray has already deleted (its last experiment snapshot,
      written before a driver crash, may lag behind ``num_to_keep`` deletions) falls back to
      the trial's newest checkpoint that still exists instead of failing the trial."""

    def restore(self, checkpoint_path, *args, **kwargs):
        return super().restore(existing_checkpoint(checkpoint_path), *args, **kwargs)

    def cleanup(self):
        _join_trial_thread()
        return super().cleanup()

    def reset_config(self, new_config):
        _join_trial_thread()
        return super().reset_config(new_config)


def _join_trial_thread() -> None:
    session = running_trial_thread()
    if session is not None:
        stop = _CURRENT.get("stop")
        if stop is not None:
            stop.request()  # stop at the next optimizer step, with a checkpoint, not at the epoch's end
        session.finish(timeout=stop_wait_seconds())


def make_trainable(ctx: TrialContext):
    """The function trainable given to ``tune.Tuner`` (and to ``Tuner.restore``)."""

    def sweeps_trial(config: dict) -> None:
        run_ray_trial(config, ctx)

    sweeps_trial.__mixins__ = (TrialActorMixin,)  # type: ignore[attr-defined]  # read by Ray's wrap_function
    return sweeps_trial


# ---- one trial -----------------------------------------------------------------------------------
_CURRENT: dict[str, StopRequest] = {}  # "stop": the running trial's stop request (one trial per actor)
_TRACKERS: dict[str, Any] = {}  # one tracker per actor process (actors are reused between trials)
_TRACKERS_LOCK = threading.Lock()


def _tracker(spec: StudySpec):
    with _TRACKERS_LOCK:
        uri = spec.tracking_store_uri()
        if uri not in _TRACKERS:
            _TRACKERS[uri] = tracker_for(spec)
        return _TRACKERS[uri]


def run_ray_trial(config: dict, ctx: TrialContext) -> None:
    import torch
    from ray import tune

    from sweeps.trial import TrialSpec  # lazy: the Ray driver loads no torch

    spec = ctx.spec
    if os.path.isdir(ctx.cwd):
        os.chdir(ctx.cwd)
    elif _is_local_store(spec.tracking_uri()):
        raise RuntimeError(f"this node ({socket.gethostname()}) does not have the driver's folder {ctx.cwd}, so it "
                           f"cannot write to the local MLflow store {spec.tracking_uri()!r}; on a multi-machine "
                           "cluster set tracking.uri to an MLflow server (http://...)")
    torch.set_num_threads(ctx.threads)
    if not ctx.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU trial must not pick a GPU (device: auto)
    context = tune.get_context()
    trial_id, number = context.get_trial_id(), number_of(context.get_trial_name())
    params = {k: config[k] for k in spec.search if k in config}
    out_dir = Path(ctx.trials_dir) / f"trial-{number:04d}"
    tags: dict[str, Any] = {TAG_RAY_TRIAL_ID: trial_id, TAG_RAY_NODE: node_description()}

    reader = reader_for(spec)
    existing = find_trial_run(reader, ctx.parent, trial_id)
    if existing is None:  # the trial may have run under another id before a driver was killed
        existing = adopt_lost_run(reader, _tracker(spec), ctx.parent, number, trial_id, params)
    if existing is not None:
        hung = recorded_hang(reader, existing.run_id)
        if hung:  # budget.trial_timeout stopped it: never resumed into the same hang
            raise RuntimeError(f"trial {number} failed: {hung}")
        final = finished_report(reader, existing.run_id, spec.objective.metric, number)
        if final is not None:
            # MLflow says the trial finished (the driver died before Ray recorded it): report
            # its result again instead of training (and reopening its run) a second time.
            tune.report({**final, **final_values(spec, reader.get_run(existing.run_id), final)})
            return

    with _own_folder(ctx, out_dir, trial_id, number) as moved:
        if moved is not None:
            tags["sweeps.moved_aside"] = str(moved)
        checkpoint = tune.get_checkpoint()
        resume = False
        if checkpoint is not None:
            with checkpoint.as_directory() as folder:
                donor = restore_checkpoint(Path(folder), out_dir, params)
            if donor is not None and donor.get("final") and donor["trial_id"] == trial_id:
                # Finished before the driver died (Ray had not recorded it yet): report, don't rerun.
                tune.report(donor["final"])
                return
            resume = True
            if donor is not None and (donor["trial_id"] != trial_id or donor["params"] != params):
                tags.update({"sweeps.pbt_params": json.dumps(params), "sweeps.pbt_from": donor["number"]})
        else:
            clear_checkpoints(out_dir)  # a retry without a Ray checkpoint starts over
        trial = TrialSpec(number, params, out_dir, ctx.parent, "ray", resume=resume, tags=tags, continues=existing,
                          logged_up_to=logged_up_to(reader, existing.run_id) if existing is not None else {})
        _train(ctx, trial, trial_id)


@contextlib.contextmanager
def _own_folder(ctx: TrialContext, out_dir: Path, trial_id: str, number: int):
    """The trial folder, held for this Ray trial of this study (sweeps.trial_folder) before
    anything is written to it: another study's files there (a study name reused after its
    runs/ray/<study> was deleted) are moved aside, never overwritten. Studies started before
    sweeps gave Ray studies an identity have none: their folders are used as they are."""
    if ctx.study_uid is None:
        yield None
        return
    # Parameters are not part of the owner: a PBT exploit changes them within the same trial.
    with trial_folder.claimed(out_dir, f"{ctx.study_uid}:{trial_id}:trial-{number:04d}", {}) as moved:
        yield moved


def _train(ctx: TrialContext, trial, trial_id: str) -> None:
    """Train the trial (its folder holds what it resumes from) and report its end to Ray."""
    from sweeps.trial import run_trial, trial_config  # lazy: the Ray driver loads no torch

    spec, number, params, out_dir = ctx.spec, trial.number, trial.params, trial.out_dir
    epochs = trial_config(spec, params).epochs
    objective, maximize = spec.objective.metric, spec.objective.direction == "maximize"
    n_objectives = len(spec.objective_list())
    several = [r_objective(i) for i in range(n_objectives)] if n_objectives > 1 else []
    tracker = _tracker(spec)
    existing = trial.continues
    state: dict[str, Any] = {"stopped": False, "best": None, "run_id": existing.run_id if existing else None}

    def on_hung(reason: str) -> None:  # budget.trial_timeout: the run says why, then the actor is killed
        if state.get("run") is not None:
            tracker.log(state["run"], tags={layout.TAG_STATE: "FAIL", layout.TAG_ERROR: reason, TAG_HUNG: reason})
            tracker.end_run(state["run"], "FAILED")

    limit = spec.trial_timeout_seconds()
    watchdog = HangWatchdog(limit, spec.budget.trial_timeout, on_hung) if limit else None

    def base_metrics(epoch: int, value: float) -> dict:
        best = state["best"]
        if best is None or (value > best if maximize else value < best):
            state["best"] = best = value
        # Several objectives: Ray wants the searcher's metrics in every result; only the final
        # report's values are told to it (NaN until then).
        return {"epoch": epoch, objective: value, R_OBJECTIVE: best, R_NUMBER: number,
                R_RUN_ID: state["run_id"] or "", **dict.fromkeys(several, math.nan)}

    def should_prune(epoch: int, value: float) -> bool:
        metrics = base_metrics(epoch, value)
        if epoch >= epochs:
            return False  # reported once the trial has finished (below)
        try:
            with watchdog.paused() if watchdog is not None else contextlib.nullcontext():
                report_with_checkpoint(metrics, out_dir, trial_id, number, params)
        except SystemExit:
            # Ray took the trial off this actor (scheduler STOP/PAUSE or the experiment ended).
            state["stopped"] = True
            return True
        return False

    def on_start(run: RunHandle) -> None:
        state["run_id"], state["run"] = run.run_id, run

    # Ray stopping the actor (the end of the fit: a signal, budget.timeout) sets this: the
    # trial stops at its next optimizer step rather than at the end of its epoch.
    interrupt = _CURRENT["stop"] = StopRequest()
    heartbeat = watchdog.beat if watchdog is not None else (lambda: None)
    control = TrialControl(interrupt, should_prune, heartbeat, on_start)
    if watchdog is not None:
        watchdog.start()
    try:
        outcome = run_trial(spec, trial, control, tracker)
    finally:
        if watchdog is not None:
            watchdog.stop()
    if state["stopped"] or (interrupt.is_set() and outcome.state == "INTERRUPTED"):
        raise SystemExit(0)  # Ray's runner thread treats this as a clean stop
    if outcome.state in ("FAIL", "INTERRUPTED"):
        # Ray retries the trial from its latest checkpoint (FailureConfig), then marks it ERROR.
        raise RuntimeError(f"trial {number} failed: {outcome.reason}")
    history = outcome.result.history if outcome.result is not None else []
    last = history[-1] if history else None
    metrics = base_metrics(int(last["epoch"]), last[objective]) if last else {
        "epoch": 0, objective: math.nan, R_OBJECTIVE: math.nan, R_NUMBER: number, R_RUN_ID: state["run_id"] or "",
        **dict.fromkeys(several, math.nan)}
    metrics.update({R_DONE: 1, R_STATE: outcome.state, R_REASON: outcome.reason or "",
                    R_VALUE: math.nan if outcome.value is None else float(outcome.value)})
    if outcome.value is not None:
        metrics[R_OBJECTIVE] = float(outcome.value)  # best over every epoch, also those before a resume
    metrics.update({R_FIGURE_PREFIX + k: float(v) for k, v in outcome.figures.items()})
    if several and outcome.values is not None:
        metrics.update({r_objective(i): v for i, v in enumerate(outcome.values)})
    report_with_checkpoint(metrics, out_dir, trial_id, number, params, final=True)


def ended_for_good(run) -> bool:
    """Whether ``run_trial`` itself ended this MLflow run with a final outcome: COMPLETE, or
    PRUNED because it diverged. (A scheduler stop also closes the run as PRUNED, but Ray may
    have paused the trial, so that one can still be continued.)"""
    state, reason = run.data.tags.get(layout.TAG_STATE), run.data.tags.get("sweeps.reason", "")
    diverged = state == "PRUNED" and reason.startswith("diverged")
    return run.info.status == "FINISHED" and (state == "COMPLETE" or diverged)


def finished_report(reader: TrackingReader, run_id: str, objective: str, number: int) -> dict | None:
    """The final Ray report of a trial whose MLflow run already ended for good (COMPLETE,
    or PRUNED because it diverged); None when the run is to be continued."""
    run = reader.get_run(run_id)
    if not ended_for_good(run):
        return None
    tags = run.data.tags
    state, reason = tags.get(layout.TAG_STATE), tags.get("sweeps.reason", "")
    history = reader.metric_history(run_id, objective)
    value = run.data.metrics.get("objective", math.nan)
    last = max(history, key=lambda m: m.step) if history else None
    return {"epoch": last.step if last else 0, objective: last.value if last else math.nan, R_OBJECTIVE: value,
            R_NUMBER: number, R_RUN_ID: run_id, R_DONE: 1, R_STATE: state, R_REASON: reason, R_VALUE: value}


def final_values(spec, run, final: dict) -> dict:
    """For several objectives: each one's value from the finished run (the searcher's metrics and
    the figures ``_train`` would have reported): a deployment metric as logged, the trained
    objective as the run's ``objective``; NaN for what the run does not hold."""
    objectives = spec.objective_list()
    if len(objectives) < 2:
        return {}
    metrics = run.data.metrics
    values = {r_objective(i): metrics.get(o.metric, math.nan) if is_deploy_metric(o.metric)
              else final[R_VALUE] if o.metric == spec.objective.metric else math.nan
              for i, o in enumerate(objectives)}
    figures = {R_FIGURE_PREFIX + k: v for k, v in metrics.items() if k in DEPLOY_METRICS or is_deploy_metric(k)}
    return {**values, **figures}


def _is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def node_description() -> str:
    """host, node IP and Ray node id of this actor (the MLflow tag ``sweeps.ray_node``)."""
    import ray

    try:
        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only a label
        node_id, ip = "?", "?"
    return f"{socket.gethostname()}/{ip}/{node_id}"
