"""A study that starts from an earlier one, and a study that goes on past its budget.

``warm_start: {from: STUDY, top: K}`` (sweeps/spec/model.py): a new study's first trials
are the K best completed configurations of the earlier study, enqueued with Optuna's
``enqueue_trial``; parameters the new search space lacks are dropped and those it adds are left
to the sampler (a partial enqueued trial has its other parameters drawn).

``sweeps run SPEC --add-trials N`` raises the budget of a study that ran by N without editing
the spec: the raised budget is a user attribute of the study, which every process opening the
study (the driver, its workers, status and report) takes over ``budget.n_trials``.
"""
from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from sweeps.backends import optuna_study
from sweeps.errors import StudyStateError
from sweeps.spec.model import StudySpec
from sweeps.spec.search_space import CategoricalParam

ATTR_WARM_START = "warm_start_of"  # on an enqueued trial: "<earlier study>#<its trial number>"


def _fits(p: Any, value: Any) -> bool:
    """Whether ``value`` can be drawn from search parameter ``p`` (a choice, or within the range)."""
    if isinstance(p, CategoricalParam):
        return value in p.choices
    return isinstance(value, (int, float)) and not isinstance(value, bool) and p.low <= value <= p.high


def enqueue_warm_start(spec: StudySpec, study: optuna.Study) -> str:
    """Enqueue the best ``warm_start.top`` configurations of the earlier study into ``study`` (a new
    one, with no trials yet); returns the sentence saying what was carried over."""
    ws = spec.warm_start
    assert ws is not None  # the caller checks it
    source = spec.model_copy(update={"name": ws.study, "warm_start": None})
    where = f"{source.storage_url()}"
    missing = StudyStateError(f"warm_start.from: study {ws.study!r} is not in {where}; run it first, or fix the "
                              f"name in {spec.path or 'the spec'}")
    try:
        storage = optuna_study.open_storage(source, create=False)
    except StudyStateError:
        raise missing from None
    name = optuna_study.current_study_name(storage, ws.study)
    if name is None:
        raise missing
    earlier = optuna.load_study(study_name=name, storage=storage)
    if len(earlier.directions) > 1:
        raise StudyStateError(f"warm_start.from: study {name!r} has several objectives, so no single best "
                              "configurations to start from; name a study of one objective")
    done = [(t.value, t) for t in earlier.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None]
    if not done:
        raise StudyStateError(f"warm_start.from: study {name!r} has no completed trial to start from")
    maximize = earlier.direction == optuna.study.StudyDirection.MAXIMIZE
    best = [t for _, t in sorted(done, key=lambda vt: vt[0], reverse=maximize)]
    carried: set[str] = set()
    for t in best[:ws.top]:
        params = {k: v for k, v in t.params.items() if k in spec.search and _fits(spec.search[k], v)}
        carried |= set(params)
        study.enqueue_trial(params, user_attrs={ATTR_WARM_START: f"{name}#{t.number}"}, skip_if_exists=True)
    drawn = sorted(set(spec.search) - carried)
    return (f"warm start: the first {min(ws.top, len(best))} trials are the best of study {name!r} (trials "
            f"{', '.join(str(t.number) for t in best[:ws.top])}); carried over: {', '.join(sorted(carried)) or 'none'}"
            + (f"; drawn: {', '.join(drawn)}" if drawn else ""))


def extend_budget(spec: StudySpec, add: int) -> int:
    """Raise the budget of the spec's study (which must have run) by ``add``; the new budget."""
    study = optuna_study.open_study(spec, create=False)
    budget = spec.budget.n_trials  # open_study applied an earlier extension
    study.set_user_attr(optuna_study.ATTR_N_TRIALS, budget + add)
    return budget + add
