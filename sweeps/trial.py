"""One whole trial, whichever backend runs it: spec + sampled params -> core.train -> a tracked run.

The backend describes the trial (:class:`TrialSpec`: its number, params, folder, the study's run
it nests under, and the run it continues, if any) and steers it through one
:class:`~sweeps.trial_control.TrialControl` (the stop request, pruning, heartbeat, the hook told
the run). Everything else about a trial (the MLflow child run, its params, per-step curves,
artifacts and status mapping) is decided here, once, so both backends write the same layout.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.config import TrainConfig, apply_overrides
from core.ddp_launch import TaskSpec, train_distributed
from core.diskfull import describe_disk_full
from core.distributed import lr_scale_factor
from core.faults import Fault, stop_here
from core.results import TrainResult
from core.train import train
from sweeps import deploy_check, trial_folder
from sweeps.parent_run import process_git_commit
from sweeps.slot_plan import ddp_processes, visible_gpu_count
from sweeps.spec.model import StudySpec
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, RunStatus, Tracker
from sweeps.tracking.trial_extras import TrialExtras
from sweeps.trial_control import TrialControl, TrialInterrupted
from sweeps.trial_reporter import TrialReporter, new_points
from sweeps.worker_identity import worker_identity

TrialState = Literal["COMPLETE", "PRUNED", "FAIL", "INTERRUPTED"]

# A pruned trial ended as the study meant it to: FINISHED, its state in the sweeps.state and
# sweeps.pruned tags (as Optuna's MLflowCallback and Ray Tune's MLflow logger do), so MLflow's
# red mark is left for failures.
_MLFLOW_STATUS: dict[str, RunStatus] = {
    "COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED", "INTERRUPTED": "KILLED"}
# The fixed configuration a trial run shows as params beside the searched ones.
HEADLINE_PARAMS = ("epochs", "optimizer", "scheduler", "seed")


@dataclass
class TrialOutcome:
    state: TrialState
    value: float | None  # best value of the objective metric over the trial's epochs
    reason: str
    run: RunHandle | None
    result: TrainResult | None = None
    seconds: float = 0.0
    oom: bool = False
    values: list[float] | None = None  # every objective's value, in the spec's order (COMPLETE trials)
    figures: dict[str, float] = field(default_factory=dict)  # deployment figures (sweeps.deploy_check)
    rejected: bool = False  # PRUNED before training: its architecture violates a constraint


@dataclass
class TrialSpec:
    """What a backend knows about a trial before it runs."""

    number: int
    params: dict
    out_dir: Path
    parent: RunHandle  # the study's run: the trial's run nests under it
    backend: str  # the backend's name, on the trial's run
    resume: bool = False  # without ``owner``: whether to resume from a checkpoint in out_dir
    tags: dict = field(default_factory=dict)  # extra tags: retry_of, worker slot, backend ids
    overrides: dict = field(default_factory=dict)  # train fields forced by the backend (OOM retry)
    # "<study uid>:<trial folder>": out_dir is claimed for it (sweeps.trial_folder) and a
    # checkpoint there is resumed only if it is this owner's; anything else is moved aside.
    owner: str | None = None
    # The trial's own earlier run, which it continues (a Ray trial started again): reopened RUNNING
    # without its stale end-of-run tags, its first params and config kept (PBT's new ones are tags).
    continues: RunHandle | None = None
    # With ``continues``: each metric's last step in that run. Steps trained again from an older
    # checkpoint are not logged twice, nor the checkpoint's (or a PBT donor's) curves.
    logged_up_to: dict[str, int] = field(default_factory=dict)


def trial_config(spec: StudySpec, params: dict, overrides: dict | None = None) -> TrainConfig:
    """The resolved TrainConfig of a trial. The best checkpoint (the model a trial is judged,
    promoted and exported by) follows the study objective, and a trial that holds K >= 2 GPUs
    runs DDP over them unless the spec sets ``train.distributed.nproc``."""
    cfg = spec.resolved_train_config(params)
    extra: dict = {"monitor": spec.objective.metric,
                   "monitor_mode": "max" if spec.objective.direction == "maximize" else "min"}
    nproc = ddp_processes(spec.resources.gpus_per_trial, spec.resources.devices, cfg.device,
                          (spec.train.get("distributed") or {}).get("nproc"), visible_gpu_count())
    if nproc is not None:  # a trial holding K GPUs runs DDP over them (resources.gpus_per_trial)
        extra["distributed"] = {"nproc": nproc}
    return apply_overrides(cfg, {**extra, **(overrides or {})})


# End-of-run tags of an earlier start that a continued run drops when it runs again.
_STALE_TAGS = (layout.TAG_PRUNED, layout.TAG_ERROR, "sweeps.reason", "sweeps.traceback")


def start_trial_run(spec: StudySpec, tracker: Tracker, trial: TrialSpec) -> RunHandle:
    """Create the trial's nested MLflow run with its tags, params and resolved config; or reopen
    the run it continues, with its tags (the first start's params and config are kept)."""
    cfg = trial_config(spec, trial.params, trial.overrides)
    tags = {
        layout.TAG_ROLE: layout.ROLE_TRIAL, layout.TAG_STUDY: spec.name, layout.TAG_BACKEND: trial.backend,
        layout.TAG_TRIAL_NUMBER: trial.number, layout.TAG_STATE: "RUNNING", layout.TAG_SEED: cfg.seed,
        layout.TAG_DEVICE: _device_description(), layout.TAG_WORKER: worker_identity(),
        layout.TAG_SPEC_HASH: spec.spec_hash(), layout.TAG_GIT_COMMIT: process_git_commit(), **trial.tags,
    }
    if trial.continues is not None:
        return tracker.start_run(trial.continues, tags={**dict.fromkeys(_STALE_TAGS), **tags})
    run = tracker.start_run(f"trial-{trial.number}", parent=trial.parent, tags=tags)
    tracker.log(run, params=trial_params(spec, trial, cfg))
    tracker.log_artifact(run, resolved_config(spec, trial, cfg), layout.ART_CONFIG)
    return run


def trial_params(spec: StudySpec, trial: TrialSpec, cfg: TrainConfig) -> dict[str, Any]:
    """The trial run's MLflow params: the searched ones under their own names, so MLflow's run
    table and comparison view open on them, and a few fixed ones that say what was trained; the
    whole resolved configuration is the run's config artifact (``layout.ART_CONFIG``)."""
    fixed = cfg.to_dict()
    params: dict[str, Any] = {"task": spec.task.name or spec.task.target}
    if spec.task.model is not None:
        params["model"] = spec.task.model
    params.update({k: fixed[k] for k in HEADLINE_PARAMS})
    params.update(trial.params)
    # What a retry changed from the searched point (a halved batch, accumulated twice), and the
    # batch the optimizer sees when DDP or accumulation make it differ from batch_size.
    params.update({f"train.{k}": fixed[k] for k in trial.overrides or {}})
    dist = cfg.distributed
    global_batch = cfg.batch_size * dist.nproc * cfg.grad_accum_steps
    if global_batch != cfg.batch_size:
        params["global_batch_size"] = global_batch
    if dist.lr_scale_rule != "none":
        params["scaled_lr"] = cfg.lr * lr_scale_factor(dist.lr_scale_rule, dist.nproc)
    return params


def task_spec(spec: StudySpec, params: dict) -> TaskSpec:
    """The trial's task as a picklable recipe: every DDP rank builds its own copy from it."""
    args = spec.task_args(params)
    model = args.pop("model", spec.task.model)
    return TaskSpec(name=spec.task.name, target=spec.task.target, model=model, args=args)


def resolved_config(spec: StudySpec, trial: TrialSpec, cfg: TrainConfig) -> dict:
    """Everything needed to rebuild the trial exactly (``sweeps rerun`` reads this)."""
    return {"study": spec.name, "trial_number": trial.number, "params": trial.params, "seed": cfg.seed,
            "train": cfg.to_dict(), "task": {"name": spec.task.name, "target": spec.task.target,
                                              "model": spec.task.model, "args": spec.task_args(trial.params)},
            "objective": spec.objective.model_dump(), "spec_hash": spec.spec_hash()}


def run_trial(spec: StudySpec, trial: TrialSpec, control: TrialControl, tracker: Tracker) -> TrialOutcome:
    """Run one trial end to end. Never raises for a failing trial: the failure is the outcome.
    ``control.on_start`` receives the trial's run before training."""
    control.hold_if_asked()
    started = time.monotonic()
    run = start_trial_run(spec, tracker, trial)
    stop_here(Fault.TRIAL_RUN_MADE)  # tests: a kill that leaves a run the study does not name
    control.on_start(run)
    logged_up_to = trial.logged_up_to if trial.continues is not None else None
    extras = TrialExtras(tracker, run, logged_up_to)  # system metrics from now until the trial ends
    reporter = TrialReporter(tracker, run, spec.objective.metric, control, logged_up_to, extras)
    try:
        with _claimed(trial) as moved:
            if moved is not None:
                tracker.log(run, tags={"sweeps.moved_aside": str(moved)})
            outcome = _train_trial(spec, trial, reporter, run)
    except Exception as exc:  # noqa: BLE001 - the folder cannot be had: the trial fails, saying why
        outcome = TrialOutcome("FAIL", None, f"{type(exc).__name__}: {first_line(exc)}", run)
    finally:
        extras.system.stop()  # also when a BaseException leaves: no sampler outlives its trial
    extras.finish(trial.number, trial.params, outcome.result)
    outcome.seconds = time.monotonic() - started
    finish_trial_run(tracker, run, outcome, logged_up_to)
    return outcome


def _claimed(trial: TrialSpec):
    """The trial's folder, held for it (``sweeps.trial_folder``) when it has an owner."""
    if trial.owner is None:
        return contextlib.nullcontext(None)
    return trial_folder.claimed(trial.out_dir, trial.owner, trial.params)


def _train_trial(spec: StudySpec, trial: TrialSpec, reporter: TrialReporter, run: RunHandle) -> TrialOutcome:
    """Build the task and train; every failure becomes the outcome, never an exception."""
    # With an owner, the folder holds only this trial's own checkpoint now (or nothing).
    resume = trial.resume or trial.owner is not None
    try:
        # Until the first step, a signal aborts the set-up at once (see TrialInterrupted).
        with reporter.control.stop.setting_up():
            figures = _measured(spec, trial, reporter)
            reason = deploy_check.rejection_reason(spec.constraints, figures)
            if reason:  # no epoch is trained; Optuna's sampler learns from its constraint values
                reporter.tracker.log(run, tags={deploy_check.TAG_REJECTED: "true"})
                return TrialOutcome("PRUNED", None, reason, run, figures=figures, rejected=True)
            task = spec.make_task(trial.params)  # also checks the task section before any rank starts
            cfg = trial_config(spec, trial.params, trial.overrides)
            if reporter.extras is not None and cfg.distributed.nproc > 1:
                reporter.extras.not_watched("under DDP every rank builds its own copy, in its own process")
            elif reporter.extras is not None:
                reporter.extras.watch_datasets(task)
            if cfg.distributed.nproc > 1:  # N rank processes; this process keeps the reporter
                result = train_distributed(task_spec(spec, trial.params), cfg, reporter=reporter,
                                           out_dir=trial.out_dir, resume=resume, owner=trial.owner)
            else:
                result = train(task, cfg, reporter=reporter, out_dir=trial.out_dir, resume=resume,
                               owner=trial.owner)
        outcome = outcome_of(result, run)
        outcome.figures = figures
        if outcome.state == "COMPLETE":
            outcome.values = deploy_check.objective_values(spec, result.history, result.best_epoch, figures)
            if outcome.values is None and len(spec.objective_list()) > 1:
                missing = deploy_check.missing_objectives(spec, result.history, result.best_epoch, figures)
                outcome.state, outcome.reason = "FAIL", f"no value of the objective {', '.join(missing)}"
        return outcome
    except TrialInterrupted as exc:
        name = signal.Signals(exc.signum).name if exc.signum else "a stop request"
        return TrialOutcome("INTERRUPTED", None, f"stopped by {name} while the trial was setting up "
                            "(imports, the task's datasets or model), before its first step", run)
    except SystemExit as exc:  # the task called sys.exit(): the trial fails, the worker goes on
        return TrialOutcome("FAIL", None, f"the task called sys.exit({exc.code!r})", run)
    except Exception as exc:  # noqa: BLE001 - a failing trial is data, not a crash of the study
        oom = _is_oom(exc)
        full = describe_disk_full(exc, trial.out_dir)  # torch words a full disk as "unexpected pos"
        reason = ("out of memory: " + first_line(exc) if oom else full if full
                  else f"{type(exc).__name__}: {first_line(exc)}")
        reporter.tracker.log(run, tags={"sweeps.traceback": traceback.format_exc()[-4000:]})
        if oom:
            _release_cuda_memory()
        return TrialOutcome("FAIL", None, reason, run, oom=oom)


def _measured(spec: StudySpec, trial: TrialSpec, reporter: TrialReporter) -> dict[str, float]:
    """The deployment figures, when an objective or a constraint needs them, logged to the run."""
    if not spec.deploy_metrics_needed():
        return {}
    figures = deploy_check.measure(spec, trial.params, trial.out_dir)
    reporter.log_metrics(figures, 0)
    return figures


def finish_trial_run(tracker: Tracker, run: RunHandle, outcome: TrialOutcome,
                     logged_up_to: Mapping[str, int] | None = None) -> None:
    """Final metrics, tags and the MLflow status that mirrors the study state:
    COMPLETE -> FINISHED; PRUNED -> FINISHED + sweeps.pruned; FAIL -> FAILED + sweeps.error;
    INTERRUPTED (SIGTERM) -> KILLED, and the study marks the trial FAIL with the reason.
    ``logged_up_to``: a continued run's (``TrialSpec``), whose step 0 may hold them already."""
    tags: dict = {layout.TAG_STATE: "FAIL" if outcome.state == "INTERRUPTED" else outcome.state}
    if outcome.state == "PRUNED":
        tags[layout.TAG_PRUNED] = "true"
    if outcome.reason:
        tags["sweeps.reason"] = outcome.reason
    if outcome.state in ("FAIL", "INTERRUPTED"):
        tags[layout.TAG_ERROR] = outcome.reason
    result = outcome.result
    final: dict[str, float] = {}
    if result is not None and result.onnx is not None:
        tags[layout.TAG_ONNX_PASSED] = str(result.onnx.passed).lower()
        final.update({"onnx_max_abs_diff": result.onnx.max_abs_diff, "onnx_ort_latency_ms": result.onnx.ort_latency_ms,
                      "onnx_torch_latency_ms": result.onnx.torch_latency_ms})
    if result is not None and result.torchscript is not None:
        final["torchscript_max_abs_diff"] = result.torchscript["max_abs_diff"]
    if outcome.value is not None:
        final["objective"] = outcome.value
    final["trial_seconds"] = outcome.seconds
    points = new_points(final, 0, logged_up_to)
    if points:
        tracker.log_metrics(run, points, 0)
    tracker.log(run, tags=tags)
    tracker.end_run(run, _MLFLOW_STATUS[outcome.state])


def outcome_of(result: TrainResult, run: RunHandle) -> TrialOutcome:
    if result.status == "completed":
        return TrialOutcome("COMPLETE", result.best_metric, result.reason, run, result)
    if result.status == "pruned":
        return TrialOutcome("PRUNED", result.best_metric, result.reason, run, result)
    if result.status == "diverged":
        # A diverging learning rate is a result about the search space, not a crash: it is
        # PRUNED (so samplers learn to avoid it and it does not count as a failure in a row).
        return TrialOutcome("PRUNED", result.best_metric, "diverged: " + result.reason, run, result)
    return TrialOutcome("INTERRUPTED", result.best_metric, result.reason, run, result)


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _release_cuda_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_line(exc: BaseException) -> str:
    """An error's first line, at most 500 characters (its type when it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _device_description() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    if torch.cuda.is_available():
        return f"cuda (CUDA_VISIBLE_DEVICES={visible})"
    return f"cpu ({torch.get_num_threads()} threads)"


