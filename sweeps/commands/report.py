"""``sweeps report SPEC [-o FILE]``, and ``--format table|csv|json`` for ``sweeps status``.

``report`` writes one self-contained HTML page of the study (plotly.js inline: it opens from
disk, offline), by default at ``runs/<study>/report.html``, and logs it as an artifact of the
study's parent MLflow run (``report/``). The tables behind the page come from
:mod:`dashboards.tables`; ``status --format csv|json`` prints the same trials table.

Imported by ``sweeps.cli`` on every invocation: the heavy imports (pandas, plotly, the
dashboards) happen inside the commands, not here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sweeps.cli import COMMANDS, _load, args, command, console, err_console
from sweeps.tracking import layout

STATUS_FORMATS = ("table", "csv", "json")


# ---- report ----------------------------------------------------------------------------------
def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="where to write the page (default: runs/<study>/report.html)")
    p.add_argument("--no-log", action="store_true", help="do not log the page to the study's parent MLflow run")


@command("report", "write one self-contained HTML page of a study's results and log it to its MLflow run")
@args(_report_args)
def cmd_report(a: argparse.Namespace) -> int:
    from dashboards.report import load_study, write_report

    spec = _load(a.spec)
    if a.output:
        _check_output(Path(a.output))  # before the study is read: a wrong -o fails at once
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
    from sweeps.tracking.base import RunHandle

    loaded.tracker.log_artifact(RunHandle(parent_id, loaded.experiment_id, loaded.result.name), path,
                                layout.ART_REPORT_DIR)
    loaded.tracker.flush()
    console.print(f"logged to MLflow run {parent_id} as {layout.ART_REPORT_DIR}/{path.name}",
                  markup=False, highlight=False, soft_wrap=True)
    return 0


def _check_output(out: Path) -> None:
    from sweeps.errors import PathError

    if out.is_dir():
        raise PathError(f"report -o {out}: {out} is a folder; name the page file, e.g. -o {out / 'report.html'}")
    blocker = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PathError(f"report -o {out}: {blocker} is a file, not a folder; choose another path for the page")


# ---- status --format ---------------------------------------------------------------------------
def status_text(spec, result, fmt: str) -> str:
    """The study's trials as ``sweeps status --format csv|json`` prints them: the trials table of
    :func:`dashboards.tables.trials_table`, completed trials best first, then the rest by number.
    JSON is one object: study, backend, metric, direction, budget, counts, best (number or null),
    trials (one record per row, NaN as null)."""
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
        return json.dumps(doc, indent=2) + "\n"
    raise ValueError(f"format {fmt!r} is not one of {', '.join(STATUS_FORMATS)}")


def _extend_status() -> None:
    """Give ``sweeps status`` a ``--format`` option: ``table`` (the default) runs the command as
    ``sweeps.cli`` defines it; ``csv``/``json`` print :func:`status_text`. Does nothing when the
    status command already has ``--format`` (cli.py took it over) or was extended already."""
    entry = COMMANDS.get("status")
    if entry is None or getattr(entry[0], "_has_format", False):
        return
    fn, setup, help_text = entry
    probe = argparse.ArgumentParser(add_help=False)
    setup(probe)
    if "--format" in probe._option_string_actions:
        return

    def status_setup(p: argparse.ArgumentParser) -> None:
        setup(p)
        p.add_argument("--format", choices=STATUS_FORMATS, default="table",
                       help="table (default), or the trials table as csv or json on stdout")

    def cmd_status(a: argparse.Namespace) -> int:
        if getattr(a, "format", "table") == "table":
            return fn(a)
        from sweeps.backends import get_backend

        spec = _load(a.spec)
        result = get_backend(spec.backend).load(spec)
        sys.stdout.write(status_text(spec, result, a.format))
        sys.stdout.flush()
        return 0

    cmd_status._has_format = True
    cmd_status.__doc__ = fn.__doc__
    COMMANDS["status"] = (cmd_status, status_setup, help_text)


_extend_status()
