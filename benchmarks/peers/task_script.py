"""The packed benchmark's plain arm: a study of one of the project's tasks as a competent user writes
it with plain Optuna, PyTorch and ``MlflowClient``, one trial after another (or ``n_jobs`` in
threads).

The task's own model, data, loss and metrics (``core.tasks``: the same architecture, split and
objective every ``sweeps`` arm trains) in a hand loop: batches sliced from in-memory tensors in a
seeded order, the spec's optimizer with its schedule stepped per batch, validation each epoch; a
parent run for the study and a nested run per trial with its parameters, per-epoch metrics and
per-step loss (one ``log_batch`` per epoch); the best checkpoint saved and logged; TPE with the
study's seed and constant liar, the median pruner when the study has one.

    python -m benchmarks.peers.task_script STUDY.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import optuna
import torch
from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from core.config import TrainConfig
from core.tasks.base import make_task


def tensors(ds) -> tuple[torch.Tensor, torch.Tensor]:
    """A map-style dataset as two stacked tensors (what a user loads into memory once)."""
    if hasattr(ds, "tensors"):
        return ds.tensors[0], ds.tensors[1]
    xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.as_tensor(ys)


def train_trial(study: dict, lr: float, weight_decay: float, report) -> float:
    """One trial: the best objective over its epochs; ``report(epoch, metrics, step_losses)``
    logs an epoch and returns False when the trial is pruned."""
    task = make_task(study["task"]["name"], model=study["task"].get("model"), args=study["task"].get("args"))
    torch.manual_seed(study["seed"])
    model = task.build_model()
    (x_train, y_train), (x_val, y_val) = (tensors(ds) for ds in task.datasets())
    loss_fn = task.make_loss(TrainConfig(label_smoothing=0.0))
    metrics = {f"val_{k}": m for k, m in task.metrics().items()}
    cls = torch.optim.AdamW if study["optimizer"] == "adamw" else torch.optim.SGD
    extra = {"momentum": 0.9} if study["optimizer"] == "sgd" else {}
    optimizer = cls(model.parameters(), lr=lr, weight_decay=weight_decay, **extra)
    bs, epochs = study["batch_size"], study["epochs"]
    steps = math.ceil(len(x_train) / bs)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps)
    objective, maximize = study["objective"], study["direction"] == "maximize"
    best = -math.inf if maximize else math.inf
    order = torch.Generator().manual_seed(study["seed"])
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(x_train), generator=order)
        losses = []
        for b in range(steps):
            idx = perm[b * bs:(b + 1) * bs]
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.detach())
        model.eval()
        for m in metrics.values():
            m.reset()
        with torch.inference_mode():
            out = model(x_val)
            val_loss = float(loss_fn(out, y_val))
            for m in metrics.values():
                m.update(task.postprocess(out), y_val)
        values = {"val_loss": val_loss, **{k: float(m.compute()) for k, m in metrics.items()},
                  "train_loss": float(torch.stack(losses).mean())}
        value = values[objective]
        improved = value > best if maximize else value < best
        best = value if improved else best
        if not report(epoch, values, [float(v) for v in losses], model if improved else None):
            raise optuna.TrialPruned()
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("study")
    args = p.parse_args()
    study_cfg = json.loads(Path(args.study).read_text())
    torch.set_num_threads(study_cfg.get("threads", 1))
    out = Path(study_cfg["out_dir"])
    client = MlflowClient(study_cfg["tracking_uri"])
    exp_id = client.create_experiment(study_cfg["name"], artifact_location=(out / "mlartifacts").as_uri())
    parent = client.create_run(exp_id, run_name=study_cfg["name"]).info.run_id

    def objective(trial: optuna.Trial) -> float:
        space = study_cfg["search"]
        lr = trial.suggest_float("lr", *space["lr"], log=True)
        wd = trial.suggest_float("weight_decay", *space["weight_decay"], log=True)
        run_id = client.create_run(exp_id, run_name=f"trial-{trial.number}",
                                   tags={"mlflow.parentRunId": parent}).info.run_id
        client.log_batch(run_id, params=[Param("lr", str(lr)), Param("weight_decay", str(wd))])
        ckpt = out / f"trial-{trial.number}" / "best.pt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        step = [0]

        def report(epoch: int, values: dict, losses: list[float], improved_model) -> bool:
            now = int(time.time() * 1000)
            points = [Metric("step/train_loss", v, now, step[0] + i) for i, v in enumerate(losses)]
            step[0] += len(losses)
            points += [Metric(k, v, now, epoch) for k, v in values.items()]
            client.log_batch(run_id, metrics=points)
            if improved_model is not None:
                torch.save(improved_model.state_dict(), ckpt)
            trial.report(values[study_cfg["objective"]], epoch)
            return not trial.should_prune()

        status = RunStatus.FAILED
        try:
            best = train_trial(study_cfg, lr, wd, report)
            client.log_metric(run_id, "objective", best)
            status = RunStatus.FINISHED
            return best
        except optuna.TrialPruned:
            status = RunStatus.KILLED
            raise
        finally:
            if ckpt.exists():
                client.log_artifact(run_id, str(ckpt), "checkpoints")
            client.set_terminated(run_id, RunStatus.to_string(status))

    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=study_cfg["pruner_warmup"])
              if study_cfg.get("pruner") == "median" else optuna.pruners.NopPruner())
    sampler = optuna.samplers.TPESampler(seed=study_cfg["seed"], constant_liar=True)
    study = optuna.create_study(direction=study_cfg["direction"], sampler=sampler, pruner=pruner)
    study.optimize(objective, n_trials=study_cfg["n_trials"], n_jobs=study_cfg.get("n_jobs", 1))
    client.log_metric(parent, "best_value", study.best_value)
    client.set_terminated(parent)


if __name__ == "__main__":
    main()
