"""``warm_start: {from: STUDY, top: K}`` enqueues the earlier study's K best configurations (the
shared parameters carried over, the rest drawn), and ``sweeps run SPEC --add-trials N`` raises a
study's budget without editing the spec. On real Optuna journal storage, in-process."""
from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from sweeps import cli
from sweeps.backends import optuna_study
from sweeps.backends.optuna_study import ATTR_WARM_START, enqueue_warm_start, extend_budget
from sweeps.errors import StudyStateError
from sweeps.spec.load import spec_from_dict
from sweeps.spec.search_space import suggest
from tests.sweeps.study_helpers import save_spec, tiny_spec

LR = {"type": "float", "low": 1.0e-3, "high": 0.5, "log": True}


def _earlier(tmp_path, monkeypatch) -> None:
    """Study ``first`` (lr x label_smoothing, maximize) with 4 completed trials and a pruned one."""
    monkeypatch.chdir(tmp_path)
    spec = spec_from_dict(tiny_spec("first", search={"lr": LR, "label_smoothing": {"type": "categorical",
                                                                              "choices": [0.0, 0.1]}}))
    study = optuna_study.open_study(spec)
    dists = {"lr": FloatDistribution(1.0e-3, 0.5, log=True), "label_smoothing": CategoricalDistribution([0.0, 0.1])}
    for lr, ls, value, state in [(0.01, 0.0, 0.90, TrialState.COMPLETE), (0.3, 0.1, 0.97, TrialState.COMPLETE),
                                 (0.05, 0.0, 0.95, TrialState.COMPLETE), (0.002, 0.1, 0.50, TrialState.COMPLETE),
                                 (0.1, 0.0, None, TrialState.PRUNED)]:
        study.add_trial(create_trial(params={"lr": lr, "label_smoothing": ls}, distributions=dists, value=value,
                                     state=state))


def test_a_warm_start_enqueues_the_best_configurations_of_the_earlier_study(tmp_path, monkeypatch):
    _earlier(tmp_path, monkeypatch)
    # Another search space: lr narrowed (0.3 falls outside it), label_smoothing gone, momentum new.
    search = {"lr": {**LR, "high": 0.2}, "momentum": {"type": "float", "low": 0.5, "high": 0.99}}
    spec = spec_from_dict(tiny_spec("second", search=search, warm_start={"from": "first", "top": 2}))
    study = optuna_study.open_study(spec)
    note = enqueue_warm_start(spec, study)
    assert note == ("warm start: the first 2 trials are the best of study 'first' (trials 1, 2); carried over: "
                    "lr; drawn: momentum")
    asked = [study.ask() for _ in range(3)]
    drawn = [suggest(t, spec.search) for t in asked]
    assert [t.user_attrs.get(ATTR_WARM_START) for t in asked] == ["first#1", "first#2", None]
    assert drawn[1]["lr"] == 0.05  # trial 2's lr, inside the new range
    assert 1.0e-3 <= drawn[0]["lr"] <= 0.2  # trial 1's lr 0.3 is outside the new range: drawn
    assert all(0.5 <= d["momentum"] <= 0.99 for d in drawn) and all("label_smoothing" not in d for d in drawn)


def test_a_warm_start_from_a_study_that_did_not_run_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec_from_dict(tiny_spec("second", warm_start={"from": "nowhere"}))
    study = optuna_study.open_study(spec)
    with pytest.raises(StudyStateError, match=r"warm_start.from: study 'nowhere' is not in runs/nowhere.journal; "
                                              r"run it first"):
        enqueue_warm_start(spec, study)


def test_add_trials_raises_the_budget_every_opener_of_the_study_sees(tmp_path, monkeypatch):
    _earlier(tmp_path, monkeypatch)
    spec = spec_from_dict(tiny_spec("first", search={"lr": LR, "label_smoothing": {"type": "categorical",
                                                                              "choices": [0.0, 0.1]}},
                                    budget={"n_trials": 5}))
    study = optuna_study.open_study(spec, create=False)
    assert optuna_study.budget_left(study, spec.budget.n_trials) == 0  # 4 complete + 1 pruned
    assert extend_budget(spec, 3) == 8
    again = spec_from_dict(tiny_spec("first", search={"lr": LR, "label_smoothing": {"type": "categorical",
                                                                               "choices": [0.0, 0.1]}},
                                     budget={"n_trials": 5}))
    reopened = optuna_study.open_study(again, create=False)
    assert again.budget.n_trials == 8 and optuna_study.budget_left(reopened, again.budget.n_trials) == 3
    assert extend_budget(again, 2) == 10  # from the raised budget, not the spec's


@pytest.mark.slow  # `sweeps run` starts its workers' fork server before it finds the study never ran
def test_add_trials_to_a_study_that_never_ran_exits_2_saying_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = save_spec(tmp_path, tiny_spec("never"))
    assert cli.main(["run", str(path), "--add-trials", "3"]) == 2
    err = capsys.readouterr().err
    assert "--add-trials extends a study that ran: storage: runs/never.journal does not exist" in err
    assert not (tmp_path / "runs" / "never.journal").exists()


@pytest.mark.parametrize("warm_start, needle", [
    ({"from": "tiny"}, "warm_start.from: 'tiny' is this study; name an earlier study, or extend this one with: "
                       "sweeps run SPEC --add-trials N"),
    ({"form": "a"}, "warm_start.form: unknown key (did you mean 'from'?); allowed here: from, top"),
    ({"from": "a", "top": 0}, "warm_start.top: 0 is out of range; use a value >= 1"),
])
def test_a_wrong_warm_start_section_is_refused_naming_the_field(warm_start, needle):
    from sweeps.errors import SpecError

    with pytest.raises(SpecError) as exc:
        spec_from_dict(tiny_spec("tiny", warm_start=warm_start))
    assert needle in str(exc.value)


def test_optuna_enqueues_the_partial_configuration(tmp_path):
    """The library behaviour the warm start relies on: an enqueued trial missing a parameter has it drawn."""
    study = optuna.create_study(storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.journal"))))
    study.enqueue_trial({"a": 1.0})
    trial = study.ask()
    assert trial.suggest_float("a", 0, 2) == 1.0 and 0 <= trial.suggest_float("b", 0, 2) <= 2
