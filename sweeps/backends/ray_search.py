"""The spec's sampler, pruner and resources, as Ray Tune objects.

Choosing what to try (search algorithm) stays apart from stopping trials (scheduler):
  sampler random -> BasicVariantGenerator(random_state=seed) over ``search_space.to_ray_space``
  sampler grid   -> BasicVariantGenerator over ``search_space.ray_grid_space`` (the whole grid once)
  sampler tpe    -> OptunaSearch(TPESampler(seed, constant_liar)) over the same Optuna
                    distributions the optuna backend uses (several objectives: a list of metrics)
  pruner asha      -> ASHAScheduler(grace_period=min_resource, reduction_factor, max_t=epochs)
  pruner hyperband -> HyperBandScheduler(reduction_factor, max_t=epochs)
  pruner median    -> MedianStoppingRule(grace_period=warmup_epochs, min_samples_required=2)
  pruner pbt       -> PopulationBasedTraining perturbing lr and momentum every
                      perturbation_interval epochs, kept inside the spec's bounds
Time is counted in ``training_iteration``: one report per epoch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sweeps.backends.ray_trainable import R_OBJECTIVE, r_objective
from sweeps.errors import BackendError
from sweeps.slot_plan import auto_cpu_workers
from sweeps.spec import search_space as ss
from sweeps.spec.model import StudySpec

PBT_KEYS = ("lr", "momentum")


def _mode(spec: StudySpec) -> str:
    return "max" if spec.objective.direction == "maximize" else "min"


def make_search(spec: StudySpec, workers: int) -> tuple[Any, dict, int, int]:
    """``(search_alg, param_space, num_samples, first_trial_counter)`` for the Tuner, running
    at most ``workers`` trials at once.

    ``first_trial_counter``: where the search algorithm starts counting trials in their
    ``experiment_tag`` (0 for BasicVariantGenerator, 1 for a Searcher)."""
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    name, seed = spec.sampler.name, spec.sampler.seed
    if name == "random":
        return (BasicVariantGenerator(random_state=seed, max_concurrent=workers), ss.to_ray_space(spec.search),
                spec.budget.n_trials, 0)
    if name == "grid":
        # The whole grid once (num_samples repeats it): like Optuna's GridSampler, the study
        # ends when the grid is done; the loader refuses n_trials below the grid size.
        return BasicVariantGenerator(random_state=seed, max_concurrent=workers), ss.ray_grid_space(spec.search), 1, 0
    if name == "tpe":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True, **spec.sampler.model_options())
        objectives = spec.objective_list()
        # Several objectives: OptunaSearch makes its study with one direction per metric and is told
        # the final report's value of each (it ignores per-epoch reports then: nothing to prune by).
        metric: str | list[str] = ([r_objective(i) for i in range(len(objectives))] if len(objectives) > 1
                                   else R_OBJECTIVE)
        mode: str | list[str] = ([("max" if o.direction == "maximize" else "min") for o in objectives]
                                 if len(objectives) > 1 else _mode(spec))
        searcher = OptunaSearch(space=ss.optuna_distributions(spec.search), metric=metric, mode=mode,
                                sampler=sampler)
        return ConcurrencyLimiter(searcher, max_concurrent=workers), {}, spec.budget.n_trials, 1
    raise BackendError(f"sampler.name: {name!r} cannot run on the ray backend; use random, grid or tpe")


def make_scheduler(spec: StudySpec):
    from ray.tune.schedulers import (
        ASHAScheduler,
        FIFOScheduler,
        HyperBandScheduler,
        MedianStoppingRule,
        PopulationBasedTraining,
    )

    p, metric, mode = spec.pruner, spec.objective.metric, _mode(spec)
    epochs = int(spec.resolved_train_config().epochs)
    common: dict[str, Any] = {"time_attr": "training_iteration", "metric": metric, "mode": mode}
    if p.name == "none":
        return FIFOScheduler()
    if p.name == "asha":
        return ASHAScheduler(**common, max_t=epochs, grace_period=min(p.min_resource, epochs),
                             reduction_factor=p.reduction_factor)
    if p.name == "hyperband":
        return HyperBandScheduler(**common, max_t=epochs, reduction_factor=p.reduction_factor)
    if p.name == "median":
        return MedianStoppingRule(**common, grace_period=p.warmup_epochs, min_samples_required=2)
    if p.name == "pbt":
        space = ss.to_ray_space(spec.search)
        # A categorical value moves to a neighbouring choice; a range is resampled or scaled.
        mutations = {k: list(p.choices) if isinstance(p, ss.CategoricalParam) else space[k]
                     for k, p in spec.search.items() if k in PBT_KEYS}
        if not mutations:
            raise BackendError("pruner pbt perturbs lr or momentum; add one of them to search")
        return PopulationBasedTraining(**common, perturbation_interval=p.perturbation_interval,
                                       hyperparam_mutations=mutations, custom_explore_fn=BoundsClip(spec),
                                       synch=False)
    raise BackendError(f"pruner.name: {p.name!r} cannot run on the ray backend")


class BoundsClip:
    """PBT's explore multiplies by 0.8 or 1.2, which can leave the search range: keep the
    perturbed values inside ``[low, high]`` (bounds are inclusive everywhere)."""

    def __init__(self, spec: StudySpec) -> None:
        self.bounds = {k: (p.low, p.high, isinstance(p, ss.IntParam)) for k, p in spec.search.items()
                       if k in PBT_KEYS and isinstance(p, (ss.FloatParam, ss.IntParam))}

    def __call__(self, config: dict) -> dict:
        for key, (low, high, is_int) in self.bounds.items():
            if key in config:
                value = min(max(config[key], low), high)
                config[key] = int(round(value)) if is_int else float(value)
        return config


@dataclass(frozen=True)
class TrialResources:
    cpus: float
    gpus: float
    workers: int

    @property
    def threads(self) -> int:
        return max(1, int(math.floor(self.cpus)))


def plan_resources(spec: StudySpec, cluster: dict[str, float]) -> TrialResources:
    """Per-trial CPUs/GPUs and parallel trials from ``resources`` and the cluster's totals.

    ``gpus_per_trial`` applies when the cluster has GPUs (and ``devices`` is not cpu);
    ``workers: auto`` = as many trials as fit (by GPUs, by ``cpus_per_trial``, or one per
    two CPUs); ``cpus_per_trial: auto`` = the CPUs divided among the workers."""
    r = spec.resources
    total_cpus = float(cluster.get("CPU", 1.0))
    total_gpus = 0.0 if r.devices == "cpu" else float(cluster.get("GPU", 0.0))
    gpus = r.gpus_per_trial if total_gpus > 0 else 0.0
    if gpus > total_gpus:
        raise BackendError(f"resources.gpus_per_trial: {gpus} is more than the {total_gpus:g} GPUs of the "
                           "Ray cluster; lower it or add GPU nodes")
    cpus_fixed = None if r.cpus_per_trial == "auto" else float(r.cpus_per_trial)
    if cpus_fixed is not None and cpus_fixed > total_cpus:
        raise BackendError(f"resources.cpus_per_trial: {cpus_fixed:g} is more than the {total_cpus:g} CPUs of "
                           "the Ray cluster; lower it or add nodes")
    if r.workers != "auto":
        workers = int(r.workers)
    elif gpus:
        workers = max(1, int(total_gpus // gpus))
    elif cpus_fixed:
        workers = max(1, int(total_cpus // cpus_fixed))
    else:
        workers = auto_cpu_workers(total_cpus)
    cpus = cpus_fixed if cpus_fixed is not None else max(total_cpus / workers, 0.01)
    return TrialResources(cpus=cpus, gpus=gpus, workers=workers)
