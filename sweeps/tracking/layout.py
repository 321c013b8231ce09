"""The MLflow layout every backend writes and every reader (status, promote, rerun,
report) relies on. One place for the names, so writers and readers cannot drift.

experiment      = the study name (or ``tracking.experiment``)
parent run      = one per study, reused when the study resumes; tag role=study
child run       = one per trial, nested under the parent (``mlflow.parentRunId``); tag role=trial
per-epoch metrics: ``core.metrics.LOOP_METRICS`` and the task's ``val_<name>``, step = epoch (1-based)
per-step metrics : ``step/<name>`` for ``core.results.STEP_METRICS``, step = optimizer step (1-based)
"""
from __future__ import annotations

from pathlib import Path

TAG_ROLE = "sweeps.role"  # "study" | "trial" | "rerun" | "seeds"
ROLE_STUDY, ROLE_TRIAL, ROLE_RERUN, ROLE_SEEDS = "study", "trial", "rerun", "seeds"
TAG_STUDY = "sweeps.study"  # study name, on parent and children
TAG_BACKEND = "sweeps.backend"  # "optuna" | "ray"
TAG_TRIAL_NUMBER = "sweeps.trial_number"
TAG_STATE = "sweeps.state"  # COMPLETE | PRUNED | FAIL | RUNNING (the study's view of the trial)
TAG_PRUNED = "sweeps.pruned"  # "true" on pruned trials (MLflow status FINISHED)
TAG_ERROR = "sweeps.error"  # failure reason on failed trials (MLflow status FAILED)
TAG_SEED = "sweeps.seed"
TAG_DEVICE = "sweeps.device"
TAG_WORKER = "sweeps.worker"  # host:boot-id:pid of the worker that ran the trial (sweeps.worker_identity)
TAG_SPEC_HASH = "sweeps.spec_hash"
TAG_STUDY_UID = "sweeps.study_uid"  # the study's identity (a UUID stored in the study), on parent and trials
TAG_GIT_COMMIT = "sweeps.git_commit"
TAG_RERUN_OF = "rerun_of"  # run id of the original, on a rerun
TAG_ONNX_PASSED = "sweeps.onnx_parity_passed"  # "true" | "false"
TAG_PARETO_FRONT = "sweeps.pareto_front"  # on a trial of several objectives: "true" on the front
TAG_BEST_TRIAL = "sweeps.best_trial"  # on the parent: number of the best trial so far
TAG_BEST_RUN_ID = "sweeps.best_run_id"
PARENT_TAG = "mlflow.parentRunId"

STEP_METRIC_PREFIX = "step/"

# Artifact paths inside a trial run
ART_CONFIG = "config/resolved_config.json"  # {"train": TrainConfig dict, "task": {...}, "params": {...}, "seed": int}
ART_CHECKPOINT_DIR = "checkpoints"  # best.pt (and last.pt)
ART_ONNX_DIR = "onnx"  # model.onnx + parity_report.json
ART_EVAL_DIR = "eval"  # confusion_matrix.json
ART_LR_FINDER_DIR = "lr_finder"  # lr_finder.json (curve + suggestion)
# On the parent run
ART_SPEC_DIR = "spec"  # the spec file as given + resolved spec json
ART_SUMMARY = "summary/summary.json"
ART_REPORT_DIR = "report"


def artifact_root_uri(root: str | Path | None) -> str | None:
    """Where experiments a tracker creates keep artifacts: a URI as given, a local folder absolute."""
    if root is None:
        return None
    text = str(root)
    if "://" in text or text.startswith(("mlflow-artifacts:", "file:")):
        return text.rstrip("/")
    return str(Path(text).resolve())  # a relative root would depend on the worker's cwd
