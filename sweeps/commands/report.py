"""``sweeps report SPEC [-o FILE]``.

``report`` writes one self-contained HTML page of the study (plotly.js inline: it opens from
disk, offline), by default at ``runs/<study>/report.html``, and logs it as an artifact of the
study's parent MLflow run, always as ``report/report.html`` whatever ``-o`` names: a second
call replaces the page there instead of adding a copy beside it. The tables behind the page come from
:mod:`dashboards.tables`, as do those of ``status --format csv|json``.

Imported by ``sweeps.cli`` on every invocation: the heavy imports (pandas, plotly, the
dashboards) happen inside the command, not here.
"""
from __future__ import annotations

# Each command imports what it runs inside its own function, lazily for start-up: `sweeps --help`
# and every other command load none of it (torch, MLflow, Optuna, pandas).
import argparse
from pathlib import Path

from sweeps.commands.base import Command, console, err_console, load_spec_file, spec_argument
from sweeps.errors import PathError
from sweeps.moved_store import follow_moved_store
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle


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
    Command("report", "write one self-contained HTML page of a study's results and log it to its MLflow run",
            _report_args, cmd_report),
)
