"""A trial's deployment figures, measured before training, and the constraints judged on them.

The figures (``core.deploy_metrics``: ONNX Runtime latency on CPU, parameter count, file size)
depend on the architecture only, never on the weights, so one measurement of the model as
built, with its initial weights, serves both uses: a trial whose architecture violates a
constraint is rejected before its first epoch, and a trial that trains reports the same figures
as its deployment objectives. Every trial is measured the same way (``deploy:`` of the spec).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sweeps.spec.model import StudySpec
from sweeps.spec.objectives import Bound, is_deploy_metric

if TYPE_CHECKING:
    pass

ATTR_FIGURES = "deploy_figures"  # Optuna user attribute: the trial's measured figures
ATTR_REJECTED = "rejected"  # Optuna user attribute: True for a trial rejected before training
TAG_REJECTED = "sweeps.rejected"  # MLflow tag of the same
DEPLOY_DIR = "deploy"  # in the trial folder: initial.onnx, the model measured
MISSING = 1e9  # constraint value of a figure this machine cannot measure (gpu_latency_ms without CUDA)


def measure(spec: StudySpec, params: dict, out_dir: Path) -> dict[str, float]:
    """Build the trial's model with its initial weights (seeded as training seeds it), export it
    to ``out_dir/deploy/initial.onnx`` and measure it."""
    import torch
    from torch.utils.data import DataLoader

    from core.deploy_metrics import deployment_metrics  # lazy: ONNX only at export
    from core.onnx_export import export_and_verify  # lazy: ONNX only at export

    task = spec.make_task(params)
    cfg = spec.resolved_train_config(params)
    with torch.random.fork_rng(devices=[]):  # the trial's own seeding is untouched
        torch.manual_seed(cfg.seed)
        model = task.build_model().eval()
    _, val = task.datasets()
    x, _ = next(iter(DataLoader(val, batch_size=min(64, max(spec.deploy.batch, 8)), shuffle=False,
                                collate_fn=task.collate_fn)))
    path = out_dir / DEPLOY_DIR / "initial.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    # The parity check proves the file computes the model; latency is measured below, the same way
    # for every trial (export_and_verify's own latency is a quick one at batch 64).
    export_and_verify(model, x, path, max_samples=16, latency_runs=2)
    return deployment_metrics(path, x.numpy(), model, batches=(spec.deploy.batch,),
                              threads=spec.deploy.threads, runs=spec.deploy.runs)


def violations(constraints: Mapping[str, Bound], figures: Mapping[str, float]) -> dict[str, float]:
    """How far each constrained figure is outside its bound (0 inside), in the spec's order."""
    return {m: (MISSING if figures.get(m) is None or math.isnan(figures[m]) else b.violation(figures[m]))
            for m, b in constraints.items()}


def rejection_reason(constraints: Mapping[str, Bound], figures: Mapping[str, float]) -> str:
    """``""`` when every constraint holds, else why the trial is rejected (each violated bound)."""
    bad = [f"{m} = {figures[m]:.4g} (needs {constraints[m].describe()})" if m in figures
           else f"{m} not measurable here (needs {constraints[m].describe()})"
           for m, v in violations(constraints, figures).items() if v > 0]
    return "rejected before training: " + "; ".join(bad) if bad else ""


def constraint_values(constraints: Mapping[str, Bound], figures: Mapping[str, float] | None) -> dict[str, float]:
    """A finished trial's constraint values for Optuna's ``Trial.set_constraint`` (> 0: infeasible),
    from its measured figures; tpe and gp learn from them to avoid infeasible regions. A trial
    that failed before it was measured gives no information either way (0)."""
    if not figures:
        return {m: 0.0 for m in constraints}
    return violations(constraints, figures)


def objective_values(spec: StudySpec, history: list[dict[str, float]], best_epoch: int | None,
                     figures: Mapping[str, float]) -> list[float] | None:
    """The trial's value of every objective, in the spec's order: a trained metric at the best
    epoch (the checkpoint promote registers), a deployment metric as measured. None when one
    is missing (the trial then cannot be told as complete on several objectives)."""
    values = _values(spec, history, best_epoch, figures)
    return None if any(v is None for v in values.values()) else [float(v) for v in values.values()]  # type: ignore[arg-type]


def missing_objectives(spec: StudySpec, history: list[dict[str, float]], best_epoch: int | None,
                       figures: Mapping[str, float]) -> list[str]:
    """The objectives a trial has no value of, each with why (for the trial's failure reason)."""
    out = []
    for metric, value in _values(spec, history, best_epoch, figures).items():
        if value is None:
            out.append(f"{metric} (not measured on this machine: it needs a GPU that onnxruntime can use)"
                       if is_deploy_metric(metric) else f"{metric} (NaN or not reported at the best epoch)")
    return out


def _values(spec: StudySpec, history: list[dict[str, float]], best_epoch: int | None,
            figures: Mapping[str, float]) -> dict[str, float | None]:
    row = next((h for h in history if h.get("epoch") == best_epoch), None)
    out: dict[str, float | None] = {}
    for o in spec.objective_list():
        value = figures.get(o.metric) if is_deploy_metric(o.metric) else (row or {}).get(o.metric)
        out[o.metric] = None if value is None or math.isnan(value) else float(value)
    return out
