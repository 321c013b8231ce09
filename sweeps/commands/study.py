"""The commands that run a study and look after it: ``validate``, ``run``, ``worker``,
``status``, ``sync-tracking``, ``repair-journal``, and ``check``: sanity checks of a spec's task
before a sweep, on CPU, in seconds (core/sanity.py). ``check`` builds the task and the model for
the first point of the search space (each float or int at its low end, each categorical at its
first choice), runs one forward and backward, overfits one small batch and checks the data
pipeline. Every finding is printed; any problem exits 2.

Every command that takes a spec validates it first; a bad spec exits with code 2 and creates
nothing. The heavy imports (backends, MLflow, the dashboards) happen inside the handlers, so
``--help`` and a bad spec stay fast.
"""
from __future__ import annotations

# Each command imports what it runs inside its own function, lazily for start-up: `sweeps --help`
# and every other command load none of it (torch, MLflow, Optuna, pandas).
import argparse
import contextlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from core.faults import Pause, pause_here
from sweeps.backends.driver import EXIT_BUDGET_UNMET, no_trial_completed
from sweeps.commands import Command, console, err_console, load_spec_file, spec_argument
from sweeps.errors import SpecError, StudyStateError, UsageError
from sweeps.moved_store import follow_moved_store

if TYPE_CHECKING:
    from sweeps.backends.base import Backend, StudyResult
    from sweeps.spec.model import StudySpec

STATUS_FORMATS = ("table", "csv", "json")


# ---- validate -------------------------------------------------------------------------------
def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="+", help="study spec YAML file(s)")


def cmd_validate(a: argparse.Namespace) -> int:
    code = 0
    for path in a.spec:
        try:
            spec = load_spec_file(path)
        except SpecError as exc:  # report it and go on: every file named gets its verdict
            err_console.print(str(exc), markup=False, highlight=False)
            code = 2
            continue
        console.print(f"{path}: ok (study {spec.name!r}, {len(spec.search)} searched parameters, "
                      f"backend {spec.backend}, {spec.budget.n_trials} trials)", markup=False, highlight=False)
        _warn_nothing_searched(spec, path)
    return code


def _warn_nothing_searched(spec, path: str) -> None:
    """An empty ``search:`` is valid (one configuration, trained as a study) but several trials of it
    train the same model again and again: say so rather than run them without a word."""
    if not spec.search and spec.budget.n_trials > 1:
        err_console.print(f"warning: {path}: search is empty, so each of the {spec.budget.n_trials} trials trains "
                          f"the same configuration with the same seed; add a parameter to search, or set "
                          f"budget.n_trials: 1", markup=False, highlight=False)


# ---- run / worker ---------------------------------------------------------------------------
def _extend(spec, path: str, add: int) -> tuple[int, int]:
    """``--add-trials N``: the study's budget before and after raising it by N."""
    if add < 1:
        raise UsageError(f"--add-trials {add}: give 1 or more trials to add")
    if spec.backend != "optuna":
        raise UsageError(f"--add-trials extends Optuna studies; {path} has backend {spec.backend}: raise "
                         "budget.n_trials in the spec instead")
    from sweeps.backends.optuna_study import extend_budget  # here: Optuna loads only when a study is extended

    try:
        after = extend_budget(spec, add)
    except StudyStateError as exc:
        raise StudyStateError(f"--add-trials extends a study that ran: {exc}") from None
    return after - add, after


def _run_args(p: argparse.ArgumentParser) -> None:
    spec_argument(p)
    p.add_argument("--fresh", action="store_true", help="start a new version of the study; keep the old one")
    p.add_argument("--quiet", action="store_true", help="plain line output instead of the live view")
    p.add_argument("--add-trials", type=int, default=0, metavar="N",
                   help="raise the budget of a study that ran by N trials and run them (the spec is not edited)")


def cmd_run(a: argparse.Namespace) -> int:
    from sweeps.backends.by_name import get_backend
    spec = load_spec_file(a.spec)  # the study's one snapshot of its spec: workers get this text, never the file
    # Lazy, for start-up time (stdlib only): an Optuna study's workers' fork server starts now, so
    # that its imports overlap everything the driver imports and sets up from here on; it is
    # stopped when the command is done with it, whatever ends it.
    from sweeps.backends import worker_forkserver

    with worker_forkserver.running() if spec.backend == "optuna" else contextlib.nullcontext():
        result = _run_study(a, spec, get_backend(spec.backend, a.spec))
    if result.exit_code == 0 and result.finished() and all(t.rejected for t in result.finished()) \
            and not any(t.state == "COMPLETE" for t in result.trials):
        # The budget was spent, yet no model trained: nothing to compare or promote.
        err_console.print(f"error: every trial of study {spec.name!r} was rejected before training by the "
                          f"constraints ({', '.join(f'{k} {b.describe()}' for k, b in spec.constraints.items())}); "
                          f"loosen them (see the rejected figures with: sweeps status {a.spec})",
                          markup=False, highlight=False)
        return 1
    no_result = no_trial_completed(result, a.spec)
    if result.exit_code == 0 and no_result:  # the budget is spent and nothing trained to the end
        err_console.print(f"error: {no_result}", markup=False, highlight=False)
        return EXIT_BUDGET_UNMET
    return result.exit_code


def _run_study(a: argparse.Namespace, spec: StudySpec, backend: Backend) -> StudyResult:
    pause_here(Pause.SPEC_READ)  # tests edit the file here: nothing may read it again
    _warn_nothing_searched(spec, a.spec)
    if a.add_trials:
        before, after = _extend(spec, a.spec, a.add_trials)
        console.print(f"study {spec.name!r}: budget raised from {before} to {after} trials (the spec is unchanged)",
                      markup=False, highlight=False)

    # runs/ moved: a resumed study's new trial runs must write where the artifacts are now. Under
    # the study's run lock: a store another run of the study is using is never rewritten under it.
    def follow_moved() -> None:
        follow_moved_store(spec.tracking_store_uri(), err_console)

    return backend.run(spec, fresh=a.fresh, quiet=a.quiet, on_locked=follow_moved)


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file whose storage is a shared RDB URL (postgresql://...)")
    p.add_argument("--devices", default=None, metavar="auto|cpu|0,1,...",
                   help="fan out over this machine's devices as `sweeps run` does: one worker process per slot, "
                        "each pinned with CUDA_VISIBLE_DEVICES (overrides resources.devices; auto: every visible "
                        "GPU). Without --devices or --gpus-per-trial: one trial at a time in this process")
    p.add_argument("--gpus-per-trial", type=float, default=None, metavar="K",
                   help="GPUs per trial for the fan-out (overrides resources.gpus_per_trial: 1, 2, ... or "
                        "0.5, 0.25, ... to share a GPU)")
    p.add_argument("--slot", type=int, default=None,
                   help="the single worker's slot number, tagged on its trial runs as sweeps.worker_slot "
                        "(default 0; the worker itself is named host:boot-id:pid). Not with --devices")
    p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for `sweeps run SPEC` to create the study and its MLflow parent run "
                        "when the worker starts first (default: 600; 0: fail at once)")


def cmd_worker(a: argparse.Namespace) -> int:
    spec = load_spec_file(a.spec)
    if spec.backend != "optuna":
        raise StudyStateError(f"{a.spec}: backend: {spec.backend!r}; workers join Optuna studies. For Ray, "
                              "start Ray nodes with `ray start --address ...` instead")
    if not spec.is_rdb_storage():
        raise StudyStateError(f"{a.spec}: storage: {spec.storage_url()!r} is a local journal file; workers on "
                              "several machines need a shared RDB URL such as postgresql://user@host/db")
    if a.devices is None and a.gpus_per_trial is None:
        from sweeps.backends.optuna_worker import run_worker

        return run_worker(spec, worker_index=a.slot if a.slot is not None else 0, wait_s=a.wait)
    if a.slot is not None:
        raise UsageError(f"--slot {a.slot} cannot be combined with --devices / --gpus-per-trial: the fan-out "
                         "numbers its workers' slots itself (0, 1, ...); leave --slot out")
    from sweeps.backends.device_fanout import parse_devices_flag, run_worker_pool

    overrides: dict = {}
    if a.devices is not None:
        overrides["devices"] = parse_devices_flag(a.devices)
    if a.gpus_per_trial is not None:
        overrides["gpus_per_trial"] = a.gpus_per_trial
    return run_worker_pool(spec, overrides, wait_s=a.wait)


# ---- status ----------------------------------------------------------------------------------
def _status_args(p: argparse.ArgumentParser) -> None:
    spec_argument(p)
    p.add_argument("--format", choices=STATUS_FORMATS, default="table",
                   help="table (default), or the trials table as csv or json on stdout")


def cmd_status(a: argparse.Namespace) -> int:
    from sweeps.backends.by_name import get_backend

    spec = load_spec_file(a.spec)
    result = get_backend(spec.backend, a.spec).load(spec)
    if a.format != "table":
        sys.stdout.write(status_text(spec, result, a.format))
        sys.stdout.flush()
        return 0
    from sweeps.live import results_table

    counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(result.counts().items())) or "no trials"
    console.print(results_table(result, title=f"study {result.name} ({result.backend}): {counts}; "
                                              f"budget {spec.budget.n_trials}"))
    for t in result.trials:
        if t.state == "FAIL" and t.reason:
            console.print(f"trial {t.number} failed: {t.reason}", markup=False, highlight=False)
    return 0


def status_text(spec, result, fmt: str) -> str:
    """The study's trials as ``sweeps status --format csv|json`` prints them: the trials table of
    :func:`dashboards.tables.trials_table` (the one the HTML report shows), completed trials best
    first, then the rest by number. JSON is one object: study, backend, metric, direction,
    budget, counts, best (number or null), trials (one record per row, NaN as null); with several
    objectives also objectives and front (the Pareto front's trial numbers)."""
    from dashboards.tables import ranked_trials, table_records, trials_table

    df = ranked_trials(trials_table(result, spec.search), result.direction)
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt == "json":
        best = result.best()
        doc = {"study": result.name, "backend": result.backend, "metric": result.metric,
               "direction": result.direction, "budget": spec.budget.n_trials, "counts": result.counts(),
               "best": None if best is None else best.number,
               "trials": table_records(df)}
        if len(result.objectives()) > 1:  # the front of the stored values (sweeps.pareto), by trial number
            doc["objectives"] = [{"metric": m, "direction": d} for m, d in result.objectives()]
            doc["front"] = sorted(t.number for t in result.front())
        return json.dumps(doc, indent=2) + "\n"
    raise ValueError(f"format {fmt!r} is not one of {', '.join(STATUS_FORMATS)}")


# ---- maintenance -----------------------------------------------------------------------------
def _sync_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uri", required=True, help="MLflow tracking URI to send the kept points to")
    p.add_argument("--spool", default="runs/.mlflow_spool", help="folder of kept points")


def cmd_sync_tracking(a: argparse.Namespace) -> int:
    from sweeps.tracking.sync import sync_spool

    report = sync_spool(a.uri, a.spool)
    console.print(report)
    return 1 if report.get("failed") or report.get("refused") else 0


def _repair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("journal", help="path of the journal file")


def cmd_repair_journal(a: argparse.Namespace) -> int:
    from sweeps.backends.journal_file import repair_journal

    console.print(repair_journal(a.journal), markup=False, highlight=False)
    return 0


# ---- check ---------------------------------------------------------------------------------------
def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file")
    p.add_argument("--steps", type=int, default=None, metavar="N",  # None: core.sanity.OVERFIT_STEPS
                   help="optimizer steps the overfit check may take (default: 500)")
    p.add_argument("--factor", type=float, default=10.0, metavar="F",
                   help="the overfit check passes once the loss on one batch falls F times (default: 10)")


def first_point(search: dict[str, Any]) -> dict[str, Any]:
    """The search space's first point: a range's low end, a categorical's first choice."""
    from sweeps.spec.search_space import CategoricalParam

    return {key: p.choices[0] if isinstance(p, CategoricalParam) else p.low for key, p in search.items()}


def cmd_check(a: argparse.Namespace) -> int:
    from core.config import ConfigError, apply_overrides
    from core.sanity import OVERFIT_STEPS, sanity_check
    from core.tasks.base import TaskError
    steps = OVERFIT_STEPS if a.steps is None else a.steps
    if steps < 1 or not a.factor > 1:
        raise UsageError(f"--steps {steps} --factor {a.factor}: use --steps 1 or more and --factor above 1")
    started = time.monotonic()
    spec = load_spec_file(a.spec)
    params = first_point(spec.search)
    try:
        task = spec.make_task(params)
        # On CPU: the check is about the code and the data, and must not wait for a GPU.
        cfg = apply_overrides(spec.resolved_train_config(params), {"device": "cpu"})
    except (TaskError, ConfigError) as exc:
        raise SpecError(a.spec, [f"{exc} (at the search space's first point {params})"]) from None
    findings = sanity_check(task, cfg, steps=steps, factor=a.factor)
    for f in findings:
        (console if f.ok else err_console).print(f"{'ok     ' if f.ok else 'PROBLEM'} {f.check:<10} {f.message}",
                                                 markup=False, highlight=False)
    problems = sum(not f.ok for f in findings)
    seconds = time.monotonic() - started
    if problems:
        err_console.print(f"{a.spec}: {problems} problem{'s' if problems != 1 else ''} found in {seconds:.1f} s "
                          f"(task {spec.task.name or spec.task.target!r}, point {params}); fix them before the "
                          f"sweep", markup=False, highlight=False)
        return 2
    console.print(f"{a.spec}: ok in {seconds:.1f} s (task {spec.task.name or spec.task.target!r}, point {params})",
                  markup=False, highlight=False)
    return 0


COMMANDS = (
    Command("validate", "check a study spec and report every problem at once", _validate_args, cmd_validate),
    Command("run", "run (or resume) the study of a spec until its total budget is met", _run_args, cmd_run),
    Command("worker", "join a study on shared RDB storage and run its trials until the total budget is met",
            _worker_args, cmd_worker),
    Command("status", "a table of the study's trials, the best marked", _status_args, cmd_status),
    Command("sync-tracking", "send metrics kept locally while the MLflow server was unreachable", _sync_args,
            cmd_sync_tracking),
    Command("repair-journal", "keep the intact records of a damaged Optuna journal file (a backup is kept)",
            _repair_args, cmd_repair_journal),
    Command("check", "sanity-check a spec's task before a sweep: one forward/backward, overfit one batch, "
            "the data pipeline (exit 2 on a problem)", _check_args, cmd_check),
)
