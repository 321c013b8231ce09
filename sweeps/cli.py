"""The ``sweeps`` command line: the parser, built in one place from the commands that the
modules of :mod:`sweeps.commands` declare, and how errors reach the user.

Every command that takes a spec validates it first; a bad spec, path or name exits with
code 2 and creates nothing. Errors print one clear message, never a traceback
(``SWEEPS_DEBUG=1`` shows it): an exception no command foresaw prints its type and first
line, and the file under ``runs/.errors/`` (or the temp folder) that holds its traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from core import faults
from core.diskfull import describe_disk_full
from sweeps.commands import Command, after_sweep, cluster, err_console, study
from sweeps.errors import DiskFullError, SweepsError
from sweeps.fast_exit import exit_now

# Every subcommand, in the order `sweeps --help` lists them. A command module that fails to
# import is a bug in this project: the ImportError surfaces here, no command is hidden.
COMMANDS: tuple[Command, ...] = (*study.COMMANDS, *cluster.COMMANDS, *after_sweep.COMMANDS)

DESCRIPTION = ("Hyperparameter sweeps for PyTorch: Optuna or Ray Tune studies over core.train(), every trial "
               "tracked in MLflow.")


class _VersionAction(argparse.Action):
    """``--version``: prints ``sweeps <version>`` and exits 0. The version is looked up only when
    asked: importing importlib.metadata costs about 0.1 s, which every other command would pay."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = f"sweeps {version('sweeps')}\n"
        except PackageNotFoundError:  # a source tree on PYTHONPATH: the version lives in installed metadata
            parser.exit(1, "error: sweeps is not installed, so it has no version; install it with "
                           "pip install -e . (in the project folder)\n")
        sys.stdout.write(text)
        parser.exit(0)


def build_parser(commands: tuple[Command, ...] = COMMANDS) -> argparse.ArgumentParser:
    """The whole ``sweeps`` parser, built from ``commands``: one subparser each."""
    parser = argparse.ArgumentParser(prog="sweeps", description=DESCRIPTION)
    parser.add_argument("--version", action=_VersionAction, help="print the installed version of sweeps and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(func=cmd.handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    # MLflow's INFO lines (database table creation) are noise here; its workers inherit this.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        faults.check_environment()
    except faults.UnknownFaultPoint as exc:  # a test's misspelt point: refused before anything runs
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        return 2
    try:
        if faults.armed(faults.Fault.CLI_UNEXPECTED_ERROR):  # fault point: how an unforeseen exception reaches the user
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
    exit_now(main())


if __name__ == "__main__":
    entry()
