"""Several objectives, constraints and deployment figures in a study spec (issue 28).

``objectives: [{metric: val_acc, direction: maximize}, {metric: onnx_latency_ms, direction: minimize}]``
replaces the single ``objective`` (which keeps working and reads as a one-element list);
``constraints: {onnx_latency_ms: {max: 2.0}, params: {max: 1e6}}`` bounds deployment figures;
``deploy:`` says how they are measured (``core.deploy_metrics``). The section models live here
(sweeps/spec/model.py holds the study model); :func:`objective_problems` holds the rules that span
objectives, constraints, backend, sampler and pruner, called by sweeps/spec/checks.py.

A deployment metric is measured from the exported ONNX model, the same way for every trial; it
depends on the architecture only (never on training), which is why a constraint on one can
reject a trial before its first epoch.
"""
from __future__ import annotations

import inspect
import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.config import TrainConfig
from core.tasks.base import TaskError, resolve_factory

# Lower is better for every one of them. gpu_latency_ms exists only where onnxruntime has CUDA.
DEPLOY_METRICS = ("onnx_latency_ms", "onnx_latency_p95_ms", "onnx_latency_spread_ms", "params",
                  "onnx_size_mb", "onnx_size_bytes", "gpu_latency_ms")
_BATCH_METRIC = re.compile(r"^onnx_latency_b(\d+)(_p95|_spread)?_ms$")


class _Strict(BaseModel):
    # As sweeps.spec._Section: YAML gives real types, and an unknown key is an error.
    model_config = ConfigDict(extra="forbid", strict=True)


class ObjectiveSection(_Strict):
    metric: str = "val_acc"
    direction: Literal["maximize", "minimize"] = "maximize"


class Bound(_Strict):
    """``{max: 2.0}``, ``{min: 10}`` or both: the feasible range of one deployment metric."""

    min: float | None = None
    max: float | None = None

    @field_validator("min", "max", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        # strict would refuse the int 1000000 for a float bound, and YAML 1.2 reads 1e6 as a float
        # but 1000000 as an int: both are the same bound.
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{v!r} is not allowed; use a finite number")
        return v

    def violation(self, value: float) -> float:
        """How far ``value`` is outside the range (0 inside): Optuna's constraint value, > 0 infeasible."""
        over = value - self.max if self.max is not None else -math.inf
        under = self.min - value if self.min is not None else -math.inf
        return max(0.0, over, under)

    def describe(self) -> str:
        parts = ([f">= {self.min:g}"] if self.min is not None else []) + \
                ([f"<= {self.max:g}"] if self.max is not None else [])
        return " and ".join(parts)


class DeploySection(_Strict):
    """How the deployment figures are measured (core.deploy_metrics): latency at batch 1 and at
    ``batch``, ``runs`` timed calls after a warm-up, on ``threads`` pinned intra-op threads."""

    batch: int = Field(32, ge=1)
    threads: int = Field(1, ge=1)
    runs: int = Field(50, ge=5)


def is_deploy_metric(metric: str) -> bool:
    return metric in DEPLOY_METRICS or _BATCH_METRIC.match(metric) is not None


def deploy_metric_names(batch: int) -> list[str]:
    """Every figure a trial measures with ``deploy.batch`` = ``batch`` (gpu_latency_ms only on a GPU)."""
    extra = [] if batch == 1 else [f"onnx_latency_b{batch}_ms", f"onnx_latency_b{batch}_p95_ms",
                                   f"onnx_latency_b{batch}_spread_ms"]
    return [*DEPLOY_METRICS, *extra]


def objective_list(objective: ObjectiveSection, objectives: list[ObjectiveSection] | None) -> list[ObjectiveSection]:
    return list(objectives) if objectives else [objective]


def primary_objective(objectives: list[ObjectiveSection]) -> ObjectiveSection | None:
    """The objective training follows (best checkpoint, pruning): the first that training reports."""
    return next((o for o in objectives if not is_deploy_metric(o.metric)), None)


def settle_objectives(spec: Any) -> Any:
    """A loaded StudySpec's ``objective`` becomes the primary one of ``objectives`` (training follows
    it: best checkpoint, monitor), so every one-objective path reads it unchanged; with several
    objectives an unset pruner is ``none`` (a pruner stops trials by one number)."""
    primary = primary_objective(spec.objectives or [])
    if primary is not None and "objective" not in spec.model_fields_set:
        spec.objective = primary
        spec.__pydantic_fields_set__.discard("objective")
    if len(spec.objectives or []) > 1 and "pruner" not in spec.model_fields_set:
        spec.pruner = spec.pruner.model_copy(update={"name": "none"})
        spec.__pydantic_fields_set__.discard("pruner")
    return spec


Problem = tuple[tuple[Any, ...], str]
# Optuna samplers that optimise several objectives (CMA-ES optimises one).
_MULTI_SAMPLERS = {"optuna": ("tpe", "gp", "random", "grid", "qmc"), "ray": ("tpe", "random", "grid")}


def objective_problems(s: dict[str, Any], fields_set: set[str], out: list[Problem]) -> None:
    """The rules of ``objectives`` / ``constraints`` / ``deploy`` that span sections. ``s``: the
    sections that validated (None where one did not); ``fields_set``: the keys the file sets."""
    objectives, constraints, deploy = s.get("objectives"), s.get("constraints") or {}, s.get("deploy")
    batch = deploy.batch if deploy is not None else DeploySection().batch
    if objectives is not None:
        # The loaded spec's objective is its primary one (sweeps.spec), so a dumped spec holds both, agreeing.
        if "objective" in fields_set and s.get("objective") not in (None, primary_objective(objectives)):
            out.append((("objective",), "set together with objectives; keep one: objectives: [{metric: ..., "
                                        "direction: ...}, ...] (objective is the one-objective form)"))
        if not objectives:
            out.append((("objectives",), "[] is empty; list at least one {metric: ..., direction: ...}"))
        seen: set[str] = set()
        for i, o in enumerate(objectives):
            if o.metric in seen:
                out.append((("objectives", i, "metric"), f"{o.metric!r} is listed twice; list each metric once"))
            seen.add(o.metric)
            if is_deploy_metric(o.metric) and o.direction != "minimize":
                out.append((("objectives", i, "direction"), f"{o.direction} but {o.metric} is a deployment cost "
                                                            "(lower is better); use direction: minimize"))
            _unknown_deploy(o.metric, batch, ("objectives", i, "metric"), out)
        if objectives and primary_objective(objectives) is None:
            out.append((("objectives",), f"only deployment metrics ({', '.join(o.metric for o in objectives)}): "
                                         "nothing training reports; add one such as {metric: val_acc, "
                                         "direction: maximize}, or bound them with constraints"))
    for metric, bound in constraints.items():
        at = ("constraints", metric)
        if not is_deploy_metric(metric):
            out.append((at, f"{metric!r} is not a deployment metric, and only those are known before training; "
                            f"constrain one of {', '.join(deploy_metric_names(batch))}, or pick by a trained "
                            f"metric afterwards with sweeps promote --where \"{metric}>=...\""))
            continue
        _unknown_deploy(metric, batch, at, out)
        if bound.min is None and bound.max is None:
            out.append((at, "no bound; give max (e.g. {max: 2.0}), min, or both"))
        elif bound.min is not None and bound.max is not None and bound.min > bound.max:
            out.append((at + ("min",), f"{bound.min:g} is above max {bound.max:g}; use min <= max"))
        elif bound.max is not None and bound.max <= 0:  # every deployment figure is a positive size or time
            out.append((at + ("max",), f"{bound.max:g} rejects every model ({metric} is above 0 for any model); "
                                       "use a bound above 0"))
    resources = s.get("resources")
    if resources is not None and resources.devices == "cpu":
        named: list[tuple[Any, ...]] = [("objectives", i, "metric") for i, o in enumerate(objectives or [])
                                        if o.metric == "gpu_latency_ms"]
        named += [("constraints", "gpu_latency_ms")] if "gpu_latency_ms" in constraints else []
        for at in named:
            out.append((at, "gpu_latency_ms needs a GPU, but resources.devices is cpu; use onnx_latency_ms, or "
                            "run on GPUs (devices: auto)"))
    _multi_problems(s, fields_set, objectives or [], bool(constraints), out)


def _unknown_deploy(metric: str, batch: int, at: tuple[Any, ...], out: list[Problem]) -> None:
    match = _BATCH_METRIC.match(metric)
    if match and int(match.group(1)) != batch and int(match.group(1)) != 1:
        out.append((at, f"{metric!r} is measured at batch {match.group(1)} but deploy.batch is {batch}; "
                        f"set deploy: {{batch: {match.group(1)}}} or use onnx_latency_b{batch}_ms"))


def _multi_problems(s: dict[str, Any], fields_set: set[str], objectives: list[ObjectiveSection],
                    constrained: bool, out: list[Problem]) -> None:
    """Combinations a backend cannot run with several objectives or with constraints."""
    backend, sampler, pruner = s.get("backend") or "optuna", s.get("sampler"), s.get("pruner")
    n = len(objectives)
    if n > 1 and pruner is not None and pruner.name != "none" and "pruner" in fields_set:
        out.append((("pruner", "name"), f"{pruner.name} stops trials by one number, but the study has {n} "
                                        "objectives (a trial behind on one may lead on another); use pruner: "
                                        "{name: none}, or one objective with a pruner and the others as "
                                        "constraints"))
    if n > 1 and sampler is not None and sampler.name not in _MULTI_SAMPLERS[backend]:
        out.append((("sampler", "name"), f"{sampler.name} optimises one objective, the study has {n}; use one "
                                         f"of {', '.join(_MULTI_SAMPLERS[backend])} on backend {backend}"))
    if backend == "ray" and constrained:
        out.append((("constraints",), "not supported on backend ray (its searcher would not learn from a trial "
                                      "rejected before training); use backend: optuna, or drop constraints and "
                                      "pick with sweeps promote --where"))


# Train settings that change how a trial runs or what it writes, not the values it reaches:
# changing them between runs of one study is fine (a loader's workers, the device, the exports).
_OPERATIONAL_TRAIN_KEYS = frozenset({
    "num_workers", "prefetch_factor", "pin_memory", "device", "save_checkpoints", "checkpoint_every", "export_onnx",
    "onnx_tolerance", "export_torchscript", "profile", "detect_anomaly", "compile"})


def trained_by(spec: Any) -> dict[str, Any]:
    """What a trial's value depends on besides its drawn parameters: the task (name or target,
    model, args), the train settings other than the operational ones, and the LR range test when
    it is on."""
    train = json.loads(json.dumps(dict(sorted(spec.train.items())), default=str))
    return {"task": _task_without_defaults(spec.task.model_dump(mode="json")), "train": _without_defaults(train),
            "lr_finder": spec.lr_finder.model_dump(mode="json") if spec.lr_finder.enabled else None}


def _without_defaults(train: dict[str, Any]) -> dict[str, Any]:
    """``train`` less its operational settings and those at their defaults (a nested section
    such as ``distributed`` counts as default when what it sets is): spelling a default out, or
    a new setting arriving at its default with a new version, changes nothing."""
    import dataclasses

    defaults = dataclasses.asdict(TrainConfig())

    def at_default(key: str, value: Any) -> bool:
        if key not in defaults:
            return False
        default = defaults[key]
        if isinstance(value, dict) and isinstance(default, dict):
            return {**default, **value} == default
        return value == default

    return {k: v for k, v in train.items() if k not in _OPERATIONAL_TRAIN_KEYS and not at_default(k, v)}


def _task_without_defaults(task: dict[str, Any]) -> dict[str, Any]:
    """The ``task`` section as the task builds it: ``model`` unset reads as the factory's default
    model, and each of ``args`` written at the factory's own default is taken out (as for train
    settings), so spelling a default out changes nothing. A task that cannot be resolved here is
    kept as written."""
    try:
        factory = resolve_factory(task.get("name"), task.get("target"))
        defaults = {p.name: p.default for p in inspect.signature(factory).parameters.values()
                    if p.default is not inspect.Parameter.empty}
    except (TaskError, TypeError, ValueError):
        return task
    args = {k: v for k, v in (task.get("args") or {}).items() if k not in defaults or v != defaults[k]}
    model = task.get("model")
    return {**task, "model": defaults.get("model") if model is None else model, "args": args}


def judged_by(spec: Any) -> dict[str, Any]:
    """What makes a study's trials comparable: how each was trained (:func:`trained_by`), its
    objectives (metric and direction, in order), its constraints and how the deployment figures
    are measured. Stored when a study starts and compared when it resumes or a worker joins (both
    backends): otherwise the sampler, the Pareto front, the best trial and promote would mix
    values of different trainings or metrics under one name."""
    return {"objectives": [[o.metric, o.direction] for o in spec.objective_list()],
            "constraints": {k: b.model_dump() for k, b in sorted(spec.constraints.items())},
            "deploy": spec.deploy.model_dump() if spec.deploy_metrics_needed() else None,
            "training": trained_by(spec)}


def judged_by_changes(stored: dict[str, Any], wanted: dict[str, Any], study: str, spec_path: Any) -> str:
    """The message refusing a resumed study whose training, objectives, constraints or
    deployment measurement changed ("" when none did). A part a study stored nothing for (it
    started before that part was stored) is not compared."""
    training = stored.get("training") or {}
    if isinstance(training.get("train"), dict):  # as stored by any version
        training = {**training, "train": _without_defaults(training["train"])}
    if isinstance(training.get("task"), dict):
        training = {**training, "task": _task_without_defaults(training["task"])}
    if training:
        stored = {**stored, "training": training}
    changed = sorted(k for k in wanted if k in stored and stored[k] != wanted[k])
    if not changed:
        return ""
    what = []
    for k in changed:
        if k == "training":
            parts = sorted(p for p in wanted[k] if stored[k].get(p) != wanted[k][p])
            what.append(f"training ({', '.join(_training_differences(stored[k], wanted[k], parts))})")
        else:
            what.append(f"{k} (stored {stored[k]}, spec {wanted[k]})")
    return (f"study {study!r} changed since it started: {'; '.join(what)}. Its earlier trials were trained or "
            f"judged differently, so the sampler, the front, the best trial and promote would mix them. "
            f"Restore the spec, or start a new study with: sweeps run {spec_path or '<spec>'} --fresh")


def _training_differences(stored: dict[str, Any], wanted: dict[str, Any], parts: list[str]) -> list[str]:
    """``train.epochs: 8 -> 2`` for each key that differs, section by section."""
    out = []
    for part in parts:
        old, new = stored.get(part), wanted.get(part)
        if old is None or new is None:  # a section stored only while on (lr_finder)
            out.append(f"{part}: {'off' if old is None else 'on'} -> {'off' if new is None else 'on'}")
            continue
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"{part}.{key}: {old.get(key, '(default)')!r} -> {new.get(key, '(default)')!r}")
    return out
