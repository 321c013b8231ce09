"""The spec's sampler draws from (seed, trial number): in-memory studies, several "processes"
played by several sampler objects on one storage, as `sweeps run`, its resume and its workers
build them (``make_sampler``)."""
from __future__ import annotations

import math

import optuna
import pytest

from sweeps.backends.optuna_sampler import TrialSeededSampler, make_sampler
from sweeps.spec.load import spec_from_dict
from sweeps.spec.search_space import optuna_distributions
from tests.sweeps.study_helpers import tiny_spec

FLOATS = {"lr": {"type": "float", "low": 1e-3, "high": 1.0, "log": True},
          "momentum": {"type": "float", "low": 0.0, "high": 0.99}}
GRID = {"momentum": {"type": "categorical", "choices": [0.0, 0.5, 0.9]},
        "weight_decay": {"type": "categorical", "choices": [0.0, 0.01]}}


def _spec(sampler: str, search: dict = FLOATS, seed: int | None = 0):
    return spec_from_dict(tiny_spec(sampler={"name": sampler, "seed": seed}, search=search))


def _value(params: dict) -> float:
    """A smooth objective with its optimum inside the space, so model-based samplers have a slope."""
    lr = params.get("lr", 0.03)
    return (math.log10(lr) + 1.5) ** 2 + (params["momentum"] - 0.5) ** 2 + params.get("weight_decay", 0.0)


def _worker(storage, spec) -> optuna.Study:
    """One process of the study: its own sampler object, as ``open_study`` builds it."""
    return optuna.create_study(study_name="s", storage=storage, load_if_exists=True,
                               sampler=make_sampler(spec))


def _run(study: optuna.Study, spec, n: int) -> None:
    dists = optuna_distributions(spec.search)
    for _ in range(n):
        trial = study.ask(dists)
        study.tell(trial, _value(trial.params))


def _params(study: optuna.Study) -> list[tuple]:
    return [tuple(sorted(t.params.items())) for t in sorted(study.trials, key=lambda t: t.number)]


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_resumes_and_parallel_workers_never_redraw_and_match_one_uninterrupted_run(sampler):
    spec = _spec(sampler)
    storage = optuna.storages.InMemoryStorage()
    _run(_worker(storage, spec), spec, 2)  # sweeps run with n_trials: 2
    _run(_worker(storage, spec), spec, 2)  # the same spec again with n_trials: 4 (a new sampler object)
    a, b = _worker(storage, spec), _worker(storage, spec)  # two parallel workers, asking in turn
    dists = optuna_distributions(spec.search)
    for _ in range(2):
        ta, tb = a.ask(dists), b.ask(dists)
        a.tell(ta, _value(ta.params))
        b.tell(tb, _value(tb.params))
    drawn = _params(a)
    assert len(drawn) == 8 and len(set(drawn)) == 8, drawn

    # Trial n's draw depends on (seed, n) only: one uninterrupted process draws the same points.
    whole = _worker(optuna.storages.InMemoryStorage(), spec)
    _run(whole, spec, 8)
    assert _params(whole) == drawn


def test_tpe_past_its_startup_trials_draws_from_its_model_under_the_wrapper():
    wrapped = make_sampler(_spec("tpe"))
    assert isinstance(wrapped, TrialSeededSampler)
    assert isinstance(wrapped.sampler_for(0), optuna.samplers.TPESampler)

    spec = _spec("tpe")
    tpe = TrialSeededSampler(lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=3, constant_liar=True), 0)
    rnd = TrialSeededSampler(lambda s: optuna.samplers.RandomSampler(seed=s), 0)
    studies = {}
    for name, sampler in (("tpe", tpe), ("random", rnd)):
        studies[name] = optuna.create_study(sampler=sampler)
        _run(studies[name], spec, 15)
    assert studies["tpe"].sampler is tpe
    drawn = _params(studies["tpe"])
    assert len(set(drawn)) == 15
    # Start-up trials are TPE's own random draws, seeded like a random sampler's; later trials
    # come from its Parzen estimators, so they differ.
    random_drawn = _params(studies["random"])
    assert drawn[:3] == random_drawn[:3]
    assert all(d != r for d, r in zip(drawn[3:], random_drawn[3:], strict=True))


def test_cmaes_keeps_its_optimizer_across_fresh_inner_samplers():
    pytest.importorskip("cmaes")  # a project dependency; Optuna imports it only for this sampler
    spec = _spec("cmaes")
    storage = optuna.storages.InMemoryStorage()
    _run(_worker(storage, spec), spec, 8)
    _run(_worker(storage, spec), spec, 8)  # resumed: the optimizer comes back from the study
    study = _worker(storage, spec)
    assert len(set(_params(study))) == 16
    # 2 parameters: a population of 6, so generation 1 starts once 6 trials of generation 0 are told.
    generations = [t.system_attrs.get("cma:generation") for t in study.trials]
    assert max(g for g in generations if g is not None) >= 1, generations


def test_qmc_sequence_advances_across_resumes_instead_of_restarting():
    spec = _spec("qmc")
    storage = optuna.storages.InMemoryStorage()
    _run(_worker(storage, spec), spec, 4)
    _run(_worker(storage, spec), spec, 4)
    resumed = _params(_worker(storage, spec))
    plain = optuna.create_study(sampler=optuna.samplers.QMCSampler(seed=0, scramble=True))
    _run(plain, spec, 8)
    # Trial 0 is a random point (drawn before the search space is known); then the one sequence.
    assert resumed[1:] == _params(plain)[1:]
    assert len(set(resumed)) == 8


def test_gp_runs_past_its_startup_trials_under_the_wrapper():
    spec = _spec("gp")
    storage = optuna.storages.InMemoryStorage()
    _run(_worker(storage, spec), spec, 10)  # GPSampler's random start-up trials
    _run(_worker(storage, spec), spec, 2)  # then two from the Gaussian process, in a resumed process
    drawn = _params(_worker(storage, spec))
    assert len(set(drawn)) == 12


def test_grid_is_covered_once_by_parallel_workers_and_stops_when_exhausted():
    spec = _spec("grid", GRID)
    assert not isinstance(make_sampler(spec), TrialSeededSampler)  # trial n takes grid point n
    storage = optuna.storages.InMemoryStorage()
    a, b = _worker(storage, spec), _worker(storage, spec)
    dists = optuna_distributions(spec.search)
    for _ in range(2):
        ta, tb = a.ask(dists), b.ask(dists)
        a.tell(ta, _value(ta.params))
        b.tell(tb, _value(tb.params))
    # The rest in Study.optimize, which GridSampler stops itself once no grid point is left.
    a.optimize(lambda t: _value({k: t.suggest_categorical(k, d.choices) for k, d in dists.items()}), n_trials=100)
    drawn = _params(a)
    grid = {tuple(sorted({"momentum": m, "weight_decay": w}.items())) for m in (0.0, 0.5, 0.9) for w in (0.0, 0.01)}
    assert len(drawn) == 6 and set(drawn) == grid


def test_seed_null_stays_unseeded():
    for name in ("tpe", "random", "qmc"):
        sampler = make_sampler(_spec(name, seed=None))
        assert not isinstance(sampler, TrialSeededSampler), name
