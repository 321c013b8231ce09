"""The spec's sampler and pruner as Optuna objects, the sampler drawing by (seed, trial number).

:func:`make_sampler` and :func:`make_pruner` build what the spec names. A seeded sampler's
random draws depend on (seed, trial number), not on the process asking. An Optuna sampler draws
from one random state made when the sampler object is built. Every ``sweeps run``, replacement
worker or ``sweeps worker`` builds its sampler afresh from the spec's seed, so each of them would
start that state over: a resumed study, or one given more budget, would propose its first trials
again (trial 2 repeating trial 0, and so on).

:class:`TrialSeededSampler` builds, for each trial, an inner sampler seeded with
:func:`seed_for` ``(seed, trial.number)``. Trial numbers are unique within a study, so no two
trials draw from the same random state whichever process asks, and the same spec run again
from scratch draws the same points trial by trial. Public sampler API only.

A fresh inner sampler per trial loses nothing that matters: TPE, random and GP read their
history from the study on every trial; CMA-ES stores its optimizer in the trials' system
attributes and restores it from there; QMC counts its sequence position in the study's
system attributes. Only in-process caches are lost (GP's warm start of its kernel fit).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
from optuna.samplers import BaseSampler

from sweeps.errors import BackendError
from sweeps.spec import search_space as ss
from sweeps.spec.model import StudySpec

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.study import Study
    from optuna.trial import FrozenTrial, TrialState

CACHE_SIZE = 64  # inner samplers kept: a worker runs one trial at a time, this is ample slack


def seed_for(seed: int, trial_number: int) -> int:
    """The inner sampler's seed of trial ``trial_number``: well mixed, so nearby (seed, number)
    pairs give unrelated streams, and below 2**32 as numpy's RandomState requires."""
    return int(np.random.SeedSequence([seed, trial_number]).generate_state(1)[0])


class TrialSeededSampler(BaseSampler):
    """Delegates every sampler call about a trial to ``factory(seed_for(seed, trial.number))``,
    built once per trial and kept until the trial ends (a bounded cache)."""

    def __init__(self, factory: Callable[[int], BaseSampler], seed: int) -> None:
        self._factory = factory
        self._seed = seed
        self._inner: OrderedDict[int, BaseSampler] = OrderedDict()
        self._lock = threading.Lock()  # Study.optimize(n_jobs>1) calls a sampler from several threads

    def __str__(self) -> str:
        return f"{type(self).__name__}({self._factory(self._seed)})"

    def sampler_for(self, trial_number: int) -> BaseSampler:
        """The inner sampler of trial ``trial_number``; the same object for the whole trial, so
        its random state advances across the trial's parameters instead of restarting."""
        with self._lock:
            inner = self._inner.get(trial_number)
            if inner is None:
                inner = self._inner[trial_number] = self._factory(seed_for(self._seed, trial_number))
                while len(self._inner) > CACHE_SIZE:
                    self._inner.popitem(last=False)
            else:
                self._inner.move_to_end(trial_number)
            return inner

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self.sampler_for(trial.number).before_trial(study, trial)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.sampler_for(trial.number).infer_relative_search_space(study, trial)

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self.sampler_for(trial.number).sample_relative(study, trial, search_space)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self.sampler_for(trial.number).sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        try:
            self.sampler_for(trial.number).after_trial(study, trial, state, values)
        finally:  # the trial is over: nothing will ask about it again
            with self._lock:
                self._inner.pop(trial.number, None)

    def reseed_rng(self) -> None:
        # Optuna calls this so that copies of one sampler in parallel threads stop drawing the
        # same values. Draws here already differ by trial number; reseeding from the OS would
        # only make a seeded study irreproducible.
        pass


def make_sampler(spec: StudySpec) -> optuna.samplers.BaseSampler:
    """The spec's sampler, the same in every process of the study. A seeded sampler draws trial n's
    values from ``(sampler.seed, n)`` (:class:`TrialSeededSampler`), so resuming, more budget and
    replacement or parallel workers never redraw a point already drawn, and the same spec run again
    from scratch draws the same points. ``seed: null`` stays unseeded."""
    seed, name = spec.sampler.seed, spec.sampler.name
    samplers = optuna.samplers
    if name == "grid":
        # Not wrapped: trial n takes grid point n (later ones a point no trial has visited, read
        # from the study), and the seed only shuffles the grid: the same shuffle in every
        # process, or one grid index would mean different points to different workers.
        return samplers.GridSampler(ss.grid_search_space(spec.search), seed=seed)
    factories = {
        # constant_liar: running trials count as bad guesses, so parallel workers spread out.
        "tpe": lambda s: samplers.TPESampler(seed=s, constant_liar=True, **spec.sampler.model_options()),
        "random": lambda s: samplers.RandomSampler(seed=s),
        "cmaes": lambda s: samplers.CmaEsSampler(seed=s),
        "gp": lambda s: samplers.GPSampler(seed=s, **spec.sampler.model_options()),
        # One sequence for the whole study (its position is counted in the study); only the
        # random first point, drawn before the search space is known, comes from the trial.
        "qmc": lambda s: samplers.QMCSampler(seed=seed, scramble=True,
                                             independent_sampler=samplers.RandomSampler(seed=s)),
    }
    if name not in factories:
        raise BackendError(f"sampler.name: {name!r} cannot run on the optuna backend")
    if seed is None:
        return factories[name](None)
    return TrialSeededSampler(factories[name], seed)


def make_pruner(spec: StudySpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    epochs = int(spec.resolved_train_config().epochs)
    if p.name == "none":
        return optuna.pruners.NopPruner()
    if p.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=p.warmup_epochs)
    if p.name == "percentile":
        return optuna.pruners.PercentilePruner(p.percentile, n_startup_trials=2, n_warmup_steps=p.warmup_epochs)
    if p.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_resource,
                                                      reduction_factor=p.reduction_factor)
    if p.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_resource, max_resource=epochs,
                                              reduction_factor=p.reduction_factor)
    raise BackendError(f"pruner.name: {p.name!r} cannot run on the optuna backend; use ray for pbt")
