"""The search space draws the same values under Optuna, Ray and the grid samplers; bounds are inclusive."""
from __future__ import annotations

import numpy as np
import optuna
import pytest
from pydantic import TypeAdapter, ValidationError

from sweeps.spec import search_space as ss
from sweeps.spec.search_space import CategoricalParam, FloatParam, IntParam, SearchParam

optuna.logging.set_verbosity(optuna.logging.WARNING)


def space(**params: dict) -> dict:
    adapter = TypeAdapter(SearchParam)
    return {key.replace("__", "."): adapter.validate_python(p) for key, p in params.items()}


SPACE = space(
    lr={"type": "float", "low": 1e-3, "high": 1.0, "log": True},
    momentum={"type": "float", "low": 0.8, "high": 0.95, "step": 0.05},
    epochs={"type": "int", "low": 1, "high": 3},
    task__width={"type": "int", "low": 16, "high": 64, "step": 16},
    batch_size={"type": "categorical", "choices": [16, 32, 64]},
)


def test_models_parse_and_refuse_bad_fields():
    assert isinstance(SPACE["lr"], FloatParam) and isinstance(SPACE["epochs"], IntParam)
    assert isinstance(SPACE["batch_size"], CategoricalParam)
    assert SPACE["epochs"].step is None  # None means 1
    with pytest.raises(ValidationError):
        space(x={"type": "int", "low": 1.5, "high": 3})  # strict: an int param takes ints only
    with pytest.raises(ValidationError):
        space(x={"type": "categorical", "choices": [[1, 2]]})  # choices are scalars


def test_optuna_distributions_include_both_bounds():
    d = ss.optuna_distributions(SPACE)
    assert (d["lr"].low, d["lr"].high, d["lr"].log) == (1e-3, 1.0, True)
    assert (d["task.width"].low, d["task.width"].high, d["task.width"].step) == (16, 64, 16)
    assert d["task.width"]._contains(64) and d["epochs"]._contains(3)
    assert d["batch_size"].choices == (16, 32, 64)


def test_suggest_draws_every_int_value_including_high():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen_epochs, seen_width = set(), set()
    for _ in range(60):
        trial = study.ask()
        params = ss.suggest(trial, SPACE)
        study.tell(trial, 0.0)
        # Optuna computes low + k * step in floats: 0.8500000000000001 is its 0.85.
        assert 1e-3 <= params["lr"] <= 1.0 and round(params["momentum"], 9) in (0.8, 0.85, 0.9, 0.95)
        seen_epochs.add(params["epochs"])
        seen_width.add(params["task.width"])
    assert seen_epochs == {1, 2, 3} and seen_width == {16, 32, 48, 64}
    assert list(params) == list(SPACE)  # the spec's key order


def test_grid_search_space_is_exact_and_inclusive():
    grid = ss.grid_search_space({k: v for k, v in SPACE.items() if k != "lr"})
    assert grid == {"momentum": [0.8, 0.85, 0.9, 0.95], "epochs": [1, 2, 3],
                    "task.width": [16, 32, 48, 64], "batch_size": [16, 32, 64]}
    assert ss.grid_search_space(space(x={"type": "float", "low": 0.1, "high": 0.5, "step": 0.1})) == \
        {"x": [0.1, 0.2, 0.3, 0.4, 0.5]}  # decimal steps: no 0.30000000000000004
    assert ss.grid_size({k: v for k, v in SPACE.items() if k != "lr"}) == 4 * 3 * 4 * 3
    with pytest.raises(ValueError):
        ss.grid_search_space(SPACE)  # lr is continuous
    sampler = optuna.samplers.GridSampler(ss.grid_search_space(space(e={"type": "int", "low": 1, "high": 3})))
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: ss.suggest(t, space(e={"type": "int", "low": 1, "high": 3}))["e"], n_trials=3)
    assert sorted(t.params["e"] for t in study.trials) == [1, 2, 3]


def test_grid_problems():
    assert ss.grid_problems({k: v for k, v in SPACE.items() if k != "lr"}) == []
    assert ss.grid_problems(SPACE)[0][0] == ("search", "lr")
    huge = space(a={"type": "int", "low": 0, "high": 999}, b={"type": "int", "low": 0, "high": 999})
    assert "1000000 points" in ss.grid_problems(huge)[0][1]


@pytest.mark.ray
def test_ray_space_bounds_are_inclusive():
    from ray import tune

    r = ss.to_ray_space(SPACE)
    assert (r["epochs"].lower, r["epochs"].upper) == (1, 4)  # randint excludes upper: high + 1
    assert (r["task.width"].lower, r["task.width"].upper, r["task.width"].get_sampler().q) == (16, 64, 16)
    assert (r["lr"].lower, r["lr"].upper) == (1e-3, 1.0)
    assert r["batch_size"].categories == [16, 32, 64]
    rng = np.random.default_rng(0)
    assert {int(v) for v in r["epochs"].sample(size=300, random_state=rng)} == {1, 2, 3}
    assert {int(v) for v in r["task.width"].sample(size=300, random_state=rng)} == {16, 32, 48, 64}
    momentum = {round(float(v), 6) for v in r["momentum"].sample(size=300, random_state=rng)}
    assert momentum == {0.8, 0.85, 0.9, 0.95}
    logint = ss.to_ray_space(space(n={"type": "int", "low": 1, "high": 4, "log": True}))["n"]
    assert {int(v) for v in logint.sample(size=400, random_state=rng)} == {1, 2, 3, 4}
    assert ss.ray_grid_space({"e": SPACE["epochs"]}) == {"e": tune.grid_search([1, 2, 3])}


def test_param_problems():
    assert ss.param_problems("task.width", SPACE["task.width"], "ray") == []
    off_grid = space(w={"type": "int", "low": 10, "high": 42, "step": 16})["w"]
    assert ss.param_problems("w", off_grid, "optuna") == []
    assert ss.param_problems("w", off_grid, "ray")[0][0] == ("search", "w", "low")
    dup = space(c={"type": "categorical", "choices": [1, 2, 1]})["c"]
    assert "listed twice" in ss.param_problems("c", dup, "optuna")[0][1]
    int_log = space(n={"type": "int", "low": 0, "high": 8, "log": True})["n"]
    assert "low >= 1" in ss.param_problems("n", int_log, "optuna")[0][1]


def test_split_params_and_signature():
    train, task = ss.split_params({"lr": 0.1, "task.width": 32, "task.model": "mlp", "batch_size": 16})
    assert train == {"lr": 0.1, "batch_size": 16} and task == {"width": 32, "model": "mlp"}
    sig = ss.signature(SPACE)
    assert list(sig) == sorted(SPACE) and sig["lr"] == {"type": "float", "low": 0.001, "high": 1.0,
                                                         "log": True, "step": None}


@pytest.mark.ray
def test_ray_space_round_trips_to_the_same_optuna_distributions():
    # Ray's TPE is Optuna's behind OptunaSearch: its conversion must land on our distributions.
    from ray.tune.search.optuna import OptunaSearch

    assert OptunaSearch.convert_search_space(ss.to_ray_space(SPACE)) == ss.optuna_distributions(SPACE)
