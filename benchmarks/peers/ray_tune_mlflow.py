"""Peer (d): the study with Ray Tune and MLflow (``ray.air.integrations.mlflow.setup_mlflow``).

Ray Tune's Optuna searcher with the spec's sampler (TPE or GP), seed and start-up trials, Ray's
median stopping rule for the median pruner (its stopped trials' runs are closed as KILLED by the driver), one
trial per CPU at a time (each with one torch thread). The rule pauses a trial while too few others
have reached its epoch, so each epoch reports a Tune checkpoint (weights, optimizer, schedule, the
MLflow run id) and a resumed trial continues in its run. Each trial calls ``setup_mlflow``, which
starts its run (nested under the study's run through the ``mlflow.parentRunId`` tag) and logs its
config; the trial then logs per-epoch metrics, the per-step loss (one ``log_batch`` per epoch) and
its best checkpoint, and reports to Tune.

    python -m benchmarks.peers.ray_tune_mlflow STUDY.json
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import ray
import torch
from mlflow.entities import Metric
from ray import tune
from ray.air.integrations.mlflow import setup_mlflow
from ray.tune.schedulers import FIFOScheduler, MedianStoppingRule
from ray.tune.search.optuna import OptunaSearch

from benchmarks.peers.digits_cnn import Training, load_data, sampler, study_config


def trainable(config: dict, study_cfg: dict, parent: str) -> None:
    torch.set_num_threads(1)
    trial_name = tune.get_context().get_trial_name()
    x_train, y_train, x_val, y_val = load_data(study_cfg["val_fraction"])
    training = Training.create(study_cfg, config["lr"], config["batch_size"], len(x_train))
    resumed = tune.get_checkpoint()  # the median rule pauses trials; a paused trial resumes here
    if resumed is None:
        ml = setup_mlflow(config, tracking_uri=study_cfg["tracking_uri"], experiment_name=study_cfg["name"],
                          run_name=trial_name, tags={"mlflow.parentRunId": parent})
        state = {"run_id": ml.active_run().info.run_id, "epoch": 0, "step": 0, "best": 0.0}
    else:
        with resumed.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt")
        for part in ("model", "optimizer", "scheduler"):
            getattr(training, part).load_state_dict(state.pop(part))
        ml = mlflow
        ml.set_tracking_uri(study_cfg["tracking_uri"])
        ml.start_run(run_id=state["run_id"])
    ckpt = Path(study_cfg["out_dir"]) / trial_name / "best.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    client = ml.MlflowClient()
    for epoch in range(state["epoch"] + 1, study_cfg["epochs"] + 1):
        lr_now = training.lr()
        losses = training.train_epoch(x_train, y_train)
        val = training.evaluate(x_val, y_val)
        now = int(time.time() * 1000)
        epoch_metrics = {**val, "train_loss": sum(losses) / len(losses), "lr": lr_now}
        step = state["step"]
        client.log_batch(state["run_id"], metrics=[Metric("step/train_loss", v, now, step + i)
                                                   for i, v in enumerate(losses)]
                         + [Metric(k, v, now, epoch) for k, v in epoch_metrics.items()])
        state.update(epoch=epoch, step=step + len(losses))
        if val["val_acc"] > state["best"]:
            state["best"] = val["val_acc"]
            torch.save(training.model.state_dict(), ckpt)
            ml.log_artifact(str(ckpt), "checkpoints")  # the trial may be stopped after any report
        with tempfile.TemporaryDirectory() as folder:
            torch.save({**state, "model": training.model.state_dict(), "optimizer": training.optimizer.state_dict(),
                        "scheduler": training.scheduler.state_dict()}, Path(folder) / "state.pt")
            tune.report({"val_acc": val["val_acc"]}, checkpoint=tune.Checkpoint.from_directory(folder))
    ml.end_run()


def main() -> None:
    study_cfg = study_config(sys.argv[1])
    out = Path(study_cfg["out_dir"])
    client = mlflow.MlflowClient(study_cfg["tracking_uri"])
    exp_id = client.create_experiment(study_cfg["name"], artifact_location=(out / "mlartifacts").as_uri())
    parent = client.create_run(exp_id, run_name=study_cfg["name"]).info.run_id
    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    space = {"lr": tune.loguniform(study_cfg["lr"]["low"], study_cfg["lr"]["high"]),
             "batch_size": tune.choice(study_cfg["batch_sizes"])}
    scheduler = (MedianStoppingRule(time_attr="training_iteration", grace_period=study_cfg["pruner"]["warmup_epochs"],
                                    min_samples_required=2)
                 if study_cfg["pruner"]["name"] == "median" else FIFOScheduler())
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trainable, study_cfg=study_cfg, parent=parent), {"cpu": 1}),
        param_space=space,
        tune_config=tune.TuneConfig(metric="val_acc", mode="max", num_samples=study_cfg["n_trials"],
                                    search_alg=OptunaSearch(sampler=sampler(study_cfg, constant_liar=cpus > 1)),
                                    scheduler=scheduler,
                                    max_concurrent_trials=cpus),
        run_config=tune.RunConfig(name=study_cfg["name"], storage_path=str(out / "ray_results"), verbose=0),
    )
    best = tuner.fit().get_best_result()
    # A trial the scheduler stops ends inside tune.report, so its run is closed here.
    left_open = f"tags.`mlflow.parentRunId` = '{parent}' and attributes.status = 'RUNNING'"
    for run in client.search_runs([exp_id], left_open):
        client.set_terminated(run.info.run_id, "KILLED")
    client.log_metric(parent, "best_val_acc", best.metrics["val_acc"])
    client.set_terminated(parent)
    ray.shutdown()


if __name__ == "__main__":
    main()
