"""The rules of a study spec that span several fields (STUDY_SPEC.md "Rules the loader enforces").

Run by :func:`sweeps.spec.load.load_spec` on whichever sections validated: the task resolves and
takes the given arguments (:mod:`sweeps.spec.task_checks`), train values type-check against
TrainConfig, search keys are train fields or ``task.<arg>`` and not also fixed, the objective is a
reported metric, the sampler/pruner run on the chosen backend, options a component would ignore
are refused (never a silent fallback).
"""
from __future__ import annotations

import re
from typing import Any, Literal, get_args, get_origin

from core.config import ConfigError, TrainConfig, apply_overrides, config_fields
from core.metrics import LOOP_METRICS, declared_metrics
from core.pack_rules import config_problem
from sweeps.spec import search_space as ss
from sweeps.spec.messages import BOOL_WORDS, did_you_mean, foreign, show, unwrap
from sweeps.spec.model import BACKEND_PRUNERS, BACKEND_SAMPLERS, PrunerSection
from sweeps.spec.objectives import is_deploy_metric, objective_problems
from sweeps.spec.search_space import CategoricalParam, FloatParam, Problem
from sweeps.spec.task_checks import TaskInfo, instantiate_checks, representatives, task_problems


def _kind(hint: Any) -> str:
    hint = unwrap(hint)
    if get_origin(hint) is Literal:
        return "literal"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(hint, "other")


def _type_mismatch(key: str, p: Any, hint: Any, owner: str) -> str | None:
    """Why parameter ``p`` cannot feed a field typed ``hint`` (None when it can)."""
    kind = _kind(hint)
    if kind == "int" and isinstance(p, FloatParam):
        return f"type float draws non-integers but {owner} is an integer; use type: int"
    if kind in ("bool", "str", "literal") and not isinstance(p, CategoricalParam):
        allowed = ", ".join(map(str, get_args(unwrap(hint)))) if kind == "literal" else kind
        return f"type {p.type} draws numbers but {owner} takes {allowed}; use type: categorical"
    return None


def _search_problems(s: dict[str, Any], info: TaskInfo | None, cfg: TrainConfig | None, out: list[Problem]) -> None:
    search, train, task = s["search"] or {}, s["train"] or {}, s["task"]
    fields = config_fields()
    for key, p in search.items():
        own = ss.param_problems(key, p, s["backend"] or "optuna")
        out.extend(own)
        at = ("search", key)
        if key.startswith(ss.TASK_PREFIX):
            if info is None:
                continue
            arg = key[len(ss.TASK_PREFIX):]
            if info.accepted is not None and arg not in info.accepted:
                names = [ss.TASK_PREFIX + a for a in info.accepted]
                out.append((at, f"task {info.label!r} has no argument {arg!r}{did_you_mean(key, names)}; "
                                f"searchable task arguments: {', '.join(names)}"))
                continue
            if arg in task.args or (arg == "model" and task.model is not None):
                fixed = task.model if arg == "model" else task.args[arg]
                place = "task.model" if arg == "model" else f"task.args.{arg}"
                out.append((at, f"also fixed as {place} = {show(fixed)}; remove it from one of the two"))
            if arg == "model" and not info.builtin and info.models and isinstance(p, CategoricalParam):
                for bad in (c for c in p.choices if c not in info.models):
                    out.append((at + ("choices",), f"{bad!r} is not offered by task {info.label!r}; "
                                                   f"use models from {', '.join(info.models)}"))
            problem = _type_mismatch(key, p, info.hints[arg], f"task argument {arg}") if arg in info.hints else None
            if problem:
                out.append((at, problem))
            continue
        if key not in fields:
            names = list(fields) + [ss.TASK_PREFIX + a for a in ((info.accepted or []) if info else [])]
            out.append((at, f"not a train-config field or task.<arg>{did_you_mean(key, names)}"))
            continue
        if key in ("distributed", "profile"):
            out.append((at, f"a nested section cannot be searched; set train.{key} instead"))
            continue
        if key in train:
            out.append((at, f"also fixed in train (train.{key} = {show(train[key])}); remove it from one of the two"))
        problem = _type_mismatch(key, p, fields[key], f"train.{key}")
        if problem:
            out.append((at, problem))
            continue
        for which, value in representatives(p):
            if any(loc == at + (which,) for loc, _ in own):
                continue  # already explained (e.g. low <= 0 with log); one message per value
            try:
                apply_overrides(cfg or TrainConfig(), {key: value})
            except ConfigError as exc:
                text = re.sub(rf"^train\.{re.escape(key)}: ", "", str(exc))
                out.append((at + (which,), f"{show(value)} is not valid for train.{key}: {text}"))
    if info is not None and info.builtin:
        instantiate_checks(s, info, out)


def _train_problems(s: dict[str, Any], out: list[Problem]) -> TrainConfig | None:
    """Each train value on its own (so every bad one is listed), then all together."""
    train = s["train"]
    if train is None:
        return None
    fields, ok = config_fields(), True
    for key, value in train.items():
        try:
            apply_overrides(TrainConfig(), {key: value})
        except ConfigError as exc:
            ok = False
            loc, text = foreign(str(exc), ("train", key))
            if isinstance(value, str) and value.lower() in BOOL_WORDS and _kind(fields.get(key)) == "bool":
                text += " (only true and false are booleans in a study spec)"
            out.append((loc, text))
    if not ok:
        return None
    try:
        cfg = apply_overrides(TrainConfig(), train)
    except ConfigError as exc:
        out.append(foreign(str(exc), ("train",)))
        return None
    return cfg


def _reported(info: TaskInfo | None, out: list[Problem]) -> dict[str, bool | None] | None:
    """The task's per-epoch metrics and directions when the task was built while validating (built-in
    tasks) and declares them; None otherwise (checked when a trial builds the task, before any step)."""
    if info is None or info.built is None:
        return None
    declared = declared_metrics(info.built)
    return None if declared is None else {**LOOP_METRICS, **declared}


def _metric_problem(metric: str, reported: dict[str, bool | None] | None, label: str) -> str | None:
    names = list(reported) if reported is not None else list(LOOP_METRICS)
    if reported is not None and metric not in reported:
        return f"task {label!r} does not report {metric!r}{did_you_mean(metric, names)}; it reports {', '.join(names)}"
    if reported is None and metric not in LOOP_METRICS and not metric.startswith("val_"):
        return (f"{metric!r} is not a reported metric{did_you_mean(metric, names)}; use val_<name> of one of the "
                f"task's metrics, or one of {', '.join(names)}")
    return None


def _objective_problems(s: dict[str, Any], info: TaskInfo | None, out: list[Problem]) -> None:
    """objective.metric (and train.monitor) must be reported by the task, and objective.direction
    must agree with the metric's own direction (a torchmetrics metric's higher_is_better)."""
    obj, train = s["objective"], s["train"] or {}
    reported = _reported(info, out)
    label = info.label if info is not None else "task"
    if "monitor" in train and isinstance(train["monitor"], str):
        problem = _metric_problem(train["monitor"], reported, label)
        if problem:
            out.append((("train", "monitor"), problem))
    listed = s.get("objectives")
    # Each trained objective (a deployment metric is checked in sweeps.spec.objectives), at its place.
    checked = ([(("objectives", i), o) for i, o in enumerate(listed) if not is_deploy_metric(o.metric)]
               if listed else [(("objective",), obj)] if obj is not None else [])
    for at, one in checked:
        _one_objective_problems(at, one, reported, label, out)


def _one_objective_problems(at: tuple[Any, ...], obj: Any, reported: dict[str, bool | None] | None, label: str,
                            out: list[Problem]) -> None:
    problem = _metric_problem(obj.metric, reported, label)
    if problem:
        out.append((at + ("metric",), problem))
        return
    own = (reported or LOOP_METRICS).get(obj.metric)
    if own is None:
        return  # no direction of its own (lr), or a user task's metric: checked when a trial builds the task
    want = "maximize" if own else "minimize"
    if "direction" not in obj.model_fields_set and not own:
        out.append((at + ("direction",), f"not set, so the default maximize would maximize {obj.metric}; "
                                         "set direction: minimize (or maximize explicitly)"))
    elif "direction" in obj.model_fields_set and obj.direction != want:
        out.append((at + ("direction",), f"{obj.direction} contradicts {obj.metric!r} of task {label!r}, "
                                         f"which is better when {'higher' if own else 'lower'}; "
                                         f"use direction: {want}"))


def _backend_problems(s: dict[str, Any], cfg: TrainConfig | None, out: list[Problem]) -> None:
    backend, sampler, pruner, search = s["backend"], s["sampler"], s["pruner"], s["search"]
    if backend and sampler and sampler.name not in BACKEND_SAMPLERS[backend]:
        out.append((("sampler", "name"), f"{sampler.name!r} does not run on backend {backend}; use one of "
                                         f"{', '.join(BACKEND_SAMPLERS[backend])}, or backend: optuna"))
    if backend and pruner and pruner.name not in BACKEND_PRUNERS[backend]:
        other = "ray" if backend == "optuna" else "optuna"
        out.append((("pruner", "name"), f"{pruner.name!r} does not run on backend {backend}; use one of "
                                        f"{', '.join(BACKEND_PRUNERS[backend])}, or backend: {other}"))
    runnable = backend is None or (sampler is not None and sampler.name in BACKEND_SAMPLERS[backend])
    if sampler and search is not None and runnable:
        if sampler.name == "grid":
            out.extend(ss.grid_problems(search))
        cats = [k for k, p in search.items() if isinstance(p, CategoricalParam)]
        if sampler.name in ("cmaes", "qmc") and cats:
            out.append((("sampler", "name"), f"{sampler.name!r} cannot sample categorical parameters "
                                             f"({', '.join(cats)}): Optuna would draw them at random on the side; "
                                             "use tpe or gp, or make them int/float"))
    if sampler and sampler.n_startup_trials is not None and sampler.name not in ("tpe", "gp"):
        out.append((("sampler", "n_startup_trials"), f"{sampler.n_startup_trials} is set but sampler "
                                                     f"{sampler.name} does not use it (it applies to tpe and gp); "
                                                     "remove it"))
    why = ("(Ray Tune takes a trial's checkpoint at each epoch it reports, to restore, retry and exploit it); "
           "remove it or use backend: optuna")
    if backend == "ray" and "checkpoint_every" in (search or {}):
        out.append((("search", "checkpoint_every"), f"searched on backend ray, which does not support it {why}"))
    if backend == "ray" and cfg is not None and cfg.checkpoint_every > 1:
        out.append((("train", "checkpoint_every"), f"{cfg.checkpoint_every} is not supported on backend ray {why}"))
    if pruner is None:
        return
    if pruner.name == "pbt" and backend == "ray":
        if search is not None and not {"lr", "momentum"} & set(search):
            out.append((("pruner", "name"), "pbt perturbs lr or momentum during training; "
                                            "add lr or momentum to search"))
        if sampler and sampler.name not in ("random", "grid"):
            out.append((("sampler", "name"), f"{sampler.name!r} cannot be combined with pruner pbt (Ray refuses a "
                                             "search algorithm with PBT, which explores by itself); "
                                             "use random or grid"))
    used = pruner.option_names(backend or "optuna")
    for opt in ("warmup_epochs", "percentile", "min_resource", "reduction_factor", "perturbation_interval"):
        value = getattr(pruner, opt)
        if opt not in used and value != PrunerSection.model_fields[opt].default:
            users = [n for n in ("median", "percentile", "asha", "hyperband", "pbt")
                     if opt in PrunerSection(name=n).option_names(backend or "optuna")]
            out.append((("pruner", opt), f"{show(value)} is set but pruner {pruner.name} on {backend} does not use "
                                         f"it (it applies to {', '.join(users)}); remove it"))
    if cfg is None or "epochs" in (search or {}):
        return
    limit = {"median": "warmup_epochs", "percentile": "warmup_epochs", "asha": "min_resource",
             "hyperband": "min_resource", "pbt": "perturbation_interval"}.get(pruner.name)
    # Only a value the user chose: the defaults (1 epoch) merely make pruning a no-op on tiny runs.
    if limit is not None and limit in used and getattr(pruner, limit) != PrunerSection.model_fields[limit].default \
            and getattr(pruner, limit) >= cfg.epochs:
        out.append((("pruner", limit), f"{getattr(pruner, limit)} is not below train.epochs = {cfg.epochs}, so the "
                                       f"pruner could never act; lower it, raise epochs, or use pruner: none"))


def _resource_problems(s: dict[str, Any], cfg: TrainConfig | None, out: list[Problem]) -> None:
    res = s["resources"]
    if res is None:
        return
    if s["backend"] == "optuna" and res.ray_address is not None:
        out.append((("resources", "ray_address"), f"{res.ray_address!r} is set but backend is optuna; "
                                                  "remove it or use backend: ray"))
    if res.devices == "cpu" and res.gpus_per_trial != 1:
        out.append((("resources", "gpus_per_trial"), f"{res.gpus_per_trial!r} is set but devices: cpu uses no GPUs; "
                                                     "remove it"))
    if isinstance(res.devices, list) and res.gpus_per_trial > len(res.devices):
        out.append((("resources", "gpus_per_trial"), f"{res.gpus_per_trial!r} is more than the {len(res.devices)} "
                                                     f"devices listed; lower it or list more devices"))
    if cfg is not None and cfg.distributed.nproc > 1 and res.gpus_per_trial < 1:
        out.append((("resources", "gpus_per_trial"), f"{res.gpus_per_trial!r} is a GPU share but "
                                                     f"train.distributed.nproc = {cfg.distributed.nproc}; "
                                                     "DDP needs whole GPUs per process"))
    _pack_problems(s, cfg, out)
    # What OptunaBackend._plan would refuse from the spec alone, so `sweeps validate` says it too.
    if s["backend"] != "optuna" or not isinstance(res.workers, int):
        return
    g = res.gpus_per_trial
    if isinstance(res.devices, list) and g <= len(res.devices):
        fits = len(res.devices) // int(g) if g >= 1 else len(res.devices) * round(1 / g)
        if res.workers > fits:
            out.append((("resources", "workers"), f"{res.workers} workers do not fit on devices {res.devices} with "
                                                  f"gpus_per_trial {g!r} (at most {fits} at once); use {fits} or auto"))
    storage = s["storage"]
    if isinstance(storage, str) and storage.startswith("sqlite") and res.workers > 1:
        out.append((("storage",), f"{storage!r} is SQLite, which {res.workers} parallel workers would lock ('database "
                                  "is locked'); remove storage (a journal file) or use postgresql://..., "
                                  "or workers: 1"))


def _pack_problems(s: dict[str, Any], cfg: TrainConfig | None, out: list[Problem]) -> None:
    """``resources.pack``: what a population cannot hold is refused here, not found trial by trial."""
    res = s["resources"]
    if res.pack is None or res.pack_size() == 1:
        return
    where = ("resources", "pack")
    if s["backend"] == "ray":
        out.append((where, f"{res.pack!r} is not supported on backend ray (Ray Tune hands each trial to its own "
                           "actor, so trials cannot be trained together); remove it or use backend: optuna"))
    if res.gpus_per_trial >= 2:
        out.append((where, f"{res.pack!r} with gpus_per_trial {res.gpus_per_trial!r}: a trial on several GPUs runs "
                           "DDP, one run over several processes; remove pack or use gpus_per_trial: 1"))
    if cfg is None:
        return
    problem = config_problem([cfg])
    if problem:
        out.append((where, f"{res.pack!r} cannot pack these trials: {problem}; remove pack or that setting"))


def _lr_finder_problems(s: dict[str, Any], out: list[Problem]) -> None:
    lf, search = s["lr_finder"], s["search"]
    if lf is None:
        return
    if lf.end_lr <= lf.start_lr:
        out.append((("lr_finder", "end_lr"), f"{lf.end_lr!r} is not above start_lr {lf.start_lr!r}; "
                                             "use end_lr > start_lr"))
    if lf.enabled and lf.narrow_search and search is not None:
        p = search.get("lr")
        if p is None:
            out.append((("lr_finder", "narrow_search"), "true but lr is not in search, so there is no range to "
                                                        "narrow; add lr to search or set narrow_search: false"))
        elif not isinstance(p, FloatParam):
            out.append((("lr_finder", "narrow_search"), f"true but search.lr is type {p.type}; "
                                                        "narrowing needs type: float"))


def cross_problems(sections: dict[str, Any], fields_set: set[str] | None = None) -> list[Problem]:
    """The rules spanning several fields, on whichever sections validated (``fields_set``: the
    top-level keys the file sets)."""
    out: list[Problem] = []
    objective_problems(sections, fields_set or set(), out)
    info = task_problems(sections, out)
    cfg = _train_problems(sections, out)
    _search_problems(sections, info, cfg, out)
    _objective_problems(sections, info, out)
    _backend_problems(sections, cfg, out)
    _resource_problems(sections, cfg, out)
    _lr_finder_problems(sections, out)
    _ray_problems(sections, out)
    warm_start_problems(sections, out)
    return out


def _ray_problems(s: dict[str, Any], out: list[Problem]) -> None:
    """Options the Ray backend cannot honour (each would otherwise be silently dropped)."""
    if s["backend"] != "ray":
        return
    budget, lf, sampler, search = s["budget"], s["lr_finder"], s["sampler"], s["search"]
    if s["storage"] is not None:
        out.append((("storage",), f"{s['storage']!r} is the Optuna storage, but backend is ray (its experiment "
                                  "state lives in runs/ray/<name>); remove storage or use backend: optuna"))
    if budget is not None and budget.oom_retry_smaller_batch:
        out.append((("budget", "oom_retry_smaller_batch"), "true is not supported on backend ray; remove it "
                                                           "or use backend: optuna"))
    if lf is not None and lf.enabled:
        out.append((("lr_finder", "enabled"), "true is not supported on backend ray (the study-level LR finder "
                                              "runs on Optuna studies); set it false or use backend: optuna"))
    res = s["resources"]
    if res is not None and res.ray_address is not None and isinstance(res.devices, list):
        out.append((("resources", "devices"), f"{res.devices!r} cannot pin GPUs of a Ray cluster "
                                              f"(ray_address {res.ray_address!r}); Ray assigns them: use auto or cpu"))
    if sampler is not None and sampler.name == "grid" and search and budget is not None \
            and not ss.grid_problems(search) and ss.grid_size(search) > budget.n_trials:
        out.append((("budget", "n_trials"), f"{budget.n_trials} is below the {ss.grid_size(search)} points of the "
                                            "grid; Ray's grid search runs every point, so raise n_trials to "
                                            f"{ss.grid_size(search)}, shrink the grid, or use backend: optuna"))


def warm_start_problems(s: dict[str, Any], out: list[Problem]) -> None:
    """The rules spanning the section and the rest of the spec."""
    ws = s.get("warm_start")
    if ws is None:
        return
    if s.get("backend") == "ray":
        out.append((("warm_start",), "is supported on backend optuna only (it enqueues Optuna trials); remove it "
                                     "or use backend: optuna"))
    if ws.study == s.get("name"):
        out.append((("warm_start", "from"), f"{ws.study!r} is this study; name an earlier study, or extend this "
                                            "one with: sweeps run SPEC --add-trials N"))
    if not s.get("search"):
        out.append((("warm_start",), "needs a search section: it carries over searched parameters"))
