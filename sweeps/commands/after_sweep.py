"""What to do once a study has run: ``promote`` its best model, ``rerun`` a trial and
compare the curves, ``compare`` two runs, ``report`` the study as one page; listed in
``COMMANDS`` for ``sweeps.cli``.

Each command only parses its arguments here; the work lives in ``sweeps.registry``,
``sweeps.rerun``, ``sweeps.compare`` and ``dashboards.report``.

``report`` writes one self-contained HTML page of the study (plotly.js inline: it opens from
disk, offline), by default at ``runs/<study>/report.html``, and logs it as an artifact of the
study's parent MLflow run, always as ``report/report.html`` whatever ``-o`` names: a second
call replaces the page there instead of adding a copy beside it. The tables behind the page
come from :mod:`dashboards.tables`, as do those of ``status --format csv|json``.
"""
from __future__ import annotations

# Each command imports what it runs inside its own function, lazily for start-up: `sweeps --help`
# and every other command load none of it (torch, MLflow, Optuna, pandas).
import argparse
import os
from pathlib import Path

from sweeps.commands import Command, console, err_console, load_spec_file, spec_argument
from sweeps.errors import PathError, UsageError
from sweeps.moved_store import follow_moved_store
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle

# The per-file progress bars of MLflow downloads drown the tables these commands print.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one seed, each once, e.g. 0,1,2")
    return seeds


# ---- promote ---------------------------------------------------------------------------------
def _promote_args(p: argparse.ArgumentParser) -> None:
    spec_argument(p)
    p.add_argument("--alias", default="champion", help="registry alias to move to the promoted version "
                                                       "(default: champion)")
    p.add_argument("--model-name", default=None, help="registered model name (default: the study name)")
    p.add_argument("--metric", default=None, help="choose the trial by the best per-epoch value of this metric "
                                                  "(default: the study objective)")
    p.add_argument("--direction", choices=("maximize", "minimize"), default=None,
                   help="how --metric is judged (default: the study direction for the objective; minimize for "
                        "names with loss/error/time/mem/latency, else maximize)")
    p.add_argument("--dry-run", action="store_true", help="print what would happen; write nothing")
    p.add_argument("--force", action="store_true", help="move the alias even to a worse model than its holder")
    p.add_argument("--where", default=None, help="pick only trials meeting these conditions, e.g. "
                                                 "\"onnx_latency_ms<=2, params<1e6\" (with several objectives: "
                                                 "from the Pareto front)")
    best = p.add_mutually_exclusive_group()
    best.add_argument("--maximize", metavar="METRIC", default=None, help="pick the highest METRIC "
                                                                         "(= --metric METRIC --direction maximize)")
    best.add_argument("--minimize", metavar="METRIC", default=None, help="pick the lowest METRIC")


def cmd_promote(a: argparse.Namespace) -> int:
    from sweeps.registry import promote
    from sweeps.spec.load import load_spec

    spec = load_spec(a.spec)
    if not a.dry_run:  # a dry run writes nothing, and reads no artifact
        follow_moved_store(spec.tracking_store_uri(), err_console)
    metric, direction = a.metric, a.direction
    if a.maximize or a.minimize:
        if metric or direction:
            raise UsageError("--maximize/--minimize METRIC already name the metric and its direction; "
                             "drop --metric and --direction")
        metric, direction = (a.maximize, "maximize") if a.maximize else (a.minimize, "minimize")
    return promote(spec, alias=a.alias, model_name=a.model_name, metric=metric, direction=direction,
                   dry_run=a.dry_run, force=a.force, console=console, where=a.where)


# ---- rerun -----------------------------------------------------------------------------------
def _rerun_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=None, help="study spec YAML file (with --trial)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--trial", type=int, help="trial number in the spec's study")
    which.add_argument("--run-id", help="MLflow run id of the trial (any study)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None, help="train with this seed (default: the original's)")
    seeds.add_argument("--seeds", type=_seed_list, default=None,
                       help="rerun once per seed (e.g. 0,1,2) and report the objective's mean and std")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU threads to train on (default: this process's, i.e. the machine's unless "
                        "OMP_NUM_THREADS says otherwise). CPU results depend on it: give the original's count "
                        "(its sweeps.device tag; the rerun warns when they differ) for a bitwise reproduction")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the spec's, else "
                                                        "$MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")
    p.add_argument("--profile", action="store_true",
                   help="run torch.profiler over a few steps (train.profile's defaults unless the trial set it) "
                        "and log the Chrome trace and top-operator table under profile/")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of threads, e.g. 4")
    return value


def cmd_rerun(a: argparse.Namespace) -> int:
    from sweeps.compare import find_trial_run, open_client, resolve_tracking_uri
    from sweeps.rerun import print_outcome, print_seed_summary, rerun_once, rerun_seeds
    from sweeps.spec.load import load_spec
    from sweeps.tracking.mlflow_tracker import MlflowTracker

    spec = load_spec(a.spec) if a.spec else None
    if a.trial is not None and spec is None:
        raise UsageError("rerun --trial N needs the study spec: sweeps rerun SPEC --trial N "
                         "(or address the run directly: sweeps rerun --run-id ID)")
    uri = a.tracking_uri or (spec.tracking_store_uri() if spec is not None else resolve_tracking_uri())
    open_client(uri)  # refuses a missing local store before anything is created
    follow_moved_store(uri, err_console)  # runs/ moved: read and write artifacts where they are now
    tracker = MlflowTracker(uri)
    run_id = a.run_id or find_trial_run(open_client(uri), spec, a.trial)
    if a.seeds:
        print_seed_summary(rerun_seeds(tracker, run_id, a.seeds, console=console, threads=a.threads), console)
        return 0
    outcome = rerun_once(tracker, run_id, seed=a.seed, console=console, threads=a.threads, profile=a.profile)
    print_outcome(outcome, console)
    return 1 if outcome.comparison.nothing_to_compare else 0  # not a check that passed


# ---- compare ---------------------------------------------------------------------------------
def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("refs", nargs="+", metavar="[SPEC] A B",
                   help="two runs: with the study spec first, trial numbers (sweeps compare SPEC 3 7); run ids or "
                        "unique run-id prefixes (as `sweeps status` shows them, a cut-off '…' included) with or "
                        "without it")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the spec's, else "
                                                        "$MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")
    p.add_argument("--diff", action="store_true", help="show only the rows where the two runs differ")


def cmd_compare(a: argparse.Namespace) -> int:
    from sweeps.compare import compare_runs, open_client, resolve_tracking_uri

    if len(a.refs) not in (2, 3):
        raise UsageError(f"compare takes two runs, with the study spec first for trial numbers: sweeps compare SPEC 3 "
                         f"7, or sweeps compare RUN_A RUN_B; got {len(a.refs)} arguments ({' '.join(a.refs)})")
    if len(a.refs) == 2 and a.refs[0].endswith((".yaml", ".yml")):  # a spec and one trial: one run short
        raise UsageError(f"compare {' '.join(a.refs)}: two trials to compare follow the spec, e.g. sweeps compare "
                         f"{a.refs[0]} {a.refs[1]} 7")
    spec = load_spec_file(a.refs[0]) if len(a.refs) == 3 else None
    uri = a.tracking_uri or (spec.tracking_store_uri() if spec is not None else resolve_tracking_uri())
    return compare_runs(open_client(uri), a.refs[-2], a.refs[-1], console, spec=spec, only_differences=a.diff)


# ---- report ----------------------------------------------------------------------------------
def _report_args(p: argparse.ArgumentParser) -> None:
    spec_argument(p)
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="where to write the page (default: runs/<study>/report.html)")
    p.add_argument("--no-log", action="store_true", help="do not log the page to the study's parent MLflow run")


def cmd_report(a: argparse.Namespace) -> int:
    from dashboards.report import load_study, write_report
    spec = load_spec_file(a.spec)
    if a.output:
        _check_output(Path(a.output))  # before the study is read: a wrong -o fails at once
    # runs/ moved or copied: the page is logged beside the store, never into the folder it came from
    follow_moved_store(spec.tracking_store_uri(), err_console)
    loaded = load_study(spec)
    path = write_report(spec, loaded, a.output)
    console.print(f"report: {path}", markup=False, highlight=False, soft_wrap=True)
    if a.no_log:
        return 0
    parent_id = loaded.result.parent_run_id
    if not parent_id or loaded.experiment_id is None:
        err_console.print(f"warning: study {loaded.result.name!r} has no parent MLflow run in "
                          f"{spec.tracking_uri()}; the report was not logged", markup=False, highlight=False,
                          soft_wrap=True)
        return 0
    import shutil
    import tempfile

    from dashboards.report import REPORT_FILE
    with tempfile.TemporaryDirectory(prefix="sweeps-report-") as tmp:
        logged = path
        if path.name != REPORT_FILE:  # one name in the run, so that every call replaces the last page
            logged = Path(shutil.copyfile(path, Path(tmp) / REPORT_FILE))
        loaded.tracker.log_artifact(RunHandle(parent_id, loaded.experiment_id, loaded.result.name), logged,
                                    layout.ART_REPORT_DIR)
        loaded.tracker.flush()  # sent before the copy goes
    console.print(f"logged to MLflow run {parent_id} as {layout.ART_REPORT_DIR}/{REPORT_FILE} (replacing any "
                  "earlier page)", markup=False, highlight=False, soft_wrap=True)
    return 0


def _check_output(out: Path) -> None:
    if out.is_dir():
        raise PathError(f"report -o {out}: {out} is a folder; name the page file, e.g. -o {out / 'report.html'}")
    blocker = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PathError(f"report -o {out}: {blocker} is a file, not a folder; choose another path for the page")


COMMANDS = (
    Command("promote", "register the study's best trial in the MLflow model registry and move an alias to it",
            _promote_args, cmd_promote),
    Command("rerun", "train a trial again from its MLflow run and compare every curve with the original",
            _rerun_args, cmd_rerun),
    Command("compare", "two runs' params and final metrics side by side, the differences marked (runs by trial "
                       "number with the spec, by run id or a unique prefix of one)",
            _compare_args, cmd_compare),
    Command("report", "write one self-contained HTML page of a study's results and log it to its MLflow run",
            _report_args, cmd_report),
)
