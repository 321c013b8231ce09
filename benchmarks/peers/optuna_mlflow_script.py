"""Peer (b): the study as a competent user writes it with plain Optuna and ``MlflowClient``.

A parent run for the study, a nested run per trial with its parameters, per-epoch metrics and
per-step loss (one ``log_batch`` per epoch), the best checkpoint saved and logged; the spec's
sampler (TPE or GP) with its seed and start-up trials, the spec's pruner; ``--n-jobs N`` trials at once in threads,
each with ``cpu_count // N`` torch threads.

    python -m benchmarks.peers.optuna_mlflow_script STUDY.json --n-jobs 2
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import optuna
import torch
from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from benchmarks.peers.digits_cnn import Training, load_data, sampler, study_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("study")
    p.add_argument("--n-jobs", type=int, default=1)
    args = p.parse_args()
    study_cfg = study_config(args.study)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.n_jobs))
    out = Path(study_cfg["out_dir"])
    client = MlflowClient(study_cfg["tracking_uri"])
    exp_id = client.create_experiment(study_cfg["name"], artifact_location=(out / "mlartifacts").as_uri())
    parent = client.create_run(exp_id, run_name=study_cfg["name"]).info.run_id
    x_train, y_train, x_val, y_val = load_data(study_cfg["val_fraction"])

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", study_cfg["lr"]["low"], study_cfg["lr"]["high"], log=True)
        batch_size = trial.suggest_categorical("batch_size", study_cfg["batch_sizes"])
        run_id = client.create_run(exp_id, run_name=f"trial-{trial.number}",
                                   tags={"mlflow.parentRunId": parent}).info.run_id
        client.log_batch(run_id, params=[Param("lr", str(lr)), Param("batch_size", str(batch_size))])
        training = Training.create(study_cfg, lr, batch_size, len(x_train))
        ckpt = out / f"trial-{trial.number}" / "best.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        best, step, status = 0.0, 0, RunStatus.FAILED
        try:
            for epoch in range(1, study_cfg["epochs"] + 1):
                lr_now = training.lr()
                losses = training.train_epoch(x_train, y_train)
                val = training.evaluate(x_val, y_val)
                now = int(time.time() * 1000)
                metrics = [Metric("step/train_loss", v, now, step + i) for i, v in enumerate(losses)]
                step += len(losses)
                epoch_metrics = {**val, "train_loss": sum(losses) / len(losses), "lr": lr_now}
                metrics += [Metric(k, v, now, epoch) for k, v in epoch_metrics.items()]
                client.log_batch(run_id, metrics=metrics)
                if val["val_acc"] > best:
                    best = val["val_acc"]
                    torch.save(training.model.state_dict(), ckpt)
                trial.report(val["val_acc"], epoch)
                if trial.should_prune():
                    status = RunStatus.KILLED
                    raise optuna.TrialPruned()
            status = RunStatus.FINISHED
            return best
        finally:
            if ckpt.exists():
                client.log_artifact(run_id, str(ckpt), "checkpoints")
            client.set_terminated(run_id, RunStatus.to_string(status))

    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=study_cfg["pruner"]["warmup_epochs"])
              if study_cfg["pruner"]["name"] == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(direction="maximize", sampler=sampler(study_cfg, constant_liar=args.n_jobs > 1),
                                pruner=pruner)
    study.optimize(objective, n_trials=study_cfg["n_trials"], n_jobs=args.n_jobs)
    client.log_metric(parent, "best_val_acc", study.best_value)
    client.set_terminated(parent)


if __name__ == "__main__":
    main()
