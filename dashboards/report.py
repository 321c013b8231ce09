"""From a spec to the report's tables and page: the read side of ``sweeps report``.

Reads the study through its backend (``get_backend(spec.backend).load``, never writing) and
the trial runs through MLflow; writes nothing but the page file. Logging the page to the
study's parent run is the command's job (``sweeps.commands.after_sweep``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dashboards.page import header_from_spec, render_page, write_page
from dashboards.tables import StudyTables, build_tables
from sweeps.backends.base import StudyResult
from sweeps.backends.by_name import get_backend
from sweeps.parent_run import reader_for, tracker_for
from sweeps.tracking import layout
from sweeps.tracking.reader import RunLookupError, TrackingReader

REPORT_FILE = "report.html"


@dataclass
class LoadedStudy:
    result: StudyResult
    tables: StudyTables
    tracker: Any  # the spec's MlflowTracker, which ``sweeps report`` logs the page with
    experiment_id: str | None  # of the parent run; None when the study has no parent run


def find_parent_run_id(reader: TrackingReader, experiment_name: str,
                       study_name: str) -> tuple[str | None, str | None]:
    """(parent run id, experiment id) of the study's parent run, searched by its tags (of any
    identity, unlike ``parent_run.find_parent``: the report shows whatever the store holds)."""
    experiment_id = reader.experiment_id(experiment_name)
    if experiment_id is None:
        return None, None
    found = reader.find_run(experiment_id, {layout.TAG_ROLE: layout.ROLE_STUDY, layout.TAG_STUDY: study_name})
    return (found.run_id if found else None), experiment_id


def load_study(spec, result: StudyResult | None = None, tracker: Any = None) -> LoadedStudy:
    """The study as stored plus every table of the report. Raises TrackingError (with the URI and
    the fix) when the MLflow store cannot be reached."""
    result = result or get_backend(spec.backend).load(spec)
    tracker = tracker or tracker_for(spec)
    tracker.check_connection()  # a clear message naming the store, before any read
    reader = reader_for(spec)
    experiment_id = None
    if result.parent_run_id:
        try:
            experiment_id = reader.handle(result.parent_run_id).experiment_id
        except RunLookupError:
            result.parent_run_id = None  # not in this store: look it up by its tags below
    if not result.parent_run_id:
        result.parent_run_id, experiment_id = find_parent_run_id(reader, spec.experiment_name(), result.name)
    tables = build_tables(result, spec.search, reader)
    return LoadedStudy(result, tables, tracker, experiment_id if result.parent_run_id else None)


def default_report_path(spec, study_name: str) -> Path:
    """``runs/<study>/report.html``, beside the trials' folders (``runs/<study>/trial-NNNN``)."""
    journal = spec.journal_path()
    base = journal.parent if journal is not None else Path("runs")
    return base / study_name / REPORT_FILE


def write_report(spec, loaded: LoadedStudy, out: str | Path | None = None) -> Path:
    """Render the page of ``loaded`` and write it (atomically) to ``out`` or the default path."""
    path = Path(out) if out else default_report_path(spec, loaded.result.name)
    return write_page(render_page(loaded.tables, header_from_spec(spec)), path)
