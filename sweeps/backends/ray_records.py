"""A Ray Tune experiment on disk, read as the backend-neutral :class:`StudyResult`.

Where things are (relative to the working directory, like Optuna's journal):
``runs/ray/<study>/`` the Ray experiment (``storage_path`` + ``name``), ``runs/ray/<study>.study.json``
what sweeps keeps beside it (parent MLflow run, search space, budget), ``runs/<study>/trial-NNNN/``
the trial folders (checkpoints, ONNX), exactly as under Optuna. ``--fresh`` starts
``<study>-v2``, ``-v3``, ... and keeps the old ones.

State mapping (each Ray trial -> one TrialRecord, ``number`` = creation order):
  last result has ``sweeps_done``      -> its state (COMPLETE, or PRUNED for a diverged trial)
  TERMINATED without it                -> PRUNED: the scheduler stopped it before its last epoch
  ERROR                                -> FAIL (retried ``budget.max_failures`` times first)
  RUNNING / PAUSED                     -> RUNNING while a driver runs the study, else WAITING
  PENDING                              -> WAITING
"""
from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeGuard

from core.io_utils import save_json_atomic
from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.backends.driver import run_lock_held
from sweeps.backends.ray_trainable import (
    R_DONE,
    R_FIGURE_PREFIX,
    R_NUMBER,
    R_REASON,
    R_RUN_ID,
    R_STATE,
    R_VALUE,
    TAG_RAY_TRIAL_ID,
    ended_for_good,
    number_of,
    r_objective,
)
from sweeps.spec.model import StudySpec
from sweeps.tracking import layout
from sweeps.tracking.reader import TrackingReader

RAY_DIR = Path("runs") / "ray"


# ---- where ---------------------------------------------------------------------------------------
def ray_root() -> Path:
    return RAY_DIR.resolve()


def meta_path(study_name: str) -> Path:
    return ray_root() / f"{study_name}.study.json"


def lock_path(study_name: str) -> Path:
    return ray_root() / f"{study_name}.runlock"


def versions(spec: StudySpec) -> list[tuple[int, str]]:
    """Studies of this spec that exist: ``(1, name)``, ``(2, name-v2)``, ..."""
    found: list[tuple[int, str]] = []
    root = ray_root()
    if not root.is_dir():
        return found
    for meta in root.glob("*.study.json"):
        study = meta.name[: -len(".study.json")]
        if study == spec.name:
            found.append((1, study))
        m = re.fullmatch(re.escape(spec.name) + r"-v(\d+)", study)
        if m:
            found.append((int(m.group(1)), study))
    return sorted(found)


def current_study_name(spec: StudySpec) -> str | None:
    found = versions(spec)
    return found[-1][1] if found else None


def read_meta(study_name: str) -> dict | None:
    path = meta_path(study_name)
    return json.loads(path.read_text()) if path.exists() else None


def write_meta(study_name: str, meta: dict) -> None:
    path = meta_path(study_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_json_atomic(meta, path)


def driver_running(study_name: str) -> bool:
    """Whether a ``sweeps run`` holds the study's run lock now."""
    return run_lock_held(lock_path(study_name))


# ---- records -------------------------------------------------------------------------------------
def trial_number(trial) -> int:
    name = getattr(trial, "custom_trial_name", None) or ""
    if name.startswith("trial-"):
        return number_of(name)
    result = trial.last_result or {}
    return int(result.get(R_NUMBER, -1))


def record_of(trial, spec: StudySpec, rows: Iterable[dict], live: bool) -> TrialRecord:
    """One Ray trial (live or loaded from the experiment state) as a TrialRecord.
    ``rows`` are the trial's reported results in order (for the per-epoch values)."""
    metric, maximize = spec.objective.metric, spec.objective.direction == "maximize"
    intermediate: dict[int, float] = {}
    for row in rows:
        epoch, value = row.get("epoch"), row.get(metric)
        if epoch and _finite(value) and not row.get("__duplicate__"):
            intermediate[int(epoch)] = float(value)
    last = trial.last_result or {}
    status = trial.status
    reason = ""
    if last.get(R_DONE):
        state, reason = str(last.get(R_STATE)), str(last.get(R_REASON) or "")
    elif status == "TERMINATED":
        state = "PRUNED"
        if intermediate:
            reason = f"stopped early by the scheduler after epoch {max(intermediate)}"
    elif status == "ERROR":
        state, reason = "FAIL", error_reason(trial)
    elif status in ("RUNNING", "PAUSED"):
        state = "RUNNING" if live else "WAITING"
    else:
        state = "WAITING"
    value = last.get(R_VALUE) if last.get(R_DONE) else None
    if not _finite(value):
        value = (max if maximize else min)(intermediate.values()) if intermediate else None
    # Training time over every segment of the trial (a restore or a PBT exploit restarts
    # Ray's own time_total_s); started = when its first epoch began.
    stamps = [(row.get("timestamp"), row.get("time_this_iter_s")) for row in rows]
    times = [(ts, dt) for ts, dt in stamps if _finite(ts) and _finite(dt)]
    total = sum(dt for _, dt in times) if times else last.get("time_total_s")
    started = min(ts - dt for ts, dt in times) if times else None
    if not total and live and status == "ERROR":
        # Failed before its first report (e.g. in the task's set-up): its time is from Ray's
        # start of the trial to now, the moment the driver learns of the failure.
        began = getattr(getattr(trial, "run_metadata", None), "start_time", None)
        if _finite(began):
            total, started = max(time.time() - began, 0.0), began
    params = {k: trial.config[k] for k in spec.search if k in (trial.config or {})}
    n = len(spec.objective_list())
    told = [last.get(r_objective(i)) for i in range(n)] if n > 1 and state == "COMPLETE" else []
    values = [float(v) for v in told if _finite(v)]  # what OptunaSearch was told; None unless all are there
    figures = {k[len(R_FIGURE_PREFIX):]: float(v) for k, v in last.items() if k.startswith(R_FIGURE_PREFIX)}
    return TrialRecord(number=trial_number(trial), state=state, params=params,
                       value=None if value is None else float(value), duration_s=total,
                       run_id=last.get(R_RUN_ID) or None, intermediate=intermediate, reason=reason,
                       started=started, figures=figures,
                       values=values if told and len(values) == n else None)


def error_reason(trial) -> str:
    """The failure message of an errored trial, from Ray's error file (while it is there)."""
    lines: list[str] = []
    for where in ("path", "local_path"):  # the experiment storage, then the driver's staging folder
        try:
            name = trial.run_metadata.error_filename
            folder = getattr(trial, where)
            if name and folder and Path(folder, name).exists():
                lines = [ln.strip() for ln in Path(folder, name).read_text().splitlines() if ln.strip()]
                break
        except Exception:  # noqa: BLE001 - some paths need a running Ray; the reason is optional
            continue
    for line in reversed(lines):
        m = re.search(r"RuntimeError: trial \d+ failed: (.*)$", line)
        if m:
            return m.group(1)
    return lines[-1][:500] if lines else ""


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def study_result(spec: StudySpec, study_name: str, records: list[TrialRecord],
                 parent_run_id: str | None) -> StudyResult:
    return StudyResult(name=study_name, backend="ray", direction=spec.objective.direction,
                       metric=spec.objective.metric, trials=sorted(records, key=lambda t: t.number),
                       parent_run_id=parent_run_id, metrics=[o.metric for o in spec.objective_list()],
                       directions=list(spec.directions()))


def load_result(spec: StudySpec, study_name: str, reader=None, live: bool | None = None) -> StudyResult:
    """The study as stored: Ray's experiment state plus sweeps' meta file; run ids and
    failure reasons filled in from MLflow when it answers. Never writes.
    ``live``: whether a driver is running the study now (None: ask its run lock)."""
    from ray.tune import ExperimentAnalysis

    meta = read_meta(study_name) or {}
    path = ray_root() / study_name
    try:
        analysis = ExperimentAnalysis(str(path))
    except (ValueError, FileNotFoundError):
        return study_result(spec, study_name, [], meta.get("parent_run_id"))  # created, no trial yet
    live = driver_running(study_name) if live is None else live
    records = []
    for trial in analysis.trials:
        frame = analysis.trial_dataframes.get(trial.trial_id)
        rows = frame.to_dict("records") if frame is not None and len(frame) else []
        records.append(record_of(trial, spec, rows, live))
        records[-1].ray_trial_id = trial.trial_id  # type: ignore[attr-defined]
    result = study_result(spec, study_name, records, meta.get("parent_run_id"))
    if reader is not None and result.parent_run_id:
        fill_from_mlflow(reader, result)
    return result


def trial_runs(reader: TrackingReader, parent_run_id: str) -> dict[str, Any]:
    """The parent's trial runs by Ray trial id (newest first wins)."""
    runs = reader.children(parent_run_id, oldest_first=True)
    return {r.data.tags[TAG_RAY_TRIAL_ID]: r for r in runs if TAG_RAY_TRIAL_ID in r.data.tags}


def fill_from_mlflow(reader: TrackingReader, result: StudyResult) -> None:
    """Run ids of trials that never reported (failed at start), failure reasons, and the
    outcome of trials that finished after Ray's last snapshot (the driver died first)."""
    if not result.parent_run_id:
        return
    try:
        runs = trial_runs(reader, result.parent_run_id)
    except Exception:  # noqa: BLE001 - the table still shows without MLflow
        return
    for t in result.trials:
        ray_id: str | None = getattr(t, "ray_trial_id", None)  # set by load_result
        run = runs.get(ray_id) if ray_id is not None else None
        if run is None:
            continue
        t.run_id = t.run_id or run.info.run_id
        if not t.duration_s and run.info.end_time and run.info.start_time:
            t.duration_s = (run.info.end_time - run.info.start_time) / 1000  # failed before any report
        if t.state == "FAIL" and not t.reason:
            t.reason = run.data.tags.get(layout.TAG_ERROR, "")
        if t.state in ("RUNNING", "WAITING") and ended_for_good(run):
            t.state = run.data.tags[layout.TAG_STATE]
            t.reason = run.data.tags.get("sweeps.reason", "")
            t.value = run.data.metrics.get("objective", t.value)
