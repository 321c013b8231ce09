"""Several trials of the same model shapes trained together (``resources.pack``), each one a whole
trial: its own MLflow run with every curve, its folder, checkpoints, ONNX export and logged model,
its own pruning decision and outcome. The training is one ``core.train.train_population`` call
(core/population.py); around it, each member is started and finished exactly as
:func:`sweeps.trial.run_trial` starts and finishes a trial alone.

Members a population cannot hold (a model vmap refuses, found as training sets up) are trained
one after another instead, in the same runs; ``on_pack`` hears, per member, how it was trained.
"""
from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable

import torch

from core.pack_rules import config_problem
from core.population import GROUPED, VMAP, MemberRun, PackError
from core.results import TrainResult
from core.train import train, train_population
from sweeps import deploy_check, trial_folder
from sweeps.spec.model import StudySpec
from sweeps.tracking.base import RunHandle, Tracker
from sweeps.tracking.trial_extras import TrialExtras
from sweeps.trial import (
    TrialOutcome,
    TrialReporter,
    TrialSpec,
    finish_trial_run,
    first_line,
    outcome_of,
    start_trial_run,
    trial_config,
)
from sweeps.trial_control import TrialControl, TrialInterrupted

TAG_PACK = "sweeps.pack"  # on each member's run: how it trains ("packed with trials 1, 2 (vmap)" or "alone: why")
PACKED_WITH = "packed with trials"  # how a population member's note begins (a trial alone: "alone: why")


def run_population(spec: StudySpec, trials: list[TrialSpec], controls: list[TrialControl], tracker: Tracker,
                   on_pack: Callable[[int, str], None] | None = None) -> list[TrialOutcome]:
    """Run ``trials`` (same task arguments and shared train settings: ``optuna_pack`` groups them)
    as one population. Never raises for failing trials: each failure is that member's outcome."""
    for control in controls:
        control.hold_if_asked()
    started = time.monotonic()
    runs = [start_trial_run(spec, tracker, trial) for trial in trials]
    for control, run in zip(controls, runs, strict=True):
        control.on_start(run)
    extras = [TrialExtras(tracker, run, None) for run in runs]  # system metrics until the trials end
    reporters = [TrialReporter(tracker, run, spec.objective.metric, control, None, extra)
                 for run, control, extra in zip(runs, controls, extras, strict=True)]
    try:
        with contextlib.ExitStack() as folders:
            for trial, run in zip(trials, runs, strict=True):
                moved = folders.enter_context(trial_folder.claimed(trial.out_dir, trial.owner, trial.params)) \
                    if trial.owner is not None else None
                if moved is not None:
                    tracker.log(run, tags={"sweeps.moved_aside": str(moved)})
            outcomes = _train(spec, trials, reporters, runs, extras, on_pack or (lambda _k, _note: None))
    except Exception as exc:  # noqa: BLE001 - a folder cannot be had: the trials fail, saying why
        outcomes = [TrialOutcome("FAIL", None, f"{type(exc).__name__}: {first_line(exc)}", run) for run in runs]
    finally:
        for extra in extras:
            extra.system.stop()
    for trial, extra, outcome, run in zip(trials, extras, outcomes, runs, strict=True):
        extra.finish(trial.number, trial.params, outcome.result)
        outcome.seconds = time.monotonic() - started  # the population's time: the members trained together
        finish_trial_run(tracker, run, outcome)
    return outcomes


def _train(spec: StudySpec, trials: list[TrialSpec], reporters: list[TrialReporter], runs: list[RunHandle],
           extras: list[TrialExtras], on_pack: Callable[[int, str], None]) -> list[TrialOutcome]:
    """Build the task once and train the members together (or, refused, one after another)."""
    numbers = [t.number for t in trials]
    try:
        with reporters[0].control.stop.setting_up():  # the members share the worker's stop request
            task = spec.make_task(trials[0].params)
            cfgs = [trial_config(spec, t.params, t.overrides) for t in trials]
            members = [MemberRun(cfg, reporter, t.out_dir, t.owner)
                       for cfg, reporter, t in zip(cfgs, reporters, trials, strict=True)]
            extras[0].watch_datasets(task, also=extras[1:])  # described once, logged to every member's run
            refused = config_problem(cfgs) or auto_problem(spec, task, cfgs[0])
            try:
                if refused:
                    raise PackError(refused)
                notes = [f"{PACKED_WITH} {', '.join(str(n) for n in numbers if n != number)}" for number in numbers]
                _say(reporters, runs, notes, on_pack)  # before training: the live view shows it while they train
                # Then how they run, which the probe on the first batch decides before the first step.
                results = train_population(task, members, resume=True, on_layout=lambda how: _say(
                    reporters, runs, [f"{note} ({how})" for note in notes], on_pack))
            except PackError as exc:  # raised before any step: each member trains alone, in its own run
                results = _one_by_one(spec, trials, members, reporters, runs, str(exc), on_pack)
        return [_outcome(spec, result, run) for result, run in zip(results, runs, strict=True)]
    except TrialInterrupted as exc:
        reason = f"stopped by a signal ({exc.signum}) while the trials were setting up, before their first step"
        return [TrialOutcome("INTERRUPTED", None, reason, run) for run in runs]
    except Exception as exc:  # noqa: BLE001 - failing trials are data, not a crash of the study
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        for reporter, run in zip(reporters, runs, strict=True):
            reporter.tracker.log(run, tags={"sweeps.traceback": traceback.format_exc()[-4000:]})
        return [TrialOutcome("FAIL", None, reason, run) for run in runs]


def layout_of(note: str) -> str | None:
    """How the member whose ``sweeps.pack`` note this is runs (GROUPED or VMAP); None when the
    note does not say (a trial alone, or a population stopped before its first step)."""
    return next((how for how in (GROUPED, VMAP) if note.startswith(PACKED_WITH) and note.endswith(f"({how})")), None)


def _say(reporters: list[TrialReporter], runs: list[RunHandle], notes: list[str],
         on_pack: Callable[[int, str], None]) -> None:
    for k, (reporter, run, note) in enumerate(zip(reporters, runs, notes, strict=True)):
        reporter.tracker.log(run, tags={TAG_PACK: note})
        on_pack(k, note)


def auto_problem(spec: StudySpec, task, cfg) -> str | None:
    """Why ``resources.pack: auto`` leaves these trials unpacked, or None. Auto packs where packing
    is measured to help (benchmarks/RESULTS.md, packed trials): not convolutional models on a CPU,
    which train slower as one population (vmap runs the members' convolutions as one grouped
    convolution, which CPU kernels run no faster than one after another). A number packs as told."""
    if spec.resources.pack != "auto" or not _on_cpu(cfg.device):
        return None
    if any(isinstance(m, _CONVOLUTIONS) for m in task.build_model().modules()):
        return ("resources.pack: auto leaves a convolutional model unpacked on a CPU, where its population "
                "trains slower than its members one after another; set a number to pack it anyway")
    return None


def _on_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                 torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def _one_by_one(spec: StudySpec, trials: list[TrialSpec], members: list[MemberRun], reporters: list[TrialReporter],
                runs: list[RunHandle], why: str, on_pack: Callable[[int, str], None]) -> list[TrainResult]:
    _say(reporters, runs, [f"alone: {why}"] * len(runs), on_pack)
    return [train(spec.make_task(t.params), m.cfg, reporter=m.reporter, out_dir=m.out_dir, resume=True, owner=m.owner)
            for t, m in zip(trials, members, strict=True)]


def _outcome(spec: StudySpec, result: TrainResult, run: RunHandle) -> TrialOutcome:
    outcome = outcome_of(result, run)
    if outcome.state == "COMPLETE":
        outcome.values = deploy_check.objective_values(spec, result.history, result.best_epoch, {})
        if outcome.values is None and len(spec.objective_list()) > 1:
            missing = deploy_check.missing_objectives(spec, result.history, result.best_epoch, {})
            outcome.state, outcome.reason = "FAIL", f"no value of the objective {', '.join(missing)}"
    return outcome
