"""The ``sweeps`` command line.

Every command that takes a spec validates it first; a bad spec, path or name exits with
code 2 and creates nothing. Errors print one clear message, never a traceback
(``SWEEPS_DEBUG=1`` shows it): an exception no command foresaw prints its type and first
line, and the file under ``runs/.errors/`` (or the temp folder) that holds its traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Callable

from rich.console import Console

from sweeps.errors import SweepsError
from sweeps.faults import armed

console = Console(soft_wrap=True)  # long paths and messages stay on one line (grep-able, copy-able)
err_console = Console(stderr=True, soft_wrap=True)
COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None], str]] = {}


def command(name: str, help_text: str):
    def deco(fn):
        COMMANDS[name] = (fn, getattr(fn, "_args", lambda p: None), help_text)
        return fn

    return deco


def args(setup: Callable[[argparse.ArgumentParser], None]):
    def deco(fn):
        fn._args = setup
        return fn

    return deco


def _load(path: str):
    from sweeps.spec import load_spec

    return load_spec(path)


# ---- validate -------------------------------------------------------------------------------
@command("validate", "check a study spec and report every problem at once")
@args(lambda p: p.add_argument("spec", nargs="+", help="study spec YAML file(s)"))
def cmd_validate(a: argparse.Namespace) -> int:
    from sweeps.errors import SpecError

    code = 0
    for path in a.spec:
        try:
            spec = _load(path)
        except SpecError as exc:
            err_console.print(str(exc), markup=False, highlight=False)
            code = 2
            continue
        console.print(f"{path}: ok (study {spec.name!r}, {len(spec.search)} searched parameters, "
                      f"backend {spec.backend}, {spec.budget.n_trials} trials)", markup=False, highlight=False)
    return code


# ---- run / worker ---------------------------------------------------------------------------
def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file")
    p.add_argument("--fresh", action="store_true", help="start a new version of the study; keep the old one")
    p.add_argument("--quiet", action="store_true", help="plain line output instead of the live view")


@command("run", "run (or resume) the study of a spec until its total budget is met")
@args(_run_args)
def cmd_run(a: argparse.Namespace) -> int:
    from core.faults import pause_here
    from sweeps.backends import get_backend

    spec = _load(a.spec)  # the study's one snapshot of its spec: workers get this text, never the file
    pause_here("spec_read")  # tests edit the file here: nothing may read it again
    result = get_backend(spec.backend).run(spec, fresh=a.fresh, quiet=a.quiet)
    return result.exit_code


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file whose storage is a shared RDB URL (postgresql://...)")
    p.add_argument("--slot", type=int, default=None, help="the worker's slot, tagged on its trial runs (default: from the pid)")
    p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for `sweeps run SPEC` to create the study and its MLflow parent run "
                        "when the worker starts first (default: 600; 0: fail at once)")


@command("worker", "join a study on shared RDB storage and run its trials until the total budget is met")
@args(_worker_args)
def cmd_worker(a: argparse.Namespace) -> int:
    from sweeps.backends.optuna_worker import run_worker
    from sweeps.errors import StudyStateError

    spec = _load(a.spec)
    if spec.backend != "optuna":
        raise StudyStateError(f"{a.spec}: backend: {spec.backend!r}; workers join Optuna studies. For Ray, "
                              "start Ray nodes with `ray start --address ...` instead")
    if not spec.is_rdb_storage():
        raise StudyStateError(f"{a.spec}: storage: {spec.storage_url()!r} is a local journal file; workers on "
                              "several machines need a shared RDB URL such as postgresql://user@host/db")
    slot = a.slot if a.slot is not None else os.getpid() % 10_000
    return run_worker(spec, worker_index=slot, wait_s=a.wait)


# ---- status ----------------------------------------------------------------------------------
@command("status", "a table of the study's trials, the best marked")
@args(lambda p: p.add_argument("spec", help="study spec YAML file"))
def cmd_status(a: argparse.Namespace) -> int:
    from sweeps.backends import get_backend
    from sweeps.live import results_table

    spec = _load(a.spec)
    result = get_backend(spec.backend).load(spec)
    counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(result.counts().items())) or "no trials"
    console.print(results_table(result, title=f"study {result.name} ({result.backend}): {counts}; "
                                              f"budget {spec.budget.n_trials}"))
    for t in result.trials:
        if t.state == "FAIL" and t.reason:
            console.print(f"trial {t.number} failed: {t.reason}", markup=False, highlight=False)
    return 0


# ---- maintenance -----------------------------------------------------------------------------
def _sync_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uri", required=True, help="MLflow tracking URI to send the kept points to")
    p.add_argument("--spool", default="runs/.mlflow_spool", help="folder of kept points")


@command("sync-tracking", "send metrics kept locally while the MLflow server was unreachable")
@args(_sync_args)
def cmd_sync_tracking(a: argparse.Namespace) -> int:
    from sweeps.tracking.sync import sync_spool

    report = sync_spool(a.uri, a.spool)
    console.print(report)
    return 1 if report.get("failed") or report.get("refused") else 0


@command("repair-journal", "keep the intact records of a damaged Optuna journal file (a backup is kept)")
@args(lambda p: p.add_argument("journal", help="path of the journal file"))
def cmd_repair_journal(a: argparse.Namespace) -> int:
    from sweeps.backends.journal_repair import repair_journal

    console.print(repair_journal(a.journal), markup=False, highlight=False)
    return 0


# ---- entry point -----------------------------------------------------------------------------
def _register_optional() -> None:
    """Commands that live in their own modules register themselves on import."""
    import importlib

    for module in ("sweeps.commands.after_sweep", "sweeps.commands.report"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not exc.name or not module.startswith(exc.name):
                raise


def build_parser() -> argparse.ArgumentParser:
    _register_optional()
    parser = argparse.ArgumentParser(prog="sweeps", description="Hyperparameter sweeps for PyTorch: Optuna or "
                                     "Ray Tune studies over core.train(), every trial tracked in MLflow.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (fn, setup, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        setup(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    # MLflow's INFO lines (database table creation) are noise here; its workers inherit this.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        if armed("cli_unexpected_error"):  # fault point: how an unforeseen exception reaches the user
            raise RuntimeError("injected by SWEEPS_FAULT=cli_unexpected_error")
        return a.func(a)
    except SweepsError as exc:
        if os.environ.get("SWEEPS_DEBUG"):
            raise
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the last resort: a bug or an unforeseen failure
        if os.environ.get("SWEEPS_DEBUG"):
            raise
        return _unexpected(exc, a.command)


ERRORS_DIR = os.path.join("runs", ".errors")


def _unexpected(exc: Exception, command_name: str) -> int:
    """One line for an exception no command turned into a message, and the file holding its
    traceback (``runs/.errors/``, else the system temp folder): a user sees what failed, a bug
    report has the whole story. A full disk, in whatever form it surfaced, is named as such."""
    import traceback

    from core.diskfull import describe_disk_full
    from sweeps.errors import DiskFullError

    text = "".join(traceback.format_exception(exc))
    where = _save_traceback(text, command_name)
    saved = (f"the full traceback is in {where} (SWEEPS_DEBUG=1 prints it here)" if where
             else "the traceback could not be saved (SWEEPS_DEBUG=1 prints it here)")
    full = describe_disk_full(exc, getattr(exc, "filename", None) or os.getcwd())
    if full is not None:
        err_console.print(f"error: {full}; free space there and rerun (a study resumes where it stopped)",
                          markup=False, highlight=False)
        err_console.print(saved, markup=False, highlight=False)
        return DiskFullError.exit_code
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    err_console.print(f"error: {type(exc).__name__}: {first}" if first else f"error: {type(exc).__name__}",
                      markup=False, highlight=False)
    err_console.print(saved, markup=False, highlight=False)
    return 1


def _save_traceback(text: str, command_name: str) -> str | None:
    import tempfile
    import time

    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{command_name}.txt"
    for folder in (ERRORS_DIR, os.path.join(tempfile.gettempdir(), "sweeps-errors")):
        path = os.path.join(folder, name)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)
            return os.path.abspath(path)
        except OSError:  # runs/ is a file, read-only, or full: try the next place
            try:
                os.unlink(path)
            except OSError:
                pass
    return None


def entry() -> None:
    """The ``sweeps`` console script: :func:`main`, then exit without the interpreter's slow teardown."""
    from sweeps.fast_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    # `python -m sweeps.cli`: run the main of the imported module, whose COMMANDS the
    # command modules (sweeps.commands.*) register into, not this __main__ copy's.
    from sweeps.cli import entry as _entry

    _entry()
