"""The Pareto front and --where conditions: checked against a brute-force reading of the
definition and against Optuna's own front for a study it ran."""
from __future__ import annotations

import math
import random

import optuna
import pytest

from sweeps.errors import UsageError
from sweeps.pareto import Condition, dominates, pareto_front, parse_where

MAX_MIN = ("maximize", "minimize")


def test_front_of_accuracy_against_latency():
    points = [(0.90, 1.0), (0.95, 2.0), (0.93, 2.5), (0.97, 4.0), (0.89, 0.9), (0.95, 2.0), (float("nan"), 0.1)]
    # (0.93, 2.5) is dominated by (0.95, 2.0); equal points are both on the front; NaN never is.
    assert pareto_front(points, MAX_MIN) == [0, 1, 3, 4, 5]
    assert dominates((0.95, 2.0), (0.93, 2.5), MAX_MIN) and not dominates((0.95, 2.0), (0.95, 2.0), MAX_MIN)


def test_front_equals_optunas_for_a_study_it_ran():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=3))
    rng = random.Random(0)
    study.optimize(lambda t: (round(rng.random(), 2), round(rng.random() * 5, 1) + t.suggest_float("x", 0, 1) * 0),
                   n_trials=60)
    trials = study.trials
    ours = {trials[i].number for i in pareto_front([t.values for t in trials], MAX_MIN)}
    assert ours == {t.number for t in study.best_trials}
    assert 2 <= len(ours) < len(trials)


def test_where_conditions():
    conditions = parse_where("onnx_latency_ms<=2, params < 1e6 and val_acc>=0.9")
    assert [str(c) for c in conditions] == ["onnx_latency_ms<=2", "params<1e+06", "val_acc>=0.9"]
    trial = {"onnx_latency_ms": 1.5, "params": 2e5, "val_acc": 0.95}
    assert all(c.holds(trial) for c in conditions)
    assert not Condition("onnx_latency_ms", "<", 1.5).holds(trial)
    assert not Condition("missing", "<", 1.0).holds(trial)
    assert not Condition("val_acc", ">", 0.0).holds({"val_acc": math.nan})


@pytest.mark.parametrize("text", ["", "latency", "latency <= fast", "a => 2", "a <= 2; b > 1"])
def test_where_refuses_what_it_cannot_read(text):
    with pytest.raises(UsageError, match="--where"):
        parse_where(text)


@pytest.mark.parametrize("text, needle", [
    ("a>=1 and and b<2", "an empty condition between two separators"),
    ("a>=1,", "an empty condition between two separators"),
    ("   ", "no condition"),
])
def test_where_refuses_an_empty_condition(text, needle):
    with pytest.raises(UsageError, match=needle):
        parse_where(text)


def test_where_equal_to_a_displayed_value_picks_the_trial_it_was_rounded_from():
    # `sweeps status` shows val_acc 0.952777... as 0.9528; the user pastes what they see.
    [shown] = parse_where("val_acc==0.9528")
    assert shown.holds({"val_acc": 0.9527777791023254}) and not shown.holds({"val_acc": 0.9530})
    [exact] = parse_where("params==85002")
    assert exact.holds({"params": 85002.0}) and not exact.holds({"params": 85003.0})
    assert not parse_where("params==8.5e4")[0].holds({"params": 85002.0})  # an exponent: exact


def test_promote_refuses_an_empty_where_instead_of_ignoring_it():
    from sweeps.backends.base import StudyResult, TrialRecord
    from sweeps.registry import eligible

    result = StudyResult("s", "optuna", "maximize", "val_acc", [TrialRecord(0, "COMPLETE", {}, 0.9, 1.0, "r")])
    with pytest.raises(UsageError, match="--where '': no condition"):
        eligible(result, "")
