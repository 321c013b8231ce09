"""Where a ``sweeps run`` trial's time goes, for bench_peers.

Two sources, both measured:

* the trial runs ``sweeps run`` recorded (:func:`from_store`): each trial's ``trial_seconds``
  (its MLflow run created to closed) and the training loop's own ``epoch_time_s`` per epoch; the
  rest of a trial is validation, checkpoints, the ONNX export and check, and the tracking calls;
  the run's wall time beyond its trials is process start-up, imports and shut-down;
* the pieces timed alone in a fresh process (``python -m benchmarks.peers.breakdown WIDTH EPOCHS
  STEPS``, :func:`components`): imports, the ONNX export and check (a process's first and a later
  one), the checkpoint writes of one epoch (``last.pt`` rotated, ``best.pt``), and one trial's
  tracking through the tracker a worker uses (``MlflowTracker`` on SQLite) next to the plain
  script's ``MlflowClient`` calls.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def from_store(tracking_uri: str, experiment: str, wall_s: float) -> dict:
    """Per-trial figures from the trial runs of one ``sweeps run`` (seconds, medians over trials)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`sweeps.role` = 'trial'", max_results=5000)
    trial_s, train_s = [], []
    for r in runs:
        if "trial_seconds" not in r.data.metrics:
            continue
        trial_s.append(r.data.metrics["trial_seconds"])
        train_s.append(sum(m.value for m in client.get_metric_history(r.info.run_id, "epoch_time_s")))
    n = len(trial_s)
    workers = len({r.data.tags.get("sweeps.worker") for r in runs}) or 1
    if not n:
        return {"error": "no trial run with trial_seconds"}
    outside = wall_s * workers - sum(trial_s)
    return {"trials": n, "workers": workers, "wall_s": wall_s,
            "trial_s_median": statistics.median(trial_s), "train_loop_s_median": statistics.median(train_s),
            "rest_of_trial_s_median": statistics.median(t - s for t, s in zip(trial_s, train_s, strict=True)),
            "outside_trials_s_per_trial": outside / n,
            "outside_trials_definition": "(wall x workers - sum of trial_seconds) / trials: process start-up, "
                                         "imports, study set-up, between trials and shut-down"}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _python_s(code: str) -> float:
    import subprocess

    return _timed(lambda: subprocess.run([sys.executable, "-c", code], check=True, capture_output=True))


def components(width: int, epochs: int, steps_per_epoch: int) -> dict:
    """Each piece of a trial's work timed alone, in this (fresh) process; seconds."""
    import torch

    from benchmarks.bench_orchestration import WORKER_IMPORTS
    from benchmarks.peers.digits_cnn import load_data
    from core.checkpoint import save_checkpoint, save_last
    from core.onnx_export import export_and_verify
    from core.tasks.digits_models import DigitsCNN

    out: dict = {"imports": {
        "python + import torch": _python_s("import torch"),
        "python + sweeps CLI imports (sweeps.cli, mlflow, optuna, torch)":
            _python_s("import sweeps.cli, mlflow.tracking, optuna, torch"),
        "python + worker imports": _python_s(WORKER_IMPORTS),
    }}
    model = DigitsCNN(width)
    x = load_data(0.2)[2][:256]  # validation images, as the trial's export checks on
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # a momentum state to save
    model(x[:32]).sum().backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        out["onnx_export_and_check_first_s"] = _timed(lambda: export_and_verify(model, x, folder / "a.onnx"))
        out["onnx_export_and_check_later_s"] = _timed(lambda: export_and_verify(model, x, folder / "b.onnx"))
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1,
                 "rng": torch.get_rng_state()}
        out["checkpoint_epoch_s"] = statistics.median(
            _timed(lambda: (save_last(state, folder), save_checkpoint(state, folder / "best.pt"))) for _ in range(5))
        out["checkpoint_bytes"] = (folder / "best.pt").stat().st_size
        out["tracking_sweeps_s"] = _track_sweeps(folder / "sweeps", epochs, steps_per_epoch)
        out["tracking_plain_client_s"] = _track_plain(folder / "plain", epochs, steps_per_epoch)
    out["per_trial_estimate_s"] = {
        "onnx export + check (later export)": out["onnx_export_and_check_later_s"],
        f"checkpoints ({epochs} epochs)": epochs * out["checkpoint_epoch_s"],
        "tracking store (sweeps tracker)": out["tracking_sweeps_s"],
    }
    return out


def _track_sweeps(folder: Path, epochs: int, steps: int) -> float:
    """One trial's tracking as a worker does it: run, params, config artifact, curves, end."""
    from benchmarks.sweeps_runs import TrackingStore

    store = TrackingStore(folder)
    store.tracker.log_metrics(store.parent, {"warm": 1.0}, 0)  # the store exists before the trial

    def trial() -> None:
        reporter, run = store.trial_reporter("trial-0")
        store.tracker.log(run, params={f"train.p{i}": i for i in range(40)})
        store.tracker.log_artifact(run, {"config": list(range(100))}, "config")
        for epoch in range(1, epochs + 1):
            for s in range(steps):
                store.tracker.log_metrics(run, {"step/train_loss": 1.0, "step/lr": 0.1, "step/grad_norm": 1.0},
                                          (epoch - 1) * steps + s)
            store.tracker.log_metrics(run, {f"m{i}": 1.0 for i in range(10)}, epoch)
        store.tracker.end_run(run)

    seconds = _timed(trial)
    store.close()
    return seconds


def _track_plain(folder: Path, epochs: int, steps: int) -> float:
    """The same points through the plain script's calls: create_run, log_batch per epoch, end."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    folder.mkdir(parents=True)
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    exp = client.create_experiment("plain", artifact_location=(folder / "art").as_uri())
    parent = client.create_run(exp).info.run_id

    def trial() -> None:
        run = client.create_run(exp, tags={"mlflow.parentRunId": parent}).info.run_id
        client.log_batch(run, params=[Param(f"p{i}", str(i)) for i in range(40)])
        for epoch in range(1, epochs + 1):
            now = int(time.time() * 1000)
            metrics = [Metric(k, 1.0, now, (epoch - 1) * steps + s) for s in range(steps)
                       for k in ("step/train_loss", "step/lr", "step/grad_norm")]
            client.log_batch(run, metrics=metrics + [Metric(f"m{i}", 1.0, now, epoch) for i in range(10)])
        client.set_terminated(run)

    return _timed(trial)


if __name__ == "__main__":
    width, epochs, steps = (int(a) for a in sys.argv[1:4])
    print(json.dumps(components(width, epochs, steps)))
