"""LR range test: what it costs, and how good its suggested learning rate is.

Training config: ``studies/lr_bs.yaml``'s train section (digits CNN, SGD with momentum,
OneCycle, 8 epochs, grad clip 1.0) at batch 32, no checkpoints, no ONNX export. For each seed:

* the LR range test (``core.lr_finder.lr_range_test`` with the spec's ``lr_finder`` defaults:
  1e-7 -> 10, at most 100 steps and one epoch, rule ``minimum``): its cost in epochs, its suggestion;
* a training run at the suggested learning rate (OneCycle's peak lr);
* a training run at each learning rate of a grid spanning lr_bs's search range (half decades).

Accuracy = the best validation accuracy over the epochs (a trial's objective in ``sweeps``).
The ratio is the suggested lr's accuracy over the best grid point's (each averaged over seeds).
Runs are spread over 2 processes with 1 torch thread each (accuracy does not depend on speed).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import statistics

from benchmarks.common import ROOT, Context, arm, make_row, stats

NAME = "lr_finder"
TITLE = "LR range test: cost in epochs, and val accuracy at its suggestion vs the best of an lr grid"
SPEC = ROOT / "studies" / "lr_bs.yaml"
TARGET_EPOCHS = 1.0
TARGET_RATIO = 0.99
GRID = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def base_config(seed: int, epochs: int | None = None):
    from core.config import apply_overrides
    from sweeps.spec.load import load_spec

    spec = load_spec(SPEC)
    cfg = spec.resolved_train_config({"lr": 0.01, "batch_size": 32})
    overrides = {"batch_size": 32, "export_onnx": False, "save_checkpoints": False, "device": "cpu",
                 "monitor": "val_acc", "monitor_mode": "max", "seed": seed, "num_workers": 0}
    if epochs is not None:
        overrides["epochs"] = epochs
    return spec, apply_overrides(cfg, overrides)


def finder_job(seed: int, epochs: int | None) -> dict:
    """Run the LR range test with the spec's lr_finder settings; returns cost and suggestion."""
    from core.lr_finder import lr_range_test

    spec, cfg = base_config(seed, epochs)
    lf = spec.lr_finder
    res = lr_range_test(spec.make_task({}), cfg, start_lr=lf.start_lr, end_lr=lf.end_lr, num_steps=lf.num_steps,
                        rule=lf.rule)
    return {"seed": seed, "suggestion": res.suggestion, "suggestions": res.suggestions, "steps": res.steps,
            "epochs_cost": res.epochs_cost, "stopped_early": res.stopped_early, "rule": res.rule}


def train_job(seed: int, lr: float, epochs: int | None) -> dict:
    from core.config import apply_overrides
    from core.train import train

    spec, cfg = base_config(seed, epochs)
    cfg = apply_overrides(cfg, {"lr": float(lr)})
    result = train(spec.make_task({}), cfg)
    return {"seed": seed, "lr": lr, "status": result.status, "best_val_acc": result.best_metric
            if result.best_metric is not None else 0.0, "epochs": result.epochs_completed}


def run(ctx: Context) -> dict:
    seeds = list(ctx.options.get("seeds", ctx.pick([0], [0, 1, 2])))
    grid = tuple(ctx.options.get("grid", ctx.pick((1e-2, 0.1), GRID)))
    epochs = ctx.options.get("epochs", ctx.pick(2, None))  # None: the spec's 8
    procs = min(2, len(os.sched_getaffinity(0)))
    pool = cf.ProcessPoolExecutor(max_workers=procs, mp_context=mp.get_context("spawn"), initializer=_init_worker)
    with pool:
        ctx.log(f"{NAME}: LR range test x {len(seeds)} seeds")
        finders = list(pool.map(finder_job, seeds, [epochs] * len(seeds)))
        for f in finders:
            ctx.log(f"  seed {f['seed']}: suggestion {f['suggestion']:.4g} after {f['steps']} steps "
                    f"({f['epochs_cost']:.2f} epochs)")
        jobs = [(f["seed"], f["suggestion"], "suggested") for f in finders]
        jobs += [(s, lr, "grid") for lr in grid for s in seeds]
        ctx.log(f"{NAME}: {len(jobs)} training runs ({'spec epochs' if epochs is None else f'{epochs} epochs'})")
        futures = [(kind, pool.submit(train_job, s, lr, epochs)) for s, lr, kind in jobs]
        results = [(kind, fut.result()) for kind, fut in futures]

    suggested = [r for kind, r in results if kind == "suggested"]
    grid_rows = {lr: [r for kind, r in results if kind == "grid" and r["lr"] == lr] for lr in grid}
    grid_mean = {lr: statistics.mean(r["best_val_acc"] for r in rs) for lr, rs in grid_rows.items()}
    best_lr = max(grid_mean, key=grid_mean.get)
    sugg_mean = statistics.mean(r["best_val_acc"] for r in suggested)
    per_seed_ratio = []
    for r in suggested:
        best_seed = next(g for g in grid_rows[best_lr] if g["seed"] == r["seed"])
        per_seed_ratio.append(r["best_val_acc"] / best_seed["best_val_acc"])
    ratio = sugg_mean / grid_mean[best_lr]
    cost = statistics.median(f["epochs_cost"] for f in finders)
    meets = cost <= TARGET_EPOCHS and ratio >= TARGET_RATIO
    suggestions = ", ".join(f"{f['suggestion']:.3g}" for f in finders)
    rows = [make_row(
        "suggested lr vs best grid lr", metric="best val_acc over epochs",
        baseline=arm(f"best grid lr ({best_lr:g})", [g["best_val_acc"] for g in grid_rows[best_lr]]),
        candidate=arm("LR range test suggestion", [r["best_val_acc"] for r in suggested]),
        ratio={**stats(per_seed_ratio), "definition": "val_acc at the suggestion / at the best grid lr (per seed)",
               "mean_ratio": ratio},
        target=f"cost <= {TARGET_EPOCHS:g} epoch, accuracy ratio >= {TARGET_RATIO}", meets_target=meets,
        headline=f"{100 * sugg_mean:.2f}% vs {100 * grid_mean[best_lr]:.2f}% val_acc ({ratio:.4f}x the grid's best) "
                 f"for a cost of {cost:.2f} epochs (suggested lr {suggestions})",
        details={"finder": finders, "grid_mean_val_acc": {f"{lr:g}": acc for lr, acc in grid_mean.items()},
                 "suggested_runs": suggested, "grid_runs": [r for kind, r in results if kind == "grid"],
                 "grid_cost_epochs": sum(r["epochs"] for kind, r in results if kind == "grid") / len(seeds)})]
    return {
        "target": f"<= {TARGET_EPOCHS:g} epoch of cost and >= {TARGET_RATIO:.0%} of the grid's best val_acc",
        "summary": f"LR range test: costs {cost:.2f} epochs; its lr reaches {ratio:.4f}x the val_acc of the best of a "
                   f"{len(grid)}-point lr grid ({100 * sugg_mean:.2f}% vs {100 * grid_mean[best_lr]:.2f}%) "
                   f"(target <= {TARGET_EPOCHS:g} epoch, >= {TARGET_RATIO})",
        "rows": rows,
        "notes": [f"Grid: {', '.join(f'{lr:g}' for lr in grid)} (OneCycle peak lr); {len(seeds)} seed(s) "
                  "(model init and data order); accuracy averaged over seeds.",
                  "The grid costs " + f"{len(grid)} full trainings per seed; the range test "
                  f"{cost:.2f} epochs plus one training."],
        "details": {},
    }

