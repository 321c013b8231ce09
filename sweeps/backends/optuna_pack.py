"""``resources.pack`` on the Optuna backend: a worker asks for up to K trials at once (fewer for a
sampler that models the results: :func:`ask_size`), groups those that train the same model shapes
with the same batch size, epochs and other shared settings, and trains each group as one
population (sweeps/trial_population.py); a trial without a partner trains alone. The trials are
asked under the ask lock one after another: TPE's constant liar (``optuna_sampler``) and the GP
sampler count the running ones, so the points asked together spread out.

Each trial's Optuna user attribute ``pack`` (``ATTR_PACK``) says how it was trained, for the live view.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import optuna

from core.config import ConfigError
from core.pack_rules import MEMBER_FIELDS, config_problem
from sweeps.backends import optuna_study
from sweeps.backends.optuna_attrs import ATTR_PACK
from sweeps.backends.trial_liveness import HeldTrials
from sweeps.spec.model import StudySpec
from sweeps.tracking.base import Tracker
from sweeps.trial import TrialOutcome, TrialSpec, trial_config
from sweeps.trial_control import TrialControl
from sweeps.trial_population import run_population
from sweeps.worker_identity import worker_identity

# A sampler that models the results so far (TPE, GP) gets at least this many rounds of them: 64
# trials asked 16 at a time by each of 2 workers are two rounds, the first all random and the
# second 32 guesses from one model. Four rounds of 8 per worker train about as fast (a small
# trial's own work, its records, checkpoints and export, outweighs the population's steps) and
# find a better best (benchmarks/RESULTS.md, packed).
FEEDBACK_ROUNDS = 4
_MODEL_SAMPLERS = ("tpe", "gp")  # random, grid and QMC learn nothing; CMA-ES asks by generation


def ask_size(spec: StudySpec, n_trials: int, pool: int = 1) -> int:
    """How many trials a worker asks for at once: up to ``resources.pack``, within this worker's
    share of the budget (``pool`` workers started together: 16 trials on 2 workers are two
    populations of 8, not one of 16 and an idle worker) and, for a sampler that models the
    results, a share small enough to leave it :data:`FEEDBACK_ROUNDS` rounds of them."""
    share = -(-n_trials // max(pool, 1))
    if spec.sampler.name in _MODEL_SAMPLERS:
        share //= FEEDBACK_ROUNDS  # rounded down: 5 trials asked 2 at a time would be three rounds
    return max(1, min(spec.resources.pack_size(), share))


def ask_more(spec: StudySpec, study: optuna.Study, held: HeldTrials, n_trials: int,
             pool: int = 1) -> list[optuna.Trial]:
    """Called under the ask lock after the worker's first trial: up to :func:`ask_size` - 1 more,
    within the budget, each named for this worker at once (as the first)."""
    more = []
    for _ in range(ask_size(spec, n_trials, pool) - 1):
        if optuna_study.budget_left(study, n_trials) <= 0:
            break
        more.append(held.ask(worker_identity()))
    return more


def groups(spec: StudySpec, trials: list[TrialSpec]) -> list[tuple[list[int], str]]:
    """The trials (indices into ``trials``) that train together, each group with why it is alone
    when it holds one trial ("" for a population)."""
    if spec.deploy_metrics_needed():
        why = "alone: the deployment figures (an objective or constraint) are measured trial by trial"
        return [([k], why) for k in range(len(trials))]
    by_key: dict[str, list[int]] = {}
    for k, trial in enumerate(trials):
        by_key.setdefault(_shape_key(spec, trial) or f"unresolved {k}", []).append(k)
    out = []
    for members in by_key.values():
        if len(members) == 1:
            out.append((members, f"alone: no other trial of the same model, batch size and shared train settings "
                                 f"among the {len(trials)} asked together"))
            continue
        cfgs = [trial_config(spec, trials[k].params, trials[k].overrides) for k in members]
        problem = config_problem(cfgs)
        out += [([k], f"alone: {problem}") for k in members] if problem else [(members, "")]
    return out


def _shape_key(spec: StudySpec, trial: TrialSpec) -> str | None:
    """What members of one population must share: the task's arguments (its model) and every
    train setting but those a member may have of its own; None when the config does not resolve
    (the trial then fails alone, with the config's message)."""
    try:
        cfg = trial_config(spec, trial.params, trial.overrides)
    except (ConfigError, ValueError):
        return None
    shared = {k: v for k, v in cfg.to_dict().items() if k not in MEMBER_FIELDS}
    return json.dumps({"task": spec.task_args(trial.params), "train": shared}, sort_keys=True, default=str)


def run_group(spec: StudySpec, study: optuna.Study, trials: list[optuna.Trial], specs: list[TrialSpec],
              controls: list[TrialControl], tracker: Tracker) -> list[TrialOutcome]:
    """Train a group as one population (the worker keeps its trials alive in the storage)."""

    def note(k: int, text: str) -> None:
        trials[k].set_user_attr(ATTR_PACK, text)

    return run_population(spec, specs, controls, tracker, on_pack=note)


def run_packed(spec: StudySpec, study: optuna.Study, jobs: list[Any], tracker: Tracker, signals: Any,
               run_job: Callable[..., int | None], finish: Callable[..., int | None]) -> int | None:
    r"""Train trials asked together (``optuna_worker.TrialJob``\ s): each group of the same shapes as
    one population, the others one at a time (``run_job``); ``finish`` tells the study each
    outcome. After a stop, the trials not yet trained are requeued as an interrupted trial is.
    Returns the worker's exit code when it must stop, else None."""
    code = None
    for members, why in groups(spec, [job.spec_trial for job in jobs]):
        group = [jobs[k] for k in members]
        if code is not None:
            for job in group:
                finish(spec, study, job, TrialOutcome("INTERRUPTED", None, "stopped before it trained (asked with "
                                                      "others by resources.pack)", None), tracker, signals)
            continue
        if len(group) == 1:
            group[0].trial.set_user_attr(ATTR_PACK, why)
            code = run_job(spec, study, group[0], tracker, signals)
            continue
        outcomes = run_group(spec, study, [j.trial for j in group], [j.spec_trial for j in group],
                             [j.control for j in group], tracker)
        for job, outcome in zip(group, outcomes, strict=True):
            code = finish(spec, study, job, outcome, tracker, signals) or code
    return code
