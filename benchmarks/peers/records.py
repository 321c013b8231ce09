"""What an arm recorded, read back from its MLflow store after the study (never assumed).

The trial runs are the experiment's runs that no other run is nested under (the study's run
is); "nested" counts those whose parent is a run of the experiment. Per trial run: status,
parameters, metric keys and points, per-step and per-epoch curves, system metrics, and the files
among its artifacts and its logged models' artifacts (checkpoints ``*.pt``/``*.pth``/``*.ckpt``,
ONNX ``*.onnx``).
"""
from __future__ import annotations

from collections import Counter

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")


def _files(list_fn, path: str | None = None) -> list[str]:
    """Every file under ``path`` of an artifact listing (``list_fn(path)`` -> FileInfo)."""
    out = []
    for info in list_fn(path):
        out += _files(list_fn, info.path) if info.is_dir else [info.path]
    return out


def _curve_keys(client, run, epoch_key: str) -> tuple[list[str], list[str], int, int]:
    """(per-step keys, per-epoch keys, step points, epochs) of a run; system metrics left out."""
    step_keys, epoch_keys, step_points = [], [], 0
    epochs = len(client.get_metric_history(run.info.run_id, epoch_key)) if epoch_key in run.data.metrics else 0
    for key in run.data.metrics:
        if key.startswith("system/"):
            continue
        n = len(client.get_metric_history(run.info.run_id, key))
        if n > max(epochs, 1):
            step_keys.append(key)
            step_points += n
        elif n == epochs and n >= 1:
            epoch_keys.append(key)
    return sorted(step_keys), sorted(epoch_keys), step_points, epochs


def recorded(tracking_uri: str, experiment: str, epoch_key: str = "val_loss") -> dict:
    """Summary of the trial runs of ``experiment``: counts over trial runs and a per-run list."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {"trial_runs": 0, "error": f"no experiment {experiment!r} in {tracking_uri}"}
    runs = client.search_runs([exp.experiment_id], max_results=5000)
    ids = {r.info.run_id for r in runs}
    parents = {r.data.tags.get("mlflow.parentRunId") for r in runs} & ids
    trials = [r for r in runs if r.info.run_id not in parents]
    models: dict[str, list[str]] = {}
    for m in client.search_logged_models(experiment_ids=[exp.experiment_id]):
        files = _files(lambda p, mid=m.model_id: client.list_logged_model_artifacts(mid, p))
        models.setdefault(m.source_run_id or "", []).extend(files)
    per_run = []
    for r in trials:
        files = _files(lambda p, rid=r.info.run_id: client.list_artifacts(rid, p)) + models.get(r.info.run_id, [])
        step_keys, epoch_keys, step_points, epochs = _curve_keys(client, r, epoch_key)
        per_run.append({
            "name": r.info.run_name, "status": r.info.status, "params": len(r.data.params),
            "nested": r.data.tags.get("mlflow.parentRunId") in parents,
            "epochs": epochs, "epoch_keys": epoch_keys, "step_keys": step_keys, "step_points": step_points,
            "system_keys": sum(k.startswith("system/") for k in r.data.metrics),
            "checkpoints": sum(f.endswith(CHECKPOINT_SUFFIXES) for f in files),
            "onnx": sum(f.endswith(".onnx") for f in files), "files": len(files),
            "logged_models": len(models.get(r.info.run_id, [])) > 0,
            "start_ms": r.info.start_time,
            "first_epoch_ms": min((m.timestamp for m in client.get_metric_history(r.info.run_id, epoch_key)),
                                  default=None),
        })
    n = len(per_run)

    def runs_with(key: str) -> int:
        return sum(bool(p[key]) for p in per_run)

    return {
        "trial_runs": n, "statuses": dict(Counter(p["status"] for p in per_run)),
        "nested": runs_with("nested"), "study_runs": len(parents),
        "params_median": sorted(p["params"] for p in per_run)[n // 2] if n else 0,
        "epoch_curves": runs_with("epoch_keys"), "step_curves": runs_with("step_keys"),
        "epoch_keys": sorted({k for p in per_run for k in p["epoch_keys"]}),
        "step_keys": sorted({k for p in per_run for k in p["step_keys"]}),
        "step_points": sum(p["step_points"] for p in per_run),
        "system_metrics": runs_with("system_keys"), "checkpoints": runs_with("checkpoints"),
        "onnx": runs_with("onnx"), "logged_models": runs_with("logged_models"),
        "artifact_files": sum(p["files"] for p in per_run), "runs": per_run,
        # When the first trial began (its run created, just before its data and model are set up)
        # and ended its first epoch, in ms since the epoch: the same MLflow clock for every arm.
        "first_trial_start_ms": min((p["start_ms"] for p in per_run), default=None),
        "first_epoch_ms": min((p["first_epoch_ms"] for p in per_run if p["first_epoch_ms"]), default=None),
    }


TABLE_COLUMNS = (("trial_runs", "trial runs"), ("nested", "nested"), ("params_median", "params"),
                 ("epoch_curves", "epoch curves"), ("step_curves", "step curves"),
                 ("system_metrics", "system metrics"), ("checkpoints", "checkpoints"), ("onnx", "ONNX"),
                 ("logged_models", "logged models"))


def table(records: dict[str, dict]) -> list[str]:
    """Markdown rows, one per arm: how many trial runs hold each kind of record."""
    lines = ["| arm | " + " | ".join(label for _, label in TABLE_COLUMNS) + " | per-epoch keys | per-step keys |",
             "|---" * (len(TABLE_COLUMNS) + 3) + "|"]
    for arm, rec in records.items():
        cells = [str(rec.get(key, "-")) for key, _ in TABLE_COLUMNS]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {', '.join(rec.get('epoch_keys', []))} | "
                     f"{', '.join(rec.get('step_keys', []))} |")
    return lines
