"""The study's parent MLflow run: one per study, reused when the study resumes.

It holds the spec file and its hash, the git commit and package versions, the best trial
so far (kept current as trials finish) and the end-of-run summary. Both backends use it.
"""
from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps.backends.base import StudyResult
from sweeps.spec.model import StudySpec, dump_spec_dict
from sweeps.stop_signals import STOP_SIGNALS
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle, RunStatus, Tracker
from sweeps.tracking.local_runs import TAG_CLIENT_ID
from sweeps.tracking.mlflow_tracker import MlflowTracker
from sweeps.tracking.reader import TrackingReader

if TYPE_CHECKING:
    from sweeps.tracking.mlflow_tracker import MlflowTracker

TRIAL_STATES_COUNTED = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")  # on the parent as study/trials_<state>
# The parent's own counters live under "study/": the MLflow UI charts a parent's metrics beside
# its children's, and names a trial never logs keep them out of the trials' comparisons.
STUDY_METRIC_PREFIX = "study/"
PACKAGES = ("torch", "torchvision", "optuna", "mlflow", "ray", "onnxruntime", "numpy", "sweeps")


def git_commit(cwd: str | Path | None = None) -> str:
    """HEAD of the working tree (``+dirty`` when it has uncommitted changes), or "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.cache
def process_git_commit() -> str:
    """``git_commit()`` once per process: every trial a worker runs carries it, without a git
    call per trial (the code a worker imported does not change under it)."""
    return git_commit()


def package_versions(names=PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def find_parent(reader: TrackingReader, spec: StudySpec, study_name: str,
                study_uid: str | None = None) -> RunHandle | None:
    """The parent run of the study ``study_name`` (of identity ``study_uid``, when given: a
    study of the same name whose journal was deleted, or in another storage, is another study)."""
    experiment_id = reader.experiment_id(spec.experiment_name())
    if experiment_id is None:
        return None
    tags = {layout.TAG_ROLE: layout.ROLE_STUDY, layout.TAG_STUDY: study_name}
    if study_uid is not None:
        tags[layout.TAG_STUDY_UID] = study_uid
    return reader.find_run(experiment_id, tags)


def find_or_create_parent(tracker: Tracker, spec: StudySpec, study_name: str, backend: str,
                          study_uid: str | None = None) -> RunHandle:
    """The study's parent run, created on first use with the spec snapshot, commit and versions.
    A resumed study reopens its parent (RUNNING again until this invocation ends)."""
    existing = find_parent(reader_for(spec), spec, study_name, study_uid)
    if existing is not None:
        return tracker.start_run(existing, tags={layout.TAG_GIT_COMMIT: git_commit()})
    tags = {layout.TAG_ROLE: layout.ROLE_STUDY, layout.TAG_STUDY: study_name, layout.TAG_BACKEND: backend,
            layout.TAG_SPEC_HASH: spec.spec_hash(), layout.TAG_GIT_COMMIT: git_commit(),
            "mlflow.note.content": spec.description or f"Study {study_name}"}
    if study_uid is not None:
        tags[layout.TAG_STUDY_UID] = study_uid
    parent = tracker.start_run(study_name, experiment=spec.experiment_name(), tags=tags)
    tracker.log(parent, params={"objective.metric": spec.objective.metric,
                                "objective.direction": spec.objective.direction,
                                "sampler": spec.sampler.name, "pruner": spec.pruner.name,
                                "n_trials": spec.budget.n_trials, "backend": backend,
                                **{f"version.{k}": v for k, v in package_versions().items()}})
    _log_spec_snapshot(tracker, parent, spec)
    tracker.log_artifact(parent, dump_spec_dict(spec), f"{layout.ART_SPEC_DIR}/resolved_spec.json")
    return parent


def _log_spec_snapshot(tracker: Tracker, parent: RunHandle, spec: StudySpec) -> None:
    """The spec as it was read and validated (never the file again: it may have been edited
    since), under its own file name."""
    if spec.text is None or spec.path is None:
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sweeps-spec-") as folder:
        copy = Path(folder) / Path(spec.path).name
        copy.write_text(spec.text, encoding="utf-8")
        tracker.log_artifact(parent, copy, layout.ART_SPEC_DIR)


def update_parent_best(tracker: MlflowTracker, parent: RunHandle, result: StudyResult) -> None:
    """Keep the parent's best-trial tags and counts current: called by ``sweeps run`` whenever
    it sees more finished trials in the study (Optuna), after every trial (Ray), and at the end."""
    best = result.best()
    # Every state every time: a count that drops to zero (the last RUNNING trial ends) must say so.
    counts = {**dict.fromkeys(TRIAL_STATES_COUNTED, 0), **result.counts()}
    metrics = {f"{STUDY_METRIC_PREFIX}trials_{state.lower()}": float(n) for state, n in counts.items()}
    tags = {}
    if best is not None and best.value is not None:  # best() only picks trials with a value
        metrics[f"{STUDY_METRIC_PREFIX}best_value"] = float(best.value)
        tags = {layout.TAG_BEST_TRIAL: best.number, layout.TAG_BEST_RUN_ID: best.run_id or ""}
    step = len(result.finished())
    tracker.log_metrics(parent, metrics, step)
    if tags:
        tracker.log(parent, tags=tags)
    # Sent now, not with the next due batch: readers of the parent (the MLflow UI, the
    # dashboards) see the best so far while the study runs.
    tracker.flush(parent)


def parent_status(result: StudyResult, exit_code: int) -> RunStatus:
    """FINISHED when the invocation ended normally (budget met or timeout), KILLED after a
    stop signal, FAILED when it stopped on errors (max_failures, crashed workers)."""
    if exit_code - 128 in STOP_SIGNALS:
        return "KILLED"
    return "FINISHED" if exit_code == 0 else "FAILED"


def write_summary(tracker: MlflowTracker, parent: RunHandle, result: StudyResult) -> dict:
    best = result.best()
    summary: dict[str, Any] = {
        "study": result.name, "backend": result.backend, "metric": result.metric, "direction": result.direction,
        "counts": result.counts(), "stopped_reason": result.stopped_reason,
        "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params,
                                           "run_id": best.run_id},
        "trials": [{"number": t.number, "state": t.state, "value": t.value, "params": t.params,
                    "duration_s": t.duration_s, "run_id": t.run_id, "reason": t.reason} for t in result.trials],
    }
    if len(result.objectives()) > 1:
        summary["front"] = tag_front(tracker, parent, result)
    update_parent_best(tracker, parent, result)
    tracker.log_artifact(parent, summary, layout.ART_SUMMARY)
    return summary


def tag_front(tracker: MlflowTracker, parent: RunHandle, result: StudyResult) -> list[int]:
    """Tag every COMPLETE trial's run ``sweeps.pareto_front`` true or false (a resumed study's
    front moves: a trial that left it says so). Returns the front's trial numbers."""
    front = {t.number for t in result.front()}
    for t in result.trials:
        if t.state == "COMPLETE" and t.run_id:
            run = RunHandle(t.run_id, parent.experiment_id, f"trial-{t.number}")
            tracker.log(run, tags={layout.TAG_PARETO_FRONT: str(t.number in front).lower()})
    return sorted(front)


def running_children(reader: TrackingReader, parent_run_id: str,
                     trial_number: int | None = None) -> list[tuple[str, str | None]]:
    """(run id, the id it was made under) of the parent's trial runs whose MLflow status is still
    RUNNING (reruns, which a user may be running right now, are not trials and are left alone),
    or only those of trial ``trial_number``. The second id is the one a study recorded for a run
    made during an MLflow outage."""
    tags = {layout.TAG_ROLE: layout.ROLE_TRIAL}
    if trial_number is not None:
        tags[layout.TAG_TRIAL_NUMBER] = str(trial_number)
    runs = reader.children(parent_run_id, tags, status="RUNNING", max_results=1000)
    return [(r.info.run_id, r.data.tags.get(TAG_CLIENT_ID)) for r in runs]


def tracker_for(spec: StudySpec) -> MlflowTracker:
    """The spec's tracker, for a process that writes runs (each trainer writes its own, in
    its process). With a local SQLite store (the embedded default), artifacts go beside the
    database (``runs/mlartifacts``), not into ``./mlruns``; a server keeps its own."""
    uri = spec.tracking_store_uri()
    root = None
    if uri.startswith("sqlite:///"):
        root = Path(uri[len("sqlite:///"):]).parent / "mlartifacts"
    return MlflowTracker(uri, artifact_root=root)


def reader_for(spec: StudySpec) -> TrackingReader:
    """What reads the spec's runs back (the tracking store of ``tracker_for``)."""
    return TrackingReader(spec.tracking_store_uri())
