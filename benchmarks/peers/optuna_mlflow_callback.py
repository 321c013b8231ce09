"""Peer (c): the study with optuna-integration's ``MLflowCallback``, the documented way.

The callback makes a run per trial (nested under the study's run) with the parameters and the
objective; ``track_in_mlflow`` lets the objective log into that run: per-epoch metrics
(``mlflow.log_metrics``), the per-step loss (one ``log_batch`` per epoch: the fluent API takes one
step per call) and the best checkpoint. The callback holds a lock for the whole objective, so trials run one at a
time (``n_jobs=1``) with all the machine's torch threads.

    python -m benchmarks.peers.optuna_mlflow_callback STUDY.json
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import mlflow
import optuna
import torch
from mlflow.entities import Metric
from optuna_integration.mlflow import MLflowCallback

from benchmarks.peers.digits_cnn import Training, load_data, sampler, study_config


def main() -> None:
    study_cfg = study_config(sys.argv[1])
    out = Path(study_cfg["out_dir"])
    mlflow.set_tracking_uri(study_cfg["tracking_uri"])
    mlflow.create_experiment(study_cfg["name"], artifact_location=(out / "mlartifacts").as_uri())
    mlflow.set_experiment(study_cfg["name"])
    callback = MLflowCallback(tracking_uri=study_cfg["tracking_uri"], metric_name="best_val_acc",
                              mlflow_kwargs={"nested": True})
    x_train, y_train, x_val, y_val = load_data(study_cfg["val_fraction"])

    @callback.track_in_mlflow()
    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", study_cfg["lr"]["low"], study_cfg["lr"]["high"], log=True)
        batch_size = trial.suggest_categorical("batch_size", study_cfg["batch_sizes"])
        training = Training.create(study_cfg, lr, batch_size, len(x_train))
        ckpt = out / f"trial-{trial.number}" / "best.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        best, step = 0.0, 0
        client, run_id = mlflow.MlflowClient(), mlflow.active_run().info.run_id
        try:
            for epoch in range(1, study_cfg["epochs"] + 1):
                lr_now = training.lr()
                losses = training.train_epoch(x_train, y_train)
                val = training.evaluate(x_val, y_val)
                now = int(time.time() * 1000)
                client.log_batch(run_id, metrics=[Metric("step/train_loss", v, now, step + i)
                                                  for i, v in enumerate(losses)])
                step += len(losses)
                mlflow.log_metrics({**val, "train_loss": sum(losses) / len(losses), "lr": lr_now}, step=epoch)
                if val["val_acc"] > best:
                    best = val["val_acc"]
                    torch.save(training.model.state_dict(), ckpt)
                trial.report(val["val_acc"], epoch)
                if trial.should_prune():
                    raise optuna.TrialPruned()
            return best
        finally:
            if ckpt.exists():
                mlflow.log_artifact(str(ckpt), "checkpoints")

    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=study_cfg["pruner"]["warmup_epochs"])
              if study_cfg["pruner"]["name"] == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(study_name=study_cfg["name"], direction="maximize", sampler=sampler(study_cfg),
                                pruner=pruner)
    with mlflow.start_run(run_name=study_cfg["name"]):
        study.optimize(objective, n_trials=study_cfg["n_trials"], callbacks=[callback])
        mlflow.log_metric("best_val_acc", study.best_value)


if __name__ == "__main__":
    main()
